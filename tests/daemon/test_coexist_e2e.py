"""The daemon beside an inner launcher that restarts workers itself (docs/COEXISTENCE.md), with REAL processes:
the real 2-rank tiny job (ZeRO-3 + Ulysses, gloo, CPU) under a real torchrun --max-restarts=2, and under
NVRx's real ft_launcher where the package is installed. Each run goes through a crash and a hang; what
must hold in every interleaving: no double restart (the inner launcher restarts as often as its log says and
the daemon relaunches only where it owns the failure), every in-job restart recorded once as an
`inner_restart` incident (never counted as a daemon restart), and the run COMPLETES.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from test_daemon_e2e_real import _daemon, real_spec

from ulyssesd.daemon.store import open_store

WILL_RESTART = re.compile(r"\d+/\d+ (?:restart )?attempts left;\s*(?:will restart|restarting) worker group")


def _run(tmp: Path, launcher: dict, faults: list[dict], detectors: dict, steps: int = 16):
    spec = real_spec(tmp, steps=steps, faults=faults, name="coexist", detectors=detectors)
    text = spec.read_text().replace('[launcher]\nkind = "torchrun"\nnproc_per_node = 2\n',
                                    '[launcher]\nkind = "torchrun"\nnproc_per_node = 2\n'
                                    + "".join(f"{k} = {json.dumps(v)}\n" for k, v in launcher.items()))
    assert text != spec.read_text()
    spec.write_text(text)
    log = tmp / "daemon.log"
    d = _daemon(spec, log)
    rc = d.wait(900)
    assert rc == 0, log.read_text()[-4000:]
    run_dir = next((tmp / "state" / "runs").iterdir())
    store = open_store(tmp / "state" / "ulyssesd.db", readonly=True)
    run = store.list_runs()[0]
    return run_dir, store, run, log


def _attempt_restarts(run_dir: Path, attempt: int) -> int:
    """How many times the inner launcher itself said it restarts the worker group in this attempt."""
    return len(WILL_RESTART.findall((run_dir / "logs" / f"attempt-{attempt}.log").read_text(errors="replace")))


def _steps(run_dir: Path, attempt: int) -> list[int]:
    out = []
    for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d.get("kind") == "step" and d.get("attempt") == attempt:
            out.append(d["step"])
    return out


@pytest.mark.slow
def test_torchrun_max_restarts_crash_then_hang(tmp_path):
    """torchrun restarts the crashed worker group (an in-job restart, recorded once); torchrun cannot see a
    hang, so the daemon ends the attempt and relaunches (one daemon restart), stopping torchrun with its
    ranks so that torchrun does not restart on top; the second attempt completes."""
    faults = [
        {"kind": "raise", "at_step": 6, "rank": 1, "attempts": [1], "restarts": [0]},  # torchrun's to restart
        {"kind": "hang", "at_step": 10, "rank": 1, "attempts": [1], "restarts": [1]},  # the daemon's to act on
    ]
    run_dir, store, run, log = _run(tmp_path, {"inner_restarts": "torchrun", "inner_max_restarts": 2}, faults,
                                    {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 12.0})
    assert run.state.value == "COMPLETED", log.read_text()[-3000:]
    attempts = store.list_attempts(run.id)
    assert [a.number for a in attempts] == [1, 2], "exactly one daemon relaunch (the hang's)"
    inner = store.list_incidents(run.id, symptom="inner_restart")
    assert [(i.attempt, i.evidence["ordinal"], i.evidence["by"]) for i in inner] == [(1, 1, "torchrun")]
    assert inner[0].status.value == "resolved"
    # torchrun restarted exactly once in attempt 1: the daemon's hang stop did not make it restart again.
    assert _attempt_restarts(run_dir, 1) == 1
    assert _attempt_restarts(run_dir, 2) == 0
    hangs = store.list_incidents(run.id, symptom="hang")
    assert [h.attempt for h in hangs] == [1]
    assert not store.list_incidents(run.id, symptom="crash"), "the in-job crash is torchrun's, not a daemon crash"
    assert max(_steps(run_dir, 2)) == 16
    # Both worker groups of attempt 1 trained (steps past the crash at 6, before the hang at 10).
    assert 9 in _steps(run_dir, 1)


@pytest.mark.slow
def test_torchrun_gives_up_then_the_daemon_takes_over(tmp_path):
    """A crash that recurs in every worker group: torchrun restarts twice (both recorded), gives up, exits;
    the daemon's crash path relaunches once and the run completes."""
    faults = [{"kind": "raise", "at_step": 6, "rank": 1, "attempts": [1]}]  # every restart of attempt 1
    run_dir, store, run, log = _run(tmp_path, {"inner_restarts": "torchrun", "inner_max_restarts": 2}, faults,
                                    {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 12.0}, steps=10)
    assert run.state.value == "COMPLETED", log.read_text()[-3000:]
    assert [a.number for a in store.list_attempts(run.id)] == [1, 2]
    inner = store.list_incidents(run.id, symptom="inner_restart")
    assert sorted((i.attempt, i.evidence["ordinal"]) for i in inner) == [(1, 1), (1, 2)]
    assert _attempt_restarts(run_dir, 1) == 2
    crashes = store.list_incidents(run.id, symptom="crash")
    assert [c.attempt for c in crashes] == [1], "torchrun gave up: one crash, the daemon's to restart"
    assert max(_steps(run_dir, 2)) == 10


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is None,
                    reason="nvidia-resiliency-ext is not installed (pip install nvidia-resiliency-ext)")
def test_nvrx_ft_launcher_crash_then_hang(tmp_path):
    """NVRx's ft_launcher restarts the crashed group, and its rank heartbeat monitor catches the hang and
    restarts again; the daemon records both once and never acts itself (its hang floor waits past NVRx's
    timeout): one attempt, no daemon restart, COMPLETED."""
    faults = [
        {"kind": "raise", "at_step": 6, "rank": 1, "attempts": [1], "restarts": [0]},
        {"kind": "hang", "at_step": 10, "rank": 1, "attempts": [1], "restarts": [1]},
    ]
    launcher = {"inner_restarts": "nvrx", "inner_max_restarts": 2, "inner_hang": "nvrx",
                "inner_hang_timeout_s": 30.0}
    run_dir, store, run, log = _run(tmp_path, launcher, faults,
                                    {"warmup_steps": 3, "window": 10, "hang_timeout_floor_s": 90.0})  # NVRx acts at ~30-35 s
    assert run.state.value == "COMPLETED", log.read_text()[-3000:]
    assert [a.number for a in store.list_attempts(run.id)] == [1], "NVRx restarted; the daemon did not"
    inner = store.list_incidents(run.id, symptom="inner_restart")
    assert [(i.attempt, i.evidence["ordinal"], i.evidence["by"]) for i in inner] == [(1, 1, "nvrx"), (1, 2, "nvrx")]
    assert _attempt_restarts(run_dir, 1) == 2
    assert not store.list_incidents(run.id, symptom="hang"), "NVRx owns hangs: the daemon did not act"
    assert "Did not get subsequent heartbeat" in (run_dir / "logs" / "attempt-1.log").read_text(errors="replace")
    assert max(_steps(run_dir, 1)) == 16
