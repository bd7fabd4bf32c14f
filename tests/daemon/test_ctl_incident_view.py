"""`ulyssesctl incident ID` on a hang whose stack dumps are longer than the terminal view: every rank's dump
keeps its header and the top of its `Current thread` (the training thread, innermost frame first); the
whole text's last 4000 characters hid rank 0, the rank the other waited for, and began mid-line. A long log
tail keeps its last lines from a line start. Text from the store that looks like rich markup (`[rank1]`, a
path in brackets) prints as written in `incidents`, `incident`, `config` and `replay`: it was eaten as a style
or raised MarkupError (a traceback). The store is a real SQLite store; ulyssesctl runs in-process."""

from __future__ import annotations

import json

import pytest

from ulyssesd.daemon.operator.ctl import main
from ulyssesd.daemon.operator.ctl_records import evidence_excerpt
from ulyssesd.daemon.store import open_store

FRAME = '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line {} in _call_impl\n'


def _thread(name: str, top: str, frames: int) -> str:
    return (f"{name} 0x00007f370603db80 (most recent call first):\n  File \"{top}\", line 1 in here\n"
            + "".join(FRAME.format(i) for i in range(frames)) + "\n")


def _rank(rank: int, top: str, frames: int) -> str:
    return (f"=== rank {rank} stack dump (/state/runs/r/stacks) ===\n"
            + _thread("Thread", "/usr/lib/python3.11/threading.py", 6) + _thread("Current thread", top, frames) + "\n")


STACKS = _rank(0, "/work/training/faults.py", 8) + _rank(1, "/venv/torch/distributed/distributed_c10d.py", 60)


@pytest.fixture
def state_dir(tmp_path):
    sd = tmp_path / "state"
    with open_store(sd / "ulyssesd.db") as store:
        store.create_run("r", run_dir=sd / "runs" / "r", state="RUNNING")
        store.add_attempt("r", command=["train"])
        store.record_incident("r", attempt=1, symptom="hang", step=37, summary="no progress for 12 s",
                              evidence={"stacks": STACKS, "log_tail": "".join(f"log line {i}\n" for i in range(900))})
    return sd


def test_every_ranks_dump_is_shown_from_its_training_thread(state_dir, capsys):
    assert len(STACKS) > 6000
    capsys.readouterr()
    assert main(["--state-dir", str(state_dir), "incident", "1"]) == 0
    text = capsys.readouterr().out
    stacks = text[text.index("stacks"):text.index("log_tail")]
    assert "=== rank 0 stack dump" in stacks and "/work/training/faults.py" in stacks  # the waited-for rank
    assert "=== rank 1 stack dump" in stacks and "distributed_c10d.py" in stacks  # its innermost frame
    assert "other thread(s) of this rank not shown" in stacks and "more line(s)]" in stacks
    assert "incident 1 --json" in stacks
    body = [line for line in stacks.splitlines()[1:] if line.strip() and not line.startswith("─")]  # rules
    odd = [line for line in body if not line.startswith(("===", "[", "Current thread", "Thread", "  File", "  ["))]
    assert not odd, odd
    tail = text[text.index("log_tail"):text.index("actions")].splitlines()
    assert "characters before this not shown" in tail[1] and tail[2].startswith("log line ")  # a whole line
    assert "log line 899" in text and "log line 0\n" not in text


def test_json_keeps_the_whole_evidence(state_dir, capsys):
    capsys.readouterr()
    assert main(["--state-dir", str(state_dir), "incident", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evidence"]["stacks"] == STACKS


def test_a_short_text_is_shown_as_it_is():
    assert evidence_excerpt(STACKS, len(STACKS), 1) == STACKS
    assert len(evidence_excerpt(STACKS, 4000, 1)) < 4200  # the budget holds, give or take the notes


MARKUP_LIKE = "[rank1]: RuntimeError: cannot open [/ckpt/step-00000040] ([bold] is not a style here)"


def test_store_text_that_looks_like_markup_prints_as_written(tmp_path, capsys):
    sd = tmp_path / "state"
    with open_store(sd / "ulyssesd.db") as store:
        store.create_run("r", run_dir=sd / "runs" / "r", state="RUNNING")
        store.add_attempt("r", command=["train"])
        inc = store.record_incident("r", attempt=1, symptom="crash", step=40, summary=MARKUP_LIKE)
        store.record_action("r", "set_config", incident_id=inc, parameters={"why": "[/ckpt] [red]"},
                            config_diff={"launcher.extra_args": [[], ["[/x]"]]})
        store.update_incident_status(inc, "failed", "gave up: [/ckpt/step-00000040] unreadable")
        store.add_config_version("r", {"launcher": {"extra_args": []}}, reason="first")
        store.add_config_version("r", {"launcher": {"extra_args": ["[/x]"]}}, reason="[bold]patched[/bold] by [/x]")
    argv = ["--state-dir", str(sd)]
    for command in (["incidents"], ["incident", str(inc)], ["config"]):
        capsys.readouterr()
        assert main([*argv, *command]) == 0, command
        got = capsys.readouterr()
        text = " ".join(got.out.split())
        assert "Traceback" not in got.err and "MarkupError" not in got.err, got.err
        if command[0] == "config":
            assert "[bold]patched[/bold] by [/x]" in text and "['[/x]']" in text, text
        else:
            assert "[rank1]: RuntimeError: cannot open [/ckpt/step-00000040]" in text.replace("│ │", ""), text
    capsys.readouterr()
    main([*argv, "incident", str(inc)])
    shown = " ".join(capsys.readouterr().out.split())
    assert "gave up: [/ckpt/step-00000040] unreadable" in shown and '"why": "[/ckpt] [red]"' in shown, shown


def test_replay_shows_a_decisions_patch(tmp_path, capsys):
    """The table's `[patch: …]` after a decision's reason was read as a style tag and vanished."""
    from ulyssesd.remediation.synthetic import Injection, TraceSpec, trace

    tel = tmp_path / "telemetry.jsonl"
    spec = TraceSpec(steps=3000, seed=11, injections=[Injection("nan", 2500)])
    tel.write_text("".join(json.dumps(d) + "\n" for d in trace(spec)))
    capsys.readouterr()
    assert main(["replay", str(tel)]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "rollback_skip" in text and "[patch: data.skip_ranges" in text, text
