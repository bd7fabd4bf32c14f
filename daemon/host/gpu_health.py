"""GPU health through NVML: checked before each launch and every `every_s` during the run.

What is read (NVML, `nvidia-ml-py`, the `gpu` extra) and how it is judged, from NVIDIA's documented meanings:

- Xid events (nvmlEventTypeXidCriticalError, registered at the first read): the Xid catalog's immediate action
  decides. Codes whose action is restarting the application (13 graphics engine exception, 31 memory page
  fault, 43 GPU stopped processing, 45 preemptive cleanup, 8/11/69/109...) are the application's errors: not a
  GPU fault. Codes that need a GPU reset, a reboot or NVIDIA (48 double-bit ECC, 61/62 micro-controller halt,
  64 row-remap/page-retirement failure, 74 NVLink, 79 fallen off the bus, 95 uncontained ECC, 119/120 GSP,
  140 unrecovered ECC...) fail the GPU. 63 (a row remapped / page retired), 92 (high single-bit ECC rate) and
  94 (contained ECC: the application restarts, the GPU is reset at the next chance; the pending remap below
  says so) are warnings. A code in neither table is a warning that names the setting that classifies it.
- ECC (volatile, since the last reset): uncorrectable errors that rise during the run fail the GPU; some
  already there at the first read are a warning. Corrected errors are reported, never judged.
- Row remapping (Ampere and later): a pending remap (a reset is needed to use it) or a remapping failure fail
  the GPU. Page retirement (before Ampere): a retirement pending a reboot fails it.
- Throttle reasons: power capping under load (SW power cap), idle, application clocks, sync boost are normal;
  thermal and hardware slowdowns (SW/HW thermal, HW slowdown, HW power brake) are warnings, never failures.
- Temperature against the GPU's own thresholds: at or over the shutdown threshold fails it; at or over the
  slowdown threshold is a warning. Clocks are reported with the throttle warning; a clock dip alone is nothing.
- A GPU NVML reports lost (fallen off the bus), or one gone from the device list, fails.

A failing GPU is reported once (index, UUID, what failed, the reading) and excluded from later launches
(`before_launch`: CUDA_VISIBLE_DEVICES lists the healthy ones) or, when fewer healthy GPUs remain than the
launch needs, the launch is refused with that explanation. Without NVML it says once why the checks are off.
The reader is a seam: tests inject readings (`GpuReader`), the daemon uses `NvmlReader`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ulyssesd.daemon.store.enums import Severity, Symptom

# Xid catalog (docs.nvidia.com/deploy/xid-errors), by the immediate action NVIDIA lists for the code.
APPLICATION_XIDS = frozenset({8, 11, 13, 31, 32, 43, 45, 68, 69, 109})          # RESTART_APP / IGNORE
WARNING_XIDS = frozenset({63, 92, 94})                                          # recorded; reset later
FAULT_XIDS = frozenset({48, 56, 57, 58, 61, 62, 64, 65, 74, 79, 95, 119, 120, 121, 122, 123, 124, 136, 140,
                        143, 144, 145, 146, 147, 148, 149, 150, 151, 154, 155, 156, 157, 158})

# nvmlClocksEventReasons bits (nvml.h).
THROTTLE_WARNING_BITS = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
                         0x80: "HW power brake"}
THROTTLE_NORMAL_BITS = {0x1: "idle", 0x2: "applications clocks", 0x4: "SW power cap", 0x10: "sync boost",
                        0x100: "display clock"}


class GpuHealthConfig(BaseModel):
    """The `[gpu_health]` section of a run spec."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    enabled: StrictBool = Field(True, description="Check the GPUs through NVML before each launch and during the run.")
    every_s: float = Field(30.0, ge=1, le=3600, description="Seconds between two checks during the run.")
    fault_xids: list[int] = Field(default_factory=list, description="More Xid codes that fail a GPU (beyond NVIDIA's catalog table in docs/DAEMON.md).")
    ignore_xids: list[int] = Field(default_factory=list, description="Xid codes that are not a GPU problem on this host (no warning, no failure).")
    exclude_failed: StrictBool = Field(True, description="Relaunch without a failed GPU (CUDA_VISIBLE_DEVICES lists the healthy ones); false = refuse the launch instead.")


@dataclass
class GpuReading:
    """One GPU's state at one read (None: NVML does not report it on this GPU)."""

    index: int
    uuid: str
    name: str = ""
    lost: str | None = None                  # why NVML cannot reach it (fallen off the bus...)
    xids: list[int] = field(default_factory=list)   # Xid events since the previous read
    ecc_uncorrected: int | None = None       # volatile (since the last reset)
    ecc_corrected: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    retire_pending: bool | None = None
    throttle: int | None = None              # clocks event reasons bitmask
    temperature_c: float | None = None
    slowdown_c: float | None = None
    shutdown_c: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, [], "")}


