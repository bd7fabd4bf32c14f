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


# ------------------------------------------------------------------------- third round (corpus_24.txt, train part)
TRITON_MISALIGNED = """@helion.kernel(config=helion.Config(block_sizes=[64, 16, 16], num_warps=4), static_shapes=True)
RuntimeError: Triton Error [CUDA]: misaligned address
"""

CPU_ALLOCATOR_WINDOWS = ("RuntimeError: [enforce fail at ..\\c10\\core\\CPUAllocator.cpp:72] data. DefaultCPUAllocator: "
                         "not enough memory: you tried to allocate 113246208 bytes. Buy new RAM!\n")

GLUON_WORKER_TIMEOUT = """Worker timed out after 120 seconds. This might be caused by

            - Slow transform. Please increase timeout to allow slower data loading in each worker.
TimeoutError                              Traceback (most recent call last)
"""

PACKED_WORKER_TRACEBACK = ("    raise batch.exc_type(batch.exc_msg)\n"
                           "KeyError: 'Traceback (most recent call last):\\n  File \"/usr/lib/torch/utils/data/dataloader.py\", "
                           "line 57, in _worker_loop\\n    samples = collate_fn([dataset[i] for i in batch_indices])\\n"
                           "KeyError: \\'height\\'\\n'\n")

FAIRSEQ_MIN_SCALE = """| WARNING: overflow detected, setting loss scale to: 0.000244140625
| WARNING: overflow detected, setting loss scale to: 0.0001220703125
FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. Try lowering the learning rate.
"""

STORE_WORKERS_TIMEOUT = "torch.distributed.DistStoreError: Timed out after 6 seconds waiting for workers. 1/2 workers joined.\n"


@pytest.mark.parametrize("text, label, evidence", [
    (TRITON_MISALIGNED, "illegal_memory_access", "misaligned address"),
    (CPU_ALLOCATOR_WINDOWS, "host_oom_killed", "not enough memory"),
    (GLUON_WORKER_TIMEOUT, "dataloader_crash", "Worker timed out after 120 seconds"),
    (PACKED_WORKER_TRACEBACK, "dataloader_crash", "_worker_loop"),
    (FAIRSEQ_MIN_SCALE, "loss_scale_min", "Minimum loss scale reached"),
    (STORE_WORKERS_TIMEOUT, "launcher_error", "DistStoreError"),
], ids=["triton-misaligned", "cpu-allocator-windows", "gluon-worker-timeout", "packed-worker-traceback",
        "fairseq-min-scale", "store-workers-timeout"])
def test_third_round_rule_names_the_failure(text, label, evidence):
    d = diagnose(text, exit_code=1)
    assert d.label == label, d.reason
    assert any(evidence in e for e in d.evidence), d.evidence


# Look-alikes: the fp16 config's min_loss_scale, a DataLoader frame inside a progressing log, an address that is
# merely aligned, a store that is still waiting (a log line, not an error).
MIN_SCALE_CONFIG = STEPS + """
[INFO] [config.py:1000:print]   dynamic_loss_scale_args ...... {'init_scale': 65536, 'scale_window': 1000, 'min_scale': 1}
  "min_loss_scale": 1, "loss_scale_window": 1000,
"""

WORKER_FRAME_IN_PROGRESS = """  File "/usr/lib/python3.10/site-packages/torch/utils/data/_utils/worker.py", line 287, in _worker_loop
""" + STEPS

STORE_WAITING = STEPS + """
[I socket.cpp:480] [c10d] waiting for workers to join the store: 1/2 workers joined
"""


@pytest.mark.parametrize("text", [MIN_SCALE_CONFIG, WORKER_FRAME_IN_PROGRESS, STORE_WAITING],
                         ids=["min-scale-config", "worker-frame-in-progress", "store-waiting"])
def test_third_round_look_alikes_stay_healthy(text):
    d = diagnose(text)
    assert d.label == "healthy", d.reason
