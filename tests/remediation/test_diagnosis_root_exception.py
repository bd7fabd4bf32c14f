"""Log diagnosis: a plain Python exception on the rank that failed first beats its peers' communication errors.

When one rank dies of an ordinary exception (a bug, an injected `raise`), its peers fail in their next
collective (gloo "Connection closed by peer", ncclRemoteError, watchdog timeouts). Those are consequences: the
label is `python_exception` (the fixed set's label for an uncaught error in the job's
code) with the exception line as evidence, not `nccl_error`. Controls: a real NCCL error first, an exception
whose message is itself a known category, an exception long before the failure, and torchrun's Root Cause
entry naming the NCCL rank all keep their label.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ulyssesd.remediation.diagnosis import diagnose

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
# The fixtures added for this rule (sources in their .json sidecars): 06-08 measured, 09 built from real formats.
ROOT_EXCEPTION_FIXTURES = sorted((FIXTURES / "python_exception").glob("0[6-9]-*.log"))


def fixture(path: Path) -> tuple[str, dict]:
    return path.read_text(encoding="utf-8"), json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------- real message formats
GLOO_PEER = ("[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
             "closed by peer [127.0.0.1]:12173. This is typically caused by a remote worker crashing. Check the logs of "
             "the remote worker before reporting an error. GLHF!")


def traceback(rank: int, *exception: str, frames: int = 3) -> list[str]:
    """A rank-prefixed traceback as torch's excepthook prints it (the exception line(s) last)."""
    out = [f"[rank{rank}]: Traceback (most recent call last):"]
    for i in range(frames):
        out += [f'[rank{rank}]:   File "/opt/venv/lib/python3.11/site-packages/job/train.py", line {100 + i}, in step',
                f"[rank{rank}]:     out = self.engine(batch)", f"[rank{rank}]:           ^^^^^^^^^^^^^^^^^^"]
    return out + [f"[rank{rank}]: {line}" for line in exception]


def summary(root_rank: int, root_exit: int = 1, root_time: str = "09:16:24",
            others: tuple[tuple[int, int, str], ...] = ((0, -15, "09:16:24"),)) -> list[str]:
    """torchrun's ChildFailedError summary (format measured with torch 2.13, fixture 06)."""
    out = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
           "============================================================", "train.py FAILED",
           "------------------------------------------------------------", "Failures:"]
    for k, (rank, code, t) in enumerate(others, start=1):
        out += [f"[{k}]:", f"  time      : 2025-11-28_{t}", "  host      : gpu-node-07",
                f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: {4122 + rank})",
                "  error_file: <N/A>", "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"]
    out += ["------------------------------------------------------------", "Root Cause (first observed failure):", "[0]:",
            f"  time      : 2025-11-28_{root_time}", "  host      : gpu-node-07",
            f"  rank      : {root_rank} (local_rank: {root_rank})", f"  exitcode  : {root_exit} (pid: {4122 + root_rank})",
            "  error_file: <N/A>", "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
            "============================================================"]
    return out


STEPS = [f"[rank0]:[ulyssesd.training] step {s} loss 3.1{s % 10} grad_norm 0.9 step_time 2.9s" for s in range(1, 6)]
REMOTE_ERR = ["torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
              "remote process exited or there was a network error, NCCL version 2.21.5",
              "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."]
WATCHDOG = ("[rank{r}]:[E1128 09:39:02.118000641 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=600000) ran for 600088 "
            "milliseconds before timing out.")


def log(*parts: list[str] | str) -> str:
    return "\n".join(line for p in parts for line in ([p] if isinstance(p, str) else p))


# ---------------------------------------------------------------- the new fixtures
def test_the_new_fixtures_exist():
    assert len(ROOT_EXCEPTION_FIXTURES) == 4, [p.name for p in ROOT_EXCEPTION_FIXTURES]


