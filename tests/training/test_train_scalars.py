"""Training scalars through DeepSpeed's monitor: TensorBoard event files and csv_monitor files of the real job.

One real launch (torchrun, 2 gloo ranks, ZeRO-3 + Ulysses SP=2 on the CPU) with `[scalars] tensorboard`,
`csv` and `peak_tflops_per_gpu` set; the event files are read back with tensorboard's own reader and the
CSV files as DeepSpeed writes them, and both are compared with the job's telemetry. The writer's bounds
(rank 0 only, a failing monitor logged once and dropped, never raising) are unit-tested on real files.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import sys
from pathlib import Path

import pytest
from train_job_helpers import JobRun, launch, start, tiny_spec, wait_for

from ulyssesd.training.ds_config import build_ds_config
from ulyssesd.training.scalars import (
    MAX_CONSECUTIVE_FAILURES,
    TAG_PREFIX,
    ScalarWriter,
    check_monitor_dependencies,
    drop_unwritable_monitors,
    model_flops_per_step,
    step_scalars,
)
from ulyssesd.training.spec import SpecError

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
PEAK_TFLOPS = 0.05  # a made-up CPU "peak" so the tiny job's MFU is a visible number
# What every step record carries on a CPU fp32 run (loss_scale is fp16 only).
TAGS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "step_time_s", "mem_allocated_gib",
        "mem_max_allocated_gib", "mem_reserved_gib", "host_rss_gib")


# ------------------------------------------------------------------------------------- config
def test_scalars_are_off_by_default(tmp_path):
    cfg, _ = build_ds_config(tiny_spec(), 2, tmp_path)
    assert "tensorboard" not in cfg and "csv_monitor" not in cfg


def test_scalars_add_the_monitor_blocks_under_the_run_dir(tmp_path):
    cfg, _ = build_ds_config(tiny_spec(scalars={"tensorboard": True, "csv": True}), 2, tmp_path)
    assert cfg["tensorboard"] == {"enabled": True, "output_path": f"{tmp_path}/scalars/", "job_name": "tensorboard"}
    assert cfg["csv_monitor"] == {"enabled": True, "output_path": f"{tmp_path}/scalars/", "job_name": "csv"}


def test_each_attempt_gets_its_own_csv_directory(tmp_path):
    # DeepSpeed's csv_monitor appends and writes its header row once per process: attempts must not share files.
    spec = tiny_spec(scalars={"tensorboard": True, "csv": True})
    cfg, _ = build_ds_config(spec, 2, tmp_path, attempt=3)
    assert cfg["csv_monitor"]["job_name"] == "csv/attempt-3"
    assert cfg["tensorboard"]["job_name"] == "tensorboard"  # one TensorBoard run: a new event file per attempt


def test_a_monitor_block_of_the_users_config_wins_with_a_warning(tmp_path):
    spec = tiny_spec(scalars={"tensorboard": True},
                     deepspeed={"config": {"tensorboard": {"enabled": True, "output_path": "tb"}}})
    cfg, warnings = build_ds_config(spec, 2, tmp_path)
    assert cfg["tensorboard"]["output_path"] == f"{tmp_path}/tb/"
    assert any("tensorboard" in w and "is used" in w for w in warnings), warnings


def test_bad_scalars_fields_are_rejected_with_their_path():
    with pytest.raises(SpecError) as err:
        tiny_spec(scalars={"peak_tflops_per_gpu": 0, "tensorbaord": True})
    text = str(err.value)
    assert "scalars.peak_tflops_per_gpu" in text and "scalars.tensorbaord: unknown key" in text


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_an_enabled_monitor_without_its_package_is_refused_before_the_engine_is_built():
    with pytest.raises(SpecError) as err:
        check_monitor_dependencies({"wandb": {"enabled": True, "project": "p"}})
    assert "wandb package is not installed" in str(err.value)
    check_monitor_dependencies({"wandb": {"enabled": False}})  # disabled: no package needed


def test_a_monitor_directory_that_cannot_be_created_is_dropped_not_fatal(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = {"tensorboard": {"enabled": True, "output_path": f"{blocker}/sub/", "job_name": "tensorboard"},
           "csv_monitor": {"enabled": True, "output_path": f"{tmp_path}/ok/", "job_name": "csv"}}
    warnings = drop_unwritable_monitors(cfg)
    assert "tensorboard" not in cfg and len(warnings) == 1 and str(blocker) in warnings[0]
    assert (tmp_path / "ok" / "csv").is_dir() and "csv_monitor" in cfg


def test_model_flops_match_the_benchmarks_definition():
    # bench/gpu_bench.py computes every MFU figure in bench/RESULTS.md; the job must count the same FLOPs.
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from gpu_bench import model_flops_per_step as bench_flops
    finally:
        sys.path.remove(str(REPO / "bench"))
    for preset, seq in (("gpt-7b", 32768), ("gpt-1b", 32768), ("tiny", 64)):
        m = tiny_spec(model={"preset": preset}, train={"seq_len": seq}).resolved_model()
        ours = model_flops_per_step(m, seq, 2 * seq)
        assert ours == pytest.approx(bench_flops(m.model_dump(), seq, 2 * seq), rel=1e-12)
    m = tiny_spec().resolved_model()
    assert model_flops_per_step(m, 64, 128) > model_flops_per_step(m, 64, 64)


# ------------------------------------------------------------------------------------- writer
def test_the_writer_writes_on_rank_0_only():
    got: list = []
    ScalarWriter(got.extend, rank=1).write(3, {"loss": 1.0})
    assert got == []
    ScalarWriter(got.extend, rank=0).write(3, {"loss": 1.5, "lr": 1e-3})
    assert got == [(TAG_PREFIX + "loss", 1.5, 3), (TAG_PREFIX + "lr", 1e-3, 3)]


def test_a_failing_monitor_is_logged_once_then_dropped_and_never_raises(caplog):
    calls = []

    def broken(events):
        calls.append(events)
        raise OSError(28, "No space left on device")

    writer = ScalarWriter(broken, rank=0)
    with caplog.at_level(logging.WARNING, logger="ulyssesd.training.scalars"):
        for step in range(1, 10):
            writer.write(step, {"loss": 2.0})
    assert len(calls) == MAX_CONSECUTIVE_FAILURES and not writer.active
    messages = [r.getMessage() for r in caplog.records]
    assert sum("No space left on device" in m for m in messages) == 1
    assert any("no more monitor writes" in m for m in messages)


def test_a_monitor_that_recovers_keeps_writing():
    calls, fail = [], iter([True, True, False, True, True, False, False])

    def flaky(events):
        calls.append(events)
        if next(fail):
            raise RuntimeError("wandb: network")

    writer = ScalarWriter(flaky, rank=0)
    for step in range(7):
        writer.write(step, {"loss": 1.0})
    assert len(calls) == 7 and writer.active  # never MAX_CONSECUTIVE_FAILURES in a row


def test_step_scalars_leave_out_what_the_record_does_not_know():
    out = step_scalars(float("nan"), {"lr": 1e-3, "loss_scale": None, "grad_norm": 0.5}, None)
    assert set(out) == {"loss", "lr", "grad_norm"} and out["loss"] != out["loss"]  # NaN is kept


# ---------------------------------------------------------------------------------- real job
@pytest.fixture(scope="module")
def scalars_run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    run_dir = tmp_path_factory.mktemp("scalars")
    spec = tiny_spec(train={"steps": STEPS}, checkpoint={"interval_steps": STEPS, "save_at_end": False},
                     scalars={"tensorboard": True, "csv": True, "peak_tflops_per_gpu": PEAK_TFLOPS})
    run = launch(spec, run_dir)
    assert run.returncode == 0, run.output[-4000:]
    return run


def _telemetry_steps(run) -> dict[int, dict]:
    steps = run.steps()
    assert sorted(steps) == list(range(1, STEPS + 1))
    return steps


@pytest.mark.slow
def test_tensorboard_event_files_hold_every_scalar_once_per_step(scalars_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = scalars_run.run_dir / "scalars" / "tensorboard"
    event_files = list(tb_dir.glob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files  # rank 0 only: rank 1 would have written its own file
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    steps = _telemetry_steps(scalars_run)
    for name in TAGS:
        assert TAG_PREFIX + name in tags, (name, sorted(tags))
        events = acc.Scalars(TAG_PREFIX + name)
        assert [e.step for e in events] == list(range(1, STEPS + 1)), name
    # TensorBoard stores float32: equal to the telemetry's losses to float32 precision.
    losses = [e.value for e in acc.Scalars(TAG_PREFIX + "loss")]
    assert losses == pytest.approx([steps[s]["loss"] for s in range(1, STEPS + 1)], rel=1e-6)
    assert TAG_PREFIX + "loss_scale" not in tags  # fp32 run: no loss scale to show
    assert "Train/Samples/lr" in tags  # DeepSpeed's own monitor events land in the same file


@pytest.mark.slow
def test_csv_monitor_files_hold_the_telemetrys_values(scalars_run):
    csv_dir = scalars_run.run_dir / "scalars" / "csv" / "attempt-1"
    steps = _telemetry_steps(scalars_run)
    for name in TAGS:
        path = csv_dir / f"{(TAG_PREFIX + name).replace('/', '_')}.csv"
        rows = list(csv.reader(path.open()))
        assert rows[0] == ["step", name], path
        assert [int(r[0]) for r in rows[1:]] == list(range(1, STEPS + 1)), path
        if name == "host_rss_gib":
            continue  # not in telemetry
        values = [float(r[1]) for r in rows[1:]]
        assert values == [float(steps[s][name]) for s in range(1, STEPS + 1)], name  # exact: CSV keeps repr


@pytest.mark.slow
def test_mfu_in_telemetry_is_model_flops_over_the_slowest_rank_and_the_peak(scalars_run):
    m = tiny_spec().resolved_model()
    for rec in _telemetry_steps(scalars_run).values():
        expected = model_flops_per_step(m, 64, rec["tokens"]) / rec["step_time_max_s"] / 2 / (PEAK_TFLOPS * 1e12)
        assert rec["mfu"] == pytest.approx(expected, rel=1e-3, abs=1e-6)
        assert 0 < rec["mfu"]


@pytest.mark.slow
def test_broken_monitors_never_stop_the_real_job(tmp_path):
    """At start, a TensorBoard directory that cannot be created (its parent is a file) drops that monitor;
    mid-run, the CSV directory replaced by a file makes every CSV write fail: logged once, given up after
    MAX_CONSECUTIVE_FAILURES, and the job still trains to the end with its telemetry complete."""
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    run_dir = tmp_path / "run"
    steps = 8
    spec = tiny_spec(train={"steps": steps}, checkpoint={"interval_steps": steps, "save_at_end": False},
                     scalars={"csv": True},
                     deepspeed={"config": {"tensorboard": {"enabled": True, "output_path": f"{blocker}/tb/"}}},
                     faults=[{"kind": "slow_rank", "at_step": 3, "magnitude": 4.0}])  # a window to break the CSVs
    proc = start(spec, run_dir)
    run = JobRun(run_dir, None, "")
    wait_for(lambda: 2 in run.steps() if (run_dir / "telemetry.jsonl").exists() else False, 120, "step 2", proc)
    csv_dir = run_dir / "scalars" / "csv" / "attempt-1"
    assert (csv_dir / f"{TAG_PREFIX.replace('/', '_')}loss.csv").exists()
    for f in csv_dir.iterdir():
        f.unlink()
    csv_dir.rmdir()
    csv_dir.write_text("")  # the monitor's directory is now a file: every open() of a CSV under it fails
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-4000:]
    assert sorted(run.steps()) == list(range(1, steps + 1))
    assert "the tensorboard monitor is off for this attempt" in out, out[-4000:]
    assert out.count("scalars: a write to the DeepSpeed monitor failed") == 1, out[-4000:]
    assert f"scalars: {MAX_CONSECUTIVE_FAILURES} writes in a row failed" in out, out[-4000:]

