"""Detection delay and false alarms of the step-time drift CUSUM on the noisy healthy generator
(rem_helpers.healthy: lognormal step-time noise `time_noise` plus a 0-8 % per-rank spread): first at the classic
few-percent setting (drift_min_effect = 0.02: k 1.5 %, clip 10 %, h 0.6), then at the defaults (effect size
learned from the run, floor 10 %) for slowdowns of 3-30 % lasting 300 steps.

    DS_ACCELERATOR=cpu .venv/bin/python tests/remediation/drift_eval.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rem_helpers import healthy  # noqa: E402

from ulyssesd.remediation.config import DetectorsConfig  # noqa: E402
from ulyssesd.remediation.detectors.throughput_drift import ThroughputDriftDetector  # noqa: E402

FEW_PERCENT = DetectorsConfig(drift_min_effect=0.02)


def run(recs, cfg: DetectorsConfig = FEW_PERCENT):
    det = ThroughputDriftDetector(cfg)
    return [f for r in recs for f in det.observe(r, r.time or 0.0)]


def main() -> None:
    alarms = 0
    for seed in range(12):
        alarms += len(run(healthy(6000, seed=seed, time_noise=random.Random(seed).uniform(0.01, 0.08))))
    print(f"false alarms: {alarms} in {12 * 6000} healthy steps (time_noise 1-8 %)")
    for drop in (0.03, 0.05):
        for noise in (0.02, 0.03, 0.05):
            delays = []
            for seed in range(6):
                def slower(step, r, drop=drop):
                    if step >= 2000:
                        r.step_time_s *= 1 + drop
                        r.step_time_max_s *= 1 + drop
                found = [f for f in run(healthy(3000, seed=seed + 100, time_noise=noise, mutate=slower))
                         if f.step >= 2000]
                delays.append(found[0].step - 2000 if found else None)
            print(f"slowdown {drop:.0%}, time_noise {noise:.0%}: steps to the finding {delays}")
    print("defaults (effect size learned, floor 10 %), slowdown for 300 steps from step 2000:")
    for drop in (0.03, 0.05, 0.08, 0.10, 0.12, 0.20, 0.30):
        for noise in (0.02, 0.05):
            delays = []
            for seed in range(6):
                def slower300(step, r, drop=drop):
                    if 2000 <= step < 2300:
                        r.step_time_s *= 1 + drop
                        r.step_time_max_s *= 1 + drop
                found = [f for f in run(healthy(2400, seed=seed, time_noise=noise, mutate=slower300), DetectorsConfig())
                         if f.step >= 2000]
                delays.append(found[0].step - 2000 if found else None)
            print(f"slowdown {drop:.0%}, time_noise {noise:.0%}: steps to the finding {delays}")


if __name__ == "__main__":
    main()
