"""`[telemetry] source = "stdout"`: where reading an attempt's log resumes, at its edges. A log truncated,
rotated, replaced or rewritten outside the daemon, an offsets file that is corrupt or points past the end of
the log: every step the log holds is recorded once, and the reader says (loud: journal, daemon log, webhook,
health file shown by status) that it could not resume where it stopped. The daemon's own rotation is quiet."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from ulyssesd.daemon.telemetry import log_source
from ulyssesd.daemon.telemetry.log_source import OFFSETS_NAME, STDOUT_TELEMETRY_NAME, LogSource


def _lines(first: int, last: int) -> str:
    return "".join(f"step={i} loss={3.0 - i / 1000:.3f} lr=1e-4 tokens/s=12345.6\n" for i in range(first, last + 1))


def _steps(run_dir: Path) -> list[int]:
    out = []
    for line in (run_dir / STDOUT_TELEMETRY_NAME).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step":
            out.append(rec["step"])
    return out


def _log(tmp_path: Path, text: str) -> Path:
    log = tmp_path / "logs" / "attempt-1.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text(text)
    return log


def _append(log: Path, text: str) -> None:
    with log.open("a") as fh:
        fh.write(text)


def test_a_log_truncated_outside_the_daemon_is_read_again_from_its_start_and_said(tmp_path):
    """logrotate's copytruncate: the log is cut to 0 and the job writes on; its next lines are all read."""
    log = _log(tmp_path, _lines(1, 5))
    src = LogSource(tmp_path, attempt=1)
    assert src.pump(now=1.0) == 5 and src.notices == []
    os.truncate(log, 0)
    _append(log, _lines(6, 8))
    assert src.pump(now=2.0) == 3
    [said] = src.notices
    assert "shorter" in said and "truncated or rotated" in said and "cannot resume reading at byte" in said
    assert "steps up to 5" in said
    assert _steps(tmp_path) == list(range(1, 9))


def test_a_log_truncated_and_written_past_the_old_offset_is_not_read_from_the_middle(tmp_path):
    """The same, but the job wrote more than was read before the next look (a daemon that was down): the
    size alone does not show it; the text before the offset does. Every new step is recorded, none lost."""
    log = _log(tmp_path, _lines(1, 5))
    src = LogSource(tmp_path, attempt=1)
    assert src.pump(now=1.0) == 5
    os.truncate(log, 0)
    _append(log, _lines(6, 40))
    assert log.stat().st_size > src.offset
    again = LogSource(tmp_path, attempt=1)   # the next daemon, from the offsets file
    assert again.notices == []
    assert again.pump(now=2.0) == 35
    [said] = again.notices
    assert "rewritten" in said, said
    assert _steps(tmp_path) == list(range(1, 41))


def test_a_log_replaced_by_rename_is_read_from_the_new_files_start(tmp_path):
    """logrotate's default (rename + a new file): a new inode at the path; its lines are read from its start."""
    log = _log(tmp_path, _lines(1, 30))
    src = LogSource(tmp_path, attempt=1)
    assert src.pump(now=1.0) == 30
    log.rename(log.with_name(log.name + ".1"))
    _log(tmp_path, _lines(31, 80))   # longer than the old file: only the inode tells
    assert src.pump(now=2.0) == 50
    [said] = src.notices
    assert "replaced by another file" in said
    assert _steps(tmp_path) == list(range(1, 81))


def test_a_corrupt_offsets_file_is_said_and_the_log_reread_without_doubles(tmp_path):
    log = _log(tmp_path, _lines(1, 10))
    assert LogSource(tmp_path, attempt=1).pump(now=1.0) == 10
    (tmp_path / OFFSETS_NAME).write_bytes(b'{"1": {"offset": 12\x00\xff')   # torn by a disk fault
    _append(log, _lines(11, 12))
    again = LogSource(tmp_path, attempt=1)
    [said] = again.notices
    assert "cannot be read" in said and str(tmp_path / OFFSETS_NAME) in said and "from its start" in said
    assert again.pump(now=2.0) == 2 and again.parser.stats.dropped_repeated_step == 10
    assert _steps(tmp_path) == list(range(1, 13))
    assert json.loads((tmp_path / OFFSETS_NAME).read_text())["1"]["offset"] == log.stat().st_size  # healed


def test_an_invalid_entry_is_named_with_the_attempt(tmp_path):
    _log(tmp_path, _lines(1, 3))
    (tmp_path / OFFSETS_NAME).write_text(json.dumps({"1": {"offset": "12"}}))
    src = LogSource(tmp_path, attempt=1)
    [said] = src.notices
    assert "invalid entry for attempt 1" in said
    assert src.pump(now=1.0) == 3


