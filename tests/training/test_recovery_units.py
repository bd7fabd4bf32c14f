"""The host tier's manifest and verification, the save gate's decisions, the recovery options (no processes)."""

from __future__ import annotations

import pytest
import torch

from ulyssesd.training.recovery.host_tier import HostTier
from ulyssesd.training.recovery.save_gate import GateInput, decide, gate_fields, staging, wants_deferral
from ulyssesd.training.spec import SpecError, job_spec_from_dict


def _tier_with(files: dict) -> HostTier:
    tier = HostTier(rank=0)
    tier.tag, tier.step, tier.files, tier.meta = "step-00000004", 4, files, {"loss": 1.0}
    tier._digest()
    return tier


def test_a_complete_snapshot_verifies_and_a_changed_byte_is_caught() -> None:
    state = {"optimizer_state_dict": {"fp32": torch.arange(1000, dtype=torch.float32), "step": torch.tensor(3.0)},
             "ds_version": "x"}
    tier = _tier_with({"zero_pp_rank_0_mp_rank_00_optim_states.pt": state})
    assert tier.restorable() is None
    assert tier.verify() is None
    assert tier.nbytes == 1000 * 4 + 4
    state["optimizer_state_dict"]["fp32"][17] += 1.0   # one value changed in memory after the manifest
    why = tier.verify()
    assert why is not None and "changed in memory" in why and "optim_states" in why


def test_a_snapshot_without_a_manifest_is_not_restorable() -> None:
    tier = HostTier(rank=1)
    assert tier.restorable() == "no snapshot in host memory"
    tier.tag, tier.files = "step-00000002", {"a.pt": {"t": object()}}
    tier._digest_error, tier.manifest = "ValueError: boom", None
    assert "manifest of step-00000002 failed" in (tier.restorable() or "")


def test_missing_file_in_memory_is_caught() -> None:
    tier = _tier_with({"a.pt": {"t": torch.ones(4)}, "b.pt": {"t": torch.zeros(2)}})
    del tier.files["b.pt"]
    assert "b.pt is in the manifest but not in memory" in (tier.verify() or "")


@pytest.mark.parametrize(("g", "want"), [
    (GateInput(False, None, True, True), None),                      # synchronous saves: nothing to defer
    (GateInput(True, "ready", False, True), None),                   # pool ready, nothing in flight
    (GateInput(True, "filling (1.0 of 4.0 GB registered)", False, True), "the snapshot pool is filling"),
    (GateInput(True, "ready", True, True), "the previous save is still being written"),
    (GateInput(True, "refused: no room", False, True), None),        # never ready: waiting would not help
    (GateInput(True, None, False, False), None),                     # CPU: plain host memory
])
def test_what_makes_a_rank_want_to_defer(g: GateInput, want: str | None) -> None:
    got = wants_deferral(g)
    assert (got is None) == (want is None)
    if want is not None:
        assert got is not None and got.startswith(want)


def test_the_gate_defers_within_its_budget_and_never_the_final_save() -> None:
    busy = [None, "the snapshot pool is filling (1 of 2 GB registered)"]
    assert decide(busy, deferred_steps=0, max_defer=5, final=False) == (True, f"rank 1: {busy[1]}")
    assert decide(busy, deferred_steps=4, max_defer=5, final=False)[0] is True
    assert decide(busy, deferred_steps=5, max_defer=5, final=False)[0] is False   # the budget is spent
    assert decide(busy, deferred_steps=0, max_defer=5, final=True)[0] is False    # last / SIGTERM save
    assert decide(busy, deferred_steps=0, max_defer=0, final=False)[0] is False   # deferral off
    assert decide([None, None], deferred_steps=3, max_defer=5, final=False) == (False, None)


def test_staging_and_the_fields_the_save_event_carries() -> None:
    assert staging(GateInput(True, "ready", False, True)) == "pool"
    assert staging(GateInput(True, "filling (x)", False, True)) == "pinned"
    assert staging(GateInput(True, None, False, False)) == "memory"
    assert staging(GateInput(False, None, False, True)) == "sync"
    assert gate_fields("pool", 10, 3, "rank 0: x") == {"staging": "pool", "due_step": 10, "deferred_steps": 3,
                                                        "not_ready": "rank 0: x"}
    assert gate_fields("pool", 10, 0, None) == {"staging": "pool"}


@pytest.mark.parametrize(("ck", "needle"), [
    ({"memory_interval_steps": 5}, "checkpoint.memory_interval_steps=5 needs checkpoint.memory_tier = true"),
    ({"in_process_restart": True}, "checkpoint.in_process_restart = true needs checkpoint.memory_tier = true"),
    ({"memory_tier": True, "memory_interval_steps": -1}, "memory_interval_steps"),
    ({"memory_tier": True, "in_process_max_restarts": 0}, "in_process_max_restarts"),
])
def test_recovery_options_are_validated_with_the_key_named(ck: dict, needle: str) -> None:
    with pytest.raises((SpecError, ValueError)) as err:
        job_spec_from_dict({"checkpoint": ck})
    assert needle in str(err.value)


def test_recovery_options_default_off() -> None:
    cs = job_spec_from_dict({}).checkpoint
    assert (cs.memory_tier, cs.memory_interval_steps, cs.in_process_restart, cs.save_defer_max_steps) == \
        (False, 0, False, 0)