@pytest.mark.parametrize("path", ROOT_EXCEPTION_FIXTURES, ids=lambda p: p.stem)
def test_fixture_gets_the_exception_label_with_the_exception_line(path: Path):
    text, meta = fixture(path)
    d = diagnose(text, exit_code=meta["exit_code"], signal=meta["signal"])
    assert d.label == "python_exception", d
    assert d.confidence == "medium"
    assert d.evidence and meta["evidence"][0] in d.evidence[0], d.evidence  # the exception line decides
    assert "nccl_error" in d.secondary  # the peers' communication errors are kept, as consequences
    assert "Python exception" in d.reason and d.reason.endswith(".")


@pytest.mark.parametrize("path", ROOT_EXCEPTION_FIXTURES, ids=lambda p: p.stem)
def test_without_the_exception_the_same_fixture_is_a_comm_error(path: Path):
    """Control: the peers' errors alone are nccl_error, so the exception line is what changes the label."""
    text, meta = fixture(path)
    needle = meta["evidence"][0]
    kept = [ln for ln in text.splitlines() if needle not in ln]
    assert len(kept) < len(text.splitlines())
    assert diagnose("\n".join(kept), exit_code=meta["exit_code"]).label == "nccl_error"


# ---------------------------------------------------------------- line order (no usable Root Cause entry)
def test_plain_exception_first_then_gloo_peer_error():
    d = diagnose(log(STEPS, traceback(1, "ValueError: shapes (4, 128) and (64,) not aligned"), traceback(0, GLOO_PEER[9:])),
                 exit_code=1)
    assert d.label == "python_exception" and d.evidence == ["[rank1]: ValueError: shapes (4, 128) and (64,) not aligned"]
    assert d.secondary == ["nccl_error"]


def test_plain_exception_first_then_peer_watchdog_timeout():
    d = diagnose(log(STEPS, traceback(1, "AssertionError: batch has 3 sequences, expected 4"), WATCHDOG.format(r=0)),
                 exit_code=1)
    assert d.label == "python_exception" and "AssertionError" in d.evidence[0]
    assert d.secondary == ["nccl_timeout"]


def test_nccl_error_first_then_unrelated_traceback_stays_nccl_error():
    """Negative control: the NCCL failure comes first; a later plain traceback (a cleanup path) is a consequence."""
    ib = ("h100-b03:9912:9990 [2] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 10.0.0.12<50312> "
          "with status=12 opcode=0 len=0 vendor err 129 (Recv)")
    later = traceback(0, "AttributeError: 'NoneType' object has no attribute 'save_checkpoint'")
    d = diagnose(log(STEPS, ib, traceback(2, *REMOTE_ERR), later, summary(2, others=())), exit_code=1)
    assert d.label == "nccl_error", d
    assert any("NET/IB" in e for e in d.evidence)


def test_exception_long_before_the_failure_is_not_its_cause():
    """A traceback that was caught and logged while training went on (many lines back) is not the first failure."""
    caught = traceback(0, "ConnectionResetError: [Errno 104] Connection reset by peer")
    many_steps = [f"[rank0]:[ulyssesd.training] step {s} loss 3.1 grad_norm 0.9" for s in range(6, 106)]
    d = diagnose(log(STEPS, caught, many_steps, traceback(0, GLOO_PEER[9:])), exit_code=1)
    assert d.label == "nccl_error", d
    near = diagnose(log(STEPS, caught, many_steps[:3], traceback(0, GLOO_PEER[9:])), exit_code=1)
    assert near.label == "python_exception"  # within the window it does count (control for the window)


@pytest.mark.parametrize("message, label", [
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2028, "
     "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5", "nccl_error"),
    ("RuntimeError: NCCL communicator was aborted on rank 1.", "nccl_error"),  # no rule wording, but about NCCL
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.96 GiB. GPU 1 has a total capacity of 79.18 GiB "
     "of which 23.04 GiB is free.", "cuda_oom"),
    ("OSError: [Errno 28] No space left on device: '/ckpt/step-00001200/mp_rank_00_model_states.pt'", "disk_full"),
    ("KeyboardInterrupt", "nccl_error"),  # an interrupt is not a root cause
])
def test_first_exception_of_a_known_category_keeps_that_category(message: str, label: str):
    d = diagnose(log(STEPS, traceback(1, message), traceback(0, GLOO_PEER[9:])), exit_code=1)
    assert d.label == label, d


