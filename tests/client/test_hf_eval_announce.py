"""UlyssesCallback announces the Trainer's evaluations (`evaluating` at the first prediction step, `evaluated` at
on_evaluate), so that the daemon's hang timeout allows for them. Hooks called as the Trainer calls them; a real
Reporter writes the telemetry file the daemon reads, and the hang detector reads it back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")


def test_evaluation_is_announced_once_and_ended(tmp_path):
    from ulyssesd.client.hf import UlyssesCallback
    from ulyssesd.client.reporter import Reporter, ReporterConfig
    from ulyssesd.remediation.config import DetectorsConfig
    from ulyssesd.remediation.detectors import HangDetector
    from ulyssesd.remediation.records import parse_record

    path = tmp_path / "telemetry.jsonl"
    rep = Reporter(path=path, rank=0, config=ReporterConfig(synchronous=True))
    cb = UlyssesCallback(reporter=rep, signals=False)
    state, args = SimpleNamespace(global_step=50), SimpleNamespace()
    for _ in range(3):   # three eval batches: one announcement
        cb.on_prediction_step(args, state, None)
    cb.on_evaluate(args, state, None, metrics={"eval_loss": 2.0})
    cb.on_prediction_step(args, state, None)   # the next evaluation is announced again
    rep.close()
    events = [json.loads(x)["event"] for x in path.read_text().splitlines()]
    assert events == ["evaluating", "evaluated", "evaluating"]
    det = HangDetector(DetectorsConfig(), start_time=0.0)
    for i, line in enumerate(path.read_text().splitlines()[:2]):
        det.observe(parse_record(json.loads(line)), 10.0 * i)
    assert det.longest["evaluation"] == 10.0
