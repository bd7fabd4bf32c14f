"""Continue on fewer nodes when a node is lost with no spare (daemon/job/elastic.py): the pure decision (layout that
keeps the global batch, SP only where heads and sequence divide, the planner's verdict) and the supervisor with a
fake Slurm (shrink → incident with before/after, config version, the next job on fewer nodes; does not fit → FAILED
with the explanation; grow back when the operator allows it and the node is in service)."""

from __future__ import annotations

from pathlib import Path

from test_slurm_faults import FakeSlurm, WatcherOS, _emit, _slurm_sup, _watcher_ran

from ulyssesd.daemon.host.process import ExitStatus
from ulyssesd.daemon.job import elastic
from ulyssesd.daemon.job import slurm as sl
from ulyssesd.daemon.job.slurm_watch import WatchPlan
from ulyssesd.daemon.store.enums import RunState

S = RunState
FITS = elastic.Replan(True, "fits: GPU 10.0 of 80.0 GiB")
L3 = elastic.Layout(nnodes=3, nproc_per_node=1, sp=1, micro_batch=1, accum=2)  # global batch 6


# ------------------------------------------------------------------------------------------- the decision
def test_the_layout_on_fewer_nodes_keeps_the_global_batch_through_accumulation():
    after = elastic.choose_layout(L3, 2, heads=4, seq_len=64)
    assert after == elastic.Layout(2, 1, 1, 1, 3) and after.global_batch == L3.global_batch == 6
    # a micro-batch never grows; it shrinks where the per-rank share needs it (global 8 on DP 3 -> no; on DP 2 -> 4)
    big = elastic.Layout(4, 1, 1, 4, 1)
    assert elastic.choose_layout(big, 2, heads=4, seq_len=64) == elastic.Layout(2, 1, 1, 4, 2)
    assert elastic.choose_layout(elastic.Layout(4, 1, 1, 3, 1), 3, heads=4, seq_len=64) == elastic.Layout(3, 1, 1, 2, 2)


def test_sp_is_kept_or_lowered_only_to_a_degree_that_divides_world_heads_and_sequence():
    sp4 = elastic.Layout(nnodes=2, nproc_per_node=4, sp=4, micro_batch=1, accum=1)   # world 8, DP 2, global 2
    assert elastic.choose_layout(sp4, 1, heads=8, seq_len=64).sp == 4              # world 4: SP 4 stays
    odd = elastic.Layout(nnodes=3, nproc_per_node=2, sp=2, micro_batch=1, accum=2)  # world 6, DP 3, global 6
    assert elastic.choose_layout(odd, 2, heads=4, seq_len=64) == elastic.Layout(2, 2, 2, 1, 3)
    three = elastic.Layout(nnodes=2, nproc_per_node=3, sp=6, micro_batch=1, accum=3)  # world 6, DP 1, global 3
    # 1 node = world 3: SP 6 impossible; 3 divides world, heads 6 and seq 48 -> SP 3, DP 1
    assert elastic.choose_layout(three, 1, heads=6, seq_len=48) == elastic.Layout(1, 3, 3, 1, 3)
    # heads 4 do not divide by 3: SP 1, DP 3 (global 3 on DP 3)
    assert elastic.choose_layout(three, 1, heads=4, seq_len=48) == elastic.Layout(1, 3, 1, 1, 1)


def test_a_global_batch_that_does_not_split_over_the_new_dp_stops_with_the_reason():
    odd = elastic.Layout(nnodes=3, nproc_per_node=1, sp=1, micro_batch=1, accum=1)  # global 3
    got = elastic.decide(odd, 2, min_nnodes=1, heads=4, seq_len=64, replan=lambda a: FITS)
    assert not got.ok and "global batch 3" in got.reason and "DP 2" in got.reason


