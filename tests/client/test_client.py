"""ulyssesd.client without a daemon: import without torch, the Reporter's bounds, Control on a real torch
optimizer and scheduler, manifests of a foreign checkpoint directory, and the signal handlers in a real
process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ulyssesd.client import Control, Reporter, ReporterConfig, validate_manifest, write_manifest

BLOCK_TORCH = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "deepspeed", "numpy", "transformers"):
                raise ImportError(f"blocked import of {name}")
    sys.meta_path.insert(0, Block())
""")


def test_client_imports_and_reports_without_torch(tmp_path):
    code = BLOCK_TORCH + textwrap.dedent(f"""
        import ulyssesd.client as c
        rep = c.Reporter({str(tmp_path / 't.jsonl')!r}, rank=0)
        rep.step(1, 2.0)
        rep.close()
        ctl = c.Control(None, {str(tmp_path / 'control.json')!r})
        ctl.poll()
        assert "torch" not in sys.modules and "deepspeed" not in sys.modules
        print("ok")
    """)
    # Proof the blocker works: importing torch under it fails.
    bad = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import torch"], capture_output=True, text=True)
    assert bad.returncode != 0 and "blocked import of torch" in bad.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert json.loads((tmp_path / "t.jsonl").read_text())["loss"] == 2.0


# ------------------------------------------------------------------------------------ Reporter
class _StalledDiskReporter(Reporter):
    """A Reporter whose disk stalls: every batch write blocks until `release` is set."""

    release = threading.Event()

    def _write(self, fh, batch):
        self.release.wait(30)
        return super()._write(fh, batch)


def test_reporter_never_blocks_on_a_stalled_disk_and_counts_what_it_dropped(tmp_path):
    path = tmp_path / "t.jsonl"
    rep = _StalledDiskReporter(path, rank=0, config=ReporterConfig(queue_size=50, flush_interval_s=0.01))
    t0 = time.perf_counter()
    for i in range(2000):
        rep.step(i, 1.0)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"2000 steps took {elapsed:.2f}s with the disk stalled"
    # The writer holds at most one batch, the queue 50: the rest was dropped, not waited for.
    assert rep.dropped >= 2000 - 50 - 4096
    assert rep.dropped > 0
    rep.release.set()
    rep.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    steps = [r for r in lines if r["kind"] == "step"]
    assert len(steps) == 2000 - rep.dropped
    assert [r["step"] for r in steps] == sorted(r["step"] for r in steps)
    assert any(r.get("event") == "telemetry_dropped" and r["dropped"] == rep.dropped for r in lines)


def test_reporter_events_are_on_disk_when_flush_returns_and_other_ranks_write_nothing(tmp_path):
    path = tmp_path / "t.jsonl"
    rep = Reporter(path, rank=0, attempt=4)
    rep.step(1, 1.5)
    rep.event("checkpoint_saved", 1, tag="x")
    assert rep.flush(5)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["step", "event"] and recs[0]["attempt"] == 4
    rep.close()
    rep.step(2, 1.0)  # after close: ignored, no error
    other = Reporter(tmp_path / "r1.jsonl", rank=1)
    other.step(1, 1.0)
    other.close()
    assert not (tmp_path / "r1.jsonl").exists()


def test_reporter_reads_tensor_values_and_the_daemons_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ULYSSESD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("ULYSSESD_ATTEMPT", "7")
    monkeypatch.setenv("RANK", "0")
    with Reporter() as rep:
        rep.step(3, torch.tensor(2.5), grad_norm=torch.tensor(float("nan")))
    rec = json.loads((tmp_path / "telemetry.jsonl").read_text())
    assert rec["loss"] == 2.5 and rec["grad_norm"] == "nan" and rec["attempt"] == 7
    monkeypatch.setenv("ULYSSESD_ATTEMPT", "seven")
    with pytest.raises(ValueError, match="ULYSSESD_ATTEMPT"):
        Reporter()


