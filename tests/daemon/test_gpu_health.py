"""GPU health (daemon/host/gpu_health.py): a whole healthy run's readings (load, power capping, a clock dip,
application Xids, corrected ECC) are never flagged; failing readings are, naming the GPU; a failed GPU is left out
of the next launch (or the launch is refused when too few remain); without NVML the checks say once why they are
off. Readings are injected through the reader seam; the daemon test drives a real Supervisor on a fake OS."""

from __future__ import annotations

import copy
import random

import pytest
from test_daemon_unit_fakeos import FakeOS, _emit, _steps
from uls_daemon_helpers import fake_spec

from ulyssesd.daemon.core.housekeeping import LoopScheduler
from ulyssesd.daemon.host.gpu_health import (
    GpuHealth,
    GpuHealthConfig,
    GpuReading,
    NvmlReader,
    Problem,
    judge,
)
from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.daemon.store import open_store
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.supervisor import Supervisor

UUIDS = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(4)]


def _gpu(i: int, **kw) -> GpuReading:
    base = dict(name="NVIDIA H100 80GB HBM3", ecc_uncorrected=0, ecc_corrected=0, remap_pending=False,
                remap_failed=False, throttle=0x1, temperature_c=32.0, slowdown_c=87.0, shutdown_c=92.0,
                sm_clock_mhz=345.0, sm_clock_max_mhz=1980.0)
    base.update(kw)
    return GpuReading(i, UUIDS[i], **base)


def healthy_run(n: int = 600, gpus: int = 4, seed: int = 0) -> list[list[GpuReading]]:
    """Readings of a healthy run every 30 s: idle, then under load (warming to ~80 C, power capping on and
    off, clocks 1755-1980 MHz with a dip to 1410 at a power-cap step), application Xids (13, 31, 43 from a
    bad kernel the job restarted from), corrected ECC errors creeping up."""
    rng = random.Random(seed)
    out = []
    corrected = [0] * gpus
    for k in range(n):
        row = []
        for i in range(gpus):
            load = k >= 3
            temp = 32.0 + (min(48.0, 2.0 * (k - 3)) if load else 0.0) + rng.gauss(0, 1.0)
            throttle = 0x1 if not load else (0x4 if rng.random() < 0.4 else 0x0)
            clock = 345.0 if not load else (1410.0 if k == 200 else rng.uniform(1755.0, 1980.0))
            if rng.random() < 0.01:
                corrected[i] += 1
            xids = [13, 43] if (k == 300 and i == 2) else ([31] if k == 301 and i == 2 else [])
            row.append(_gpu(i, temperature_c=round(temp, 1), throttle=throttle, sm_clock_mhz=clock,
                            ecc_corrected=corrected[i], xids=xids))
        out.append(row)
    return out


class FakeReader:
    def __init__(self, readings: list[list[GpuReading]], why_off: str | None = None):
        self.readings, self.why_off, self.k = readings, why_off, 0

    def open(self):
        return self.why_off

    def read(self):
        row = self.readings[min(self.k, len(self.readings) - 1)]
        self.k += 1
        return copy.deepcopy(row)


def _health(readings, cfg=None):
    reported: list[list[Problem]] = []
    said: list[str] = []
    h = GpuHealth(cfg or GpuHealthConfig(), FakeReader(readings), report=reported.append, say=said.append)
    return h, reported, said


def test_a_whole_healthy_run_is_never_flagged():
    run = healthy_run()
    h, reported, said = _health(run)
    problems = [p for k in range(len(run)) for p in h.check(30.0 * k)]
    assert problems == [] and reported == [] and said == [] and not h.failed
    # Throttling under load was there (so the test shows what must not be flagged), and so were the app Xids.
    assert any(r.throttle == 0x4 for row in run for r in row) and any(r.xids for row in run for r in row)