# ---------------------------------------------------------------- torchrun's Root Cause entry
def test_root_cause_entry_beats_line_order():
    """--tee's tail threads can deliver a peer's error before the root rank's traceback: the entry decides."""
    text = log(STEPS, traceback(0, GLOO_PEER[9:]), traceback(1, "KeyError: 'attention_mask'"), summary(1))
    d = diagnose(text, exit_code=1)
    assert d.label == "python_exception" and d.evidence == ["[rank1]: KeyError: 'attention_mask'"]
    assert "Root Cause" in d.reason


def test_root_cause_naming_the_nccl_rank_keeps_nccl_error():
    """Negative control: the entry names rank 0, whose own error is NCCL; rank 1's plain exception came later."""
    text = log(STEPS, traceback(1, "ValueError: bad batch"), traceback(0, *REMOTE_ERR),
               summary(0, root_time="09:16:23", others=((1, 1, "09:16:25"),)))
    assert diagnose(text, exit_code=1).label == "nccl_error"


def test_root_cause_tie_in_the_same_second_falls_back_to_line_order():
    """torchrun names the lowest rank when two ranks crashed on their own in the same second: not trusted."""
    text = log(STEPS, traceback(1, "ValueError: bad batch"), traceback(0, GLOO_PEER[9:]),
               summary(0, root_time="09:16:24", others=((1, 1, "09:16:24"),)))
    d = diagnose(text, exit_code=1)
    assert d.label == "python_exception" and "ValueError" in d.evidence[0]


def test_root_cause_entry_quoting_the_traceback_with_record():
    text, _ = fixture(FIXTURES / "python_exception" / "08-gloo-record-root-cause-quotes-traceback.log")
    lines = text.splitlines()
    # Keep only torchrun's own output: the summary's quoted traceback alone must decide.
    agent = [ln for ln in lines if not ln.startswith("[rank")]
    d = diagnose("\n".join(agent), exit_code=1)
    assert d.label == "python_exception" and d.evidence == ["RuntimeError: boom"], d


# ---------------------------------------------------------------- no communication error at all
def test_plain_exception_without_comm_errors_names_the_exception():
    d = diagnose(log(STEPS, traceback(1, "ZeroDivisionError: division by zero"), summary(1)), exit_code=1)
    assert d.label == "python_exception" and d.confidence == "medium"
    assert d.evidence[0] == "[rank1]: ZeroDivisionError: division by zero"
    assert any("ChildFailedError" in e for e in d.evidence)


def test_exit_zero_and_sigterm_rules_are_unchanged():
    text = log(STEPS, traceback(1, "RuntimeError: boom"), traceback(0, GLOO_PEER[9:]))
    assert diagnose(text, exit_code=0).label == "healthy"
    assert diagnose(log(STEPS, traceback(0, "RuntimeError: boom")), exit_code=-15).label == "healthy"


def test_a_peer_killed_during_a_saves_barrier_is_not_a_full_disk():
    """A real log (bench/soak.py, 2026-12-07): rank 1 was SIGKILLed while rank 0 waited in the save's barrier, so
    rank 0's RuntimeError comes from the collective inside `_save` ("Connection reset by peer"). The raising frame is
    the process group's, not a write: the label is the kill (torchrun's Root Cause names SIGKILL), never disk_full
    (it was "disk_full, high confidence" before)."""
    text = (FIXTURES.parent / "soak_sigkill_in_save_barrier.log").read_text(encoding="utf-8")
    d = diagnose(text)
    assert d.label in ("killed", "host_oom_killed"), (d.label, d.evidence)