@dataclass
class Problem:
    """What failed (or warns) on one GPU, with the reading that shows it."""

    index: int
    uuid: str
    what: str          # a short key: xid_79, ecc_uncorrected, remap_pending, temperature, throttle...
    severity: Literal["fault", "warning"]
    message: str
    reading: dict[str, Any]


class GpuReader(Protocol):
    def open(self) -> str | None:
        """Start reading; returns why GPU health cannot run here (None: it can)."""

    def read(self) -> list[GpuReading]:
        """Every GPU of the host, now (Xid events: those since the previous read)."""


def judge(r: GpuReading, first: GpuReading | None, cfg: GpuHealthConfig) -> list[Problem]:
    """The problems of one reading; `first` is this GPU's first reading (the baseline of its counters)."""
    out: list[Problem] = []

    def add(what: str, severity: Literal["fault", "warning"], msg: str) -> None:
        out.append(Problem(r.index, r.uuid, what, severity, f"GPU {r.index} ({r.uuid}): {msg}", r.as_dict()))

    if r.lost:
        add("lost", "fault", f"NVML cannot reach it: {r.lost}")
        return out
    for x in r.xids:
        if x in cfg.ignore_xids or (x in APPLICATION_XIDS and x not in cfg.fault_xids):
            continue
        if x in FAULT_XIDS or x in cfg.fault_xids:
            add(f"xid_{x}", "fault", f"Xid {x}, a GPU fault in NVIDIA's Xid catalog (reset, reboot or RMA)")
        elif x in WARNING_XIDS:
            add(f"xid_{x}", "warning", f"Xid {x} (ECC/remap event: the GPU keeps working; reset it at the next chance)")
        else:
            add(f"xid_{x}", "warning", f"Xid {x} is in neither of the daemon's tables: classify it with "
                "[gpu_health] fault_xids or ignore_xids")
    base = first.ecc_uncorrected if first is not None else None
    if r.ecc_uncorrected is not None:
        if base is not None and r.ecc_uncorrected > base:
            add("ecc_uncorrected", "fault", f"uncorrectable ECC errors rose from {base} to {r.ecc_uncorrected}")
        elif first is None and r.ecc_uncorrected > 0:
            add("ecc_uncorrected_before", "warning",
                f"{r.ecc_uncorrected} uncorrectable ECC errors since its last reset (none new)")
    if r.remap_failed:
        add("remap_failed", "fault", "row remapping failed (NVIDIA: the GPU needs service)")
    if r.remap_pending:
        add("remap_pending", "fault", "a row remap is pending: the GPU needs a reset before it is used again")
    if r.retire_pending:
        add("retire_pending", "fault", "a page retirement is pending: the GPU needs a reset/reboot")
    if r.temperature_c is not None:
        if r.shutdown_c is not None and r.temperature_c >= r.shutdown_c:
            add("temperature", "fault", f"{r.temperature_c:g} C, at its shutdown threshold {r.shutdown_c:g} C")
        elif r.slowdown_c is not None and r.temperature_c >= r.slowdown_c:
            add("temperature_slowdown", "warning",
                f"{r.temperature_c:g} C, at its slowdown threshold {r.slowdown_c:g} C")
    if r.throttle:
        why = [name for bit, name in THROTTLE_WARNING_BITS.items() if r.throttle & bit]
        if why:
            clk = (f"; SM clock {r.sm_clock_mhz:g} of {r.sm_clock_max_mhz:g} MHz"
                   if r.sm_clock_mhz is not None and r.sm_clock_max_mhz else "")
            add("throttle", "warning", f"throttled ({', '.join(why)}){clk}")
    return out


@dataclass
class LaunchVerdict:
    env: dict[str, str] = field(default_factory=dict)   # to merge into the launch environment
    stop_reason: str | None = None                      # the launch must not go on (why)


