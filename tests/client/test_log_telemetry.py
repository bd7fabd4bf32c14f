"""Zero-code supervision: real published log lines (tests/client/fixtures/logs/README.md has provenance)
become telemetry records the daemon accepts, unknown lines are ignored, ranks are de-duplicated, and the
remediation engine finds an overflow storm and a loss spike from a DeepSpeed script's printed lines while
staying quiet on a noisy healthy one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ulyssesd.remediation.log_telemetry import LogTelemetryParser, looks_like_telemetry, parse_log_lines
from ulyssesd.remediation.records import StepRecord, parse_record
from ulyssesd.remediation.replay import replay

LOGS = Path(__file__).parent / "fixtures" / "logs"


def _records(name: str) -> list[dict]:
    recs = list(parse_log_lines((LOGS / name).read_text().splitlines()))
    for r in recs:
        parse_record(r)  # every record is one the daemon accepts
    return recs


def test_megatron_iteration_lines():
    recs = _records("megatron_lm.log")
    assert [r["step"] for r in recs] == [122, 123, 124, 125]
    first = recs[0]
    assert first["loss"] == pytest.approx(2.504220) and first["grad_norm"] == 0.231
    assert first["lr"] == pytest.approx(9.150e-06) and first["loss_scale"] == 1.0
    assert first["step_time_s"] == pytest.approx(86.5452) and first["skipped"] is False


def test_megatron_interval_without_loss_marks_the_next_record_skipped_and_invents_no_loss():
    recs = _records("megatron_bert_skipped.log")
    assert [r["step"] for r in recs] == [20]  # iteration 10 had every iteration skipped: no lm loss printed
    assert recs[0]["skipped"] is True and recs[0]["loss"] == pytest.approx(10.05022)
    assert recs[0]["loss_scale"] == 32768.0 and recs[0]["grad_norm"] == pytest.approx(217.199)
    # Lines with no loss at all (a pipeline stage that does not print it) give nothing, not a made-up NaN.
    assert _records("megatron_deepspeed_nan_gradnorm.log") == []


def test_gpt_neox_on_deepspeed_merges_throughput_and_timers_into_the_iteration():
    recs = _records("gpt_neox_deepspeed_bf16.log")
    assert len(recs) == 1
    r = recs[0]
    assert r["step"] == 34 and r["loss"] == pytest.approx(11.18665)
    assert r["mem_max_allocated_gib"] == 63.31 and r["mem_allocated_gib"] == 59.65
    assert r["step_time_s"] == pytest.approx(4.1031)  # the iteration's own time wins over the timers' sum
    assert r["time"] == pytest.approx(1690318997.269)  # 2023-07-25 21:03:17,269 (UTC)


def test_hf_trainer_dict_takes_its_step_from_tqdm_and_the_overflows_before_it():
    recs = _records("hf_trainer_deepspeed_overflow.log")
    assert len(recs) == 1
    r = recs[0]
    assert r["step"] == 380 and r["loss"] == 2.0491 and r["lr"] == pytest.approx(1.961913563176343e-4)
    assert r["skipped"] is True and r["loss_scale"] == 32.0  # the scale the last overflowing step attempted
    assert r["step_time_s"] == pytest.approx(132.12)


def test_hf_trainer_dicts_without_a_progress_bar_are_numbered_in_order():
    recs = _records("hf_trainer_grad_norm.log")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert recs[0]["grad_norm"] == pytest.approx(37.657958984375) and "skipped" not in recs[0]


def test_torchrun_rank_prefix_and_a_scripts_own_step_lines():
    recs = _records("torchtitan_rank_prefix.log")
    assert [(r["step"], r["loss"]) for r in recs] == [(1, -1.0), (2, -1.0), (3, -1.0)]


def test_deepspeed_overflow_lines_alone_make_no_step_record_but_count_for_the_next():
    p = LogTelemetryParser()
    assert list(p.feed_many((LOGS / "deepspeed_overflow_startup.log").read_text().splitlines())) == []
    assert p.stats.by_format == {"deepspeed_overflow": 4}
    (rec,) = p.feed("step=1 loss=10.5")
    assert rec["skipped"] is True and rec["loss_scale"] == 16384.0
    (rec,) = p.feed("step=2 loss=10.4")
    assert rec["skipped"] is False and "loss_scale" not in rec


def test_interleaved_ranks_keep_rank_zero_and_drop_repeated_steps():
    lines = ["[rank1]:step=1 loss=3.0", "[rank0]:step=1 loss=2.0", "[rank1]:step=2 loss=3.1",
             "[rank0]:step=2 loss=1.9", "0: step=3 loss=1.8"]
    p = LogTelemetryParser()
    recs = list(p.feed_many(lines))
    # rank 1 spoke first; once rank 0 is seen, only rank 0's lines count (rank 1's step 1 was kept before).
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 3.0), (2, 1.9), (3, 1.8)]
    assert p.stats.dropped_other_rank == 1 and p.stats.dropped_repeated_step == 1
    # Unprefixed ranks printing the same step: the first line of each step counts.
    recs = list(parse_log_lines(["step 5 | loss: 2.0", "step 5 | loss: 2.1", "step 6 | loss: 1.9"]))
    assert [(r["step"], r["loss"]) for r in recs] == [(5, 2.0), (6, 1.9)]


@pytest.mark.parametrize("line", [
    "Traceback (most recent call last):",
    "  File \"train.py\", line 10, in <module>",
    "eval loss: 2.31",                               # a loss without a step
    "{'eval_loss': 2.2, 'eval_runtime': 3.1, 'epoch': 1.0}",
    "{'train_runtime': 10.5, 'train_samples_per_second': 3.2, 'train_loss': 2.2, 'epoch': 3.0}",
    "step 3 of the data pipeline done",               # a step without a loss
    "[2024-01-01 00:00:00,000] [INFO] [config.py:1000:print]   steps_per_print .............. 10",
    "\x1b[31mgarbage\x00\xff",
    "",
])
def test_unknown_lines_are_ignored(line):
    assert list(parse_log_lines([line])) == []


def test_pipeline_engine_line_checkpoint_events_and_nan():
    recs = list(parse_log_lines([
        "steps: 10 loss: 2.3456 iter time (s): 0.512 samples/sec: 62.500",
        "[2024-05-01 10:00:00,000] [INFO] [torch_checkpoint_engine.py:33:commit] [Torch] Checkpoint global_step10 is ready now!",
        "step=11 loss=nan lr=1e-4 grad_norm=inf",
    ], attempt=2))
    assert recs[0] == {"v": 1, "kind": "step", "time": None, "attempt": 2, "step": 10, "loss": 2.3456,
                       "step_time_s": 0.512}
    assert recs[1]["event"] == "checkpoint_saved" and recs[1]["tag"] == "global_step10" and recs[1]["step"] == 10
    assert recs[2]["loss"] == "nan" and recs[2]["grad_norm"] == "inf" and recs[2]["lr"] == 1e-4
    for r in recs:
        parse_record(r)


def test_format_detection():
    assert looks_like_telemetry('{"v":1,"kind":"step","step":1,"loss":2.0}')
    assert not looks_like_telemetry(" iteration      122/  250000 | consumed samples: 1 |")
    assert not looks_like_telemetry("{'loss': 2.0, 'epoch': 0.1}")


# ------------------------------------------------------------ detectors over a printed-logs job
def _deepspeed_script_log(steps: int, overflow_rate, loss_at, seed: int = 0) -> list[str]:
    """What an unmodified fp16 DeepSpeed script prints: DeepSpeed's OVERFLOW lines, then its own loss line."""
    rng = random.Random(seed)
    scale = 65536
    lines = []
    for step in range(1, steps + 1):
        if rng.random() < overflow_rate(step):
            lines.append(f"[2024-05-01 10:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! "
                         f"Rank 0 Skipping step. Attempted loss scale: {scale}, reducing to {scale // 2}")
            scale = max(1, scale // 2)
        lines.append(f"step={step} loss={loss_at(step, rng):.4f}")
    return lines


def _findings(lines: list[str]) -> set[str]:
    recs = [parse_record(r) for r in parse_log_lines(lines)]
    assert all(isinstance(r, StepRecord) for r in recs)
    return {it.item.symptom for it in replay(recs) if it.kind == "finding"}


def test_overflow_storm_is_found_from_log_lines_and_rare_overflows_are_not():
    def noisy(step, rng):
        return 3.0 - step * 0.001 + rng.gauss(0, 0.02)

    storm = _deepspeed_script_log(400, lambda s: 0.6 if s > 250 else 0.01, noisy)
    healthy = _deepspeed_script_log(400, lambda s: 0.01, noisy)
    assert "overflow_storm" in _findings(storm)
    assert "overflow_storm" not in _findings(healthy)


def test_loss_spike_is_found_from_log_lines_and_noise_is_not():
    def spiky(step, rng):
        return 3.0 + rng.gauss(0, 0.02) + (4.0 if 300 <= step < 330 else 0.0)

    def noisy(step, rng):
        return 3.0 + rng.gauss(0, 0.05)

    assert "loss_spike" in _findings(_deepspeed_script_log(400, lambda s: 0.0, spiky))
    assert _findings(_deepspeed_script_log(400, lambda s: 0.0, noisy)) == set()


def test_ulyssesctl_replay_accepts_a_raw_log(tmp_path):
    import io
    import json

    from ulyssesd.daemon.operator.ctl_offline import run_replay

    log = tmp_path / "attempt-1.log"
    log.write_text("\n".join(["some banner", "[rank0]: Traceback-free noise"] + _deepspeed_script_log(
        400, lambda s: 0.6 if s > 250 else 0.01, lambda s, rng: 3.0 + rng.gauss(0, 0.02))) + "\n")
    out, err = io.StringIO(), io.StringIO()
    assert run_replay(log, as_json=True, out=out, err=err) == 0
    doc = json.loads(out.getvalue())
    assert any(it["type"] == "finding" and it["symptom"] == "overflow_storm" for it in doc["items"])
    # Log noise is not reported as bad telemetry; the one note allowed is the loud one that untimed records
    # (a raw log's lines carry no time) were not judged for hangs or step time.
    assert doc["bad_lines"] == [], doc["bad_lines"]
    assert all(line.startswith("warning: NO TIMESTAMPS") for line in err.getvalue().splitlines()), err.getvalue()


# ------------------------------------------------------------ the corpus of real published logs
CORPUS = LOGS / "corpus"


def _expectation(path: Path) -> tuple[str, dict[str, str], list[str]]:
    """A corpus file: `# source: URL (...)`, `# expect: records=N first=STEP:LOSS last=STEP:LOSS [at=STEP:LOSS]`,
    then the log lines exactly as published."""
    lines = path.read_text().splitlines()
    source = lines[0].removeprefix("# source: ")
    assert lines[0].startswith("# source: https://"), f"{path.name}: the first line names the source"
    assert lines[1].startswith("# expect: "), f"{path.name}: the second line says what it must parse to"
    expect = dict(kv.split("=", 1) for kv in lines[1].removeprefix("# expect: ").split())
    return source, expect, lines[2:]


def _step_loss(text: str) -> tuple[int, float]:
    step, loss = text.split(":")
    return int(step), float(loss)


def _same_loss(got, want: float) -> bool:
    if want != want:
        return got == "nan"
    return isinstance(got, float | int) and got == pytest.approx(want)


CORPUS_FILES = sorted(CORPUS.glob("*.log"))


def test_the_corpus_spans_at_least_ten_projects():
    projects = {_expectation(p)[0].split("/")[3:5][0] + "/" + _expectation(p)[0].split("/")[4] for p in CORPUS_FILES}
    projects |= {"NVIDIA/Megatron-LM", "huggingface/transformers", "deepspeedai/DeepSpeed"}  # the fixtures above
    assert len(projects) >= 10, projects


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: p.name)
def test_real_published_log_parses_to_the_right_steps_and_losses(path):
    _source, expect, lines = _expectation(path)
    p = LogTelemetryParser(attempt=1)
    recs = [r for r in p.feed_many(lines)]
    for r in recs:
        parse_record(r)  # every record is one the daemon accepts
    steps = [r for r in recs if r["kind"] == "step"]
    assert len(steps) == int(expect["records"]), [(r["step"], r["loss"]) for r in steps]
    for which, rec in (("first", steps[0]), ("last", steps[-1])):
        step, loss = _step_loss(expect[which])
        assert rec["step"] == step and _same_loss(rec["loss"], loss), (which, rec)
    if "at" in expect:
        step, loss = _step_loss(expect["at"])
        (rec,) = [r for r in steps if r["step"] == step]
        assert _same_loss(rec["loss"], loss), rec
    assert [r["step"] for r in steps] == sorted({r["step"] for r in steps})  # forward, no repeats
    assert p.stats.bad_lines == 0 and p.stats.discontinuities == 0


