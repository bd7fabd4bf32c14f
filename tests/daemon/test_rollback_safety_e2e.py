"""Issue 38's r3 sequence on the H100 (bench/results/gpu_call27), replayed on the CPU with the real 2-rank job
under the daemon: keep_last 1, no known-good anchors, async saves, a NaN at the same step on attempts 1 and 2,
and a SIGTERM that reaches the job after the NaN but before it has read the daemon's `suspect` (a slow step right
after the NaN holds the job between its control poll and the step's end, as the GPU's step 121 did).

On the H100 the job wrote an exit checkpoint after the NaN (step-00000121), retention then deleted the pending
rollback target (step-00000100, keep_last 1) and the relaunch "fell back" to the tag after the NaN. Here the run
must never resume from a tag saved at or after the onset, the rollback target must survive, and the run ends
COMPLETED or stops loudly (never silently poisoned)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from uls_daemon_helpers import run_until, write_spec

from ulyssesd.daemon.store.enums import RunState
from ulyssesd.training import checkpoint as ck
from ulyssesd.training.train_checkpoints import ASYNC_WRITE_DELAY_ENV

S = RunState
ONSET = 15   # the NaN step, on attempts 1 and 2


def _spec(tmp: Path) -> Path:
    sock = Path(tempfile.mkdtemp(prefix="uls-", dir="/tmp")) / "d.sock"
    sections = {
        "run": {"name": "r3-cpu"},
        # The save of step 10 is still being written when the NaN arrives (as step 100's 17 GB write was).
        "launcher": {"kind": "torchrun", "nproc_per_node": 2, "env": {ASYNC_WRITE_DELAY_ENV: "1.5"}},
        "model": {"preset": "tiny"},
        "parallel": {"sequence_parallel_size": 2},
        "precision": {"dtype": "fp32"},
        "train": {"steps": 30, "seq_len": 64, "micro_batch_size": 1, "lr": 1e-3, "warmup_steps": 2,
                  "device": "cpu"},
        "deepspeed.config.zero_optimization": {"stage": 3, "overlap_comm": False},
        "data": {"kind": "synthetic"},
        "checkpoint": {"interval_steps": 10, "keep_last": 1, "async_save": True},
        "detectors": {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 60.0},
        "remediation": {"max_restarts_per_hour": 10, "known_good_steps": 100000},
        "daemon": {"state_dir": str(tmp / "state"), "socket_path": str(sock), "tick_s": 0.25, "stop_grace_s": 90.0,
                   "hang_grace_s": 5.0, "stack_dump_wait_s": 2.0, "early_death_s": 5.0, "preflight": False,
                   "min_free_gib": 0},
    }
    faults = [{"kind": "nan_loss", "at_step": ONSET, "attempts": [1, 2]},
              # The step after the NaN sleeps 8 s on rank 0 after its control poll: the daemon's decision (suspect
              # written, then SIGTERM) lands inside it, so the job ends that step with a stale control state.
              {"kind": "slow_rank", "at_step": ONSET + 1, "magnitude": 8.0, "attempts": [1, 2]}]
    return write_spec(tmp / "run.toml", sections, faults)


@pytest.mark.slow
def test_nan_on_two_attempts_with_keep_last_1_never_resumes_after_the_onset(tmp_path, make_sup):
    ev: list[str] = []
    sup = make_sup(_spec(tmp_path), ev)
    sup.start()
    run_until(sup, lambda s: s.state in (S.COMPLETED, S.FAILED, S.STOPPED), timeout=600, tick=0.2)
    tele = [json.loads(line) for line in sup.telemetry_path.read_text().splitlines()]
    attempts = sup.store.list_attempts(sup.run_id)
    incidents = [sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id)]
    said = [(i.symptom.value, i.summary) for i in incidents]
    # The NaN was seen (and acted on) on attempts 1 and 2.
    nan_steps = {(r["attempt"], r["step"]) for r in tele if r.get("kind") == "step" and r["loss"] == "nan"}
    assert {(1, ONSET), (2, ONSET)} <= nan_steps, (nan_steps, said, ev[-20:])
    # No attempt wrote a checkpoint at or after the onset before its rollback: its exit is said, without a save.
    for a in (1, 2):
        late = [r["tag"] for r in tele if r.get("event") == "checkpoint_saved" and r["attempt"] == a
                and r["step"] >= ONSET]
        assert late == [], (a, late)
        exiting = [r for r in tele if r.get("event") == "exiting" and r["attempt"] == a]
        assert exiting and exiting[-1]["reason"] == "sigterm" and exiting[-1]["saved"] is False, exiting
    # No attempt resumed from a tag saved after the onset; the rollback target (step 10) survived and was used.
    resumed = [(a.number, a.resumed_from) for a in attempts]
    for _n, tag in resumed[1:]:
        assert tag is not None and ck.step_of_tag(tag) < ONSET, resumed
    assert [t for _n, t in resumed[1:3]] == ["step-00000010", "step-00000010"], resumed
    started = [r for r in tele if r.get("event") == "started" and r["attempt"] > 1]
    assert started and all((r["resumed_from"] and ck.step_of_tag(r["resumed_from"]) < ONSET) for r in started)
    assert not [s for s in said if "rolled back to the oldest valid" in s[1] or "fallback" in s[1]], said
    # Completed, or stopped loudly (an incident says why): never a run that silently went on from poisoned weights.
    if sup.state == S.COMPLETED:
        assert max(r["step"] for r in tele if r.get("kind") == "step") == 30
        assert ck.list_tags(sup.ckpt_dir)[-1] == "step-00000030"
    else:
        assert sup.state == S.FAILED and any(i.severity.value == "critical" for i in incidents), (sup.state, said)
