"""GPU acceptance of loss judgment (issue 39): the shipped gpt-1b config on the built-in synthetic data, supervised.

One supervised run of `configs/gpt-1b-1xh200.toml` (at --seq tokens, default 8K; warm-up --warmup, LR --lr: the
harsh case of the issue is warm-up 5, LR 3e-4) in `remediation.mode = "observe"`: the daemon records what the
engine would have done and does nothing. Steps 1..--healthy are the healthy part (>= 2,000: goal 0 ladder
actions, 0 restarts, and the per-family loss multi-modal and falling); from step --healthy + 1 the LR is raised
--lr-factor x (fault `lr_spike`, the optimizer's own blow-up) for --inject-steps steps: found within 20 steps
of its onset, the would-be rollback never to step 0 and no further back than one save interval.

Afterwards the recorded telemetry is replayed offline twice through the same engine (remediation/replay.py):
as recorded (per-source loss: "after") and with `loss_by_source` removed ("before": one band over the mixed
loss, what issue 39 measured), so the before/after figures come from the same steps.

At ~0.22 s/step at 8K on one H100 the default (2,050 + 50 steps) takes ~8 min of wall time with start-up; the
script stops the run at --deadline-s whatever happens and still analyzes what it has. Raw material under --out.

    python bench/gpu_loss_judgment.py --out $OUT/loss_judgment
    python bench/gpu_loss_judgment.py --analyze $OUT/loss_judgment      # offline, on the copied files
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import tomllib
from daemon_run import end_daemon, new_socket_path, run_dir_of, save_logs, save_store_and_events, start_daemon

ROOT = Path(__file__).resolve().parents[1]
LOSS_SYMPTOMS = ("loss_spike", "loss_oscillation", "nan_loss", "overflow_storm")


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def dump_toml(spec: dict[str, Any], faults: list[dict[str, Any]]) -> str:
    lines: list[str] = []

    def table(path: str, body: dict[str, Any]) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict) or path.endswith("launcher")}
        lines.append(f"[{path}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in body.items():
            if isinstance(v, dict) and k not in scalars:
                table(f"{path}.{k}", v)

    for name, body in spec.items():
        table(name, body)
    for f in faults:
        lines.append("[[faults]]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in f.items())
        lines.append("")
    return "\n".join(lines)


def build_spec(a: argparse.Namespace, work: Path) -> Path:
    spec = tomllib.loads(Path(a.config).read_text())
    tr = spec["train"]
    tr.update(steps=a.healthy + a.inject_steps, seq_len=a.seq, warmup_steps=a.warmup, lr=a.lr,
              min_lr=min(tr.get("min_lr", a.lr / 10), a.lr))
    spec.setdefault("remediation", {})["mode"] = a.mode
    # gpt-1b tags are ~17 GB and the one-GPU machine has 64 GiB of disk: saves at 1,000 and 2,000 only (the
    # onset at 2,051 then has a clean checkpoint 51 steps before it: less than one save interval of work).
    spec.setdefault("checkpoint", {}).update(interval_steps=a.save_every, keep_last=2)
    spec["daemon"] = {"state_dir": str(work / "state"), "socket_path": str(new_socket_path()), "tick_s": 0.5,
                      "stop_grace_s": 60.0, "preflight": False}
    faults = [{"kind": "lr_spike", "at_step": a.healthy + 1, "steps": 100_000, "magnitude": a.lr_factor}]
    path = work / "run.toml"
    path.write_text(dump_toml(spec, faults))
    return path


def run(a: argparse.Namespace) -> Path:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    spec = build_spec(a, work)
    shutil.copy(spec, out / "run.toml")
    log = out / "daemon.log"
    t0 = time.time()
    proc = start_daemon(spec, log)
    events: dict[str, Any] = {"started": t0, "deadline_s": a.deadline_s}
    try:
        while time.time() - t0 < a.deadline_s and proc.poll() is None:
            time.sleep(2)
    finally:
        events["daemon_rc"] = proc.poll()
        if proc.poll() is None:
            events["stopped_at_deadline"] = True
            end_daemon(proc, work / "state")
        events["wall_s"] = round(time.time() - t0, 1)
    rd = run_dir_of(work / "state")
    if rd is not None:
        for name in ("telemetry.jsonl", "calibration.json"):
            if (rd / name).exists():
                shutil.copy(rd / name, out / name)
        save_logs(rd, out, "run", tail=20_000, head=4000)
    save_store_and_events(work / "state", out, "run", events)
    shutil.rmtree(work / "state" / "runs", ignore_errors=True)   # checkpoints: 17 GB tags stay off $OUT
    return out


def _median(v: list[float]) -> float | None:
    s = sorted(v)
    return s[len(s) // 2] if s else None


def replay_counts(recs: list[dict[str, Any]], onset: int, strip_sources: bool) -> dict[str, Any]:
    """Findings and would-be decisions of the engine over the recorded telemetry. After: default thresholds.
    Before (`strip_sources`): no `loss_by_source`, and the loss modes, the calibration and the early warning
    off - the judgment issue 39 measured."""
    from ulyssesd.remediation.config import DetectorsConfig
    from ulyssesd.remediation.detectors import Finding
    from ulyssesd.remediation.engine import Decision, RemediationEngine
    from ulyssesd.remediation.records import parse_record

    eng = RemediationEngine(DetectorsConfig(loss_mixture=False, calibrate=False, early_warning=False)
                            if strip_sources else DetectorsConfig())
    found: list[Finding] = []
    decided: list[Decision] = []
    for d in recs:
        if strip_sources:
            d = {k: v for k, v in d.items() if k != "loss_by_source"}
        rec = parse_record(d)
        for it in eng.observe(rec, rec.time or 0.0):
            (found if isinstance(it, Finding) else decided).append(it)
    healthy_f = [f for f in found if (f.step or 0) < onset]
    after_loss = [f for f in found if (f.step or 0) >= onset and f.symptom in LOSS_SYMPTOMS]
    return {
        "healthy_findings": len(healthy_f),
        "healthy_findings_by_symptom": {s: sum(f.symptom == s for f in healthy_f) for s in {f.symptom for f in healthy_f}},
        "healthy_decisions": [(d.step, d.action_kind, d.apply) for d in decided if (d.step or 0) < onset],
        "healthy_rollbacks_to_step_0": sum(1 for d in decided if (d.step or 0) < onset and d.apply == "rollback_skip"
                                           and d.rollback_to_step == 0),
        "blowup_first_finding_step": after_loss[0].step if after_loss else None,
        "blowup_delay_steps": (after_loss[0].step - onset) if after_loss else None,
        "blowup_first_finding": after_loss[0].message if after_loss else None,
        "blowup_decisions": [(d.step, d.action_kind, d.apply, d.rollback_to_step) for d in decided
                             if (d.step or 0) >= onset],
        "calibration": eng.calibration and {k: eng.calibration[k] for k in ("values", "changed", "steps")},
        **_warnings(eng, onset, after_loss[0].step if after_loss else None),
    }


def _warnings(eng: Any, onset: int, found_at: int | None) -> dict[str, Any]:
    """The early warning: warnings on the healthy part (goal 0) and its lead over the first loss finding."""
    ws = [w["step"] for w in (eng.grad_watch.warnings if eng.grad_watch is not None else [])]
    first = next((s for s in ws if s >= onset), None)
    return {"healthy_warnings": [s for s in ws if s < onset], "first_warning_after_onset": first,
            "warning_lead_steps": (found_at - first) if first is not None and found_at is not None else None}


def analyze(out: Path) -> dict[str, Any]:
    spec = tomllib.loads((out / "run.toml").read_text())
    onset = int(spec["faults"][0]["at_step"])
    recs = [json.loads(x) for x in (out / "telemetry.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if r.get("kind") == "step"]
    healthy = [r for r in steps if r["step"] < onset]
    fam: dict[str, dict[str, list[float]]] = {}
    for r in healthy:
        part = "first50" if r["step"] <= 50 else "last50" if r["step"] > onset - 51 else None
        for k, v in (r.get("loss_by_source") or {}).items():
            if part:
                fam.setdefault(k, {}).setdefault(part, []).append(v)
    store = json.loads((out / "run_store.json").read_text()) if (out / "run_store.json").exists() else {}
    incidents = store.get("incidents", []) if isinstance(store.get("incidents"), list) else []
    actions = store.get("actions", []) if isinstance(store.get("actions"), list) else []
    inc_step = {i["id"]: i.get("step") for i in incidents}
    attempts = store.get("attempts", []) if isinstance(store.get("attempts"), list) else []
    times = [r["step_time_s"] for r in healthy if r.get("step_time_s")]
    result = {
        "onset_step": onset, "steps_recorded": len(steps), "max_step": max((r["step"] for r in steps), default=None),
        "median_step_time_s": _median(times),
        "per_family_median_loss": {k: {p: _median(v) for p, v in parts.items()} for k, parts in fam.items()},
        "daemon": {
            "healthy_incidents": [(i.get("step"), i.get("symptom"), (i.get("summary") or "")[:160])
                                  for i in incidents if (i.get("step") or 0) < onset],
            "healthy_actions": [(a.get("kind"), inc_step.get(a.get("incident_id"))) for a in actions
                                if (inc_step.get(a.get("incident_id")) or 0) < onset],
            "attempts": len(attempts),
            "blowup_incidents": [(i.get("step"), i.get("symptom"), (i.get("summary") or "")[:200])
                                 for i in incidents if (i.get("step") or 0) >= onset][:10],
            "blowup_actions": [(a.get("kind"), json.loads(a["parameters"]).get("rung") if isinstance(a.get("parameters"), str)
                                else (a.get("parameters") or {}).get("rung"),
                                inc_step.get(a.get("incident_id"))) for a in actions
                               if (inc_step.get(a.get("incident_id")) or 0) >= onset][:10],
        },
        "replay_after_per_source": replay_counts(recs, onset, strip_sources=False),
        "replay_before_no_sources": replay_counts(recs, onset, strip_sources=True),
        "calibration": json.loads((out / "calibration.json").read_text()) if (out / "calibration.json").exists() else None,
    }
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output folder (default $OUT/loss_judgment)")
    p.add_argument("--analyze", default=None, help="only analyze an earlier --out folder")
    p.add_argument("--config", default=str(ROOT / "configs" / "gpt-1b-1xh200.toml"))
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--healthy", type=int, default=2050, help="healthy steps before the LR is raised (>= 2000)")
    p.add_argument("--inject-steps", type=int, default=50, help="steps run with the raised LR")
    p.add_argument("--lr-factor", type=float, default=30.0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--mode", default="observe", choices=("observe", "act"))
    p.add_argument("--save-every", type=int, default=1000, help="checkpoint interval (steps)")
    p.add_argument("--deadline-s", type=float, default=550.0, help="stop the run after this many seconds of wall time")
    a = p.parse_args()
    if a.analyze:
        out = Path(a.analyze)
    else:
        import os
        out = run(argparse.Namespace(**{**vars(a), "out": a.out or str(Path(os.environ.get("OUT", ".")) / "loss_judgment")}))
    print(json.dumps(analyze(out), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