# ------------------------------------------------------------ steps checked against the run's own progress
def _megatron_line(step: int | str, loss: float = 2.9) -> str:
    return (f" iteration {step:>8}/     900 | consumed samples:          160 | elapsed time per iteration (ms): "
            f"1234.5 | learning rate: 1.000E-04 | lm loss: {loss:E} | loss scale: 1.0 | grad norm: 1.234 | "
            f"number of skipped iterations:   0 | number of nan iterations:   0 |")


def test_one_odd_megatron_line_is_a_bad_line_and_does_not_blind_the_parser():
    p = LogTelemetryParser()
    lines = [_megatron_line(s) for s in (10, 20, 30)] + [_megatron_line("10000000000000000000000000")] \
        + [_megatron_line(s) for s in (40, 50)]
    recs = list(p.feed_many(lines))
    assert [r["step"] for r in recs] == [10, 20, 30, 40, 50]
    assert p.stats.bad_lines == 1 and p.stats.discontinuities == 0
    assert "10000000000000000" in p.stats.bad_samples[0]


def test_a_jump_of_orders_of_magnitude_without_a_total_is_a_bad_line_but_a_healthy_stride_is_not():
    p = LogTelemetryParser()
    recs = list(p.feed_many([f"step {s} loss 2.0" for s in (1, 2, 3, 4)] + ["step 4000000 loss 2.0"]
                            + [f"step {s} loss 2.0" for s in (5, 6)]))
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6] and p.stats.bad_lines == 1
    # Logging every 1000 steps is the run's own stride: not a jump.
    p = LogTelemetryParser()
    recs = list(p.feed_many([f"step {s} loss 2.0" for s in (1000, 2000, 3000, 4000, 5000)]))
    assert len(recs) == 5 and p.stats.bad_lines == 0


