"""The `started` event's start-up phases (training/startup.py): the process's start read from the kernel, each
phase's end in seconds since then, in order; a real one-rank DeepSpeed job that resumes from a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.training.train_job_helpers import launch, tiny_spec
from ulyssesd.training.startup import PHASES, StartupClock, process_age_s


def test_process_age_is_read_from_the_kernel_not_from_the_first_call():
    # A child that sleeps before it asks: its age includes the sleep (and its interpreter's start-up).
    code = ("import time; time.sleep(0.6); from ulyssesd.training.startup import process_age_s, STARTUP; "
            "print(process_age_s(), STARTUP.from_kernel)")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    wall = time.monotonic() - t0
    age, from_kernel = out.stdout.split()
    assert from_kernel == "True"
    assert 0.6 <= float(age) <= wall + 0.05  # clock ticks are 10 ms


@pytest.mark.parametrize("content", ["", "12345 (x) S 1 2", "garbage without parenthesis",
                                     "1 (a) b) S " + " ".join(["x"] * 30)])
def test_an_unreadable_stat_line_gives_no_age_and_the_clock_counts_from_its_creation(tmp_path, content):
    stat = tmp_path / "stat"
    stat.write_text(content)
    assert process_age_s(str(stat)) is None
    assert process_age_s(str(tmp_path / "missing")) is None
    clock = StartupClock(age_s=0.0)
    clock.mark("imports")
    assert 0.0 <= clock.marks["imports"] < 1.0


def test_a_comm_with_spaces_and_parentheses_is_parsed_from_the_last_parenthesis(tmp_path):
    real = open("/proc/self/stat").read()
    rest = real[real.rindex(")") + 1:]
    stat = tmp_path / "stat"
    stat.write_text("4242 (evil) name (x) " + rest.lstrip())  # comm "evil) name (x" as the kernel would write it
    got, want = process_age_s(str(stat)), process_age_s()
    assert got is not None and want is not None and abs(got - want) < 0.1


def test_marks_are_ordered_unknown_phases_refused_and_first_only_keeps_the_standby_mark():
    clock = StartupClock(age_s=2.0)
    clock.mark("imports")
    time.sleep(0.02)
    clock.mark("imports", first_only=True)  # the standby's mark stands
    first = clock.marks["imports"]
    assert 2.0 <= first < 3.0
    clock.mark("checkpoint_loaded")
    time.sleep(0.01)
    clock.mark("process_group")
    fields = clock.fields()
    # listed in the order they happened (marked so here), not in PHASES order
    assert list(fields) == ["process_started_at", "imports", "checkpoint_loaded", "process_group"]
    assert fields["imports"] == first and abs(fields["process_started_at"] - (time.time() - 2.0)) < 1.0
    with pytest.raises(ValueError, match="unknown start-up phase 'model'"):
        clock.mark("model")


@pytest.mark.slow
def test_the_started_event_of_a_resumed_job_carries_every_phase_in_order(tmp_path):
    spec = tiny_spec(parallel={"sequence_parallel_size": 1}, train={"steps": 2},
                     checkpoint={"interval_steps": 2})
    first = launch(spec, tmp_path / "run", nproc=1)
    assert first.returncode == 0, first.output[-3000:]
    t_launch = time.time()
    second = launch(tiny_spec(parallel={"sequence_parallel_size": 1}, train={"steps": 3},
                              checkpoint={"interval_steps": 2}), tmp_path / "run", nproc=1, attempt=2)
    assert second.returncode == 0, second.output[-3000:]
    started = second.events("started", 2)[0]
    assert started["resumed_from"] == "step-00000002"
    phases = started["startup"]
    # The process started after this test launched it, and before the event was written.
    assert t_launch - 0.05 <= phases["process_started_at"] <= started["time"]
    want = [p for p in PHASES if not p.startswith("standby")]
    assert sorted(p for p in phases if p in PHASES) == sorted(want)
    values = [phases[p] for p in phases if p in PHASES]
    assert values == sorted(values) and values[0] > 0.0  # in the order they happened; the imports take time
    pipeline = ["imports", "process_group", "model_built", "deepspeed_initialized", "tag_agreed", "checkpoint_loaded"]
    assert [p for p in phases if p in pipeline] == pipeline
    # rank 0 checked the tag in a thread beside the build: done by the time every rank agreed on it
    assert phases["process_group"] <= phases["tag_verified"] <= phases["tag_agreed"]
    # The last phase ends no later than the event's own time since the process's start.
    assert values[-1] <= started["time"] - phases["process_started_at"] + 0.05
    first_step = min((r for r in second.records(2) if r["kind"] == "step"), key=lambda r: r["step"])
    assert first_step["time"] >= started["time"]


WARM_UP_CHILD = r"""
import os, sys, time
os.environ["DS_ACCELERATOR"] = "cpu"
from ulyssesd.training.startup import STARTUP, init_process_group, warm_up
import torch.distributed as dist
assert not dist.is_initialized()
device = warm_up("cpu")
made = dist.is_initialized()
init_process_group(False)  # the Trainer's call after the gate: a no-op, the same group
import torch
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"result-{dist.get_rank()}"), "w") as fh:  # one stdout would interleave
    print("RESULT", device, made, dist.get_world_size(), float(t), sorted(STARTUP.marks), file=fh)
