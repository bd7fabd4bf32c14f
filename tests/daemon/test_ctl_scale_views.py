"""What `ulyssesctl incidents`, `status` and `report` show when a run's record is long: the listing's limit
and its next page said, not silently cut; status's exact open count with the newest listed; the telemetry tail
read backwards gives what reading the whole tail gave; the report's step scan reads what the full parser
reads; the report lists the newest rows and says how many there are."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ulyssesd.daemon.operator import ctl_status, report
from ulyssesd.daemon.operator.ctl import main
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.telemetry.step_scan import timed_steps
from ulyssesd.remediation.records import RecordError, StepRecord, parse_line


def _state(tmp_path: Path, n: int, open_every: int = 1) -> list[str]:
    store = open_store(tmp_path / "state" / "ulyssesd.db")
    store.create_run("long-run", run_dir=str(tmp_path / "run"))
    for i in range(n):
        iid = store.record_incident("long-run", attempt=1, symptom="slow_step", step=i, summary=f"slow {i}")
        if i % open_every:
            store.update_incident_status(iid, "resolved", "fine")
    store.close()
    return ["--state-dir", str(tmp_path / "state")]


def test_incidents_limit_says_what_it_left_out_and_pages_with_before(tmp_path, capsys):
    argv = _state(tmp_path, 12)
    capsys.readouterr()
    assert main([*argv, "incidents", "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "slow 11" in out and "slow 7" in out and "slow 6" not in out
    assert "the newest 5 of 12 listed" in out and "--before 8" in out
    assert main([*argv, "incidents", "--json", "--limit", "5", "--before", "8"]) == 0
    got = capsys.readouterr()
    assert [r["summary"] for r in json.loads(got.out)] == [f"slow {i}" for i in range(2, 7)]
    assert "the newest 5 of 7 listed" in got.err and "--before 3" in got.err
    # Everything fits the default limit: the same listing as before, and no note.
    assert main([*argv, "incidents", "--json"]) == 0
    got = capsys.readouterr()
    assert [r["summary"] for r in json.loads(got.out)] == [f"slow {i}" for i in range(12)] and not got.err
    assert main([*argv, "incidents", "--limit", "0", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 12


def test_status_counts_every_open_incident_and_lists_the_newest(tmp_path, capsys, monkeypatch):
    argv = _state(tmp_path, 9, open_every=2)  # 0, 2, 4, 6, 8 stay open
    monkeypatch.setattr(ctl_status, "OPEN_INCIDENTS_LISTED", 3)
    capsys.readouterr()
    main([*argv, "status", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert d["open_incidents"] == 5
    assert [i["summary"] for i in d["open_incident_list"]] == ["slow 4", "slow 6", "slow 8"]
    main([*argv, "status"])
    assert "5 (the newest 3 below" in capsys.readouterr().out


def _tail_reference(path: Path, limit: int) -> list[dict]:
    """What status read before: the last 256 KiB, every line parsed, the newest `limit` steps."""
    lines = path.read_bytes()[-256 * 1024:].decode("utf-8", errors="replace").splitlines()
    found = []
    for line in reversed(lines):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("kind") == "step":
            found.append(d)
            if len(found) >= limit:
                break
    return found[::-1]


def test_the_tail_read_backwards_finds_the_same_steps(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    path = run / "telemetry.jsonl"
    with path.open("w") as fh:
        for s in range(1, 400):
            fh.write(json.dumps({"v": 1, "kind": "step", "step": s, "loss": 2.0 + s % 7, "time": 1.0 * s,
                                 "pad": "x" * (s % 37)}) + "\n")
            if s % 9 == 0:
                fh.write(json.dumps({"v": 1, "kind": "event", "event": "checkpoint_saved", "step": s}) + "\n")
            if s % 50 == 0:
                fh.write("not json at all\n\n")
        fh.write('{"v": 1, "kind": "step", "step": 400, "lo')  # torn last line
    from ulyssesd.daemon.telemetry import tail

    monkeypatch.setattr(tail, "TAIL_BLOCK_BYTES", 97)  # lines straddle every block boundary
    for limit in (1, 20, 200, 1000):
        got = ctl_status.recent_steps_from_telemetry(str(run), limit=limit)
        assert got == _tail_reference(path, limit) and got, limit
    assert ctl_status.recent_steps_from_telemetry(str(tmp_path / "nowhere")) == []


def _reference_steps(path: Path) -> list:
    out = []
    for line in path.read_bytes().split(b"\n"):
        try:
            rec = parse_line(line)
        except RecordError:
            continue
        if isinstance(rec, StepRecord) and rec.time is not None:
            out.append(rec)
    return out


FIELDS = ("step", "time", "attempt", "loss", "step_time_s", "step_time_max_s", "tokens_per_s", "mem_allocated_gib",
          "mem_max_allocated_gib")


def _key(rec) -> tuple:
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in (getattr(rec, f) for f in FIELDS))


def test_the_step_scan_reads_what_the_full_parser_reads(tmp_path, monkeypatch):
    from ulyssesd.daemon.telemetry import step_scan

    path = tmp_path / "telemetry.jsonl"
    lines = [
        {"v": 1, "kind": "step", "step": 1, "loss": 3.0, "time": 10.0, "attempt": 1, "step_time_s": 0.5},
        {"v": 1, "kind": "step", "step": 2, "loss": "nan", "time": 11.0, "attempt": 1},   # the dict path's NaN
        {"v": 1, "kind": "step", "step": 3, "loss": 2, "time": 12, "attempt": 1, "tokens_per_s": 100},  # ints
        {"v": 1, "kind": "event", "event": "started", "step": 0, "time": 9.0},
        {"v": 1, "kind": "step", "step": 4, "loss": 2.5},                                   # no time: skipped
        {"v": 1, "kind": "step", "step": -1, "loss": 2.5, "time": 13.0},                    # bad step: skipped
        {"v": 1, "kind": "step", "step": 5, "loss": 2.4, "time": 14.0, "attempt": 2, "mem_allocated_gib": 1.5,
         "mem_max_allocated_gib": 2.5, "step_time_max_s": 0.7, "samples": [4, 5], "loss_by_source": {"a": 2.0}},
    ]
    text = "".join(json.dumps(d) + "\n" for d in lines) + "garbage\n\n" + '{"v": 1, "kind": "step", "step": 6'
    path.write_text(text)
    monkeypatch.setattr(step_scan, "READ_BYTES", 64)  # lines straddle the reads
    got = [_key(r) for r in timed_steps(path)]
    assert got == [_key(r) for r in _reference_steps(path)]
    assert [k[0] for k in got] == [1, 2, 3, 5]


def test_the_report_lists_the_newest_rows_and_counts_them_all(tmp_path, monkeypatch):
    _state(tmp_path, 7)
    store = open_store(tmp_path / "state" / "ulyssesd.db", readonly=True)
    monkeypatch.setattr(report, "MAX_ROWS", 3)
    page = report.render_report(store, "long-run")
    assert "The newest 3 of 7 incidents" in page and "<td>7 / 0</td>" in page
    assert "slow 6" in page and "slow 3" not in page
    monkeypatch.setattr(report, "MAX_ROWS", 2000)
    page = report.render_report(store, "long-run")
    assert "The newest" not in page and "slow 0" in page
    store.close()


def test_the_curves_keep_a_bounded_number_of_points_however_many_attempts(tmp_path, monkeypatch):
    from types import SimpleNamespace

    path = tmp_path / "telemetry.jsonl"
    with path.open("w") as fh:
        for a in range(1, 31):
            for s in range(1000):
                fh.write(json.dumps({"kind": "step", "step": (a - 1) * 900 + s, "loss": 2.0, "attempt": a,
                                     "time": a * 10_000.0 + s, "step_time_s": 1.0}) + "\n")
    attempts = [SimpleNamespace(number=a, started_at=None, ended_at=None) for a in range(1, 31)]
    series, good = report.analyse_telemetry(path, attempts, [])
    assert len(series) == 30 and all(200 <= len(s.points) <= 400 for s in series)  # 12,000 over 30 attempts
    monkeypatch.setattr(report, "MAX_TOTAL_POINTS", 600)
    series2, good2 = report.analyse_telemetry(path, attempts, [])
    # MIN_POINTS each (and the attempt's last step); goodput still counts every step.
    assert all(len(s.points) in (report.MIN_POINTS, report.MIN_POINTS + 1) for s in series2) and good2 == good
    # Two attempts keep every point up to MAX_POINTS each, as before the total bound.
    monkeypatch.undo()
    two = tmp_path / "two.jsonl"
    two.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                           if json.loads(line)["attempt"] <= 2))
    series3, _ = report.analyse_telemetry(two, attempts[:2], [])
    assert [len(s.points) for s in series3] == [1000, 1000]
