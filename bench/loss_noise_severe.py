"""The loss spike detector's severe line on healthy noisy losses and on held 8x spikes (CPU, ~1 minute).

Healthy: a falling small loss (0.35 -> 0.05) with log-normal noise (sigma_log 0.3 / 0.6 / 0.9), 600 steps in 4
attempts (a detector reset between them, as a restart does), warm-up 3 and 5 steps, 40 seeds each: how many runs get a severe finding,
any finding, or an engine decision. Spike: the same loss shape x8 for 30 steps (examples/deepspeed_attach's demo
fault), window 10 / warm-up 3 (that example's e2e spec) and the defaults (window 100 / warm-up 20): missed spikes
and the delay of the first decision after the onset. Writes JSON to --out (default: stdout).

    .venv/bin/python bench/loss_noise_severe.py [--out bench/results/loss_noise_severe.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess

from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors.loss_spike import LossSpikeDetector
from ulyssesd.remediation.records import StepRecord
from ulyssesd.remediation.replay import replay


def _level(step: int) -> float:
    return 0.3 * math.exp(-step / 300) + 0.05


def healthy(sigma: float, seeds: int, warmup: int) -> dict:
    severe = anyf = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        det = LossSpikeDetector(DetectorsConfig(warmup_steps=warmup))
        step, sev, found = 0, False, False
        for attempt in range(4):
            if attempt:
                det.reset()
            for _ in range(150):
                step += 1
                loss = _level(step) * math.exp(rng.gauss(0, sigma))
                for f in det.observe(StepRecord(step=step, loss=loss, time=float(step)), float(step)):
                    found = True
                    sev = sev or bool(f.evidence.get("severe"))
        severe += sev
        anyf += found
    return {"sigma_log": sigma, "warmup_steps": warmup, "runs": seeds, "runs_with_severe": severe,
            "runs_with_any_finding": anyf}


def _items(losses: list[float], det: DetectorsConfig) -> list:
    recs = [StepRecord(step=i + 1, loss=v, time=float(i + 1)) for i, v in enumerate(losses)]
    return [it for it in replay(recs, det, RemediationConfig()) if it.item.symptom != "hang"]


def spike(sigma: float, window: int, warmup: int, seeds: int, onset: int = 300) -> dict:
    det = DetectorsConfig(warmup_steps=warmup, window=window)
    delays, missed, healthy_acted = [], 0, 0
    for seed in range(seeds):
        rng = random.Random(1000 + seed)
        noise = [math.exp(rng.gauss(0, sigma)) for _ in range(onset + 100)]
        base = [_level(s) * noise[s - 1] for s in range(1, onset + 101)]
        healthy_acted += any(it.kind == "decision" for it in _items(base, det))
        items = _items([v * (8 if onset <= s < onset + 30 else 1) for s, v in enumerate(base, 1)], det)
        acted = [it.step - onset for it in items if it.kind == "decision" and it.step >= onset]
        if acted:
            delays.append(acted[0])
        else:
            missed += 1
    return {"sigma_log": sigma, "window": window, "warmup_steps": warmup, "runs": seeds, "spikes_missed": missed,
            "act_delay_median": statistics.median(delays) if delays else None,
            "act_delay_max": max(delays) if delays else None, "same_runs_without_spike_acted_on": healthy_acted}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"commit": commit,
           "healthy": [healthy(s, args.seeds, u) for u in (3, 5) for s in (0.3, 0.6, 0.9)],
           "spike_8x_30_steps": [spike(s, w, u, args.seeds // 2) for w, u in ((10, 3), (100, 20))
                                 for s in (0.05, 0.35, 0.6)]}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