# ------------------------------------------------------------------------------------- Control
def _write_control(path, **doc):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def test_control_scales_a_scheduled_lr_absolutely_and_ignores_garbage(tmp_path):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # 1, 1/2, 1/3, ...
    path = tmp_path / "control.json"
    rep = Reporter(tmp_path / "t.jsonl", rank=0)
    ctl = Control(opt, path, reporter=rep, rank=0, world_size=1)
    lrs = []
    for step in range(1, 7):
        if step == 3:
            _write_control(path, version=1, lr_scale=0.5, gradient_clipping=0.25)
        if step == 5:
            _write_control(path, version=2, lr_scale=0.1)   # absolute: 0.1 of the schedule, not 0.05
        if step == 6:
            path.write_text("{garbage")                      # ignored: the last good state stays
        ctl.poll(step)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [1.0, 1 / 2, 0.5 / 3, 0.5 / 4, 0.1 / 5, 0.1 / 6]
    assert lrs == pytest.approx(expected)
    assert ctl.clip(default=1.0) == 0.25 and not ctl.suspect
    _write_control(path, version=3, suspect=True)
    ctl.poll(7)
    assert ctl.suspect and ctl.clip(default=1.0) == 0.25  # absent key = no change
    rep.close()
    events = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [e["control_version"] for e in events] == [1, 2, 3]
    assert events[0]["gradient_clipping"] == 0.25 and events[1]["lr_scale"] == 0.1


def test_control_without_file_changes_nothing(tmp_path):
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.3)
    ctl = Control(opt, tmp_path / "absent.json", rank=0, world_size=1)
    assert ctl.poll(1) is None and opt.param_groups[0]["lr"] == 0.3 and ctl.clip(2.0) == 2.0


# ------------------------------------------------------------------------------------ manifest
def test_manifest_of_a_foreign_checkpoint_directory(tmp_path):
    ck = tmp_path / "checkpoint-500"  # an HF Trainer directory name, not a ulyssesd tag
    (ck / "sub").mkdir(parents=True)
    (ck / "model.safetensors").write_bytes(b"w" * 1000)
    (ck / "sub" / "optimizer.pt").write_bytes(b"o" * 10)
    m = write_manifest(ck, 500, loss=2.5)
    assert m["step"] == 500 and set(m["files"]) == {"model.safetensors", "sub/optimizer.pt"}
    assert validate_manifest(ck) == (True, "ok")
    data = bytearray((ck / "model.safetensors").read_bytes())
    data[10] ^= 1  # a bit flip: sizes still match, the checksum does not
    (ck / "model.safetensors").write_bytes(bytes(data))
    assert validate_manifest(ck, verify_checksums=False) == (True, "ok")
    ok, reason = validate_manifest(ck)
    assert not ok and "model.safetensors" in reason and "sha256" in reason
    (ck / "manifest.json").unlink()
    ok, reason = validate_manifest(ck)
    assert not ok and "no manifest" in reason


# ------------------------------------------------------------------------------------- signals
def test_sigterm_sets_the_stop_flag_and_sigusr1_dumps_stacks_to_the_rank_file(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from ulyssesd.client import install_signal_handlers
        stop = install_signal_handlers({str(tmp_path)!r}, attempt=3, rank=0)
        print("ready", flush=True)
        t0 = time.time()
        while not stop.requested and time.time() - t0 < 30:
            time.sleep(0.01)   # the training loop: a step, then check the flag
        print("stopping", stop.signum, flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGUSR1)
    stack_file = tmp_path / "stacks" / "attempt-3-rank-0.txt"
    deadline = time.time() + 10
    while time.time() < deadline and "<string>" not in (stack_file.read_text() if stack_file.exists() else ""):
        time.sleep(0.05)
    assert p.poll() is None, "SIGUSR1 must not stop the job"
    assert "<string>" in stack_file.read_text()  # the main thread's frame, in the loop
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0 and out.strip() == f"stopping {int(signal.SIGTERM)}"
