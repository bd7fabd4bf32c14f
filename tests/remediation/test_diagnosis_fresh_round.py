"""Log diagnosis: the rules added after the 2026-12-02 fresh rounds (corpus_22.txt and corpus_23.txt, train parts),
each shown on the failure it must name AND on the look-alike it must leave alone. Plain strings shaped like the real
excerpts."""

from __future__ import annotations

import pytest

from ulyssesd.remediation.diagnosis import diagnose

STEPS = "\n".join(f"[2/20][{s}/7614] Loss: 8.69{s % 10}" for s in range(4080, 4085))

REMOVAL_RACE = """  File "/workspace/job/trainer.py", line 644, in train_epoch
    self.save_checkpoint(
  File "/workspace/job/trainer.py", line 290, in save_checkpoint
    shutil.rmtree(path)
  File "/usr/lib/python3.10/shutil.py", line 729, in rmtree
    os.rmdir(path)
FileNotFoundError: [Errno 2] No such file or directory: './out/model.pt.ep0.5000'
"""

MISSING_INPUT = """Traceback (most recent call last):
  File "/workspace/job/train.py", line 40, in <module>
    data = open(args.train_file)
FileNotFoundError: [Errno 2] No such file or directory: '/data/train.jsonl'
"""

NCCL_BIND = STEPS + """
42692884fcba:140:140 [0] include/socket.h:333 NCCL WARN Call to bind failed : Address already in use
42692884fcba:140:140 [0] NCCL INFO bootstrap.cc:91 -> 2
"""

C10D_STORE_PORT = """[W socket.cpp:436] [c10d] The server socket has failed to bind to [::]:29400 (errno: 98 - Address already in use).
[E socket.cpp:472] [c10d] The server socket has failed to listen on any local network address.
"""

NCCL_CONNECT = """n1:12251:12400 [5] misc/socket.cc:483 NCCL WARN socketStartConnect: Connect to 10.0.0.2<17943> failed : Software caused connection abort
n1:12251:12400 [5] NCCL INFO misc/socket.cc:564 -> 2
"""

NCCL_RETRY_INFO = """n1:12251:12400 [5] NCCL INFO Call to connect returned Connection refused, retrying
n1:12251:12400 [5] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0
""" + STEPS

WATCHDOG_FRAMES = """frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, 1000l> > >) + 0x1d2 (0x1554e9e0f8f2 in /x/torch/lib/libtorch_cuda.so)
frame #2: c10d::ProcessGroupNCCL::watchdogHandler() + 0x233 (0x1554e9e16333 in /x/torch/lib/libtorch_cuda.so)
frame #3: c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x10c (0x1554e9e1871c in /x/torch/lib/libtorch_cuda.so)
"""

WATCHDOG_HEALTHY = """[rank0]:[I1206 18:44:12.7 ProcessGroupNCCL.cpp:852] [PG 0 Rank 0] ProcessGroupNCCL initialization options: TIMEOUT(ms): 600000
gpu-node-07:4122:4183 [0] NCCL INFO comm 0x55d5c6b0 rank 0 nranks 8 cudaDev 0 busId 18000 - Init COMPLETE
""" + STEPS

LIGHTNING_REFUSED = """Traceback (most recent call last):
  File "/home/u/bin/train_lightning.py", line 138, in main
    trainer.fit(model)
lightning.fabric.utilities.exceptions.MisconfigurationException: Do not set `gradient_accumulation_steps` in the DeepSpeed config as this will be set with the `accumulate_grad_batches` argument passed via the Lightning Trainer.
"""

OVERFLOW_MONITOR = """  File "~/gpt-neox/megatron/utils.py", line 353, in check
    raise Exception(
Exception: Skipped 50 iterations in a row due to Overflow - Exiting training.
"""

MEGATRON_ROWS_NO_SKIPS = "\n".join(
    f" iteration {i:>8}/  100000 | consumed samples: {i * 8:>10} | elapsed time per iteration (ms): 4247.9 | "
    f"lm loss: 2.1{i % 10}E+00 | loss scale: 65536.0 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    for i in range(5426, 5431))

ABORTED_AFTER_WAIT_TIMEOUT = ("NCCL communicator was aborted on rank 1. Original reason for failure was: Work: "
                              "WorkNCCL(OpType=ALLREDUCE, TensorShape=[1], Timeout(ms)=2000) timed out in call to wait().\n")


@pytest.mark.parametrize("text, label, evidence", [
    (REMOVAL_RACE, "python_exception", "FileNotFoundError"),
    (MISSING_INPUT, "launcher_error", "FileNotFoundError"),
    (NCCL_BIND, "nccl_error", "Call to bind failed"),
    (C10D_STORE_PORT, "launcher_error", "errno: 98"),
    (NCCL_CONNECT, "nccl_error", "socketStartConnect"),
    (WATCHDOG_FRAMES, "nccl_timeout", "WorkNCCL::checkTimeout"),
    (LIGHTNING_REFUSED, "config_rejected", "MisconfigurationException"),
    (OVERFLOW_MONITOR, "loss_scale_overflow", "in a row due to Overflow"),
    (ABORTED_AFTER_WAIT_TIMEOUT, "nccl_timeout", "timed out in call to wait"),
], ids=["removal-race", "missing-input", "nccl-bind", "c10d-store-port", "nccl-connect", "watchdog-frames",
        "lightning-refused", "overflow-monitor", "aborted-after-wait-timeout"])
def test_fresh_round_rule_names_the_failure(text, label, evidence):
    d = diagnose(text, exit_code=1)
    assert d.label == label, d.reason
    assert any(evidence in e for e in d.evidence), d.evidence


@pytest.mark.parametrize("text", [NCCL_RETRY_INFO, WATCHDOG_HEALTHY, MEGATRON_ROWS_NO_SKIPS],
                         ids=["nccl-retry-info", "watchdog-options", "megatron-rows-no-skips"])
def test_fresh_round_look_alikes_stay_healthy(text):
    d = diagnose(text)
    assert d.label == "healthy", d.reason


def test_nccl_bind_failure_is_not_also_a_launcher_error():
    """NCCL's own socket is not the launcher's store: the port clash inside a running job is no launcher evidence."""
    d = diagnose(NCCL_BIND, exit_code=1)
    assert "launcher_error" not in d.secondary, d.secondary
