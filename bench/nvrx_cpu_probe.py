"""Probe: does NVRx's in-process wrapper (nvidia-resiliency-ext, inprocess.Wrapper) restart a 2-rank gloo job on the
CPU? Rank 1 raises in iteration 0 between all-reduces; the wrapper must restart both ranks in the same processes.
Run: pip install nvidia-resiliency-ext (0.4.1 for cp311 when checked) and
  python -m torch.distributed.run --standalone --nproc_per_node 2 bench/nvrx_cpu_probe.py
Result: docs/TRAINING.md "Host-memory tier and in-process restart" and bench/RESULTS.md."""

from __future__ import annotations

import datetime
import os
import time
from typing import Optional

import nvidia_resiliency_ext.inprocess as inprocess
import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
base_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0,
                           timeout=datetime.timedelta(seconds=60))
S = datetime.timedelta


@inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=3),
                   abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed()),
                   health_check=None, monitor_thread_interval=S(seconds=1), last_call_wait=S(seconds=1),
                   soft_timeout=S(seconds=20), hard_timeout=S(seconds=30), heartbeat_timeout=S(seconds=30),
                   barrier_timeout=S(seconds=40), completion_timeout=S(seconds=30))
def train(base_store, call_wrapper: Optional[inprocess.CallWrapper] = None):  # noqa: UP045 - NVRx reads the annotation
    it = call_wrapper.iteration
    store = dist.PrefixStore(str(it), base_store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    print(f"rank {rank} iteration {it} pg up", flush=True)
    for step in range(4):
        t = torch.ones(1)
        dist.all_reduce(t)
        if it == 0 and step == 2 and rank == 1:
            raise RuntimeError("injected")
    print(f"rank {rank} iteration {it} done", flush=True)
    return it


t0 = time.time()
r = train(base_store)
print(f"rank {rank} result {r} in {time.time() - t0:.1f}s", flush=True)
