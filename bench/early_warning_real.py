"""Early warning and calibration on real curves (issue 39 item 4), CPU only, one command:

    DS_ACCELERATOR=cpu .venv/bin/python bench/early_warning_real.py [--out DIR]

Curves: the public real-curve corpus (tests/fixtures/replay/real/, 27 curves with their sources) and the two
recorded real runs of the built-in job (tests/fixtures/replay/: the 3,000-step healthy tiny run, and two runs of the tiny preset
with its LR raised 30x from step 300: `tiny_cpu_sources_lr30.jsonl`, and `tiny_cpu_logits_lr30.jsonl` recorded
2026-12-07 on the 2-core dev box by tests/remediation/test_rem_loss_judgment_real.py with the job reporting
`logit_max`, reduced to the step fields and the start/save events). Each is replayed through the whole engine (hang findings left out:
the public rows are excerpts) twice: fixed thresholds (`calibrate = false`) and calibrated (the default).

Per curve: the findings and their steps, the first early warning (any signal) and, for incidents, the
detection delay (first loss/nan/overflow finding after the onset) and the warning's lead time before it.
Prints a table and writes the raw figures as JSON (`early_warning_real.json` under --out, default: print only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "tests" / "fixtures" / "replay" / "real"
RECORDED = ROOT / "tests" / "fixtures" / "replay"
INCIDENT_SYMPTOMS = ("loss_spike", "loss_oscillation", "nan_loss", "overflow_storm")


def curves() -> list[dict[str, Any]]:
    out = []
    for p in sorted(REAL.glob("*.json")):
        d = json.loads(p.read_text())
        out.append({"id": d["id"], "kind": d["kind"], "onset": d.get("onset_step"), "job": d.get("job") or None,
                    "rows": [{k: v for k, v in r.items() if k != "loss_carried"} for r in d["records"]],
                    "source": d["source"]["url"]})
    tiny = json.loads((RECORDED / "tiny_cpu_3k.json").read_text())
    out.append({"id": "recorded-tiny-cpu-3k", "kind": "healthy", "onset": None, "job": None,
                "rows": [{"kind": "step", **r} for r in tiny["records"]], "source": "tests/fixtures/replay/tiny_cpu_3k.json"})
    lr30 = [json.loads(line) for line in (RECORDED / "tiny_cpu_sources_lr30.jsonl").read_text().splitlines() if line]
    out.append({"id": "recorded-tiny-cpu-lr30", "kind": "incident", "onset": 300, "job": None, "rows": lr30,
                "source": "tests/fixtures/replay/tiny_cpu_sources_lr30.jsonl"})
    logits = [json.loads(line) for line in (RECORDED / "tiny_cpu_logits_lr30.jsonl").read_text().splitlines() if line]
    out.append({"id": "recorded-tiny-cpu-lr30-logits", "kind": "incident", "onset": 300, "job": None, "rows": logits,
                "source": "tests/fixtures/replay/tiny_cpu_logits_lr30.jsonl"})
    return out


def run(curve: dict[str, Any], calibrate: bool) -> dict[str, Any]:
    from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
    from ulyssesd.remediation.detectors import Finding
    from ulyssesd.remediation.engine import RemediationEngine
    from ulyssesd.remediation.records import StepRecord, parse_record
    from ulyssesd.remediation.replay import replay

    eng = RemediationEngine(DetectorsConfig(calibrate=calibrate), RemediationConfig(mode="observe"), curve["job"])
    recs = [parse_record(r) for r in curve["rows"]]
    findings: list[tuple[str, int | None]] = []
    warnings: list[dict[str, Any]] = []
    grad_rows = sum(1 for r in recs if isinstance(r, StepRecord) and r.grad_norm is not None)
    for it in replay(recs, engine=eng):
        if isinstance(it.item, Finding) and it.item.symptom != "hang":
            findings.append((it.item.symptom, it.item.step))
        warnings.extend(eng.new_warnings)
        eng.new_warnings = []
    warnings.extend(eng.new_warnings)
    out: dict[str, Any] = {"findings": findings, "warnings": [{k: w.get(k) for k in ("step", "signal", "z")}
                                                               for w in warnings],
                           "grad_norm_rows": grad_rows, "fitted": bool(eng.calibration and eng.calibration.get("values"))}
    onset = curve["onset"]
    if curve["kind"] == "incident" and onset is not None:
        hits = [s for sym, s in findings if sym in INCIDENT_SYMPTOMS and s is not None and s >= onset]
        out["found_at"] = hits[0] if hits else None
        out["delay"] = hits[0] - onset if hits else None
        first_w = next((w["step"] for w in warnings if w.get("step") is not None and w["step"] >= onset - 50), None)
        out["warned_at"] = first_w
        out["signals"] = sorted({str(w.get("signal")) for w in warnings if (w.get("step") or 0) >= onset - 50})
        out["lead"] = (hits[0] - first_w) if hits and first_w is not None and first_w <= hits[0] else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="directory for early_warning_real.json")
    args = ap.parse_args(argv)
    rows = []
    for c in curves():
        before, after = run(c, calibrate=False), run(c, calibrate=True)
        rows.append({"id": c["id"], "kind": c["kind"], "onset": c["onset"], "source": c["source"],
                     "before": before, "after": after})
    print(f"{'curve':48s} {'kind':13s} {'gn rows':>7s} {'findings fixed/fit':>18s} {'delay fixed/fit':>15s} "
          f"{'warnings':>8s} {'lead':>5s}")
    for r in rows:
        b, a = r["before"], r["after"]
        delay = f"{b.get('delay')}/{a.get('delay')}" if r["kind"] == "incident" else "-"
        print(f"{r['id'][:48]:48s} {r['kind']:13s} {a['grad_norm_rows']:7d} "
              f"{len(b['findings']):>8d}/{len(a['findings']):<9d} {delay:>15s} {len(a['warnings']):8d} "
              f"{str(a.get('lead')) if r['kind'] == 'incident' else '-':>5s}")
    healthy = [r for r in rows if r["kind"] == "healthy"]
    incidents = [r for r in rows if r["kind"] == "incident"]
    leads = [r["after"]["lead"] for r in incidents if r["after"].get("lead") is not None]
    summary = {
        "healthy_curves": len(healthy),
        "healthy_with_findings": {"fixed": sum(1 for r in healthy if r["before"]["findings"]),
                                  "calibrated": sum(1 for r in healthy if r["after"]["findings"])},
        "warnings_on_healthy_curves": sum(len(r["after"]["warnings"]) for r in healthy),
        "warnings_on_healthy_spikes": sum(len(r["after"]["warnings"]) for r in rows if r["kind"] == "healthy_spike"),
        "incidents": len(incidents),
        "incidents_found": {"fixed": sum(1 for r in incidents if r["before"].get("found_at") is not None),
                            "calibrated": sum(1 for r in incidents if r["after"].get("found_at") is not None)},
        "detection_delay_change": [
            (r["id"], r["before"].get("delay"), r["after"].get("delay")) for r in incidents
            if r["before"].get("delay") != r["after"].get("delay")],
        "incidents_armed": sum(1 for r in incidents if r["after"]["grad_norm_rows"] >= 35),
        "warned_before_finding": len(leads),
        "lead_median": statistics.median(leads) if leads else None,
        "lead_worst": min(leads) if leads else None,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "early_warning_real.json").write_text(json.dumps({"summary": summary, "curves": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
