"""The job's start-up clock: when each start-up phase of a rank ended, counted from the process's own start.

A restart's time to the next productive step (MTTR) is detection + launch + start-up + checkpoint load + first
step; the start-up part had no timestamps between the launch and the resume. `STARTUP` marks the end of each
phase with one `time.monotonic()` call and the `started` event carries them (`startup`, docs/TRAINING.md):

    {"process_started_at": <unix time the rank's process was created>,
     "imports": s, ["standby_warm": s, "standby_gate": s,] "process_group": s, "model_built": s,
     "deepspeed_initialized": s, "tag_verified": s, "tag_agreed": s, "checkpoint_loaded": s}

every value but the first is seconds since the process started, listed in the order they happened (cumulative,
so a phase's own duration is the difference with the one before). `tag_verified` is when rank 0's choice and
check of the resume tag ended: it runs in a thread beside the model build (train_checkpoints.py), so it may
come before `model_built`; `tag_agreed` is when every rank knew the tag, after the build. The process's start comes from the kernel (`/proc/self/stat` field 22,
clock ticks since boot, against CLOCK_BOOTTIME), so the interpreter's own start-up and the first imports,
before any of this code runs, are counted too; where that is not readable, from this module's import.
The first step's record (its `time`) then tells the first step.

`mapped_loads` makes the resume's `torch.load`s map the checkpoint files instead of copying them (below).

`warm_up` is what a warm standby (training/standby.py) does before its gate: everything of a start-up that does
not depend on the attempt's config, so that a restart does not pay it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("ulyssesd.training")

#: Order of the phases in the event (a warm standby's two marks only on a standby's attempt).
PHASES = ("imports", "standby_warm", "standby_gate", "process_group", "model_built", "deepspeed_initialized",
          "tag_verified", "tag_agreed", "checkpoint_loaded")


def process_age_s(stat_path: str = "/proc/self/stat") -> float | None:
    """Seconds since this process was created (kernel's start time), or None where it cannot be read."""
    try:
        with open(stat_path, "rb") as fh:
            raw = fh.read(4096).decode("ascii", "replace")
        # Field 2 (comm) is in parentheses and may hold spaces: the fields after the last ')' are fixed.
        fields = raw[raw.rindex(")") + 2:].split()
        start_ticks = int(fields[19])  # field 22 of the whole line: starttime, in clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if 0.0 <= age < 30 * 86400 else None  # a nonsense reading is no reading


class StartupClock:
    """Marks the end of start-up phases, in seconds since the process started (see the module docstring)."""

    def __init__(self, age_s: float | None = None) -> None:
        age = process_age_s() if age_s is None else age_s
        now = time.monotonic()
        self.from_kernel = age is not None  # False: counted from this module's import, not the process start
        self.origin = now - (age or 0.0)  # monotonic time of the process's start
        self.process_started_at = time.time() - (age or 0.0)
        self.marks: dict[str, float] = {}

    def mark(self, phase: str, first_only: bool = False) -> None:
        """`phase` ended now (a later mark replaces it; with `first_only` an earlier one stands: a standby
        marked its imports before the gate)."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; one of {', '.join(PHASES)}")
        if not (first_only and phase in self.marks):
            self.marks[phase] = round(time.monotonic() - self.origin, 3)

    def fields(self) -> dict[str, Any]:
        """The `started` event's `startup` value: the process's start, then each phase reached, by time."""
        out: dict[str, Any] = {"process_started_at": round(self.process_started_at, 3)}
        if not self.from_kernel:
            out["process_start_from"] = "module import"
        marks = dict(self.marks)  # a snapshot: the tag-choosing thread may mark meanwhile
        out.update(sorted(marks.items(), key=lambda kv: (kv[1], PHASES.index(kv[0]))))
        return out


#: The rank's one clock, created when the job's entry point first imports this module.
STARTUP = StartupClock()


def in_background(fn: Callable[[], T], name: str) -> Callable[[], T]:
    """Start `fn` in a daemon thread now; the returned join waits for it and returns its value or raises its
    exception on the caller's thread (a start-up phase overlapped with another, e.g. the tag check with the
    model build)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by join() on the caller's thread
            out["error"] = exc

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()

    def join() -> T:
        worker.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    return join


# --------------------------------------------------------------------------------------------- warm-up
#: Modules DeepSpeed and torch import lazily inside deepspeed.initialize (its optimizer sanity check imports
#: the Muon optimizer, which pulls in torch._inductor; torch.optim imports torch._dynamo): 9 s of a 12 s
#: model build of the tiny CPU job under cProfile on the loaded 2-core box (2026-12-01). Imported while the
#: standby waits, they cost the restart nothing. On the H200 (gpt-1b, 2026-12-02) deepspeed.initialize's lazy
#: imports were torch._dynamo, torch._inductor, torch.distributed.fsdp, sympy and triton_kernel_wrap.
LAZY_MODULES = ("torch._dynamo", "torch._inductor", "sympy", "torch._higher_order_ops.triton_kernel_wrap",
                "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.stage3",
                "deepspeed.runtime.engine", "torch.distributed.fsdp", "deepspeed.sequence.layer")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(cuda: bool) -> None:
    """DeepSpeed's process group, as every rank of the job makes it: a plain `python -m ulyssesd.training` is a
    world of one on a free port, no shm-comm JIT build, NCCL on a GPU and gloo on the CPU. It depends on the
    launcher's environment only (rendezvous, rank, world size), not on the config, so a standby makes it
    before its gate; a second call is a no-op (DeepSpeed's init_distributed returns when it already ran).
    With more than one rank on CUDA, DeepSpeed 0.19.8 passes `device_id` to torch's init_process_group, so the
    default NCCL communicator (and its GPU buffers, not measured) is connected here, before the gate; a world
    of one has no communicator to build until its first collective."""
    if "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())  # no launcher: a fixed port would collide
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)  # plain `python -m ulyssesd.training` = one rank
    import deepspeed
    import deepspeed.ops

    STARTUP.mark("imports", first_only=True)  # a standby imported everything before its gate
    # Otherwise the CPU accelerator JIT-compiles deepspeed_shm_comm (~60 s), used only by inference.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")


