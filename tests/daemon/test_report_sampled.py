"""`ulyssesctl report` on a telemetry file too big to read whole (daemon/telemetry/step_sample.py): evenly
spaced windows, every attempt's first and last step placed exactly by bisection, the goodput's step-time sums
estimated from the sample and the page saying so. Checked against the whole-file answer on the same file."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from ulyssesd.daemon.operator import report
from ulyssesd.daemon.telemetry.step_sample import SampleConfig, step_lines

SMALL = SampleConfig(max_bytes=256 << 10, windows=64)  # the test file (~6 MB) is 24x that


def _telemetry(path, rnd):
    """Attempts of very different lengths (one of 3 steps, far shorter than the window spacing), restarts that
    redo steps, events between steps, noisy step times."""
    lengths = [9000, 3, 4000, 120, 7000, 1, 5000]
    t, step, rows = 1_000_000.0, 0, []
    for a, n in enumerate(lengths, start=1):
        step = max(0, step - rnd.randint(0, 50))  # resumed at or before the last step: some are redone
        t += 30.0  # the restart's gap
        rows.append({"kind": "event", "event": "started", "step": step, "attempt": a, "time": t})
        for _ in range(n):
            step += 1
            d = 0.5 + rnd.random() * 0.2
            t += d
            rows.append({"kind": "step", "step": step, "loss": 2.0 + rnd.random(), "attempt": a, "time": t,
                         "step_time_s": d, "tokens_per_s": 8000.0, "mem_allocated_gib": 40.0, "pad": "x" * 150})
            if step % 500 == 0:
                rows.append({"kind": "event", "event": "checkpoint_saved", "step": step, "tag": f"s{step}",
                             "attempt": a, "time": t})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(lengths)


def test_a_big_file_is_sampled_and_the_attempts_are_placed_exactly(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    n = _telemetry(path, random.Random(7))
    attempts = [SimpleNamespace(number=a, started_at=None, ended_at=None) for a in range(1, n + 1)]
    full_series, full = report.analyse_telemetry(path, attempts, [], SampleConfig(max_bytes=1 << 40))
    series, est = report.analyse_telemetry(path, attempts, [], SMALL)
    assert full.sampled is None and est.sampled is not None
    assert est.sampled.read_bytes <= SMALL.max_bytes + SMALL.windows and est.sampled.probes > 0
    # Every attempt is there (the 1- and 3-step ones too), with its exact first and last point.
    assert [s.attempt for s in series] == [s.attempt for s in full_series] == list(range(1, n + 1))
    for got, want in zip(series, full_series, strict=True):
        assert got.points[0][0] == want.points[0][0] and got.points[-1][0] == want.points[-1][0]
    assert est.wall_s == full.wall_s and est.restart_downtime_s == pytest.approx(full.restart_downtime_s)
    # The step-time sums are estimates from 1/33 of the file (the whole lines of the windows stand for it all).
    assert est.productive_s == pytest.approx(full.productive_s, rel=0.03)
    assert est.redone_restart_s + est.productive_s == pytest.approx(full.redone_restart_s + full.productive_s,
                                                                      rel=0.03)


def test_a_small_file_is_read_whole_and_the_page_says_when_it_was_not(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    _telemetry(path, random.Random(8))
    lines, info = step_lines(path, SampleConfig(max_bytes=path.stat().st_size))
    assert info is None and sum(1 for _ in lines) == sum(1 for x in path.open() if '"kind": "step"' in x)
    note = report._sampled_note(step_lines(path, SMALL)[1])
    assert "Sampled telemetry" in note and "--full-telemetry" in note and "estimates" in note
    assert report._sampled_note(None) == ""
