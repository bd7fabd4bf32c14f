"""GPU memory of the warm standby (`[restart] standby = true`), beside the attempt that trains.

Once an attempt trains, the daemon starts the next attempt's ranks in standby (daemon/job/standby.py). Each
standby rank runs `training/startup.py` `warm_up` before its gate, on the same device as the training rank of
its LOCAL_RANK: it creates a CUDA context there (`torch.cuda.set_device` + a first allocation), `warm_device`
creates the cuBLAS/cuBLASLt handles (their workspaces stay allocated: 64 MiB on the H200, device call 14) and
loads the matmul and SDPA kernels' modules, then empties its allocator's cache; then the process group: with
one rank NCCL's communicator is lazy (none before the gate), with more DeepSpeed 0.19.8 passes `device_id` to
`init_process_group` (deepspeed/comm/torch.py, world size != 1 on CUDA) and torch then connects the
communicator at once (`eager_connect_single_device`), so its buffers are on the GPU before the gate too (not
measured yet: a note, not in the figure). The preload goes to host memfds, never to the GPU. So for the
whole run every GPU holds a second process's context and workspaces: bytes outside the training rank's own
allocator, counted in the required memory, not in its allocated peak. Formula and figure: docs/PLANNER.md
"The warm standby on the GPU".
"""

from __future__ import annotations

from .host_extras import RestartLike
from .inputs import CUDA_CONTEXT_GIB
from .rendering import PHASES, Item

# One waiting standby process on one GPU: its CUDA context, the cuBLAS/cuBLASLt workspaces warm_device keeps
# and the kernel modules it loaded. Provisional, NOT measured: bench/RESULTS.md has no GPU memory figure of a
# CUDA context or of a standby yet (its "CUDA context" row is 0.20 s of start-up time); until
# bench/gpu_standby_mem.py is run this is the planner's own allowance for one process's context and workspaces
# outside the allocator (inputs.CUDA_CONTEXT_GIB = 1 GiB), on the safe side of the 64 MiB of cuBLAS workspaces
# that were measured.
STANDBY_GPU_MIB = int(CUDA_CONTEXT_GIB * 1024)
STANDBY_GPU = "warm standby process (CUDA context, cuBLAS)"
#: What the GPU verdict and the plan's notes say a standby costs, and the setting that removes it.
STANDBY_GPU_OFF = "[restart] standby = false (every relaunch is then cold)"


def standby_gpu_items(restart: RestartLike) -> list[Item]:
    """Per-GPU items of the warm standby (none without `[restart] standby`): outside the job's allocator."""
    if not restart.standby:
        return []
    return [Item(STANDBY_GPU, STANDBY_GPU_MIB << 20, "gpu",
                 f"{STANDBY_GPU_MIB} MiB per GPU, another process's CUDA context + cuBLAS workspaces "
                 "(provisional, not measured); in required, not in allocated",
                 PHASES, off=STANDBY_GPU_OFF, outside_allocator=True)]


def standby_gpu_notes(restart: RestartLike, world_size: int) -> list[str]:
    """What the plan's notes say about the standby on the GPU (nothing without `[restart] standby`)."""
    if not restart.standby:
        return []
    notes = [f"standby: each GPU also holds the waiting warm standby's CUDA context and cuBLAS workspaces "
             f"({STANDBY_GPU_MIB / 1024:.2f} GiB, another process: in required, not in allocated) for the whole "
             "run; its preload is host memory, never GPU"]
    if world_size > 1:
        notes.append(f"standby: with {world_size} ranks its NCCL communicator is connected before the gate "
                     "(DeepSpeed binds device_id); those GPU buffers are not measured and not counted")
    return notes
