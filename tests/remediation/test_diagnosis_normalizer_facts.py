"""The normalizer and the fact extractor on real excerpts (tests/remediation/unseen/corpus_26.txt, its tuning half, and
the older corpora): every prefix off, every fact with its line; and the decision by cause on structures the rule table
has no wording for. The held-out half of corpus_26 is not read here (generality_round.py scores it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from generality_round import cases as round_cases  # noqa: E402
from generality_round import split as round_split  # noqa: E402

from ulyssesd.daemon.core.attempt_diagnosis import diagnose_attempt  # noqa: E402
from ulyssesd.remediation.diagnosis import diagnose  # noqa: E402
from ulyssesd.remediation.diagnosis.facts import Fact, extract, phase_at  # noqa: E402
from ulyssesd.remediation.diagnosis.normalizer import normalize, strip_prefixes, unique  # noqa: E402

CASES = {c.id: c for c in round_cases()}
SPLIT = round_split()


def case(cid: str):
    assert SPLIT[cid] == "tune", f"{cid} is held out: tests read only the tuning half"
    return CASES[cid]


def line_of(text: str, needle: str) -> int:
    """1-based number of the first line of `text` containing `needle` (what a fact must cite)."""
    for i, ln in enumerate(text.split("\n")):
        if needle in ln:
            return i + 1
    raise AssertionError(f"{needle!r} not in the excerpt")


def facts_of(cid: str) -> tuple[str, list[Fact]]:
    text = case(cid).text
    return text, extract(normalize(text))


def one(facts: list[Fact], kind: str) -> Fact:
    got = [f for f in facts if f.kind == kind]
    assert len(got) >= 1, (kind, facts)
    return got[0]


# ---------------------------------------------------------------- the normalizer
@pytest.mark.parametrize("raw,msg,rank", [
    ("[rank2]:   File \"/w/Megatron-LM/megatron/training.py\", line 170, in pretrain",
     "  File \"/w/Megatron-LM/megatron/training.py\", line 170, in pretrain", 2),
    ("[default3]:RuntimeError: boom", "RuntimeError: boom", 3),
    ("3: [rank3]: AssertionError: hidden size not divisible", "AssertionError: hidden size not divisible", 3),
    ("[1,0]<stderr>:Traceback (most recent call last):", "Traceback (most recent call last):", 0),
    ("[2024-07-17 19:44:06,829] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step.",
     "[deepspeed] OVERFLOW! Rank 0 Skipping step.", None),
    ("2020-10-18 02:34:05 | INFO | fairseq.trainer | begin training epoch 1", "begin training epoch 1", None),
    ("[NeMo W 2023-04-19 21:40:25 experimental:27] Module is experimental", "Module is experimental", None),
    ("Dec 07 11:40:01 gpu-node-3 python[1234]: Killed", "Killed", None),
    ("[12345.678901] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234", "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234", None),
    ("[1757] {'loss': 0.0, 'grad_norm': 1.41}", "{'loss': 0.0, 'grad_norm': 1.41}", None),
    ("job.o52401091:=>> PBS: job killed: walltime 906 exceeded limit 900", "=>> PBS: job killed: walltime 906 exceeded limit 900",
     None),
    ("18:19:08.785 W0205 18:19:08.782000 4021 api.py:900] Sending process 4086 closing signal SIGTERM",
     "W0205 18:19:08.782000 4021 api.py:900] Sending process 4086 closing signal SIGTERM", None),
    ('  File "C:\\Users\\me\\env\\lib\\site-packages\\torch\\serialization.py", line 789, in load',
     '  File "C:/Users/me/env/lib/site-packages/torch/serialization.py", line 789, in load', None),
])
def test_prefixes_of_every_launcher_and_logger_come_off(raw, msg, rank):
    got, got_rank, kinds = strip_prefixes(raw)
    assert got == msg and got_rank == rank, (got, got_rank, kinds)


def test_messages_keep_their_own_colons_and_brackets():
    for keep in ("0:00:01 elapsed", "RuntimeError: CUDA error: out of memory", "[E ProcessGroupNCCL.cpp:458] [Rank 0] x",
                 "Epoch 0:  23%|██▎  | 3/13 [01:38<05:27, 32.75s/it, loss=4.73]", "usage: train.py [-h] --cfg CFG ..."):
        assert strip_prefixes(keep)[0] == keep


def test_real_excerpts_normalise_with_line_numbers_ansi_and_bars():
    text = case("evs-78-pbs-walltime-grep-prefixed").text
    lines = normalize(text)
    assert [ln.no for ln in lines[:3]] == [1, 2, 3]
    assert all(ln.text.startswith("=>> PBS: job killed: walltime") for ln in lines if ln.text)
    bar = normalize("\x1b[32mEpoch 1:  50%|#####| 5/10\x1b[0m\rEpoch 1: 60%|######| 6/10\nKilled\n")
    assert [ln.text for ln in bar] == ["Epoch 1:  50%|#####| 5/10", "Epoch 1: 60%|######| 6/10", "Killed", ""]
    assert bar[2].no == 3


def test_many_ranks_repeating_a_message_read_as_one():
    text = "\n".join(f"{r}: [rank{r}]: AssertionError: num_attention_heads must divide hidden_size" for r in range(8))
    lines = normalize(text)
    assert [ln.repeat_of for ln in lines] == [None] + [1] * 7
    assert [ln.text for ln in unique(lines)] == ["AssertionError: num_attention_heads must divide hidden_size"]


# ---------------------------------------------------------------- the fact extractor, each fact with its line
def test_torch_load_failure_is_an_exception_raised_while_loading():
    text, facts = facts_of("longmem-15-torch-load-hasrecord-version")
    exc = one(facts, "exception")
    assert exc.line == line_of(text, 'RuntimeError: Expected hasRecord("version")')
    assert exc.get("type") == "RuntimeError" and exc.get("where") == "loading"
    assert exc.get("frames")[-1].file.endswith("torch/serialization.py")


def test_windows_paths_are_read_as_posix_frames():
    text, facts = facts_of("imaginaire-131-windows-load-checkpoint-typeerror")
    exc = one(facts, "exception")
    assert exc.line == line_of(text, "TypeError: unsupported operand")
    assert exc.get("frames")[-1].file.startswith("C:/Users/ETMProject/") and exc.get("where") == "loading"


def test_a_failed_checkpoint_write_is_raised_while_saving():
    text, facts = facts_of("ronin-51-torch-save-cannot-be-opened")
    exc = one(facts, "exception")
    assert exc.line == line_of(text, "RuntimeError: File my_out") and exc.get("where") == "saving"
    assert phase_at(facts, exc.line) == "training"


def test_argument_validation_is_found_by_where_it_was_raised_and_by_argparse_output():
    text, facts = facts_of("cpt-65-argparse-then-launch-traceback")
    val = [f for f in facts if f.kind == "validation"]
    assert [f.line for f in val] == [line_of(text, "--local_rank=2"), line_of(text, "--local_rank=0"),
                                     line_of(text, "--local_rank=1")]
    assert val[0].get("program") == "train_adgen.py" and not val[0].get("launcher")
    assert phase_at(facts, val[0].line) == "before_first_step"


def test_scheduler_terminations_name_their_reason_and_line():
    text, facts = facts_of("canu-444-lsf-term-runlimit")
    sch = one(facts, "scheduler")
    assert (sch.get("scheduler"), sch.get("reason"), sch.line) == ("lsf", "time", line_of(text, "TERM_RUNLIMIT"))
    assert one(facts, "exit").get("code") == 140
    text, facts = facts_of("souporcell-20-lsf-term-memlimit")
    assert one(facts, "scheduler").get("reason") == "memory"
    text, facts = facts_of("canu-530-pbs-mem-exceeded")
    sch = one(facts, "scheduler")
    assert (sch.get("scheduler"), sch.get("reason"), sch.line) == ("pbs", "memory", line_of(text, "PBS: job killed: mem"))
    text, facts = facts_of("rq-2092-killed-horse-stopped-by-user")
    assert one(facts, "scheduler").get("reason") == "cancelled"


def test_signals_in_launcher_wrapper_and_exit_code_forms():
    text, facts = facts_of("acumen-4-mp-spawn-sigkill-loguru")
    sig = one(facts, "signal")
    assert sig.get("signal") == 9 and sig.line == line_of(text, "ProcessExitedException: process 0 terminated")
    assert not any(f.kind == "exception" and "terminated with signal" in f.text for f in facts)
    text, facts = facts_of("fontbakery-dashboard-100-k8s-exit-137")
    assert one(facts, "exit").attrs == {"code": 137, "signal": 9}
    assert not any(f.kind == "signal" for f in facts)  # "Last State: Terminated" is a status field, not bash's report
    text, facts = facts_of("pytorch-unet-205-windows-access-violation")
    ex = one(facts, "exit")
    assert ex.get("ntstatus") == 0xC0000005 and ex.line == line_of(text, "0xC0000005")


def test_loss_scale_progress_and_completion_facts():
    text, facts = facts_of("fairseq-2404-one-overflow-note-healthy")
    ls = one(facts, "loss_scale")
    assert ls.get("scale") == 1024.0 and ls.line == 1
    text, facts = facts_of("fairseq-940-healthy-train-log")
    assert len([f for f in facts if f.kind == "progress"]) >= 5
    assert not any(f.kind in ("exception", "signal", "exit", "scheduler", "validation") for f in facts)
    text, facts = facts_of("invokeai-1162-misconfiguration-after-max-steps")
    done = one(facts, "completed")
    exc = [f for f in facts if f.kind == "exception"][-1]
    assert done.line == 1 and phase_at(facts, exc.line) == "after_training"


# ---------------------------------------------------------------- the decision by cause
def test_failure_evidence_is_never_healthy():
    # The first miss: an assertion repeated by many ranks behind srun and torch prefixes, no Traceback header.
    text = "\n".join(f"{r}: [rank{r}]: AssertionError: num_attention_heads (12) must divide hidden_size (1000)"
                     for r in range(4))
    d = diagnose(text)
    assert d.label == "python_exception" and d.confidence == "low" and "line 1" in d.reason
    d = diagnose("step 1 loss 2.0\nstep 2 loss 1.9\n./run.sh: line 12: 4711 Terminated   python train.py\n")
    assert d.label == "killed" and "Terminated" in d.evidence[0]
    # ...and healthy still needs nothing more than no failure: progress alone stays healthy.
    assert diagnose("step 1 loss 2.0\nstep 2 loss 1.9\nstep 3 loss 1.8\n").label == "healthy"


def test_earliest_failure_is_the_root_cause():
    text = ("step 10 loss 2.1\nloss is nan at step 11\n"
            "[rank0]:[E ProcessGroupNCCL.cpp:458] [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600004 milliseconds before timing out.\n")
    assert diagnose(text, exit_code=1).label == "nan_loss"


def test_checkpoint_load_error_is_checkpoint_corrupt_whatever_the_message():
    for msg in ("RuntimeError: storage has wrong size: expected 0 got 512", "EOFError: something new",
                "ValueError: a wording nobody has seen"):
        text = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
                "    state = torch.load(path)\n"
                "  File \"/env/lib/python3.10/site-packages/torch/serialization.py\", line 1025, in load\n"
                f"    return _load(opened_zipfile)\n{msg}\n")
        d = diagnose(text, exit_code=1)
        assert d.label == "checkpoint_corrupt" and d.evidence == [msg] and "line 6" in d.reason, d


def test_a_late_validation_error_is_not_a_refused_config():
    d = diagnose(case("invokeai-1162-misconfiguration-after-max-steps").text, exit_code=1)
    assert d.label == "python_exception"
    early = diagnose("usage: train.py [-h] --cfg CFG\ntrain.py: error: the following arguments are required: --cfg\n",
                     exit_code=2)
    assert early.label == "config_rejected"


def test_sigkill_sent_by_a_scheduler_or_user_is_killed_not_oom():
    d = diagnose(case("rq-2092-killed-horse-stopped-by-user").text, exit_code=-9)
    assert d.label == "killed" and d.confidence == "high"
    assert diagnose(case("canu-530-pbs-mem-exceeded").text, exit_code=-9).label == "host_oom_killed"


# ---------------------------------------------------------------- issue 28 item 7: signals named by their evidence
def test_sigkill_with_readable_host_evidence_and_no_oom_is_killed():
    tail = "step 100 loss 2.0\nKilled\n"
    assert diagnose_attempt(tail, -9, None, {"oom_kills": None, "kernel_lines": []}).label == "killed"
    assert diagnose_attempt(tail, -9, None, {"oom_kills": 0, "kernel_lines": None}).label == "killed"
    nothing = diagnose_attempt(tail, -9, None, {"oom_kills": None, "kernel_lines": None})
    assert nothing.label == "host_oom_killed" and nothing.confidence == "medium"
    oom = diagnose_attempt(tail, -9, None, {"oom_kills": 1, "kernel_lines": []})
    assert oom.label == "host_oom_killed" and oom.confidence == "high"
    d = diagnose_attempt(tail, -9, None, {"oom_kills": None, "kernel_lines": []})
    assert "sender unknown" in d.reason and d.secondary[0] == "host_oom_killed"


def test_look_alikes_of_kills_and_exits_in_a_running_log_stay_healthy():
    text = ("step 1 loss 2.0\nKilled 3 stale dataloader workers\nnvidia-smi exited with code 1\n"
            "step 2 loss 1.9\nstep 3 loss 1.8\nstep 4 loss 1.7\n")
    assert diagnose(text).label == "healthy"
