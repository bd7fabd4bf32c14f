"""The HF Trainer integration: a real Trainer run (tiny GPT-2 from a config, no download) writes step records
and manifests through UlyssesCallback. Skips cleanly when transformers (the `hf` extra) is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer" / "train.py"


def test_trainer_run_reports_steps_and_manifests(tmp_path):
    from ulyssesd.client import validate_manifest

    env = {**os.environ, "ULYSSESD_RUN_DIR": str(tmp_path), "RANK": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLE), "--output-dir", str(tmp_path / "out"), "--max-steps", "20"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 21)) and all("grad_norm" in r for r in steps)
    saved = [r for r in recs if r.get("event") == "checkpoint_saved"]
    assert [r["tag"] for r in saved] == ["checkpoint-10", "checkpoint-20"]
    assert validate_manifest(tmp_path / "out" / "checkpoint-20") == (True, "ok")
    assert recs[-1]["event"] == "exiting" and recs[-1]["reason"] == "completed"
