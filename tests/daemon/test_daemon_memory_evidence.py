"""The daemon's CUDA OOM path with the planner (issue 21): the fake job (real processes, files, SQLite) dies
with torch's OOM message; on a (stubbed) H200 host the memory decision is re-planned and stored with its
evidence, the relaunched config carries the change, and the run completes."""

from __future__ import annotations

from uls_daemon_helpers import fake_spec, run_until

from ulyssesd.daemon.operator import ctl_plan
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.training.planner import Cluster

DONE = (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED)


def test_cuda_oom_decision_is_replanned_and_names_its_evidence(tmp_path, make_sup, monkeypatch):
    monkeypatch.setattr(ctl_plan, "detect_local_cluster",
                        lambda nnodes, nproc: Cluster.preset("h200-141g", gpus_per_node=nproc, nodes=nnodes))
    spec = fake_spec(tmp_path, steps=20, interval=5, faults=[{"kind": "cuda_oom", "at_step": 7}])
    spec.write_text(spec.read_text().replace("micro_batch_size = 1", "micro_batch_size = 4"))
    ev: list[str] = []
    sup = make_sup(spec, ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=90)
    assert sup.state == RunState.COMPLETED, ev
    assert len(sup.store.list_attempts(sup.run_id)) == 2
    [inc] = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "cuda_oom"]
    actions = sup.store.list_actions(incident_id=inc.id)
    memory = [a for a in actions if (a.parameters or {}).get("ladder") == "memory"]
    assert memory, [a.parameters for a in actions]
    params = memory[0].parameters
    # Not the blind ladder's first rung (the persistence threshold): the cause's rung, with its evidence.
    assert params["rung"] != "raise_persistence_threshold", params
    assert params["evidence"]["oom"]["requested_gib"] == 25.96 and params["evidence"]["cause"] in (
        "activations", "model_states")
    assert "re-planned" in params["reason"] and "25.96 GiB" in params["reason"]
    # The tiny model was predicted to fit at micro-batch 4 and the message has no allocator numbers: the
    # change is made, and the decision says it is no prediction.
    assert "not a prediction" in params["reason"]
    assert memory[0].config_diff == {"train.micro_batch_size": [4, 2], "train.gradient_accumulation_steps": [1, 2]}


def test_memory_spike_decision_uses_the_planner_and_never_stops_a_healthy_run(tmp_path, make_sup, monkeypatch):
    """A memory spike (no crash) to 134 of 139.8 GiB on a (stubbed) H200: the daemon hands the engine its
    replanner for spikes too. The planner's tiny-model plan cannot explain 134 GiB, so no change is predicted to
    fit: the incident says so (alert, no config change, no restart) and the run completes."""
    monkeypatch.setattr(ctl_plan, "detect_local_cluster",
                        lambda nnodes, nproc: Cluster.preset("h200-141g", gpus_per_node=nproc, nodes=nnodes))
    spec = fake_spec(tmp_path, steps=24, interval=5, detectors={"device_memory_gib": 139.8},
                     remediation={"grace_steps": 2, "severe_grace_steps": 1},
                     faults=[{"kind": "memory_spike", "at_step": 8, "steps": 6, "magnitude": 133.0}])
    ev: list[str] = []
    sup = make_sup(spec, ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=90)
    assert sup.state == RunState.COMPLETED, ev
    assert len(sup.store.list_attempts(sup.run_id)) == 1   # no restart
    [inc] = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "memory_spike"]
    [act] = sup.store.list_actions(incident_id=inc.id)
    params = act.parameters
    assert params["rung"] == "alert" and params["apply"] == "none" and not act.config_diff, params
    assert "no blind change" in params["reason"] and "peak 134.00 GiB" in params["reason"]
    assert params["evidence"]["spike"]["max_allocated_gib"] == 134.0 and "plan" in params["evidence"]


# torch's message of the H200 spike (bench/results/gpu_call13_raw.tgz): 138.14 GiB allocated, far above the
# fake job's steady 1 GiB per step.
SPIKE_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of "
             "139.80 GiB of which 339.06 MiB is free. Including non-PyTorch memory, this process has 139.46 GiB memory "
             "in use. Of the allocated memory 138.14 GiB is allocated by PyTorch, and 38.71 MiB is reserved by PyTorch "
             "but unallocated.")


def test_transient_oom_relaunches_unchanged_then_skips_a_recurrence_at_the_same_step(tmp_path, make_sup, monkeypatch):
    """A spike OOM in step 7 after six steady steps, on attempts 1 and 2: attempt 2 is the same config (no new
    version, no change), the recurrence in the same step skips that step's batch from the latest checkpoint
    (step 5), attempt 3 completes: 2 restarts, each action naming its evidence in the store."""
    monkeypatch.setattr(ctl_plan, "detect_local_cluster",
                        lambda nnodes, nproc: Cluster.preset("h200-141g", gpus_per_node=nproc, nodes=nnodes))
    spec = fake_spec(tmp_path, steps=12, interval=5,
                     faults=[{"kind": "cuda_oom", "at_step": 7, "attempts": [1, 2]}])
    spec.write_text(spec.read_text().replace('"FAKEJOB_STEP_S"', f'"FAKEJOB_OOM_MESSAGE" = "{SPIKE_OOM}", "FAKEJOB_STEP_S"'))
    ev: list[str] = []
    sup = make_sup(spec, ev)
    sup.start()
    run_until(sup, lambda s: s.state in DONE, timeout=90)
    assert sup.state == RunState.COMPLETED, ev
    attempts = sup.store.list_attempts(sup.run_id)
    assert len(attempts) == 3 and attempts[0].config_version == attempts[1].config_version, attempts
    incidents = [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "cuda_oom"]
    acts = [a for i in incidents for a in sup.store.list_actions(incident_id=i.id)
            if (a.parameters or {}).get("ladder") == "memory"]
    assert [a.parameters["rung"] for a in acts] == ["relaunch_unchanged", "rollback_skip"], [a.parameters for a in acts]
    first, second = acts
    assert first.kind.value == "restart" and not first.config_diff
    assert "peaked at 1.0 GiB" in first.parameters["reason"] and "transient; relaunching unchanged" in first.parameters["reason"]
    assert first.parameters["evidence"]["cause"] == "transient" and first.parameters["evidence"]["oom"]["allocated_gib"] == 138.14
    assert second.kind.value == "rollback_skip" and second.parameters["rollback_to_step"] == 5
    assert second.config_diff == {"data.skip_ranges": [[], [[6, 7]]]}, second.config_diff   # step 7's sample
    assert second.parameters["evidence"]["cause"] == "step_driven"
