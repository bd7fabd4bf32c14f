"""Units of the host tier across processes (shm_tier.choose, ShmCopy on a temp dir) and of the mid-step
failure summary (group_restart): each decision shown for the case it must refuse and the case it must take."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ulyssesd.training.recovery.group_restart import failure_summary, is_collective_error
from ulyssesd.training.recovery.host_tier import HostTier
from ulyssesd.training.recovery.shm_tier import SHM_DIR_ENV, ShmCopy, choose, run_shm_dir, summary

S6, S8 = ("step-00000006", 6, 2, 5), ("step-00000008", 8, 2, 5)


@pytest.mark.parametrize("held, disk_step, load, want, needle", [
    ([[S6, S8], [S6, S8]], 5, "latest", "step-00000008", None),
    ([[S6, S8], [S6]], 5, "latest", "step-00000006", None),          # rank 1 died while writing step-8
    ([[S6, S8], []], 5, "latest", None, "rank(s) [1] hold no copy"),
    ([[S8], [S6]], 5, "latest", None, "no snapshot in common"),
    ([[S8], [S8]], 8, "latest", None, "not newer than the newest durable tag"),
    ([[S8], [S8]], 5, "step-00000005", None, "names the tag to load (a rollback)"),
    ([[("step-00000008", 8, 2, 7)]] * 2, 5, "latest", None, "set aside by a rollback"),
    ([[("step-00000008", 8, 4, 5)]] * 2, 5, "latest", None, "taken with 4 ranks"),
])
def test_which_shared_memory_copy_a_relaunch_takes(held, disk_step, load, want, needle) -> None:
    tag, why = choose(held, 2, disk_step, load)
    assert tag == want
    assert (why is None) if needle is None else (needle in str(why))


def _tier(step: int, value: float) -> HostTier:
    tier = HostTier(0)
    tier.tag, tier.step = f"step-{step:08d}", step
    tier.files = {"zero_pp_rank_0_mp_rank_00_optim_states.pt": {"w": torch.full((64,), value)}}
    tier._digest()
    return tier


def test_a_copy_round_trips_keeps_one_older_and_a_changed_byte_is_refused(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path / "shm"))
    run_dir = tmp_path / "run"
    shm = ShmCopy(run_dir, 0, 2, 1 << 30)
    for step in (2, 4, 6):
        shm.publish_async(_tier(step, float(step)), tmp_path / "no-checkpoints")
        shm.join()
        assert shm.last.get("tag") == f"step-{step:08d}", shm.last
    assert sorted(m["tag"] for m in shm.copies()) == ["step-00000004", "step-00000006"]   # two at most
    newest = max(shm.copies(), key=lambda m: m["step"])
    assert summary(newest) == ("step-00000006", 6, 2, 0)
    loaded = shm.load(newest)
    assert isinstance(loaded, HostTier) and loaded.verify() is None
    assert torch.equal(loaded.files["zero_pp_rank_0_mp_rank_00_optim_states.pt"]["w"], torch.full((64,), 6.0))
    # A copy whose bytes changed after its manifest is never trusted.
    path = shm.root / "step-00000006" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    obj = torch.load(path, weights_only=False)
    obj["w"][3] += 1.0
    torch.save(obj, path)
    why = shm.load(newest)
    assert isinstance(why, str) and "changed in memory" in why
    shm.clean()
    assert not run_shm_dir(run_dir).exists()


def test_a_copy_over_its_bound_is_skipped_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path / "shm"))
    shm = ShmCopy(tmp_path / "run", 0, 1, 100)
    shm.publish_async(_tier(2, 1.0), tmp_path)
    shm.join()
    assert "memory_shm_max_gib" in shm.last["skipped"] and shm.copies() == []


def test_who_failed_a_step_mid_way() -> None:
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2954")
    assert is_collective_error(peer) and not is_collective_error(ValueError("bad batch"))
    assert failure_summary([("RuntimeError: closed", True), ("InjectedFault: boom", False)]) == (
        [1], "rank 1: InjectedFault: boom")
    failed, why = failure_summary([("RuntimeError: closed", True)] * 2)
    assert failed == [] and "every rank" in why


def test_raise_mid_step_fires_once_on_its_rank_and_not_on_a_replay() -> None:
    from ulyssesd.training.faults import FaultInjector, InjectedFault
    from ulyssesd.training.spec import FaultSpec

    emitted: list[tuple] = []
    spec = [FaultSpec(kind="raise_mid_step", at_step=5, rank=1)]
    mine = FaultInjector(spec, 1, 1, 1, 0, torch.device("cpu"), lambda *a, **k: emitted.append(a))
    other = FaultInjector(spec, 0, 0, 1, 0, torch.device("cpu"), lambda *a, **k: None)
    mine.mid_step(4)
    other.mid_step(5)   # another rank only announces it
    with pytest.raises(InjectedFault, match="raise_mid_step"):
        mine.mid_step(5)
    mine.replayed_through = 5   # after an in-process restart, step 5 is redone
    mine.mid_step(5)
    assert emitted == [("raise_mid_step", 5)]
