"""A user's own training script, stdlib only, for the hostile daemon tests: prints `step=N loss=X` lines
and misbehaves as told, on the attempt told (ULYSSESD_ATTEMPT).

    plain_job.py --steps N --sleep S [--chatty-hang-at K] [--exit3-at K] [--hang-at K] [--junk-mib M] [--attempt A]
"""

import argparse
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--chatty-hang-at", type=int, default=0)
p.add_argument("--exit3-at", type=int, default=0)
p.add_argument("--hang-at", type=int, default=0)
p.add_argument("--junk-mib", type=int, default=0, help="print this many MiB of noise before the first step")
p.add_argument("--ignore-term", action="store_true", help="a hung job does not react to SIGTERM")
p.add_argument("--attempt", type=int, default=1, help="misbehave on this attempt only")
a = p.parse_args()
attempt = int(os.environ.get("ULYSSESD_ATTEMPT", "1"))
bad = attempt == a.attempt
if a.ignore_term and bad:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
line = "noise " * 20 + "\n"
for _ in range(a.junk_mib * (1 << 20) // len(line)):
    sys.stdout.write(line)
sys.stdout.flush()
for step in range(1, a.steps + 1):
    if bad and step == a.exit3_at:
        print("my own reason to stop: dataset shard missing", flush=True)
        sys.exit(3)
    if bad and step == a.chatty_hang_at:
        while True:  # stuck in a collective that keeps logging
            print("[rank0]: NCCL WARN waiting for peer, retrying...", flush=True)
            time.sleep(0.05)
    if bad and step == a.hang_at:
        while True:
            time.sleep(1)
    print(f"step={step} loss={2.5 - step * 0.01:.4f}", flush=True)
    time.sleep(a.sleep)
print("done", flush=True)
