"""A newcomer's first commands (an outside check following README's install table): the first `ulyssesctl
status` on a laptop looks in ~/.local/state/ulyssesd, while the systemd unit keeps its store in
/var/lib/ulyssesd. The refusal must say where it looked and how to point it elsewhere."""

from __future__ import annotations

import json

from ulyssesd.daemon.operator.ctl import main


def test_no_database_in_the_default_state_dir_says_how_to_point_elsewhere(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ULYSSESD_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert main(["status"]) == 20
    err = capsys.readouterr().err
    assert str(tmp_path / "xdg" / "ulyssesd") in err and "--state-dir" in err and "/var/lib/ulyssesd" in err
    assert main(["runs", "--json"]) == 20
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 20 and "ULYSSESD_STATE_DIR" in doc["error"]


def test_an_explicit_db_that_is_missing_gets_no_state_dir_hint(tmp_path, capsys):
    """--db names the file itself: the state-dir advice would be wrong there."""
    assert main(["--db", str(tmp_path / "x.db"), "runs"]) == 20
    err = capsys.readouterr().err
    assert "x.db" in err and "--state-dir" not in err