class GpuHealth:
    """The daemon's GPU watch: `before_launch` at each launch, `tick` every loop (reads every `every_s`).
    `report(faults)` records the new failures of one check (an incident) once per GPU and kind; `say` tells
    the operator (warnings, and once why the checks are off)."""

    def __init__(self, cfg: GpuHealthConfig, reader: GpuReader | None, *, report: Callable[[list[Problem]], None],
                 say: Callable[[str], None]):
        self.cfg, self.reader, self.report, self.say = cfg, reader, report, say
        self.off: str | None = None if cfg.enabled else "[gpu_health] enabled = false"
        self.opened = False
        self.first: dict[str, GpuReading] = {}      # uuid -> first reading (counter baselines)
        self.failed: dict[str, Problem] = {}        # uuid -> its first fault
        self.seen: set[tuple[str, str]] = set()     # (uuid, what) already reported
        self.last_read: float | None = None
        self.indices: dict[str, int] = {}           # uuid -> index at the last read
        self.last: list[GpuReading] = []            # the last read's readings (for status and benches)

    def _open(self) -> bool:
        if not self.opened:
            self.opened = True
            if self.off is None:
                self.off = self.reader.open() if self.reader is not None else "no NVML reader"
            if self.off is not None:
                self.say(f"GPU health checks are off: {self.off}")
        return self.off is None

    def check(self, now: float) -> list[Problem]:
        """Read every GPU once and report what is new; returns the new problems."""
        if not self._open():
            return []
        assert self.reader is not None
        self.last_read = now
        readings = self.last = self.reader.read()
        new: list[Problem] = []
        present = {r.uuid for r in readings}
        for uuid, first in self.first.items():
            if uuid not in present:
                gone = GpuReading(first.index, uuid, first.name, lost="no longer in NVML's device list")
                new += self._note(judge(gone, first, self.cfg))
        for r in readings:
            self.indices[r.uuid] = r.index
            new += self._note(judge(r, self.first.get(r.uuid), self.cfg))
            self.first.setdefault(r.uuid, r)
        faults = [p for p in new if p.severity == "fault"]
        if faults:
            self.report(faults)
        return new

    def _note(self, problems: list[Problem]) -> list[Problem]:
        out = []
        for p in problems:
            if (p.uuid, p.what) in self.seen:
                continue
            self.seen.add((p.uuid, p.what))
            out.append(p)
            if p.severity == "fault":
                self.failed.setdefault(p.uuid, p)
            else:
                self.say(f"GPU health warning: {p.message}")
        return out

    def poll(self, now: float) -> None:
        """The daemon's scheduled check (every `every_s`); what it finds is reported and said."""
        self.check(now)

    def tick(self, now: float) -> list[Problem]:
        """The periodic check, when `every_s` has passed since the last read."""
        if self.off is not None or (self.last_read is not None and now - self.last_read < self.cfg.every_s):
            return []
        return self.check(now)

    def before_launch(self, env: Mapping[str, str], needed: int | None, now: float) -> LaunchVerdict:
        """Check now; keep the launch off failed GPUs. `env`: the launch environment (its CUDA_VISIBLE_DEVICES
        restricts the candidates); `needed`: GPUs the launch uses on this host (None: unknown, nothing set)."""
        self.check(now)
        if self.off is not None or not self.failed:
            return LaunchVerdict()
        visible = env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))  # the job inherits ours
        candidates = sorted(self.indices.items(), key=lambda kv: kv[1])
        if visible is not None:
            wanted = [v.strip() for v in visible.split(",") if v.strip()]
            by_key = {**{str(i): u for u, i in candidates}, **{u: u for u, _ in candidates}}
            if any(w not in by_key for w in wanted):
                return LaunchVerdict(stop_reason=f"GPU {self._failed_text()} failed and CUDA_VISIBLE_DEVICES="
                                     f"{visible!r} names devices NVML does not list by index or UUID: cannot "
                                     "exclude it; fix the launch environment or the GPU")
            candidates = [(by_key[w], self.indices[by_key[w]]) for w in wanted]
        healthy = [(u, i) for u, i in candidates if u not in self.failed]
        if len(healthy) == len(candidates):
            return LaunchVerdict()
        if not self.cfg.exclude_failed:
            return LaunchVerdict(stop_reason=f"GPU {self._failed_text()} failed; [gpu_health] exclude_failed = "
                                 "false: not launching (repair or replace it, then start the run again)")
        if needed is not None and len(healthy) < needed:
            return LaunchVerdict(stop_reason=f"GPU {self._failed_text()} failed; {len(healthy)} healthy GPU(s) "
                                 f"left, the launch needs {needed}: not relaunching onto a failed GPU (repair or "
                                 "replace it, or lower launcher.nproc_per_node, then start the run again)")
        use = healthy[:needed] if needed is not None else healthy
        self.say(f"GPU health: launching without GPU {self._failed_text()}: "
                 f"CUDA_VISIBLE_DEVICES={','.join(str(i) for _, i in use)}")
        return LaunchVerdict(env={"CUDA_VISIBLE_DEVICES": ",".join(str(i) for _, i in use)})

    def _failed_text(self) -> str:
        return ", ".join(f"{p.index} ({p.uuid}: {p.what})" for p in self.failed.values())


def gpus_needed(launcher: Any) -> int | None:
    """GPUs a launch uses on this host (its `nproc_per_node`); None where that is not known here: srun (Slurm's
    nodes) and local (one process that may use any GPU it sees: a failed one is left out of all it sees)."""
    return None if launcher.kind in ("srun", "local") else int(launcher.nproc_per_node)


