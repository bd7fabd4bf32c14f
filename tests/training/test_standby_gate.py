"""The job side of a warm standby (training/standby.py): the gate file is parsed with bounds, the wait is
bounded, and a preloaded checkpoint is served to DeepSpeed's own TorchCheckpointEngine bit for bit — or not
at all when it is of another tag, no longer the file on disk, or does not match its manifest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ulyssesd.training import checkpoint as ckpt
from ulyssesd.training import standby
from ulyssesd.training.standby import Preload, StandbyError, read_gate, wait_at_gate


def _tag(root: Path, step: int, seed: int) -> Path:
    """A checkpoint tag with ZeRO-3-named shards of two ranks, its manifest, and `latest` pointing at it."""
    g = torch.Generator().manual_seed(seed)
    d = root / ckpt.tag_for_step(step)
    d.mkdir(parents=True)
    for rank in (0, 1):
        torch.save({"module": {"w": torch.randn(64, 64, generator=g, dtype=torch.float32),
                               "b": torch.randn(64, generator=g).to(torch.bfloat16)}, "ulyssesd_step": step},
                   d / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {"exp_avg": torch.randn(4096, generator=g)}},
                   d / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    ckpt.write_manifest(d, step, 1.0, step, 1)
    ckpt.point_latest_to(root, d.name)
    return d


class _Engine:
    def __init__(self):
        self.checkpoint_engine = TorchCheckpointEngine()


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bit for bit
    return a == b


def test_gate_file_is_parsed_with_bounds_and_names_what_is_wrong(tmp_path):
    gate = tmp_path / "gate.json"
    assert read_gate(gate) is None  # closed
    gate.write_text(json.dumps({"v": 1, "attempt": 3, "config": "/r/configs/v2.json", "config_version": 2}))
    assert read_gate(gate) == standby.Gate(3, Path("/r/configs/v2.json"), 2)
    gate.write_text("{not json")
    with pytest.raises(StandbyError, match="is not valid JSON"):
        read_gate(gate)
    gate.write_text(json.dumps({"attempt": "3", "config": "", "config_version": 0}))
    with pytest.raises(StandbyError, match=r"'attempt' must be a positive integer.*'config' must be.*'config_version'"):
        read_gate(gate)
    gate.write_text(json.dumps([1]))
    with pytest.raises(StandbyError, match="must be a JSON object"):
        read_gate(gate)
    gate.write_text(" " * (standby.MAX_GATE_BYTES + 1))
    with pytest.raises(StandbyError, match="larger than"):
        read_gate(gate)


def test_preload_is_served_bit_exact_through_deepspeeds_checkpoint_engine(tmp_path):
    root = tmp_path / "checkpoints"
    d = _tag(root, 4, seed=1)
    pre = Preload.read(root, rank=0)
    assert pre is not None and pre.tag == d.name
    assert sorted(Path(p).name for p in pre.files) == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                      "zero_pp_rank_0_mp_rank_00_model_states.pt"]  # its own only
    eng, events, nbytes = _Engine(), [], pre.nbytes
    with pre.serve(eng, root, d.name, lambda name, **f: events.append((name, f))):
        got = {p.name: eng.checkpoint_engine.load(str(p), map_location="cpu") for p in sorted(d.glob("*.pt"))}
    assert "load" not in vars(eng.checkpoint_engine)  # the engine's own load again
    for name, sd in got.items():
        assert _same(sd, torch.load(d / name, map_location="cpu", weights_only=False)), name
    (name, fields), = events
    assert name == "standby_preload_used" and fields["tag"] == d.name and fields["preloaded_bytes"] == nbytes > 0
    assert (fields["from_memory"], fields["from_disk"]) == (2, 2)  # rank 0's two shards; rank 1's from disk
    assert pre.files == {}  # host memory released after the load


def test_a_preload_of_another_tag_or_a_replaced_file_is_never_used(tmp_path):
    root = tmp_path / "checkpoints"
    old = _tag(root, 4, seed=1)
    pre = Preload.read(root, rank=0)
    new = _tag(root, 8, seed=2)
    assert not pre.still_latest()
    eng, events = _Engine(), []
    with pre.serve(eng, root, new.name, lambda name, **f: events.append(name)):
        sd = eng.checkpoint_engine.load(str(new / "zero_pp_rank_0_mp_rank_00_model_states.pt"), map_location="cpu")
    assert events == ["standby_preload_dropped"] and sd["ulyssesd_step"] == 8

    # Same tag name, file rewritten after the preload (a rolled-back timeline saved it again): disk wins.
    pre = Preload.read(root, rank=0)
    f = new / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"module": {}, "ulyssesd_step": 99}, f)
    with pre.serve(eng, root, new.name, lambda name, **kw: events.append(kw)):
        assert eng.checkpoint_engine.load(str(f), map_location="cpu")["ulyssesd_step"] == 99
    assert events[-1]["from_memory"] == 0 and events[-1]["from_disk"] == 1
    assert old.is_dir()

    # Bytes that do not match the manifest are not preloaded at all.
    (root / "latest").write_text(old.name)
    shard = old / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(raw))
    assert Preload.read(root, rank=0) is None


def test_checksums_checked_by_every_standby_rank_spare_the_second_hash_only_while_nothing_changed(tmp_path):
    root, run_dir = tmp_path / "checkpoints", tmp_path
    d = _tag(root, 4, seed=1)
    (d / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script: no rank owns it, rank 0 checks it\n")
    ckpt.write_manifest(d, 4, 1.0, 4, 1)

    def ready(rank):
        pre = Preload.read(root, rank)
        standby._write_ready(run_dir, 2, rank, {"verified": {"tag": pre.tag, "files": pre.verified}})
        return pre

    pre0 = ready(0)
    assert "zero_to_fp32.py" in pre0.verified and all("zero_pp_rank_0_" in Path(p).name for p in pre0.files)
    assert standby.verified_newest(root, run_dir, 2, world=2) is None  # rank 1 has not said so yet
    ready(1)
    got = pre0.verified_files(root, run_dir, 2, world=2)
    assert got is not None and got[0] == d.name == pre0.verified_in_standby and got[1] == got[2]
    assert standby.verified_newest(root, run_dir, 3, world=2) is None  # another attempt's standby
    f = d / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes())  # rewritten after the check (same bytes, new mtime): hash again
    assert standby.verified_newest(root, run_dir, 2, world=2) is None
    ready(1)
    assert standby.verified_newest(root, run_dir, 2, world=2) == d.name
    _tag(root, 8, seed=2)  # a newer tag nobody checked
    assert standby.verified_newest(root, run_dir, 2, world=2) is None


def test_wait_is_bounded_preloads_a_tag_that_appears_and_returns_the_gate(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    root.mkdir()
    gate = tmp_path / "standby" / "gate-2.json"
    monkeypatch.setenv(standby.TIMEOUT_ENV, "5")
    monkeypatch.setenv(standby.PRELOAD_ENV, "1")
    monkeypatch.setenv(standby.CKPT_DIR_ENV, str(root))
    monkeypatch.setenv(standby.DEVICE_ENV, "cpu")
    monkeypatch.setenv("RANK", "1")
    now = [0.0]

    def sleep(s):
        now[0] += 1.0
        if now[0] == 2.0:
            _tag(root, 4, seed=1)  # the running attempt saves while the standby waits
        if now[0] == 4.0:
            gate.parent.mkdir(exist_ok=True)
            gate.write_text(json.dumps({"attempt": 2, "config": "c.json", "config_version": 3}))

    got, pre = wait_at_gate(gate, tmp_path, 2, clock=lambda: now[0], sleep=sleep)
    assert got == standby.Gate(2, Path("c.json"), 3)
    assert pre is not None and pre.tag == "step-00000004" and all("zero_pp_rank_1_" in p for p in pre.files)
    ready = json.loads((tmp_path / "standby" / "attempt-2-rank-1.ready").read_text())
    # Rewritten when the tag appeared: what it checked is what rank 0 may rely on after the gate.
    assert ready["device"] == "cpu" and ready["preloaded"] == ready["verified"]["tag"] == "step-00000004"

    now[0] = 0.0
    gate.unlink()
    with pytest.raises(StandbyError, match=r"was not opened within 5s \(ULYSSESD_STANDBY_TIMEOUT_S\)"):
        wait_at_gate(gate, tmp_path, 2, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + 1.0))
    gate.write_text(json.dumps({"attempt": 7, "config": "c.json", "config_version": 3}))
    with pytest.raises(StandbyError, match="opens attempt 7, this standby is attempt 2"):
        wait_at_gate(gate, tmp_path, 2, clock=lambda: now[0], sleep=lambda s: None)


def _big_tag(root: Path, step: int, model_floats: int) -> Path:
    """A tag whose rank-0 model shard is `model_floats` float32 (in 8 tensors) and whose rank-0 optimizer shard
    is small; rank 1's shards are small. `latest` points at it."""
    g = torch.Generator().manual_seed(step)
    d = root / ckpt.tag_for_step(step)
    d.mkdir(parents=True)
    torch.save({"module": {f"w{i}": torch.randn(model_floats // 8, generator=g) for i in range(8)},
                "ulyssesd_step": step}, d / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    for name in ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                 "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        torch.save({"optimizer_state_dict": {"exp_avg": torch.randn(4096, generator=g)}}, d / name)
    ckpt.write_manifest(d, step, 1.0, step, 1)
    ckpt.point_latest_to(root, d.name)
    return d


def test_a_gate_opened_during_a_slow_preload_is_noticed_within_one_chunk(tmp_path, monkeypatch):
    import threading
    import time

    root, run_dir = tmp_path / "checkpoints", tmp_path
    d = _big_tag(root, 4, model_floats=2 << 20)  # 8 MiB model shard: 32 chunks of 256 KiB
    chunk_delay = 0.05
    monkeypatch.setattr(standby, "PRELOAD_CHUNK_BYTES", 256 << 10)
    monkeypatch.setenv(standby.CHUNK_DELAY_ENV, str(chunk_delay))  # a slow disk: the whole shard takes >= 1.6 s
    for k, v in {standby.TIMEOUT_ENV: "60", standby.PRELOAD_ENV: "1", standby.CKPT_DIR_ENV: str(root),
                 standby.DEVICE_ENV: "cpu", "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    standby._warm_imports()  # imported once here, so the wait below starts its preload at once
    gate = run_dir / "standby" / "gate-2.json"
    gate.parent.mkdir()
    opened: list[float] = []

    def open_gate():
        time.sleep(0.5)  # the small optimizer shard (one chunk) is done; the model shard is being read
        tmp = gate.with_suffix(".tmp")
        tmp.write_text(json.dumps({"attempt": 2, "config": "c.json", "config_version": 1}))
        os.replace(tmp, gate)
        opened.append(time.monotonic())

    opener = threading.Thread(target=open_gate)
    t0 = time.monotonic()
    opener.start()
    got, pre = wait_at_gate(gate, run_dir, 2)
    returned = time.monotonic()
    opener.join()
    noticed_s = returned - opened[0]
    print(f"gate noticed {noticed_s * 1000:.0f} ms after it opened (chunk {chunk_delay * 1000:.0f} ms + read), "
          f"wait {returned - t0:.2f}s, full shard >= {32 * chunk_delay:.1f}s")
    assert got.attempt == 2
    assert noticed_s < chunk_delay + 0.5, noticed_s  # one chunk (+ a loaded box), not the rest of the shard
    assert returned - t0 < 32 * chunk_delay
    # Only whole verified files are held: the optimizer shard; the interrupted model shard is loaded from disk,
    # and the ready file does not vouch for it (rank 0 then hashes the tag itself).
    assert pre is not None and not pre.complete
    assert [Path(p).name for p in pre.files] == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert list(pre.verified) == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert standby.verified_newest(root, run_dir, 2, world=1) is None
    eng, events = _Engine(), []
    with pre.serve(eng, root, d.name, lambda name, **f: events.append((name, f))):
        got_sd = {p.name: eng.checkpoint_engine.load(str(p), map_location="cpu") for p in d.glob("*zero_pp_rank_0_*.pt")}
    for name, sd in got_sd.items():
        assert _same(sd, torch.load(d / name, map_location="cpu", weights_only=False)), name
    (name, fields), = events
    assert (fields["from_memory"], fields["from_disk"], fields["preload_complete"]) == (1, 1, False)


def test_a_load_served_from_the_preload_is_not_slower_than_from_disk(tmp_path):
    """The hardest case for a preload: the shard is in the page cache (just written). Each load is followed by
    what DeepSpeed does with it: a copy into buffers it already holds."""
    import time

    root = tmp_path / "checkpoints"
    d = _big_tag(root, 4, model_floats=64 << 20)  # a 256 MiB model shard
    shard = d / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    pre = Preload.read(root, rank=0)
    assert pre is not None and pre.complete and str(shard.resolve()) in pre.files
    dst = {k: torch.empty_like(v) for k, v in torch.load(shard, weights_only=False)["module"].items()}

    def timed(load) -> float:
        t0 = time.perf_counter()
        sd = load(str(shard), map_location="cpu")
        for k, v in sd["module"].items():
            dst[k].copy_(v)
        return time.perf_counter() - t0

    disk_engine, eng = TorchCheckpointEngine(), _Engine()
    served, disk = [], []
    with pre.serve(eng, root, d.name, lambda name, **f: None):
        for _ in range(4):  # interleaved, best of each: the box is shared
            served.append(timed(eng.checkpoint_engine.load))
            disk.append(timed(disk_engine.load))
        sd = eng.checkpoint_engine.load(str(shard), map_location="cpu")
        assert _same(sd, torch.load(shard, map_location="cpu", weights_only=False))  # bit for bit
    gib = shard.stat().st_size / 2**30
    print(f"{gib:.2f} GiB shard: preload {pre.seconds:.2f}s (read + sha256), load + copy from the preload "
          f"{min(served):.3f}s, from disk (page cache) {min(disk):.3f}s")
    assert min(served) <= 1.10 * min(disk), (served, disk)