def warm_device(index: int) -> None:
    """What a first training step creates on the GPU besides memory: the cuBLAS/cuBLASLt handles of this thread
    and of autograd's backward thread, and the matmul and attention (SDPA) kernels' libraries and modules,
    in bf16 and fp32, with tensors of a few hundred KiB; the allocator's cache is emptied after, so a waiting
    standby holds its CUDA context and those handles' workspaces, never memory the running attempt needs."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda", index)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(256, 256, device=dev, dtype=dtype, requires_grad=True)
        (x @ x).float().sum().backward()
        q = torch.randn(1, 4, 256, 64, device=dev, dtype=dtype, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum().backward()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()


def warm_up(device_setting: str = "auto", import_job_code: Callable[[], None] = lambda: None) -> str:
    """A standby's config-free start-up (`train.device` = `device_setting`: cpu / cuda / auto): the imports of
    every attempt (torch, DeepSpeed, the model, data and checkpoint code, and what deepspeed.initialize would
    import lazily), the CUDA context, cuBLAS and the attention kernels on its device, and, under a launcher
    (WORLD_SIZE set: torchrun's rendezvous is the standby's own), the process group.
    `import_job_code` imports the job's own modules (the caller's: this module is imported by them). Returns
    the device's name. A warm-up step that fails is logged and left to the attempt (it would then pay it
    itself), except the imports, which the attempt needs too."""
    import torch

    cuda = device_setting != "cpu" and torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, as main() does
    import deepspeed  # noqa: F401
    import deepspeed.ops  # noqa: F401

    import_job_code()
    for name in LAZY_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # another DeepSpeed/torch version: imported when needed, as before
            log.info("standby warm-up: %s not imported (%s)", name, exc)
    STARTUP.mark("imports")
    device = "cpu"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        torch.empty(1, device=f"cuda:{local}")  # the context and the allocator, before they are needed
        device = f"cuda:{local}"
        try:
            warm_device(local)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the attempt creates them itself
            log.warning("standby warm-up: cuBLAS/attention warm-up on %s failed (%s); left to the attempt",
                        device, exc)
    if "WORLD_SIZE" in os.environ:  # under a launcher; a launcher-less world of one has nothing to meet
        try:
            init_process_group(cuda)
            STARTUP.mark("process_group")
        except Exception as exc:  # noqa: BLE001 - the attempt's own init_distributed tries again, and reports
            log.warning("standby warm-up: process group not created before the gate (%s); the attempt will", exc)
    return device


# ------------------------------------------------------------------------------------------- the load
def offloads_to_host(engine: Any) -> bool:
    """The engine keeps optimizer states or parameters off the GPU (ZeRO offload to cpu or nvme)."""
    for name in ("zero_offload_optimizer", "zero_offload_param"):
        get = getattr(engine, name, None)
        cfg = get() if callable(get) else None
        device = getattr(cfg, "device", None)
        if cfg is not None and str(getattr(device, "value", device)) != "none":
            return True
    return False


@contextlib.contextmanager
def mapped_loads(engine: Any) -> Iterator[None]:
    """While DeepSpeed loads the resume tag, its checkpoint engine's `torch.load` maps each file (`mmap=True`,
    MAP_PRIVATE: writes to a tensor stay private, the file is never written) instead of copying every byte
    out of the page cache into fresh memory: on the H200 that copy was 12.2 s of a 15.7 s load of a 17 GB
    tag that rank 0's sha256 check had just read into the page cache (one thread, 1.4 GB/s; bench/RESULTS.md).
    DeepSpeed then copies the mapped tensors into its own partitions as before: the same bytes, bit for bit.
    A file torch cannot map (not torch.save's zip format) is loaded as before. Checkpoint files are never
    rewritten in place (temp file + rename; retention unlinks, which keeps a mapped inode), so a mapping
    cannot lose its bytes. A standby's `Preload.serve`, entered inside this, answers from its own memory first.
    Not with ZeRO offload to the host (`offload_optimizer` / `offload_param`): its states would stay tensors
    on the host, i.e. mappings of the file, holding a tag that retention deletes on disk for the whole
    attempt; those loads copy as before."""
    import torch

    if offloads_to_host(engine):
        yield
        return
    ce = engine.checkpoint_engine
    before = vars(ce).get("load")  # an instance override already there is restored on the way out
    plain = ce.load

    def load(path: str, map_location: Any = None) -> Any:
        try:
            with torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE):
                return torch.load(path, map_location=map_location, weights_only=False, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return plain(path, map_location=map_location)  # the legacy format cannot be mapped

    ce.load = load
    try:
        yield
    finally:
        vars(ce).pop("load", None)
        if before is not None:
            ce.load = before
