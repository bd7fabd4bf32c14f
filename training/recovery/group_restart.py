"""The process group after a step failed mid-way on some ranks: torn down, then rebuilt in the same processes.

When a rank raises after the step's collectives began (in backward, between the forward's all-to-all and the
reduce-scatter), the other ranks wait for it in a collective it never joins. As NVRx's in-process restart does
(its `AbortTorchDistributed`), the way out is to tear the group down: the failing rank destroys its process
groups (and drops the engine holding references to them: gloo closes a group's connections only when its last
reference goes), its gloo pairs close and every peer's pending collective fails at once ("Connection closed by
peer");
each peer then destroys its own, so a rank waiting on a healthy third one is released by that one's teardown
(a cascade, bounded by the group's own timeout where a rank neither fails nor answers).
Then every rank makes a new default group through the job's rendezvous store, under a prefix of its own per
rebuild (`ulyssesd-in-process/<launcher restart>/<generation>`: a key of an earlier group is never read again,
the stale-address trap of a shared rendezvous store), bounded by `rebuild_timeout_s`; a rank that does not come
(SIGKILLed, wedged) makes the others' rebuild fail, and they take the usual path (exit, the daemon relaunches).
DeepSpeed's own group caches (its `groups` module, the sequence-parallel groups) are released by its
`destroy_process_group`, so the engine built next makes its groups on the new one.
NCCL: this process's NCCL backends are aborted before the teardown (`backend.abort()`, as NVRx does), but a
peer blocked in an NCCL kernel is not released by this rank's socket shutdown (NVLink / shared-memory
transports): that needs the peer's own abort, from a thread watching the store for the fault, not built (the
fault then ends on NCCL's timeout and the usual path). Checked with gloo on the CPU only.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ulyssesd.training")

#: Seconds between two looks at the rebuild's arrivals.
POLL_S = 0.02
#: The rendezvous store's key prefix of the groups this module makes.
STORE_PREFIX = "ulyssesd-in-process"
#: Words of the errors a collective raises when a peer left it (gloo, NCCL, torch's c10d).
_COLLECTIVE_WORDS = ("connection closed by peer", "connection reset by peer", "gloo", "nccl", "broken pipe",
                     "process group", "processgroup", "timed out", "socket")


def is_collective_error(exc: BaseException) -> bool:
    """True when `exc` is a collective failing because a peer left it (not this rank's own fault)."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _COLLECTIVE_WORDS)


def abort_process_groups() -> float:
    """Tear every process group of this process down (NCCL backends aborted first); seconds it took."""
    import deepspeed.comm as ds_dist
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    if not dist.is_initialized():
        return 0.0
    if torch.cuda.is_available():
        for group in list(dist.distributed_c10d._world.pg_names):
            try:
                backend = group._get_backend(torch.device("cuda"))
            except Exception:  # noqa: BLE001 - a group without a CUDA backend has nothing to abort
                continue
            abort = getattr(backend, "abort", None)
            if abort is not None:
                abort()
    try:
        ds_dist.destroy_process_group()   # also releases DeepSpeed's and the SP module's group references
    except Exception as exc:  # noqa: BLE001 - a half-broken group may fail its own teardown; forget it anyway
        log.warning("destroying the process group failed (%s); dropping it", exc)
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
    # gloo closes a group's connections only when its last reference goes (its abort() does not), and a peer
    # waits on them: the caller dropped the engine (the groups' other holders) before this call.
    gc.collect()
    return time.perf_counter() - t0


def cut_connections(keep_ports: set[int]) -> int:
    """Shut down (not close: their owner still holds the descriptors) this process's established TCP connections
    but those to or from `keep_ports` (the rendezvous store's). A torn-down gloo group whose objects are still
    referenced (DeepSpeed's parameters keep `ds_process_group`) keeps its connections open and its peers waiting;
    a shutdown makes each peer's pending receive fail at once. Returns how many were shut down."""
    import socket

    import psutil

    cut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or conn.fd < 0 or not conn.raddr:
            continue
        if conn.laddr.port in keep_ports or conn.raddr.port in keep_ports:
            continue
        try:
            dup = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue   # closed meanwhile
        try:
            dup.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            dup.close()
    return cut


class GroupRebuilder:
    """One rank's rebuilds of the default process group (see the module docstring). Made while the group is
    still there: it keeps the group's rendezvous store alive for the next one."""

    def __init__(self, rank: int, world: int, backend: str, rebuild_timeout_s: float):
        import torch.distributed as dist

        self.rank, self.world, self.backend = rank, world, backend
        self.rebuild_timeout_s = rebuild_timeout_s
        self.store = dist.distributed_c10d._get_default_store()
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        # The store's port: its connections survive `release_peers` (the launcher's MASTER_PORT, or the store's own).
        under = getattr(self.store, "underlying_store", self.store)
        while hasattr(under, "underlying_store"):
            under = under.underlying_store
        self.keep_ports = {p for p in (getattr(under, "port", None), int(os.environ.get("MASTER_PORT") or 0)) if p}
        self.generation = 0
        from deepspeed.constants import default_pg_timeout

        self.pg_timeout = default_pg_timeout   # the timeout DeepSpeed made the first group with

    def rebuild(self, should_stop: Callable[[], bool]) -> float:
        """Collective over a new group: every rank makes it and passes one barrier, within the bound; raises
        when that fails (a rank never came) or `should_stop` says so (a SIGTERM: the launcher ends the job and
        waits for this process). Returns the seconds it took."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        abort_process_groups()   # a rank that got here by its own error has not torn down yet
        self.generation += 1
        bound = datetime.timedelta(seconds=self.rebuild_timeout_s)
        store = dist.PrefixStore(f"{STORE_PREFIX}/{self.restart}/{self.generation}", self.store)
        # Every rank checks in first, in short polls: a signal is handled between them (a wait in the store's
        # C++ would hold it off until the bound), and a missing rank is named by the count.
        store.add("arrived", 1)
        deadline = time.monotonic() + self.rebuild_timeout_s
        while (arrived := store.add("arrived", 0)) < self.world:
            if should_stop():
                raise RuntimeError("SIGTERM during the process group's rebuild: the launcher is ending the job")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{arrived} of {self.world} ranks came to the rebuild within "
                                   f"{self.rebuild_timeout_s:g} s")
            time.sleep(POLL_S)
        # The rendezvous and the first barrier wait for a missing rank `bound` at most; the group's collectives
        # then get the timeout DeepSpeed gave the first group.
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world, timeout=bound)
        try:
            if self.backend == "gloo":
                dist.monitored_barrier(timeout=bound)   # names the rank that did not come
            else:
                dist.barrier()
            dist.distributed_c10d._set_pg_timeout(self.pg_timeout)
        except Exception:
            abort_process_groups()
            raise
        log.warning("process group rebuilt in-process (generation %d) in %.2f s", self.generation,
                    time.perf_counter() - t0)
        return time.perf_counter() - t0


def failure_summary(errors: list[Any]) -> tuple[list[int], str]:
    """(ranks whose own error ended the step, the error to report) from every rank's (error, collective)."""
    failed = [r for r, (_e, collective) in enumerate(errors) if not collective]
    if failed:
        return failed, f"rank {failed[0]}: {errors[failed[0]][0]}"
    return [], f"a collective failed on every rank (rank 0: {errors[0][0]})"
