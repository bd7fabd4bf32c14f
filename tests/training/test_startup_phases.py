"""The `started` event's start-up phases (training/startup.py): the process's start read from the kernel, each
phase's end in seconds since then, in order; a real one-rank DeepSpeed job that resumes from a checkpoint."""

from __future__ import annotations

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
    clock.mark("process_group")
    fields = clock.fields()
    assert list(fields) == ["process_started_at", "imports", "process_group", "checkpoint_loaded"]
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
    assert [p for p in phases if p in PHASES] == want
    values = [phases[p] for p in want]
    assert values == sorted(values) and values[0] > 0.0  # cumulative; the imports take time
    # The last phase ends no later than the event's own time since the process's start.
    assert values[-1] <= started["time"] - phases["process_started_at"] + 0.05
    first_step = min((r for r in second.records(2) if r["kind"] == "step"), key=lambda r: r["step"])
    assert first_step["time"] >= started["time"]