def test_a_counter_that_goes_backwards_for_good_is_an_event_and_nothing_after_it_is_dropped():
    p = LogTelemetryParser(attempt=1)
    lines = [f"step {s} loss {3.0 - s / 100:.3f}" for s in range(1, 31)] \
        + [f"step {s} loss {2.5 - s / 100:.3f}" for s in range(1, 11)]  # an in-job rollback / a new epoch's count
    recs = list(p.feed_many(lines))
    steps = [r for r in recs if r["kind"] == "step"]
    events = [r for r in recs if r["kind"] == "event"]
    assert [r["step"] for r in steps] == list(range(1, 31)) + list(range(1, 11))
    assert len(events) == 1 and events[0]["event"] == "step_discontinuity"
    assert events[0]["kind"] == "event" and events[0]["from_step"] == 30 and events[0]["to_step"] == 1
    for r in recs:
        parse_record(r)
    assert p.stats.discontinuities == 1 and p.stats.bad_lines == 0


def test_ranks_lagging_behind_are_not_a_reset():
    p = LogTelemetryParser()
    recs = list(p.feed_many(["step 6 loss 2.0", "step 3 loss 2.1", "step 7 loss 2.0", "step 4 loss 2.1",
                             "step 8 loss 2.0", "step 5 loss 2.1", "step 9 loss 2.0"]))
    assert [r["step"] for r in recs] == [6, 7, 8, 9] and p.stats.discontinuities == 0