@pytest.mark.parametrize("change, what, severity", [
    (dict(xids=[79]), "xid_79", "fault"),
    (dict(xids=[48]), "xid_48", "fault"),
    (dict(xids=[95]), "xid_95", "fault"),
    (dict(ecc_uncorrected=2), "ecc_uncorrected", "fault"),
    (dict(remap_pending=True), "remap_pending", "fault"),
    (dict(remap_failed=True), "remap_failed", "fault"),
    (dict(retire_pending=True), "retire_pending", "fault"),
    (dict(temperature_c=92.0), "temperature", "fault"),
    (dict(lost="GPU is lost"), "lost", "fault"),
    (dict(temperature_c=88.0), "temperature_slowdown", "warning"),
    (dict(throttle=0x40, sm_clock_mhz=900.0), "throttle", "warning"),
    (dict(throttle=0x80), "throttle", "warning"),
    (dict(xids=[94]), "xid_94", "warning"),
    (dict(xids=[250]), "xid_250", "warning"),
])
def test_failing_readings_name_the_gpu_and_what_failed(change, what, severity):
    run = healthy_run(20)
    run[15][1] = GpuReading(**{**run[15][1].__dict__, **change})
    h, reported, said = _health(run)
    found = [p for k in range(20) for p in h.check(30.0 * k)]
    assert [(p.index, p.uuid, p.what, p.severity) for p in found] == [(1, UUIDS[1], what, severity)]
    p = found[0]
    assert p.message.startswith(f"GPU 1 ({UUIDS[1]}):") and p.reading["uuid"] == UUIDS[1]
    if severity == "fault":
        assert [[x.what for x in batch] for batch in reported] == [[what]] and UUIDS[1] in h.failed
    else:   # a warning is said once, never a failure
        assert reported == [] and not h.failed and len(said) == 1 and UUIDS[1] in said[0]
    if what == "xid_250":
        assert "fault_xids or ignore_xids" in p.message
    if what == "throttle":
        assert "900 of 1980 MHz" in p.message or "power brake" in p.message


def test_xid_tables_can_be_extended_and_a_gpu_gone_from_the_list_fails():
    run = healthy_run(5)
    run[3][0].xids = [250]
    h, reported, _ = _health(run, GpuHealthConfig(fault_xids=[250]))
    assert [p.what for k in range(4) for p in h.check(k)] == ["xid_250"] and UUIDS[0] in h.failed
    run = healthy_run(5)
    run[4] = run[4][:3]   # GPU 3 fell off the bus: NVML lists 3 GPUs
    h, reported, _ = _health(run)
    found = [p for k in range(5) for p in h.check(k)]
    assert [(p.index, p.what) for p in found] == [(3, "lost")] and "no longer in NVML" in found[0].message


def test_ecc_errors_already_there_at_the_first_read_warn_and_only_a_rise_fails():
    run = healthy_run(4)
    for row in run:
        row[0].ecc_uncorrected = 3
    h, reported, said = _health(run)
    assert [p.what for k in range(4) for p in h.check(k)] == ["ecc_uncorrected_before"] and reported == []
    assert judge(run[0][0], run[0][0], GpuHealthConfig()) == []


def _failed_gpu1():
    run = healthy_run(3)
    run[1][1].xids = [79]
    h, reported, said = _health(run)
    h.check(0.0)
    h.check(30.0)
    return h, said