class NvmlReader:
    """The GPUs as NVML reports them (`pynvml`, from `nvidia-ml-py`). Each query NVML does not support on a GPU
    reads None (not judged); a GPU NVML has lost reads `lost`."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.events: Any = None   # the Xid event set (None: not supported here; the rest still runs)

    def open(self) -> str | None:
        try:
            import pynvml
        except ImportError:
            return "nvidia-ml-py is not installed (pip install 'ulyssesd[gpu]')"
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            return f"NVML did not start ({exc}): no NVIDIA driver on this host"
        if count == 0:
            return "NVML lists no GPU on this host"
        self.nvml = pynvml
        try:
            self.events = pynvml.nvmlEventSetCreate()
            for i in range(count):
                pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(i),
                                                pynvml.nvmlEventTypeXidCriticalError, self.events)
        except pynvml.NVMLError:
            self.events = None   # e.g. not supported in a container without the capability: Xids not watched
        return None

    def _xids(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        n = self.nvml
        for _ in range(1000):   # bounded: a storm of events is read over several checks
            try:
                data = n.nvmlEventSetWait_v2(self.events, 0)
            except n.NVMLError:
                break   # timeout: no event left (or the set broke: the next check tries again)
            try:
                uuid = _text(n.nvmlDeviceGetUUID(data.device))
            except n.NVMLError:
                uuid = "?"
            out.setdefault(uuid, []).append(int(data.eventData))
        return out

    def read(self) -> list[GpuReading]:
        n = self.nvml
        xids = self._xids() if self.events is not None else {}
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(n.nvmlDeviceGetUUID(h))
            except n.NVMLError as exc:
                out.append(GpuReading(i, f"index-{i}", lost=str(exc)))
                continue
            r = GpuReading(i, uuid, _text(_q(n, n.nvmlDeviceGetName, h) or ""), xids=xids.get(uuid, []))
            try:
                n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)
            except n.NVMLError_GpuIsLost as exc:
                r.lost = str(exc)
                out.append(r)
                continue
            except n.NVMLError:
                pass
            r.ecc_uncorrected = _q(n, n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                   n.NVML_VOLATILE_ECC)
            r.ecc_corrected = _q(n, n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                 n.NVML_VOLATILE_ECC)
            remap = _q(n, n.nvmlDeviceGetRemappedRows, h)
            if remap is not None:
                r.remap_pending, r.remap_failed = bool(remap[2]), bool(remap[3])
            pend = _q(n, n.nvmlDeviceGetRetiredPagesPendingStatus, h)
            r.retire_pending = None if pend is None else bool(pend)
            reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                n.nvmlDeviceGetCurrentClocksThrottleReasons
            r.throttle = _q(n, reasons, h)
            r.temperature_c = _q(n, n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)
            r.slowdown_c = _q(n, n.nvmlDeviceGetTemperatureThreshold, h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
            r.shutdown_c = _q(n, n.nvmlDeviceGetTemperatureThreshold, h, n.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
            r.sm_clock_mhz = _q(n, n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM)
            r.sm_clock_max_mhz = _q(n, n.nvmlDeviceGetMaxClockInfo, h, n.NVML_CLOCK_SM)
            out.append(r)
        return out


def _q(n: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """One NVML query; None where this GPU does not support it."""
    try:
        return fn(*args)
    except n.NVMLError:
        return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def build(cfg: GpuHealthConfig, launcher_kind: str, *, report: Callable[[list[Problem]], None],
          say: Callable[[str], None], reader: GpuReader | None = None) -> GpuHealth:
    """The daemon's GPU watch for a launch of `launcher_kind` (srun: the GPUs are Slurm's nodes', not this
    host's: off, and said so)."""
    health = GpuHealth(cfg, reader if reader is not None else NvmlReader(), report=report, say=say)
    if launcher_kind == "srun" and health.off is None:
        health.off = "launcher.kind = 'srun': the job's GPUs are on Slurm's nodes, not this host"
    return health


def incident_reporter(incidents: Any) -> Callable[[list[Problem]], None]:
    """`report` for the daemon: one critical `gpu_failure` incident per check that found new failures, naming
    each GPU (index, UUID), what failed and the reading. `incidents`: the daemon's incident log (its
    `incident(...)` and `position()`)."""
    def report(faults: list[Problem]) -> None:
        names = "; ".join(p.message for p in faults)
        incidents.incident(Symptom.gpu_failure, incidents.position().last_step or 0, Severity.critical,
                           f"GPU failure: {names}"[:500],
                           {"gpus": [{"index": p.index, "uuid": p.uuid, "what": p.what, "message": p.message,
                                      "reading": p.reading} for p in faults],
                            "action": "not relaunched onto a failed GPU (docs/DAEMON.md, GPU health)"})
    return report