# Leave the group before the interpreter exits: a gloo group torn down by static destructors can abort a rank
# ("terminate called without an active exception", SIGABRT; seen once in CI) after its work is done.
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_standby_makes_its_process_group_before_the_gate_and_the_attempt_reuses_it(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(WARM_UP_CHILD)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [(tmp_path / f"result-{r}").read_text().strip() for r in (0, 1)]
    for line in lines:
        assert line.split(" ", 5)[1:5] == ["cpu", "True", "2", "3.0"], line  # made before, world 2, it works
        assert "'imports'" in line and "'process_group'" in line


def test_without_a_launcher_the_warm_up_leaves_the_process_group_to_the_attempt(tmp_path):
    code = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'; from ulyssesd.training.startup import warm_up; "
            "import torch.distributed as dist; print(warm_up('cpu'), dist.is_initialized(), "
            "'MASTER_PORT' in os.environ)")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_PORT", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["cpu", "False", "False"]


def _rank0_trainer(tmp_path):
    from types import SimpleNamespace

    from ulyssesd.training.spec import job_spec_from_dict
    from ulyssesd.training.telemetry import TelemetryWriter
    from ulyssesd.training.train import Trainer

    t = Trainer(job_spec_from_dict({}), tmp_path, attempt=2, config_version=1)
    t.rank, t.world = 0, 1
    t.tele = TelemetryWriter(tmp_path / "telemetry.jsonl", 2, 1)
    t.dist = SimpleNamespace(broadcast_object_list=lambda box, src: None)  # a world of one
    return t


def test_rank_0_checks_the_resume_tag_while_the_model_is_built(tmp_path, monkeypatch):
    t = _rank0_trainer(tmp_path)

    def slow_choice():
        time.sleep(0.6)  # a disk-bound sha256 of the tag
        return "step-00000004", None

    monkeypatch.setattr(t, "_choose_tag", slow_choice)
    t0 = time.monotonic()
    chosen = t._start_choosing_tag()
    time.sleep(0.6)  # the model build meanwhile
    assert t._agree_on_tag(chosen) == "step-00000004"
    assert time.monotonic() - t0 < 1.0  # overlapped: 0.6 s, not 1.2 s


def test_a_failed_choice_in_the_thread_is_raised_on_rank_0_and_a_refusal_still_exits_3(tmp_path, monkeypatch):
    from ulyssesd.training.train_checkpoints import CheckpointLoadError

    t = _rank0_trainer(tmp_path)

    def broken():
        raise OSError(30, "Read-only file system", "checkpoints/latest")

    monkeypatch.setattr(t, "_choose_tag", broken)
    chosen = t._start_choosing_tag()
    with pytest.raises(OSError, match="Read-only file system"):
        t._agree_on_tag(chosen)
    monkeypatch.setattr(t, "_choose_tag", lambda: (None, "no valid checkpoint left in checkpoints"))
    with pytest.raises(CheckpointLoadError, match="no valid checkpoint left"):
        t._agree_on_tag(t._start_choosing_tag())
