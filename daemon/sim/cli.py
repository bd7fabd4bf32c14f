"""`ulyssesd simulate`: many seeded simulated runs, their invariants, and a replayable trace of any violation.

    ulyssesd simulate --seed 0 --runs 1000 --days 7 [--jobs 4] [--out DIR]
    ulyssesd simulate --replay violation.json

Seeds `seed .. seed+runs-1` run in `--jobs` worker processes. A violation prints its seed, the invariant and the
fewest fault events that still break it (JSON, also written to `--out`); `--replay` runs that file again.
Exit code 0 when every run held every invariant, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.sim.runner import (
    RunResult,
    SimConfig,
    config_from,
    describe,
    faults_from,
    minimise,
    run_seed,
)


def _quiet() -> None:
    """The daemon's own log lines go nowhere: a simulated week is thousands of them per run."""
    from ulyssesd.daemon.host.logging import configure_logging

    configure_logging(level="CRITICAL", stream=open(os.devnull, "w"))  # noqa: SIM115 - the process's lifetime


def _one(args: tuple[int, SimConfig]) -> RunResult:
    _quiet()
    seed, cfg = args
    r = run_seed(seed, cfg)
    if r.ok:  # a held run's fault list and trace are not needed again: 10^5 of them would not fit in memory
        r.faults, r.trace = [], [{}] * len(r.trace)
    return r