def test_a_failed_gpu_is_left_out_of_the_next_launch(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    h, said = _failed_gpu1()
    v = h.before_launch({}, 2, 60.0)
    assert v.stop_reason is None and v.env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert "without GPU 1" in said[-1]
    # The launch's own CUDA_VISIBLE_DEVICES (indices or UUIDs) limits the candidates.
    assert h.before_launch({"CUDA_VISIBLE_DEVICES": "1,3"}, 1, 90.0).env == {"CUDA_VISIBLE_DEVICES": "3"}
    assert h.before_launch({"CUDA_VISIBLE_DEVICES": f"{UUIDS[1]},{UUIDS[2]}"}, 1, 90.0).env == \
        {"CUDA_VISIBLE_DEVICES": "2"}
    # A launch that does not use the failed GPU changes nothing.
    assert h.before_launch({"CUDA_VISIBLE_DEVICES": "0,2"}, 2, 90.0).env == {}
    # Unknown device names: not silently kept.
    assert "cannot exclude it" in h.before_launch({"CUDA_VISIBLE_DEVICES": "MIG-x"}, 1, 90.0).stop_reason


def test_too_few_healthy_gpus_refuse_the_launch_with_the_reason(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    h, _ = _failed_gpu1()
    why = h.before_launch({}, 4, 60.0).stop_reason
    assert why and "3 healthy GPU(s) left, the launch needs 4" in why and UUIDS[1] in why and "xid_79" in why
    h.cfg.exclude_failed = False
    assert "exclude_failed = false" in h.before_launch({}, 2, 60.0).stop_reason


def test_without_nvml_it_says_once_why_it_is_off():
    said: list[str] = []
    h = GpuHealth(GpuHealthConfig(), NvmlReader(), report=lambda faults: None, say=said.append)
    try:
        import pynvml  # noqa: F401
        has_nvml = True
    except ImportError:
        has_nvml = False
    for k in range(3):
        h.check(30.0 * k)
        h.before_launch({}, 1, 30.0 * k)
    if h.off is None:
        pytest.skip("NVML works on this host: the off path is not reachable here")
    assert len(said) == 1 and said[0].startswith("GPU health checks are off: ")
    if not has_nvml:
        assert "pip install 'ulyssesd[gpu]'" in said[0]
    assert h.tick(1e9) == [] and len(said) == 1


def test_daemon_records_a_gpu_failure_and_relaunches_without_it(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    class EnvOS(FakeOS):
        envs: list[dict] = []

        def spawn(self, argv, env, cwd, log_path):
            self.envs.append(dict(env))
            return super().spawn(argv, env, cwd, log_path)

    fos = EnvOS()
    run = healthy_run(4)
    reader = FakeReader(run)
    spec = load_run_spec(fake_spec(tmp_path, launcher={"kind": "torchrun", "nproc_per_node": 2},
                                   detectors={"hang_timeout_floor_s": 600.0}))
    said: list[str] = []
    sched = LoopScheduler(use_thread=False)
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), fos, scheduler=sched, say=said.append,
                     gpu_reader=reader)
    sup.start()
    assert "CUDA_VISIBLE_DEVICES" not in fos.envs[0]   # all healthy: nothing set
    _emit(sup, kind="event", event="started", step=0)
    _steps(sup, 1, 5)
    for row in run[reader.k:]:
        row[0].xids = [79]   # GPU 0 falls off the bus during the run (the next read sees it)
    sched.enqueue("gpu_health")
    sup.tick()
    inc = [sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id)]
    assert [i.symptom.value for i in inc] == ["gpu_failure"]
    assert UUIDS[0] in inc[0].summary and inc[0].evidence["gpus"][0]["what"] == "xid_79"
    assert inc[0].evidence["gpus"][0]["index"] == 0
    # The job dies of it; the relaunch leaves GPU 0 out.
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(200):
        if len(fos.envs) > 1 or sup.state in (RunState.FAILED, RunState.STOPPED):
            break
        fos.advance(0.5)
        sup.tick()
    assert len(fos.envs) == 2, (sup.state, said[-5:])
    assert fos.envs[1]["CUDA_VISIBLE_DEVICES"] == "1,2"


def test_a_gpu_failing_before_the_first_launch_is_an_incident_and_the_launch_avoids_it(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    class EnvOS(FakeOS):
        envs: list[dict] = []

        def spawn(self, argv, env, cwd, log_path):
            self.envs.append(dict(env))
            return super().spawn(argv, env, cwd, log_path)

    run = healthy_run(3)
    for row in run:
        row[0].remap_pending = True   # a row remap waits for a reset since before the daemon started
    fos = EnvOS()
    spec = load_run_spec(fake_spec(tmp_path, launcher={"kind": "torchrun", "nproc_per_node": 2}))
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), fos, gpu_reader=FakeReader(run))
    sup.start()
    inc = [sup.store.get_incident(i.id) for i in sup.store.list_incidents(sup.run_id)]
    assert [(i.symptom.value, i.evidence["gpus"][0]["what"]) for i in inc] == [("gpu_failure", "remap_pending")]
    assert fos.envs[0]["CUDA_VISIBLE_DEVICES"] == "1,2" and sup.state == RunState.STARTING
    # Too few healthy GPUs for the launch: refused, FAILED, with the reason, and no job started.
    (tmp_path / "b").mkdir()
    spec4 = load_run_spec(fake_spec(tmp_path / "b", launcher={"kind": "torchrun", "nproc_per_node": 4}))
    fos4 = EnvOS()
    fos4.envs = []
    sup4 = Supervisor(spec4, open_store(spec4.daemon.resolved_db_path()), fos4, gpu_reader=FakeReader(run))
    sup4.start()
    assert sup4.state == RunState.FAILED and fos4.envs == [] and sup4.job is None
    assert "3 healthy GPU(s) left, the launch needs 4" in sup4.store.get_run(sup4.run_id).state_reason
