"""Gradient accumulation is real: micro-batch 1 × accumulation 2 trains exactly like micro-batch 2 × 1.

Regression test: calling engine.step() only once per optimizer step made DeepSpeed (which counts
micro-steps inside step()) apply no update at step 1 and four micro-batches at step 2.
"""

from __future__ import annotations

import math

import pytest
from train_job_helpers import launch, tiny_spec

pytestmark = pytest.mark.slow


def test_accumulation_matches_larger_micro_batch(tmp_path) -> None:
    common = {"steps": 3, "warmup_steps": 1}
    big = tiny_spec(parallel={"sequence_parallel_size": 1}, checkpoint={"interval_steps": 100},
                    train={**common, "micro_batch_size": 2, "gradient_accumulation_steps": 1})
    accum = tiny_spec(parallel={"sequence_parallel_size": 1}, checkpoint={"interval_steps": 100},
                      train={**common, "micro_batch_size": 1, "gradient_accumulation_steps": 2})
    a = launch(big, tmp_path / "mb2", nproc=1)
    b = launch(accum, tmp_path / "ga2", nproc=1)
    assert a.returncode == 0, a.output[-3000:]
    assert b.returncode == 0, b.output[-3000:]
    sa, sb = a.steps(), b.steps()
    assert sorted(sa) == sorted(sb) == [1, 2, 3]
    # Every step applies an update (a grad norm is reported) and consumes the same samples.
    for step in (1, 2, 3):
        assert sb[step]["grad_norm"] is not None and math.isfinite(sb[step]["grad_norm"])
        assert sa[step]["samples"] == sb[step]["samples"]
        assert sa[step]["loss"] == pytest.approx(sb[step]["loss"], abs=1e-5), step