def test_explicit_pattern_reads_wording_nothing_else_does():
    from ulyssesd.remediation.logread.options import PatternError

    line = "E3 it#77 L=2.5 g=0.3"
    assert list(parse_log_lines([line])) == []
    p = LogTelemetryParser(pattern=r"it#(?P<step>\d+) L=(?P<loss>\S+) g=(?P<grad_norm>\S+)")
    (rec,) = p.feed(line)
    assert rec["step"] == 77 and rec["loss"] == 2.5 and rec["grad_norm"] == 0.3
    with pytest.raises(PatternError, match=r"\(\?P<loss>"):
        LogTelemetryParser(pattern=r"it#(?P<step>\d+)")
    with pytest.raises(PatternError, match="not a regular expression"):
        LogTelemetryParser(pattern=r"it#(?P<step>\d+")


def test_the_newest_unparsed_progress_like_line_is_kept_as_the_example_for_the_fix():
    p = LogTelemetryParser()
    list(p.feed_many(["loading model", "E3 it#77 L=2.5", "Epoch 3 it#78 L=2.4", "done loading"]))
    assert p.stats.step_records == 0 and p.stats.unparsed_sample == "Epoch 3 it#78 L=2.4"


def test_ulyssesctl_replay_says_how_many_records_it_parsed_and_is_loud_at_zero(tmp_path):
    import io
    import json

    from ulyssesd.daemon.operator.ctl_offline import run_replay

    good = tmp_path / "good.log"
    good.write_text("".join(f"iter {i}: loss {3 - i / 100:.4f}, time 12.34ms\n" for i in range(1, 41)))
    out, err = io.StringIO(), io.StringIO()
    assert run_replay(good, out=out, err=err) == 0
    assert "parsed 40 step record(s)" in err.getvalue() and "NO STEP RECORDS" not in err.getvalue()

    odd = tmp_path / "odd.log"
    odd.write_text("".join(f"E3 it#{i} L=2.{i}\n" for i in range(1, 9)))
    out, err = io.StringIO(), io.StringIO()
    assert run_replay(odd, as_json=True, out=out, err=err) == 8  # nothing judged: not a clean exit
    doc = json.loads(out.getvalue())
    assert doc["parsed"]["step_records"] == 0
    assert "NO STEP RECORDS" in err.getvalue() and "[telemetry] pattern" in err.getvalue()
    assert "E3 it#8 L=2.8" in err.getvalue()  # the line that was not understood, for the pattern
    spec = tmp_path / "run.toml"
    spec.write_text('[job]\nkind = "command"\ncommand = ["t.py"]\n[telemetry]\nsource = "stdout"\n'
                    "pattern = 'it#(?P<step>\\d+) L=(?P<loss>\\S+)'\n")
    out, err = io.StringIO(), io.StringIO()
    assert run_replay(odd, spec=spec, as_json=True, out=out, err=err) == 0, err.getvalue()
    assert json.loads(out.getvalue())["parsed"]["step_records"] == 8


