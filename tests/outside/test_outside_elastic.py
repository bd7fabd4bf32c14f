"""Outside-in checks of ulyssesd's elastic Slurm runs (docs/SLURM.md "Continue at a smaller size") and of
its coexistence with torchrun --max-restarts (docs/COEXISTENCE.md), written from the docs only.

Real processes throughout: the one-machine Slurm cluster of bench/slurm_cluster.py (3 nodes, no spare),
`ulyssesd run` on a spec of our own, `ulyssesctl` to read what happened, and a node failure made by hand the
way a dead host looks to Slurm: its link cut, its job processes SIGKILLed and its slurmd frozen (so it stops
answering and Slurm calls it DOWN/not responding). Bringing the node back: link up, slurmd thawed,
`scontrol update state=resume`. Needs root, slurm-wlm and munge; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ULYSSESD = str(BIN / "ulyssesd")
ULYSSESCTL = str(BIN / "ulyssesctl")
CLUSTER = [sys.executable, str(REPO / "bench" / "slurm_cluster.py")]

# Each test starts its own 3-node Slurm cluster (~1 min each): run with `make test-extended` before a release,
# not in CI's slow suite (its 90-minute budget); tests/slurm/test_slurm_elastic_e2e.py covers the same in CI.
pytestmark = [pytest.mark.slow, pytest.mark.extended]


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("slurmctld", "slurmd", "sbatch", "munged", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install slurm-wlm munge iproute2)"
    return None


# ------------------------------------------------------------------ the cluster


class Cluster:
    """The test cluster as its CLI prints it, plus a node failure done by hand."""

    def __init__(self, directory: Path, info: dict[str, Any]) -> None:
        self.dir = directory
        self.instance = int(info["instance"])
        self.conf = info["SLURM_CONF"]
        self.env = dict(os.environ, SLURM_CONF=self.conf, DS_ACCELERATOR="cpu")

    def ns(self, node: str) -> str:
        return f"usl{self.instance}-{node}"

    def slurmd_pid(self, node: str) -> int:
        # the conf path tells this cluster's slurmd from another cluster's on the same box
        out = subprocess.run(["pgrep", "-f", f"slurmd -D -N {node} -f {self.conf}"], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        assert pids, f"no slurmd for {node}"
        return pids[0]

    def node_state(self, node: str) -> str:
        out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], env=self.env,
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()

    def kill_node(self, node: str) -> None:
        """A dead host: link cut, its job processes SIGKILLed, slurmd frozen (answers nothing)."""
        ns = self.ns(node)
        sd = self.slurmd_pid(node)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "down"], check=True)
        os.kill(sd, signal.SIGSTOP)
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for p in pids:
            if int(p) != sd:
                try:
                    os.kill(int(p), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def restore_node(self, node: str) -> None:
        ns = self.ns(node)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up"], check=True)
        os.kill(self.slurmd_pid(node), signal.SIGCONT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=self.env,
                           capture_output=True, timeout=30)
            state = self.node_state(node)
            if state in ("idle", "mixed", "allocated") and "*" not in state:
                return
            time.sleep(2)
        raise AssertionError(f"{node} not back in service: {self.node_state(node)!r}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("slurm")
    up = subprocess.run([*CLUSTER, "up", "--nodes", "3", "--dir", str(directory)], capture_output=True,
                        text=True, timeout=300)
    if up.returncode != 0:
        subprocess.run([*CLUSTER, "down", "--dir", str(directory)], capture_output=True, timeout=300)
        pytest.fail(f"cluster up failed: {up.stdout}\n{up.stderr}")
    info = json.loads(up.stdout[: up.stdout.rindex("}") + 1])
    c = Cluster(directory, info)
    try:
        yield c
    finally:
        for node in ("n1", "n2", "n3"):  # a frozen slurmd would block `down`
            try:
                os.kill(c.slurmd_pid(node), signal.SIGCONT)
            except (AssertionError, ProcessLookupError):
                pass
        subprocess.run([*CLUSTER, "down", "--dir", str(directory)], capture_output=True, timeout=300)


@pytest.fixture
def fresh(cluster: Cluster) -> Iterator[Cluster]:
    """Every node in service and no job left before and after a test."""
    for node in ("n1", "n2", "n3"):
        if cluster.node_state(node) not in ("idle",):
            cluster.restore_node(node)
    yield cluster
    subprocess.run(["scancel", "--user=root"], env=cluster.env, capture_output=True, timeout=30)
    for node in ("n1", "n2", "n3"):
        if cluster.node_state(node).endswith("*") or cluster.node_state(node).startswith("down"):
            cluster.restore_node(node)


# ------------------------------------------------------------------ the run


def spec_text(*, steps: int, on_node_loss: str = "shrink", min_nnodes: int = 2, grow_back: bool = False,
              hang_floor_s: float | None = 120.0) -> str:
    """3 nodes x 1 rank, SP 1, micro-batch 1 x accumulation 2: global batch 6 (the docs' own example).

    hang_floor_s: `[detectors] hang_timeout_floor_s`, set above the time Slurm takes to call a dead node
    DOWN (SlurmdTimeout 10 s + a ping period: 17-22 s here, docs/SLURM.md) so the node-loss path, not the
    hang path, handles the loss; None keeps the default (20 s)."""
    detectors = "" if hang_floor_s is None else f"[detectors]\nhang_timeout_floor_s = {hang_floor_s}\n"
    return detectors + f"""
[run]
name = "o34-elastic"

[launcher]
kind = "srun"
nnodes = 3
nproc_per_node = 1

[slurm]
mode = "submit"
partition = "debug"
on_node_loss = "{on_node_loss}"
min_nnodes = {min_nnodes}
grow_back = {"true" if grow_back else "false"}

[model]
preset = "tiny"

[parallel]
sequence_parallel_size = 1

[precision]
dtype = "fp32"

[train]
steps = {steps}
seq_len = 128
micro_batch_size = 1
gradient_accumulation_steps = 2
lr = 1e-3
min_lr = 1e-4
warmup_steps = 5
device = "cpu"

[deepspeed.config.zero_optimization]
stage = 3
stage3_param_persistence_threshold = 1e6
overlap_comm = false
contiguous_gradients = true

[data]
kind = "synthetic"

[checkpoint]
interval_steps = 5
keep_last = 3

[remediation]
mode = "act"
"""


class Run:
    def __init__(self, tmp: Path, env: dict[str, str], spec: str) -> None:
        self.state = tmp / "state"
        self.env = env
        spec_path = tmp / "run.toml"
        spec_path.write_text(spec)
        self.log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([ULYSSESD, "run", "--spec", str(spec_path), "--state-dir", str(self.state)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def ctl(self, *args: str, check: bool = True) -> Any:
        out = subprocess.run([ULYSSESCTL, "--state-dir", str(self.state), *args, "--json"], env=self.env,
                             capture_output=True, text=True, timeout=60)
        if check:
            assert out.returncode == 0, f"ulyssesctl {args}: {out.stdout}{out.stderr}"
        return json.loads(out.stdout) if out.stdout.strip() else None

    def status(self) -> dict[str, Any]:
        try:
            return self.ctl("status", check=False) or {}
        except (json.JSONDecodeError, subprocess.TimeoutExpired):
            return {}

    def wait(self, what: str, pred: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            st = self.status()
            if st and pred(st):
                return st
            if st.get("state") in ("COMPLETED", "FAILED", "STOPPED") and not pred(st):
                break
            time.sleep(1.0)
        raise AssertionError(f"timed out / ended waiting for {what}; last status: "
                             f"{ {k: st.get(k) for k in ('state', 'state_reason', 'attempt', 'step')} }\n"
                             f"{self.daemon_tail()}")

    def wait_end(self, timeout: float = 900) -> dict[str, Any]:
        return self.wait("the run to end", lambda s: s.get("state") in ("COMPLETED", "FAILED", "STOPPED"), timeout)

    def daemon_tail(self) -> str:
        self.log.flush()
        return (Path(self.log.name).read_text(errors="replace"))[-3000:]

    @property
    def run_dir(self) -> Path:
        return Path(self.status()["run_dir"])

    def steps(self) -> list[dict[str, Any]]:
        recs = []
        for line in (self.run_dir / "telemetry.jsonl").read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("kind") == "step":
                recs.append(r)
        return recs

    def plan(self, attempt: int) -> str:
        return (self.run_dir / "slurm" / f"attempt-{attempt}.plan.json").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            subprocess.run([ULYSSESCTL, "--state-dir", str(self.state), "stop"], env=self.env,
                           capture_output=True, timeout=60)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


def node_loss_incident(run: Run, node: str) -> dict[str, Any]:
    listed = run.ctl("incidents", "--limit", "0")
    rows = listed if isinstance(listed, list) else listed.get("incidents", [])
    hits = [r for r in rows if node in json.dumps(r) and "lost" in json.dumps(r).lower()]
    assert hits, f"no incident names the lost node {node}: {json.dumps(rows)[:3000]}"
    return run.ctl("incident", str(hits[-1]["id"]))


def assert_same_sample_order(steps: list[dict[str, Any]], global_batch: int) -> None:
    """Step k (of any attempt) reads samples [(k-1)*G, k*G): the order never depends on the node count."""
    assert steps
    for r in steps:
        assert r["samples"] == [(r["step"] - 1) * global_batch, r["step"] * global_batch], r


def wait_step(run: Run, n: int) -> None:
    run.wait(f"step {n}", lambda s: (s.get("step") or 0) >= n and s.get("latest_checkpoint"), 600)


# ------------------------------------------------------------------ the checks


_SHRUNK: dict[str, Any] = {}


def shrunk_run(cluster: Cluster, tmp_path: Path) -> dict[str, Any]:
    """Run 240 steps on n1..n3, kill n3 at step >= 15; what the run left (cached: one run serves two checks)."""
    if _SHRUNK:
        return _SHRUNK
    run = Run(tmp_path, cluster.env, spec_text(steps=240))
    try:
        wait_step(run, 15)
        cluster.kill_node("n3")
        run.wait("attempt 2 training on two nodes",
                 lambda s: (s.get("attempt") or 0) >= 2 and s.get("state") == "RUNNING", 600)
        out: dict[str, Any] = {"plan2": run.plan(2)}
        out["resize"] = json.loads((run.run_dir / "slurm" / "resize.json").read_text())
        out["incident"] = node_loss_incident(run, "n3")
        (tmp_path / "incident.json").write_text(json.dumps(out["incident"], indent=1))
        out["end"] = run.wait_end()
        out["steps"] = run.steps()
    finally:
        run.stop()
    _SHRUNK.update(out)
    return _SHRUNK


def test_node_loss_shrinks_to_two_nodes_same_global_batch(fresh: Cluster, tmp_path: Path) -> None:
    r = shrunk_run(fresh, tmp_path)
    assert "--nodes=2" in r["plan2"] and "n3" in r["plan2"], r["plan2"]  # 2 nodes, n3 excluded
    assert r["resize"]["nnodes"] == 2 and r["resize"]["full_nnodes"] == 3, r["resize"]
    assert r["resize"]["lost_nodes"] == ["n3"], r["resize"]
    inc = r["incident"]
    assert inc["severity"] == "critical" and "n3" in inc["summary"], inc["summary"]
    shrink = [a for a in inc["actions"] if a["kind"] == "set_config" and a["parameters"].get("resize") == "shrink"]
    assert len(shrink) == 1, json.dumps(inc["actions"])[:3000]
    p = shrink[0]["parameters"]
    before, after = p["before"], p["after"]
    assert (before["nnodes"], before["dp"], before["accum"]) == (3, 3, 2), p
    assert (after["nnodes"], after["dp"], after["accum"], after["micro_batch"]) == (2, 2, 3, 1), p
    assert before["global_batch"] == after["global_batch"] == 6, p
    assert "memory" in p and p["memory"].get("fits") is True, p
    assert shrink[0]["config_diff"] == {"train.gradient_accumulation_steps": [2, 3]}, shrink[0]
    assert r["end"]["state"] == "COMPLETED" and r["end"]["step"] == 240, r["end"]
    assert {s["attempt"] for s in r["steps"]} >= {1, 2}
    assert_same_sample_order(r["steps"], 6)  # every step, on 3 nodes and on 2, read the same 6 samples


def test_shrink_incident_says_it_continues(fresh: Cluster, tmp_path: Path) -> None:
    text = shrunk_run(fresh, tmp_path)["incident"]["summary"]
    assert "no spare for n3: continuing on 2 node(s)" in text and "global batch 6 kept" in text, text
    assert "DP 3 -> 2" in text, text


_GROWN: dict[str, Any] = {}


def test_grow_back_when_node_returns(fresh: Cluster, tmp_path: Path) -> None:
    grown_run(fresh, tmp_path)


def test_grow_action_before_has_the_small_layout(fresh: Cluster, tmp_path: Path) -> None:
    before = grown_run(fresh, tmp_path)["grow"]["before"]
    assert (before.get("nnodes"), before.get("dp"), before.get("accum"), before.get("global_batch")) == (2, 2, 3, 6)


def grown_run(fresh: Cluster, tmp_path: Path) -> dict[str, Any]:
    """Lose n3, train on two nodes, bring n3 back, operator restart: grows back (cached: serves two checks)."""
    if _GROWN:
        return _GROWN
    run = Run(tmp_path, fresh.env, spec_text(steps=300, grow_back=True))
    try:
        wait_step(run, 15)
        fresh.kill_node("n3")
        st = run.wait("attempt 2 training on two nodes",
                      lambda s: (s.get("attempt") or 0) >= 2 and s.get("state") == "RUNNING"
                      and (s.get("step") or 0) > 15, 600)
        assert "--nodes=2" in run.plan(2)
        fresh.restore_node("n3")
        # a relaunch is what grows back: an operator restart is one (docs/SLURM.md "Growing back")
        run.ctl("restart")
        st = run.wait("attempt 3 running", lambda s: (s.get("attempt") or 0) >= 3 and s.get("state") == "RUNNING",
                      600)
        plan3 = run.plan(3)
        assert "--nodes=3" in plan3, plan3
        assert not (run.run_dir / "slurm" / "resize.json").exists()
        inc = node_loss_incident(run, "n3")
        (tmp_path / "incident.json").write_text(json.dumps(inc, indent=1))
        grow = [a["parameters"] for a in inc["actions"] if a["parameters"].get("resize") == "grow"]
        assert len(grow) == 1 and len(inc["actions"]) >= 2, json.dumps(inc["actions"])[:3000]
        assert grow[0]["after"]["nnodes"] == 3 and grow[0]["before"]["nnodes"] == 2, grow[0]
        assert grow[0]["after"]["accum"] == 2 and grow[0]["after"]["global_batch"] == 6, grow[0]
        st = run.wait_end()
        assert st["state"] == "COMPLETED", st
        inc = node_loss_incident(run, "n3")
        assert inc["status"] == "resolved", (inc["status"], inc.get("status_reason"))
        steps = run.steps()
        assert {r["attempt"] for r in steps} >= {1, 2, 3}
        assert_same_sample_order(steps, 6)
        _GROWN["grow"] = grow[0]
    finally:
        run.stop()
    return _GROWN


@pytest.mark.parametrize("setting", [{"min_nnodes": 3}, {"on_node_loss": "stop"}], ids=["min3", "stop"])
def test_no_shrink_setting_stops_with_reason(fresh: Cluster, tmp_path: Path, setting: dict[str, Any]) -> None:
    run = Run(tmp_path, fresh.env, spec_text(steps=400, **setting))
    try:
        wait_step(run, 10)
        fresh.kill_node("n3")
        st = run.wait_end()
        assert st["state"] == "FAILED", st
        assert "not continuing on fewer nodes" in st["state_reason"], st["state_reason"]
        assert "n3" in json.dumps(run.ctl("incidents", "--limit", "0"))
        assert not (run.run_dir / "slurm" / "attempt-2.plan.json").exists()  # no attempt on 2 nodes
    finally:
        run.stop()


def test_node_loss_with_default_hang_floor_still_shrinks(fresh: Cluster, tmp_path: Path) -> None:
    """The spec as a user writes it (no [detectors] block): a dead node must still end on two nodes.

    The hang floor (20 s) and Slurm's DOWN verdict (17-22 s) race here; whichever path sees the loss, the
    next attempt must not ask for the dead node again (docs/SLURM.md "A lost node", "Continue at a smaller
    size")."""
    run = Run(tmp_path, fresh.env, spec_text(steps=240, hang_floor_s=None))
    try:
        wait_step(run, 15)
        fresh.kill_node("n3")
        run.wait("training again after the loss, on two nodes",
                 lambda s: (s.get("attempt") or 0) >= 2 and s.get("state") == "RUNNING"
                 and "--nodes=2" in run.plan(int(s["attempt"])), 300)
    finally:
        run.stop()


# ------------------------------------------------------------------ torchrun --max-restarts under the daemon

TRAIN_SCRIPT = r'''
"""A plain torch.distributed (gloo) job of our own: knows nothing about ulyssesd."""
import argparse, os, re, sys, time
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--crash-at", type=int, default=15)
p.add_argument("--tmp-in-dir", action="store_true", help="atomic save through ckpt/.tmp_N (a common idiom)")
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
os.makedirs(a.ckpt, exist_ok=True)
saved = sorted(int(m.group(1)) for f in os.listdir(a.ckpt) if (m := re.fullmatch(r"step_(\d+)\.pt", f)))
start = saved[-1] if saved else 0
w = torch.zeros(4)
if start:
    w = torch.load(os.path.join(a.ckpt, f"step_{start:06d}.pt"))["w"]
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
print(f"rank {rank} restart_count {restart} resuming from {start}", flush=True)
for step in range(start + 1, a.steps + 1):
    g = torch.ones(4) * (rank + 1)
    dist.all_reduce(g)
    w -= 0.01 * g
    loss = float(2.0 / step + w.abs().sum() * 1e-3)
    if rank == 1 and restart == 0 and step == a.crash_at:
        raise RuntimeError("injected crash on rank 1")
    if rank == 0:
        print(f"step={step} loss={loss:.5f}", flush=True)
        if step % 5 == 0:
            tmp = os.path.join(a.ckpt, f".tmp_{step}") if a.tmp_in_dir else a.ckpt.rstrip("/") + ".partial"
            torch.save({"w": w, "step": step}, tmp)
            os.replace(tmp, os.path.join(a.ckpt, f"step_{step:06d}.pt"))
    time.sleep(0.25)
dist.barrier()
dist.destroy_process_group()
'''


TORCHRUN_SPEC = """
[run]
name = "o34-torchrun"

[job]
kind = "command"
command = ["train.py", "--ckpt", "{checkpoint_dir}", "--steps", "40", "--crash-at", "15"EXTRA]
checkpoint_dir = "ckpt"
total_steps = 40

[telemetry]
source = "stdout"

[launcher]
kind = "torchrun"
nproc_per_node = 2
extra_args = ["--max-restarts", "2"]
env = { DS_ACCELERATOR = "cpu", OMP_NUM_THREADS = "1" }

[daemon]
preflight = false
"""


def test_torchrun_max_restarts_crash_restarted_once_recorded_once(tmp_path: Path) -> None:
    torchrun_crash_once(tmp_path, [])


def torchrun_crash_once(tmp_path: Path, extra: list[str]) -> None:
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    spec = TORCHRUN_SPEC.replace("EXTRA", "".join(f', "{e}"' for e in extra))
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    run = Run(tmp_path, env, spec)
    try:
        st = run.wait_end(600)
        assert st["state"] == "COMPLETED", st
        assert st["attempt"] == 1 and st["restarts"] == 0, st  # torchrun restarted, not the daemon
        assert st["step"] == 40, st
        incidents = run.ctl("incidents", "--limit", "0")
        inner = [i for i in incidents if i["symptom"] == "inner_restart"]
        assert len(inner) == 1, json.dumps(incidents)[:3000]
        ev = inner[0]["evidence"]
        assert ev["by"] == "torchrun" and ev["ordinal"] == 1 and ev["max_restarts"] == 2, ev
        assert inner[0]["status"] == "resolved", inner[0]
        assert not [i for i in incidents if i["symptom"] in ("crash", "hang")], json.dumps(incidents)[:3000]
        log = (run.run_dir / "logs" / "attempt-1.log").read_text(errors="replace")
        assert log.count("will restart worker group") == 1, log[-3000:]
    finally:
        run.stop()


def test_torch_save_bad_file_name_is_not_disk_full(tmp_path: Path) -> None:
    """The job saves through ckpt/.tmp_N, a name torch's zip writer refuses: a crash at every save (step 5).

    What must hold: the diagnosis is not disk_full (the disk has tens of GB free), the incident names the error."""
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    spec = TORCHRUN_SPEC.replace("EXTRA", ', "--tmp-in-dir"')
    run = Run(tmp_path, dict(os.environ, DS_ACCELERATOR="cpu"), spec)
    try:
        st = run.wait_end(600)
        assert st["state"] == "FAILED", st  # it can never get past step 5: failing is right
        incidents = run.ctl("incidents", "--limit", "0")
        crashes = [i for i in incidents if i["symptom"] not in ("inner_restart",)]
        assert crashes, json.dumps(incidents)[:3000]
        assert all(i["symptom"] != "disk_full" for i in crashes), [(i["symptom"], i["summary"]) for i in crashes]
    finally:
        run.stop()
