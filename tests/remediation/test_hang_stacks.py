"""Reading faulthandler dumps of a hung attempt (remediation/hang_stacks.py)."""

from __future__ import annotations

import subprocess
import sys

from ulyssesd.remediation.hang_stacks import read_hang, read_rank

WAIT = '''Thread 0x00007f91310de6c0 (most recent call first):
  <no Python frame>

Current thread 0x00007f948af76140 (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 4000 in all_gather_into_tensor
  File "/site/deepspeed/comm/torch.py", line 220 in all_gather_into_tensor
  File "/site/ulyssesd/training/train.py", line 420 in _train_step_inner
'''
LOADER = '''Current thread 0x00007f2428460140 (most recent call first):
  File "/site/ulyssesd/training/data.py", line 150 in sample
  File "/site/ulyssesd/training/train.py", line 410 in _train_step_inner
'''


def test_waiting_rank_and_straggler():
    r = read_hang({0: WAIT, 1: LOADER})
    assert r.label == "nccl_timeout" and r.waited_for == (1,)
    assert "rank 0 wait inside a collective (/site/deepspeed/comm/torch.py:220 in all_gather_into_tensor)" in r.summary
    assert "rank 1 is outside any collective at /site/ulyssesd/training/data.py:150 in sample" in r.summary


PREFETCH = '''Thread 0x00007f2400001640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/queue.py", line 140 in put
  File "/site/ulyssesd/training/data/loader.py", line 70 in _fill
  File "/usr/lib/python3.11/threading.py", line 982 in run

'''


def test_the_data_prefetch_thread_is_not_taken_for_the_training_loop():
    r = read_hang({0: PREFETCH + WAIT, 1: PREFETCH + LOADER})
    assert r.label == "nccl_timeout" and r.waited_for == (1,)
    # The loop's innermost frame, not the prefetch thread's queue wait.
    assert r.ranks[0].where == "/site/torch/distributed/distributed_c10d.py:4000 in all_gather_into_tensor"
    assert r.ranks[1].where.endswith("data.py:150 in sample")


def test_no_rank_in_a_collective_is_not_a_communication_hang():
    r = read_hang({0: LOADER, 1: LOADER})
    assert r.label is None and r.waited_for == () and "no rank is inside a collective" in r.summary


def test_all_ranks_waiting_names_no_straggler_and_mixed_log_is_unattributed():
    assert read_hang({0: WAIT, 1: WAIT}).waited_for == ()
    mixed = read_hang(None, unattributed=LOADER + WAIT)
    assert mixed.label == "nccl_timeout" and mixed.ranks[0].rank is None and "the ranks wait" in mixed.summary
    assert read_hang(None, "").label is None


def test_a_real_faulthandler_dump_is_parsed(tmp_path):
    # A real dump (faulthandler's own format) of a process whose main thread waits in a function named like
    # a collective, while a helper thread sleeps.
    script = tmp_path / "dump.py"
    script.write_text(
        "import faulthandler, sys, threading, time\n"
        "def barrier():\n    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "barrier()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30).stdout
    rank = read_rank(out, 3)
    assert rank.in_collective and rank.where.endswith("in barrier"), out