def test_fits_continues_and_does_not_fit_stops_with_the_re_planned_memory():
    ok = elastic.decide(L3, 2, min_nnodes=1, heads=4, seq_len=64, replan=lambda a: FITS)
    assert ok.ok and ok.after == elastic.Layout(2, 1, 1, 1, 3) and "GPU 10.0 of 80.0 GiB" in ok.reason
    assert ok.patch(job_world_size_set=False) == {"train.gradient_accumulation_steps": 3}
    assert ok.patch(job_world_size_set=True)["parallel.world_size"] == 2
    ev = ok.evidence()
    assert ev["before"]["dp"] == 3 and ev["after"]["dp"] == 2 and ev["after"]["global_batch"] == 6
    tight = elastic.Replan(False, "GPU 91.2 of 80.0 GiB per GPU; does not fit")
    no = elastic.decide(L3, 2, min_nnodes=1, heads=4, seq_len=64, replan=lambda a: tight)
    assert not no.ok and "does not fit on 2 node(s)" in no.reason and "91.2 of 80.0" in no.reason
    floor = elastic.decide(L3, 2, min_nnodes=3, heads=4, seq_len=64, replan=lambda a: FITS)
    assert not floor.ok and "min_nnodes=3" in floor.reason


# ------------------------------------------------------------------------------------------- the supervisor
def _lose_n2(sup, fos, fake):
    _watcher_ran(sup, fake, "NODE_FAIL", lost=["n2"])
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    sup.tick()