def test_an_offset_past_the_end_of_the_log_is_said_and_the_log_reread(tmp_path):
    log = _log(tmp_path, _lines(1, 6))
    assert LogSource(tmp_path, attempt=1).pump(now=1.0) == 6
    entry = json.loads((tmp_path / OFFSETS_NAME).read_text())["1"]
    entry["offset"] = 10**9
    (tmp_path / OFFSETS_NAME).write_text(json.dumps({"1": entry}))
    _append(log, _lines(7, 7))
    again = LogSource(tmp_path, attempt=1)
    assert again.pump(now=2.0) == 1
    [said] = again.notices
    assert "shorter" in said and "byte 1000000000" in said
    assert _steps(tmp_path) == list(range(1, 8))


def test_the_older_offsets_form_resumes_quietly(tmp_path):
    """A run directory from before the inode and tail were kept: `{"1": N}` still resumes at N."""
    log = _log(tmp_path, _lines(1, 4))
    assert LogSource(tmp_path, attempt=1).pump(now=1.0) == 4
    (tmp_path / OFFSETS_NAME).write_text(json.dumps({"1": log.stat().st_size}))
    _append(log, _lines(5, 6))
    again = LogSource(tmp_path, attempt=1)
    assert again.pump(now=2.0) == 2 and again.notices == [] and again.parser.stats.dropped_repeated_step == 0


def test_the_daemons_own_rotation_is_quiet(tmp_path):
    """attempt_log's rotation cuts the live log and tells the source (log_shortened): nothing to say."""
    log = _log(tmp_path, _lines(1, 20))
    src = LogSource(tmp_path, attempt=1)
    assert src.pump(now=1.0) == 20
    size = log.stat().st_size
    os.truncate(log, 0)
    src.log_shortened(size)
    _append(log, _lines(21, 60))
    assert src.pump(now=2.0) == 40 and src.notices == []
    # An ended attempt's log trimmed to its tail (a new file, the same text before the offset): quiet too.
    text = log.read_bytes()
    cut = text.index(b"\n", len(text) // 2) + 1
    tmp = log.with_name("t")
    tmp.write_bytes(text[cut:])
    os.replace(tmp, log)
    src.log_shortened(cut)
    _append(log, _lines(61, 62))
    assert src.pump(now=3.0) == 2 and src.notices == []
    assert _steps(tmp_path) == list(range(1, 63))


def test_a_log_that_disappears_is_said_once_and_read_on_from_the_open_file(tmp_path):
    log = _log(tmp_path, _lines(1, 3))
    src = LogSource(tmp_path, attempt=1)
    assert src.pump(now=1.0) == 3
    log.rename(tmp_path / "away.log")
    assert src.pump(now=2.0) == 0 and src.pump(now=3.0) == 0
    [said] = src.notices  # the reader holds the log open: it reads on from the file the job still writes
    assert "was removed" in said and "read on" in said
    _append(tmp_path / "away.log", _lines(4, 4))
    assert src.pump(now=3.5) == 1 and len(src.notices) == 1
    (tmp_path / "away.log").rename(log)
    _append(log, _lines(5, 5))
    assert src.pump(now=4.0) == 1 and len(src.notices) == 1
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]


def test_the_supervisors_hook_says_it_in_the_journal_a_webhook_and_status(tmp_path):
    clock = [1000.0]
    said, alerts = [], []
    sup = SimpleNamespace(config={"telemetry": {"source": "stdout"}, "job": {"kind": "command"}}, attempt=1,
                          run_dir=tmp_path, config_version=1, run_id="r1", job=object(), last_step=None,
                          os=SimpleNamespace(time=lambda: clock[0]), say=said.append,
                          alert=lambda event, text, **kw: alerts.append((event, text)))
    log = _log(tmp_path, _lines(1, 5))
    log_source.pump(sup)
    assert not said and not alerts
    os.truncate(log, 0)
    _append(log, _lines(6, 7))
    clock[0] += 1
    log_source.pump(sup)
    assert len(said) == 1 and said[0].startswith("TELEMETRY: ") and "truncated or rotated" in said[0]
    assert [e for e, _ in alerts] == ["telemetry"] and "truncated or rotated" in alerts[0][1]
    health = log_source.read_health(tmp_path)
    assert health is not None and "truncated or rotated" in health["read_problems"][-1]
    assert "truncated or rotated" in log_source.health_text(health)
    clock[0] += 1
    log_source.pump(sup)
    assert len(said) == 1   # said once
    assert _steps(tmp_path) == list(range(1, 8))
