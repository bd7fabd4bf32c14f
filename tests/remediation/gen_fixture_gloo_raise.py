"""Generates the real gloo fixtures of tests/fixtures/logs/python_exception/ (06, 08): rank 1 raises a plain
RuntimeError after a barrier while rank 0 waits in an all_reduce, so rank 0 then fails with gloo's
"Connection closed by peer". Not a test (pytest does not collect it); run it by hand:

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 tests/remediation/gen_fixture_gloo_raise.py \
        [--record] > out.log 2>&1

`--record` wraps main in torch's @record, so torchrun's Root Cause entry quotes the failed rank's traceback.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def train_step(step: int, rank: int) -> None:
    if rank == 1 and step == 3:
        raise RuntimeError("boom")


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(1, 6):
        dist.barrier()
        print(f"[rank {rank}] step {step} ok", flush=True)
        if rank == 1:
            time.sleep(0.5)  # rank 0 is inside the all_reduce when rank 1 raises
        train_step(step, rank)
        t = torch.ones(4)
        dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    record(main)() if "--record" in sys.argv else main()