@pytest.mark.parametrize("line,step,loss", [
    ("INFO step 11/12 | loss 2.9539 | lr 3.00e-03", 11, 2.9539),
    ("iter 100: loss 2.3456, time 12.34ms", 100, 2.3456),
    ("Epoch 0:  50%|█████     | 10/20 [00:01<00:01,  9.1it/s, v_num=0, train_loss=2.310]", 10, 2.310),
    ("reduced_train_loss=2.950, global_step=10.00", 10, 2.950),
    (" iteration       10/     900 | consumed samples:          160 | lm loss: 2.9E+00 |", 10, 2.9),
    ("step: 10  loss:  7.1", 10, 7.1),
    ("loss 2.95 step 3", 3, 2.95), ("loss: 2.95, step: 3", 3, 2.95), ("loss=2.95 step=3", 3, 2.95),
    ("'loss': 2.95, 'step': 3", 3, 2.95), ('{"loss": 2.95, "global_step": 3}', 3, 2.95),
    ("iteration 3 | train_loss 2.95 | val_loss 3.10", 3, 2.95),
    ("[2024-05-01 10:00:00] global_step=3 avg_loss=3.0 loss=2.95", 3, 2.95),
    ("Step 3/100: loss = 2.95", 3, 2.95),
])
def test_the_wordings_users_have(line, step, loss):
    (rec,) = parse_log_lines([line])
    assert rec["step"] == step and rec["loss"] == pytest.approx(loss)


@pytest.mark.parametrize("line", [
    "step 3 | val_loss 3.10",                        # an evaluation loss alone is never the training loss
    "max_steps 1000 loss 2.0",                       # a qualified step key is not a position
    "warmup steps 100, loss 2.0",
    "Epoch 3: loss 2.0",                             # an epoch is not a step
    "number of skipped iterations: 3 | loss: 2.0",
])
def test_what_is_not_a_training_step(line):
    assert [r for r in parse_log_lines([line]) if r["kind"] == "step"] == []


@pytest.mark.parametrize("line,loss", [
    ("step 5 | loss: tensor(2.3456, device='cuda:0', grad_fn=<NllLossBackward0>)", 2.3456),
    ("step=5 loss=tensor([2.3456])", 2.3456),
])
def test_a_printed_tensor_is_a_number(line, loss):
    (rec,) = parse_log_lines([line])
    assert rec["step"] == 5 and rec["loss"] == pytest.approx(loss)


def test_a_keyed_count_beside_an_epoch_is_placed_by_what_the_run_shows():
    # Composer-style headers count batches of the run: the count goes on across epochs, steps are N.
    p = LogTelemetryParser()
    lines = ["[epoch=1][batch=3/100]:", "\t Train time/batch: 2", "\t Train loss/train/total: 11.6525",
             "[epoch=1][batch=4/100]:", "\t Train loss/train/total: 11.2",
             "[epoch=2][batch=5/100]:", "\t Train loss/train/total: 11.1"]
    assert [(r["step"], r["loss"]) for r in p.feed_many(lines)] == [(3, 11.6525), (4, 11.2), (5, 11.1)]
    # A count that restarts when the epoch moves on counts within the epoch: E x M + N from then on, no reset.
    p = LogTelemetryParser()
    lines = [f"Train Epoch: {e}/100 Step: {s}/965 | lr 5e-4 || Mask_Loss 1.6" for e in (0, 1) for s in (10, 20, 960)]
    assert [r["step"] for r in p.feed_many(lines)] == [10, 20, 960, 975, 985, 1925]
    assert p.stats.discontinuities == 0 and p.stats.bad_lines == 0