def run_many(seed: int, runs: int, cfg: SimConfig, jobs: int = 1) -> list[RunResult]:
    """Seeds seed .. seed+runs-1, in `jobs` processes (1: in this one)."""
    work = [(s, cfg) for s in range(seed, seed + runs)]
    if jobs <= 1:
        return [_one(w) for w in work]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_one, work, chunksize=max(1, runs // (jobs * 8))))


def summary(results: list[RunResult], wall_s: float) -> dict[str, Any]:
    days = sum(r.sim_s for r in results) / 86_400.0
    return {"runs": len(results), "violations": sum(1 for r in results if not r.ok), "wall_s": round(wall_s, 1),
            "runs_per_s": round(len(results) / wall_s, 3) if wall_s > 0 else None,
            "simulated_days": round(days, 1), "ticks": sum(r.ticks for r in results),
            "attempts": sum(r.attempts for r in results), "incidents": sum(r.incidents for r in results),
            "daemon_restarts": sum(r.daemons - 1 for r in results),
            "faults": sum(len(r.trace) for r in results),
            "end_states": {s: sum(1 for r in results if r.state == s) for s in sorted({r.state for r in results})},
            **_goodput(results),
            "ended_because": _reasons(results)}


def _goodput(results: list[RunResult]) -> dict[str, Any]:
    """Mean goodput measured and modelled over the runs that trained to the end of their simulated time (a run
    the daemon ended early, or left paused, is no sample of the productive fraction)."""
    full = [r for r in results if r.state == "RUNNING"]
    if not full:
        return {"goodput_runs": 0}
    return {"goodput_runs": len(full), "goodput_mean": round(sum(r.goodput for r in full) / len(full), 4),
            "goodput_model_mean": round(sum(r.goodput_model for r in full) / len(full), 4),
            "goodput_min": min(r.goodput for r in full)}


#: What an early end's reason says, most specific first (the budget's words come before the crash it followed).
END_PHRASES = ("restarts without a checkpoint", "restarts in the last hour", "no valid checkpoint", "read-only",
               "internal error", "persisted", "recurred", "crashed with", "operator stop")


def _reasons(results: list[RunResult]) -> dict[str, int]:
    """Why runs ended early, by the first words of their last transition's reason."""
    out: dict[str, int] = {}
    for r in results:
        if r.end_reason:
            key = next((p for p in END_PHRASES if p in r.end_reason), " ".join(r.end_reason.split()[:6]))
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


#: A violation's trace is a few KiB; anything far larger is not one (and is not read whole into memory).
MAX_TRACE_BYTES = 16 << 20
#: The longest simulated run (`--days`): a year; more is a typo (`inf` never ends).
MAX_DAYS = 366.0


def load_trace(path: str) -> tuple[int, Any, list[Any]]:
    """(seed, config, faults) of a violation's trace (`--out`'s JSON); ValueError/TypeError/OSError naming what
    is wrong: not a regular file (a FIFO would block), too big, not JSON, a field of the wrong type."""
    from ulyssesd.daemon.safety.regular_file import open_regular

    with open_regular(path, "rb") as fh:
        raw = fh.read(MAX_TRACE_BYTES + 1)
    if len(raw) > MAX_TRACE_BYTES:
        raise ValueError(f"over {MAX_TRACE_BYTES >> 20} MiB: not a trace written by `ulyssesd simulate --out`")
    doc = json.loads(raw)  # binary: UnicodeDecodeError, a ValueError
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object (a trace written by `ulyssesd simulate --out`)")
    seed, faults = doc.get("seed"), doc.get("faults")
    if type(seed) is not int:
        raise ValueError(f"seed {seed!r} is not an integer")
    if not isinstance(faults, list) or not all(
            isinstance(f, dict) and isinstance(f.get("kind"), str) and all(
                isinstance(f.get(k, 0.0), int | float) and not isinstance(f.get(k, 0.0), bool)
                and abs(f.get(k, 0.0)) < float("inf") for k in ("at", "arg")) for f in faults):
        raise ValueError("faults is not a list of {at: number, kind: string, cause, arg: number} objects")
    if doc.get("config") is not None and not isinstance(doc.get("config"), dict):
        raise ValueError("config is not a JSON object")
    return seed, config_from(doc.get("config")), faults_from(doc)


def simulate(seed: int, runs: int, days: float, jobs: int, out: str | None, replay: str | None,
             say: Any = print) -> int:
    _quiet()
    if replay:
        try:
            seed_of_trace, cfg, faults = load_trace(replay)
        except (OSError, ValueError, TypeError) as exc:
            print(f"ulyssesd simulate: cannot replay {replay}: {exc}", file=sys.stderr)
            return 2
        r = run_seed(seed_of_trace, cfg, faults)
        say(json.dumps({"seed": r.seed, "ok": r.ok, "violations": [v.__dict__ for v in r.violations],
                        "state": r.state, "sim_days": round(r.sim_s / 86_400, 2)}))
        return 0 if r.ok else 1
    cfg = replace(SimConfig(), days=days)
    t0 = SYSTEM.monotonic()
    results = run_many(seed, runs, cfg, jobs)
    doc = summary(results, SYSTEM.monotonic() - t0)
    bad = [r for r in results if not r.ok]
    doc["violating_seeds"] = [{"seed": r.seed, "invariant": r.violations[0].invariant} for r in bad]
    say(json.dumps(doc))
    if out:  # the nightly's record (`make sim-nightly`): the summary beside the violations' traces
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "summary.json").write_text(json.dumps({**doc, "first_seed": seed, "days": days}, indent=1) + "\n")
    for r in bad[:5]:
        faults = minimise(r, cfg)
        text = describe(r, faults, cfg)
        say(f"INVARIANT VIOLATED (seed {r.seed}): {r.violations[0].invariant}: {r.violations[0].detail}\n{text}")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"violation-seed-{r.seed}.json").write_text(text)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:  # `python -m ulyssesd.daemon.sim.cli`
    import argparse

    p = argparse.ArgumentParser(prog="ulyssesd simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--days", type=float, default=7.0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--replay")
    a = p.parse_args(argv)
    if not 0.01 <= a.days <= MAX_DAYS:
        p.error(f"--days {a.days} is not in the range 0.01 to {MAX_DAYS:g}")
    return simulate(a.seed, a.runs, a.days, a.jobs, a.out, a.replay)


if __name__ == "__main__":
    sys.exit(main())