def test_no_spare_shrinks_to_the_remaining_node_with_an_incident_and_a_config_version(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    _lose_n2(sup, fos, fake)
    assert sup.state != S.FAILED and sup.attempt == 2, sup.store.get_run(sup.run_id).state_reason
    nxt = WatchPlan.read(sup.run_dir / "slurm" / "attempt-2.plan.json")
    assert "--nodes=1" in nxt.sbatch_args and "--exclude=n2" in nxt.sbatch_args
    assert sl.read_exclusions(sup.run_dir) == ["n2"]
    assert elastic.read_resize(sup.run_dir)["nnodes"] == 1
    assert sup.config["train"]["gradient_accumulation_steps"] == 2  # global batch 2 kept on DP 1
    acts = [a for a in sup.store.list_actions(run_id=sup.run_id) if (a.parameters or {}).get("resize") == "shrink"]
    assert len(acts) == 1 and acts[0].parameters["before"]["dp"] == 2 and acts[0].parameters["after"]["dp"] == 1
    assert acts[0].parameters["memory"]["plan"]  # the re-plan it rests on (a CPU-less fake: "not planned" notes)
    inc = [i for i in sup.store.list_incidents(sup.run_id) if "lost node" in i.summary]
    assert len(inc) == 1 and "global batch 2 kept" in inc[0].status_reason
    job2, _ = _watcher_ran(sup, fake, "COMPLETED")
    assert fake.jobs[job2]["NodeList"] == "n1"


def test_does_not_fit_on_the_remaining_nodes_stops_with_the_plan(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    # 1 MiB GPUs: the real planner says the job does not fit on 1 node (nor would it on 2)
    sup = _slurm_sup(tmp_path, fos, fake, slurm={"plan_gpu_mem_gib": 0.001})
    sup.start()
    _lose_n2(sup, fos, fake)
    assert sup.state == S.FAILED
    reason = sup.store.get_run(sup.run_id).state_reason
    assert "not continuing on fewer nodes" in reason and "does not fit on 1 node(s)" in reason and "GiB" in reason
    assert elastic.read_resize(sup.run_dir) is None and sup.attempt == 1


def test_grow_back_when_allowed_and_the_node_is_in_service_again(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake, slurm={"grow_back": True})
    sup.start()
    _lose_n2(sup, fos, fake)
    assert sup.attempt == 2 and elastic.read_resize(sup.run_dir)["nnodes"] == 1
    # attempt 2 crashes while n2 is still down: relaunched at 1 node
    _watcher_ran(sup, fake, "FAILED", code="1:0")
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(20):
        sup.tick()
        fos.advance(5)
        if sup.attempt == 3:
            break
    assert sup.attempt == 3
    assert "--nodes=1" in WatchPlan.read(sup.run_dir / "slurm" / "attempt-3.plan.json").sbatch_args
    fake.nodes["n2"] = "IDLE"  # back in service
    _watcher_ran(sup, fake, "FAILED", code="1:0")
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(20):
        sup.tick()
        fos.advance(5)
        if sup.attempt == 4:
            break
    assert sup.attempt == 4
    plan = WatchPlan.read(sup.run_dir / "slurm" / "attempt-4.plan.json")
    assert "--nodes=2" in plan.sbatch_args and not any(a.startswith("--exclude") for a in plan.sbatch_args)
    assert elastic.read_resize(sup.run_dir) is None and sup.config["train"]["gradient_accumulation_steps"] == 1
    acts = [a for a in sup.store.list_actions(run_id=sup.run_id) if (a.parameters or {}).get("resize")]
    assert [a.parameters["resize"] for a in acts] == ["shrink", "grow"] and acts[0].incident_id == acts[1].incident_id
    assert acts[1].parameters["before"]["nnodes"] == 1 and acts[1].parameters["after"]["dp"] == 2
    inc = next(i for i in sup.store.list_incidents(sup.run_id) if i.id == acts[1].incident_id)
    assert inc.status_reason.startswith("grew back to 2 node(s): n2 IDLE in service again"), inc.status_reason


def test_without_grow_back_the_run_stays_small(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    _lose_n2(sup, fos, fake)
    fake.nodes["n2"] = "IDLE"
    _watcher_ran(sup, fake, "FAILED", code="1:0")
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(20):
        sup.tick()
        fos.advance(5)
        if sup.attempt == 3:
            break
    assert sup.attempt == 3
    assert "--nodes=1" in WatchPlan.read(sup.run_dir / "slurm" / "attempt-3.plan.json").sbatch_args


def test_a_command_job_is_not_shrunk_the_run_stops_saying_why(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.spec.job_section = sup.spec.job_section.model_copy(update={"kind": "command", "command": ["train.py"]})
    sup.start()
    _lose_n2(sup, fos, fake)
    assert sup.state == S.FAILED
    reason = sup.store.get_run(sup.run_id).state_reason
    assert "not continuing on fewer nodes: a command job's" in reason, reason


def test_a_node_the_spec_excludes_is_not_waited_for_by_grow_back(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2", "n3"))
    sup = _slurm_sup(tmp_path, fos, fake, slurm={"grow_back": True, "exclude": ["n3"]})  # n3: broken for good
    sup.start()
    _lose_n2(sup, fos, fake)
    assert sup.attempt == 2 and elastic.read_resize(sup.run_dir)["lost_nodes"] == ["n2"]
    fake.nodes["n2"] = "IDLE"
    _watcher_ran(sup, fake, "FAILED", code="1:0")
    fos.advance(30)
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(20):
        sup.tick()
        fos.advance(5)
        if sup.attempt == 3:
            break
    plan = WatchPlan.read(sup.run_dir / "slurm" / "attempt-3.plan.json")
    assert "--nodes=2" in plan.sbatch_args and "--exclude=n3" in plan.sbatch_args, plan.sbatch_args


def test_fits_on_the_remaining_node_by_the_real_planner_with_its_figures(tmp_path):
    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake, slurm={"plan_gpu_mem_gib": 80.0})
    sup.start()
    _lose_n2(sup, fos, fake)
    assert sup.state != S.FAILED and sup.attempt == 2, sup.store.get_run(sup.run_id).state_reason
    act = next(a for a in sup.store.list_actions(run_id=sup.run_id) if (a.parameters or {}).get("resize") == "shrink")
    mem = act.parameters["memory"]
    assert mem["fits"] and mem["gpu_capacity_gib"] == 80.0 and 0 < mem["gpu_required_gib"] < 80.0, mem
    assert "of 80.0 GiB per GPU" in mem["plan"]


def test_a_restarted_daemon_relaunches_a_shrunk_run_at_its_smaller_size(tmp_path):
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.supervisor import Supervisor

    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake, run_id="r1")
    sup.start()
    _lose_n2(sup, fos, fake)
    assert sup.attempt == 2
    # The daemon restarts (its spec file still says 2 nodes) and re-adopts attempt 2, which then crashes.
    sup2 = Supervisor(load_run_spec(tmp_path / "run.toml"), sup.store, fos, run_id="r1")
    sup2.slurm_commands = fake
    sup2.start()
    assert sup2.attempt == 2 and sup2.spec.launcher.nnodes == 2
    _watcher_ran(sup2, fake, "FAILED", code="1:0")
    fos.advance(30)
    fos.die(sup2.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(20):
        sup2.tick()
        fos.advance(5)
        if sup2.attempt == 3:
            break
    assert sup2.attempt == 3 and sup2.config["train"]["gradient_accumulation_steps"] == 2
    assert "--nodes=1" in WatchPlan.read(sup2.run_dir / "slurm" / "attempt-3.plan.json").sbatch_args


# ------------------------------------------------------------------ a node loss and a hang, both seeing it
def _training(sup, fos, fake):
    """Attempt 1's job submitted and stepping (the watcher's part done by hand)."""
    import json

    plan = WatchPlan.read(sup.run_dir / "slurm" / "attempt-1.plan.json")
    job_id = fake.sbatch(Path(plan.script), plan.sbatch_args, plan.env)
    (sup.run_dir / "slurm" / "attempt-1.job.json").write_text(json.dumps({"job_id": job_id}))
    _emit(sup, kind="event", event="started", step=0)
    for s in range(1, 8):
        fos.advance(0.5)
        _emit(sup, kind="step", step=s, loss=3.0, step_time_s=0.5, samples=[s - 1, s])
        sup.tick()
    return job_id


def _exit_attempt(sup, fos, fake, job_id, want_attempt):
    import json

    fake.nodes["n2"] = "DOWN*"
    fake.end(job_id, "CANCELLED", "0:15")
    end = sl.classify_end(job_id, fake.job(job_id), [], dict(fake.nodes), 1, False, ["n2"])
    (sup.run_dir / "slurm" / "attempt-1.end.json").write_text(json.dumps(end.to_json()))
    fos.die(sup.job.pid, ExitStatus(1, None, "wait"))
    for _ in range(40):
        sup.tick()
        fos.advance(2)
        if sup.attempt == want_attempt or sup.state == S.FAILED:
            break


def test_a_hang_leaves_an_attempt_the_watcher_is_ending_for_a_lost_node(tmp_path):
    """The watcher saw n2 lost and said so (attempt-1.lost.json) before its scancel; the job is slow to end: the
    hang floor passes meanwhile. The hang path must not take the attempt; the node loss shrinks the run."""
    import json

    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    job_id = _training(sup, fos, fake)
    (sup.run_dir / "slurm" / "attempt-1.lost.json").write_text(json.dumps({"job_id": job_id, "nodes": ["n2"]}))
    fos.advance(120)  # far past the hang floor
    sup.tick()
    assert sup.term is None and not fake.cancels("USR1")
    assert not [i for i in sup.store.list_incidents(sup.run_id) if i.symptom.value == "hang"]
    _exit_attempt(sup, fos, fake, job_id, 2)
    assert sup.attempt == 2, sup.store.get_run(sup.run_id).state_reason
    assert "--nodes=1" in WatchPlan.read(sup.run_dir / "slurm" / "attempt-2.plan.json").sbatch_args


def test_a_hang_that_took_the_attempt_first_yields_to_the_node_loss_its_end_shows(tmp_path):
    """The hang floor passed before Slurm called n2 DOWN (SlurmdTimeout 300 s on a real cluster): the hang path
    took the attempt; the job then ended with n2 lost. The next attempt must not ask for n2: it shrinks, and the
    hang incident says the node loss explained it. The healthy case: a loss marker of another job is ignored."""
    import json

    fos, fake = WatcherOS(), FakeSlurm(nodes=("n1", "n2"))
    sup = _slurm_sup(tmp_path, fos, fake)
    sup.start()
    job_id = _training(sup, fos, fake)
    (sup.run_dir / "slurm" / "attempt-1.lost.json").write_text(json.dumps({"job_id": "elsewhere", "nodes": ["n2"]}))
    fos.advance(120)
    sup.tick()
    assert sup.term is not None and sup.term.plan.relaunch is not None  # the hang path has it
    fos.advance(sup.dcfg.stack_dump_wait_s + 0.1)
    sup.tick()
    _exit_attempt(sup, fos, fake, job_id, 2)
    assert sup.attempt == 2, sup.store.get_run(sup.run_id).state_reason
    args = WatchPlan.read(sup.run_dir / "slurm" / "attempt-2.plan.json").sbatch_args
    assert "--nodes=1" in args and "--exclude=n2" in args, args
    incs = sup.store.list_incidents(sup.run_id)
    hang = [i for i in incs if i.symptom.value == "hang"]
    assert len(hang) == 1 and hang[0].status.value == "resolved" and "node loss" in hang[0].status_reason
    loss = [i for i in incs if "lost node n2" in i.summary]
    assert len(loss) == 1 and "no spare for n2: continuing on 1 node(s)" in loss[0].summary, loss[0].summary
