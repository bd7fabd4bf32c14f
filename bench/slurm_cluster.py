"""A real Slurm cluster on one machine: munged + slurmctld + N slurmd, each slurmd in its own network namespace.

Why: the daemon's Slurm integration (sbatch/srun/scancel/sacct, node loss, time limits) must be tested against
the real scheduler, and multi-node traffic (gloo between ranks) must really cross a network. Every compute node
``nK`` is a ``slurmd -N nK`` inside network namespace ``usl<I>-nK`` with address ``10.77.<I>.(10+K)`` on a
bridge (the node's side of its veth is ``eth0`` everywhere, so ``GLOO_SOCKET_IFNAME=eth0`` fits every node); slurmctld and munged run in the root namespace (controller address ``10.77.<I>.1``). Processes a job
starts on nK are children of that slurmd, so they live in nK's namespace (and in a UTS namespace whose hostname
is ``nK``, which resolves to the node's address there: gloo binds it without GLOO_SOCKET_IFNAME too); the
filesystem is shared, so run directories are visible on every node.

Needs root, ``ip netns``, ``unshare`` and Debian's ``slurm-wlm`` + ``munge`` (tested with Slurm 22.05.8):
``apt-get install -y --no-install-recommends slurm-wlm munge``.

Use from a test (tests/slurm/conftest.py gives the session fixture ``slurm_cluster``, 3 nodes: 2 for a job and
the spare n3; ``slurm_cluster_clean`` is the same cluster after ``reset()``: jobs cancelled, nodes restored)::

    def test_something(slurm_cluster):
        env = {**os.environ, **slurm_cluster.env}          # SLURM_CONF for sbatch/srun/scancel/scontrol
        subprocess.run(["sbatch", "-N2", "-p", "debug", "job.sh"], env=env, check=True)
        slurm_cluster.wait_node_state("n1", {"allocated", "mixed"}, timeout=30)
        slurm_cluster.kill_node("n1")            # SIGKILL slurmd, slurmstepd, the ranks; link cut first
        slurm_cluster.wait_node_state("n1", {"down"}, timeout=30)   # ~SlurmdTimeout (10 s) + a ping period
        slurm_cluster.job_info(job_id)["JobState"]                 # "NODE_FAIL"
        slurm_cluster.restore_node("n1")         # slurmd again, link up, state=resume, waits until idle

Fault helpers: ``kill_node`` (a node that dies), ``freeze_node``/``thaw_node`` (SIGSTOP/SIGCONT: a hung node),
``slow_node(name, cpu_fraction)``/``unslow_node`` (its processes capped in a cpu cgroup: a straggler),
``set_down(name, reason)`` (``scontrol update state=down``), ``restore_node``, ``wait_idle``, ``node_of_pid``
(which node a process runs on, from its network namespace), ``node_addr``/``master_addr``, ``pids_on``,
``link_bytes`` (traffic through a node's link), ``node_states``/``node_info``/``job_info``. Every wait is bounded
and raises ``ClusterError`` quoting the log tail of the daemon that failed. The fixture must not leak: ``down()``
kills everything in the namespaces, removes them, the bridge, /etc/netns/<ns> and the cpu cgroups, and raises if
anything is left; a test run killed before its teardown is cleaned up by the next ``up`` (``reap_orphans``).

What the scheduler records (no slurmdbd here): ``sacct`` does not work (AccountingStorageType=none; Debian's
22.05 has no accounting_storage/filetxt); finished jobs are read from ``scontrol show job -o <id>`` for
``MinJobAge`` seconds after they end (``job_info``) and, for ever, from the jobcomp text file
(``JobCompType=jobcomp/filetxt``, one ``Key=Value ...`` line per finished job; ``jobcomp_records``). Both
parse with ``parse_record``.

Several clusters may run at once (CI and an engineer on one box): each takes a free instance number I
(0..15, claimed under /run/ulyssesd-slurm-test/), which picks the subnet, the namespace/bridge names and the
slurmctld port. Node names are n1..nN in every instance (each instance has its own slurmctld).

CLI: ``python bench/slurm_cluster.py up|down|status [--nodes 3] [--dir DIR]`` (``up`` prints the
``export SLURM_CONF=...`` line to use; ``down`` finds the instance from DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

SLURM_BINARIES = ("slurmctld", "slurmd", "scontrol", "sinfo", "srun", "sbatch", "scancel", "squeue")
MUNGE_BINARIES = ("munged", "mungekey", "munge", "unmunge")
SYSTEM_BINARIES = ("ip", "unshare", "nsenter", "mount")
CLAIMS_DIR = Path("/run/ulyssesd-slurm-test")
MAX_INSTANCES = 16
LOG_TAIL_CHARS = 2500
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL
# sinfo's node states that mean "usable, nothing running"
IDLE_STATES = frozenset({"idle"})
_RECORD_KEY = re.compile(r"[A-Z][A-Za-z0-9_:/]*")


class ClusterError(RuntimeError):
    """The test cluster could not reach the state asked for; the message names the daemon and quotes its log."""


class ClusterUnavailable(ClusterError):
    """This machine cannot host the cluster (not root, no ip netns, Slurm or munge missing); tests skip."""


@dataclass(frozen=True)
class ClusterConfig:
    """What the test cluster looks like and how long it may take to get there."""

    base_dir: Path
    """Where slurm.conf, the munge key/socket, logs, spool and state live (shared by every node)."""
    nodes: int = 3
    """Compute nodes n1..nN, each a slurmd in its own network namespace."""
    cpus_per_node: int = 2
    """CPUs each node declares (this box has 2 cores; nodes oversubscribe them, which is fine for tiny jobs)."""
    memory_mb_per_node: int = 2048
    """RealMemory each node declares (below the host's real memory, so slurmd does not drain the node)."""
    slurmd_timeout_s: int = 10
    """SlurmdTimeout: a node that stops answering is set DOWN after about this long (+ up to a ping period)."""
    min_job_age_s: int = 300
    """MinJobAge: a finished job stays visible to `scontrol show job` this long (the daemon reads final states)."""
    kill_wait_s: int = 2
    """KillWait: seconds between SIGTERM and SIGKILL when a job hits its time limit or is cancelled."""
    start_timeout_s: float = 60.0
    """Longest wait for munged, slurmctld and every slurmd to come up (each wait names what it waited for)."""
    stop_timeout_s: float = 20.0
    """Longest wait for processes to die on down()/kill_node() before it reports what is left."""
    instance: int | None = None
    """Instance number 0..15 (subnet 10.77.<I>.0/24, names, ports); None takes the first free one."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise ValueError(f"nodes must be 1..200, got {self.nodes}")
        if self.instance is not None and not 0 <= self.instance < MAX_INSTANCES:
            raise ValueError(f"instance must be 0..{MAX_INSTANCES - 1}, got {self.instance}")
        if self.slurmd_timeout_s < 3:
            raise ValueError(f"slurmd_timeout_s must be >= 3 (slurmctld pings every third of it), "
                             f"got {self.slurmd_timeout_s}")


def missing_prerequisites() -> str | None:
    """Why this machine cannot host the cluster, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, slurmd as root)"
    missing = [b for b in SYSTEM_BINARIES + SLURM_BINARIES + MUNGE_BINARIES if shutil.which(b) is None]
    if missing:
        return ("not installed: " + ", ".join(missing)
                + " (apt-get install -y --no-install-recommends slurm-wlm munge iproute2 util-linux)")
    probe = f"ulyssesd-probe-{os.getpid()}-{secrets.token_hex(3)}"  # unique: clusters may start at once
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


def parse_record(line: str) -> dict[str, str]:
    """One `scontrol show ... -o` line (or a jobcomp/filetxt line) as a dict: ``Key=Value`` pairs split on
    spaces; a value runs until the next `` Key=`` with a capitalised key (Reason, Command, ... hold spaces;
    keys look like ``JobState``, ``TRES``, ``Socks/Node``, ``NtasksPerN:B:S:C``)."""
    out: dict[str, str] = {}
    key: str | None = None
    for token in line.strip().split(" "):
        head, sep, rest = token.partition("=")
        if sep and _RECORD_KEY.fullmatch(head):
            key = head
            out[key] = rest
        elif key is not None:
            out[key] += " " + token
    return out


def _tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<no log at {path}: {e}>"
    return text[-chars:] if text else f"<{path} is empty>"


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str,
                explain: Callable[[], str] = lambda: "", interval: float = 0.25) -> None:
    """Poll ``predicate`` until true or ``timeout`` seconds passed, then raise ClusterError with ``explain()``."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            detail = explain()
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}" + (f"\n{detail}" if detail else ""))
        time.sleep(interval)


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 30, check: bool = True
         ) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f}s") from e
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class SlurmTestCluster:
    """One test cluster: start with ``up()``, stop with ``down()`` (idempotent); see the module docstring."""

    config: ClusterConfig
    instance: int = -1
    _children: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    # ---- names and addresses -------------------------------------------------------------------------------
    @property
    def dir(self) -> Path:
        return self.config.base_dir

    @property
    def conf_path(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        return [f"n{k}" for k in range(1, self.config.nodes + 1)]

    @property
    def tag(self) -> str:
        return f"usl{self.instance}"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def controller_addr(self) -> str:
        return f"10.77.{self.instance}.1"

    @property
    def controller_port(self) -> int:
        return 16817 + 2 * self.instance

    @property
    def slurmd_port(self) -> int:
        return 16818  # each slurmd listens in its own namespace, so one port serves every node and instance

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket.2"

    @property
    def jobcomp_path(self) -> Path:
        return self.dir / "jobcomp.txt"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, srun, scontrol, ...) and the daemon: merge into os.environ."""
        return {"SLURM_CONF": str(self.conf_path)}

    @property
    def master_addr(self) -> str:
        """The first node's address: MASTER_ADDR for torch.distributed across the nodes."""
        return self.node_addr("n1")

    def namespace(self, node: str) -> str:
        self._check_node(node)
        return f"{self.tag}-{node}"

    def node_addr(self, node: str) -> str:
        self._check_node(node)
        return f"10.77.{self.instance}.{10 + int(node[1:])}"

    def _check_node(self, node: str) -> None:
        if node not in self.node_names:
            raise ValueError(f"no node {node!r} in this cluster (nodes: {', '.join(self.node_names)})")

    def _host_veth(self, node: str) -> str:
        return f"{self.tag}v{node[1:]}"

    def slurmd_log(self, node: str) -> Path:
        return self.dir / "log" / f"slurmd.{node}.log"

    @property
    def slurmctld_log(self) -> Path:
        return self.dir / "log" / "slurmctld.log"

    @property
    def munged_log(self) -> Path:
        return self.dir / "log" / "munged.log"

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def up(self, owned: bool = True) -> SlurmTestCluster:
        """Start munged, the network, slurmctld and every slurmd; return when every node is idle. ``owned``:
        the cluster belongs to this process, and a later ``up`` anywhere tears it down once this process is
        gone (a test runner killed before its teardown leaks nothing for long); the CLI's clusters are not."""
        reason = missing_prerequisites()
        if reason:
            raise ClusterUnavailable(reason)
        if len(str(self.munge_socket)) > UNIX_PATH_MAX:
            raise ClusterError(f"base_dir {self.dir} is too long: the munge socket path under it would be "
                               f"{len(str(self.munge_socket))} bytes, a unix socket path holds {UNIX_PATH_MAX}")
        reap_orphans()
        self.dir.mkdir(parents=True, exist_ok=True)
        # the owner before the claim: a claim whose owner lives is never taken over (see _claim_is_stale)
        (self.dir / "owner").write_text(_process_identity(os.getpid()) if owned else "cli")
        self._claim_instance()
        try:
            self._purge_instance_leftovers()
            for sub in ("log", "state", "spool", "run"):  # a fresh cluster: no old logs, jobs or node state
                shutil.rmtree(self.dir / sub, ignore_errors=True)
            self.jobcomp_path.unlink(missing_ok=True)
            for sub in ("log", "state", "spool", "run", "munge"):
                (self.dir / sub).mkdir(parents=True, exist_ok=True)
            (self.dir / "instance").write_text(str(self.instance))
            self._start_munged()
            self._make_network()
            self._write_conf()
            self._start_slurmctld()
            slurmds = {node: self._start_slurmd(node) for node in self.node_names}
            self.wait_idle(self.config.start_timeout_s, slurmds)
        except BaseException:
            self.down(check=False)
            raise
        return self

    def down(self, check: bool = True) -> None:
        """Stop everything this cluster started and remove its namespaces, bridge and claim. With ``check``,
        raise ClusterError naming whatever is still there afterwards (a test asserts nothing leaks)."""
        if self.instance < 0:
            return
        for node in self.node_names:
            ns = self.namespace(node)
            if Path(f"/run/netns/{ns}").exists():
                self._kill_pids(self._ns_pids(ns), signal.SIGCONT)
                self._kill_pids(self._ns_pids(ns), signal.SIGKILL)
        for name in ("slurmctld", "munged"):
            pid = self._pidfile_pid(self.dir / "run" / f"{name}.pid")
            if pid:
                self._kill_pids([pid], signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        for name in ("slurmctld", "munged"):
            pid = self._pidfile_pid(self.dir / "run" / f"{name}.pid")
            while pid and _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid and _pid_alive(pid):
                self._kill_pids([pid], signal.SIGKILL)
        for child in self._children:  # reap what we started in this process
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        self._children.clear()
        for node in self.node_names:
            ns = self.namespace(node)
            for _ in range(50):
                if not self._ns_pids(ns):
                    break
                self._kill_pids(self._ns_pids(ns), signal.SIGKILL)
                time.sleep(0.1)
            _run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        _run(["ip", "link", "del", self.bridge], check=False)
        for node in self.node_names:
            _run(["ip", "link", "del", self._host_veth(node)], check=False)
            self._remove_cpu_cgroup(node)
        claim = CLAIMS_DIR / str(self.instance)
        leftovers = self.leftovers()
        if not leftovers:
            try:
                if claim.is_symlink() and os.readlink(claim) == str(self.dir):
                    claim.unlink()
            except OSError:
                pass
        if check and leftovers:
            raise ClusterError("the test cluster left things behind: " + "; ".join(leftovers))

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (namespaces, links, processes, hosts dirs); empty when clean."""
        out = []
        netns = set(_run(["ip", "netns", "list"], check=False).stdout.split())
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
        for node in self.node_names:
            ns = self.namespace(node)
            if ns in netns:
                out.append(f"netns {ns}")
            if Path(f"/etc/netns/{ns}").exists():
                out.append(f"/etc/netns/{ns}")
            if f" {self._host_veth(node)}@" in links or f" {self._host_veth(node)}:" in links:
                out.append(f"link {self._host_veth(node)}")
        for node in self.node_names:
            cg = self._cpu_cgroup(node)
            if cg is not None and cg.exists():
                out.append(f"cgroup {cg}")
        if f" {self.bridge}:" in links:
            out.append(f"bridge {self.bridge}")
        for name in ("slurmctld", "munged"):
            pid = self._pidfile_pid(self.dir / "run" / f"{name}.pid")
            if pid and _pid_alive(pid):
                out.append(f"{name} pid {pid}")
        conf = str(self.conf_path)
        for pid in _pids_with_cmdline_containing(conf):
            out.append(f"pid {pid} ({_cmdline(pid)[:80]})")
        return out

    def _claim_instance(self) -> None:
        """Take an instance number: a symlink CLAIMS_DIR/<I> -> base_dir made atomically; stale claims (their
        cluster's slurmctld and munged are gone) are taken over."""
        CLAIMS_DIR.mkdir(parents=True, exist_ok=True)
        wanted = [self.config.instance] if self.config.instance is not None else list(range(MAX_INSTANCES))
        for i in wanted:
            claim = CLAIMS_DIR / str(i)
            try:
                os.symlink(str(self.dir), claim)
            except FileExistsError:
                if not _claim_is_stale(claim):
                    continue
                claim.unlink(missing_ok=True)
                try:
                    os.symlink(str(self.dir), claim)
                except FileExistsError:
                    continue
            if self.config.instance is None and not _port_free(16817 + 2 * i):
                claim.unlink(missing_ok=True)  # something else listens on this instance's slurmctld port
                continue
            self.instance = i
            return
        raise ClusterUnavailable(f"no free Slurm test cluster instance (0..{MAX_INSTANCES - 1} claimed under "
                                 f"{CLAIMS_DIR}; `python bench/slurm_cluster.py down --dir <dir>` frees one)")

    def _purge_instance_leftovers(self) -> None:
        """Remove what an earlier cluster of this instance number left (its directory may be gone, so its
        claim looked stale): namespaces, bridge, hosts dirs, and daemons whose cluster directory is gone."""
        prefix = f"{self.tag}-n"
        for ns in _run(["ip", "netns", "list"], check=False).stdout.split():
            if ns.startswith(prefix) and ns[len(prefix):].isdigit():
                self._kill_pids(self._ns_pids(ns), signal.SIGKILL)
                _run(["ip", "netns", "del", ns], check=False)
        if Path("/etc/netns").is_dir():
            for etc in Path("/etc/netns").glob(f"{prefix}*"):
                shutil.rmtree(etc, ignore_errors=True)
        _run(["ip", "link", "del", self.bridge], check=False)
        self._kill_pids(_orphaned_daemon_pids(), signal.SIGKILL)

    def _start_munged(self) -> None:
        key = self.dir / "munge" / "munge.key"
        if not key.exists():
            _run(["mungekey", "--create", "--keyfile", str(key)])
        key.chmod(0o600)
        (self.dir / "munge").chmod(0o755)
        child = self._spawn(["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                     f"--key-file={key}", f"--pid-file={self.dir / 'run' / 'munged.pid'}",
                     f"--log-file={self.munged_log}", f"--seed-file={self.dir / 'munge' / 'munged.seed'}",
                     "--num-threads=2"], self.dir / "log" / "munged.out")

        def credential_round_trips() -> bool:
            if child.poll() is not None:
                raise ClusterError(f"munged exited {child.returncode} at start; munged log:\n"
                                   f"{_tail(self.munged_log)}\n{_tail(self.dir / 'log' / 'munged.out')}")
            if not self.munge_socket.exists():
                return False
            enc = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True, timeout=10)
            if enc.returncode != 0:
                return False
            dec = subprocess.run(["unmunge", "-S", str(self.munge_socket)], input=enc.stdout,
                                 capture_output=True, timeout=10)
            return dec.returncode == 0

        _wait_until(credential_round_trips, self.config.start_timeout_s, "munged to encode/decode a credential",
                    lambda: "munged log:\n" + _tail(self.munged_log) + "\n" + _tail(self.dir / "log" / "munged.out"))

    def _make_network(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.controller_addr}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        hosts = self._hosts_text()
        for node in self.node_names:
            ns, veth = self.namespace(node), self._host_veth(node)
            _run(["ip", "netns", "add", ns])
            # the node side is called eth0 in every namespace, so GLOO_SOCKET_IFNAME=eth0 fits all nodes
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge])
            _run(["ip", "link", "set", veth, "up"])
            _run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.node_addr(node)}/24", "dev", "eth0"])
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up"])
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
            # bind-mounted over /etc/hosts for slurmd (and so every job process) on the node; `ip netns exec`
            # does the same for commands an operator runs there: n1..nN and this host's name resolve
            etc = Path(f"/etc/netns/{ns}")
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    def _hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost", f"{self.controller_addr} {socket.gethostname()} slurmctld"]
        lines += [f"{self.node_addr(n)} {n}" for n in self.node_names]
        return "\n".join(lines) + "\n"

    def _write_conf(self) -> None:
        c, d = self.config, self.dir
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={self.node_addr(n)} NodeHostname={n} CPUs={c.cpus_per_node} "
            f"RealMemory={c.memory_mb_per_node} State=UNKNOWN" for n in self.node_names)
        self.conf_path.write_text(f"""\
# Written by bench/slurm_cluster.py: a test cluster on one machine (docs/SLURM.md says why each line is so).
ClusterName=ulyssesd{self.instance}
SlurmctldHost={socket.gethostname()}({self.controller_addr})
SlurmctldPort={self.controller_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'run'}/slurmctld.pid
SlurmdPidFile={d / 'run'}/slurmd.%n.pid
SlurmctldLogFile={self.slurmctld_log}
SlurmdLogFile={d / 'log'}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp_path}
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdTimeout={c.slurmd_timeout_s}
SlurmctldTimeout=10
MessageTimeout=5
InactiveLimit=0
MinJobAge={c.min_job_age_s}
KillWait={c.kill_wait_s}
WaitTime=0
OverTimeLimit=0
ReturnToService=2
JobRequeue=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, cmd: list[str], out: Path) -> subprocess.Popen[bytes]:
        with open(out, "ab") as log:
            # own session: a Ctrl-C at the test runner does not reach the daemons; down() stops them
            child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.env})
        self._children.append(child)
        return child

    def _start_slurmctld(self) -> None:
        child = self._spawn(["slurmctld", "-D", "-c", "-f", str(self.conf_path)], self.dir / "log" / "slurmctld.out")

        def answers() -> bool:
            if child.poll() is not None:
                raise ClusterError(f"slurmctld exited {child.returncode} at start:\n{_tail(self.slurmctld_log)}\n"
                                   + _tail(self.dir / "log" / "slurmctld.out"))
            done = _run(["scontrol", "ping"], env={**os.environ, **self.env}, check=False, timeout=15)
            return done.returncode == 0 and "UP" in done.stdout

        _wait_until(answers, self.config.start_timeout_s, "slurmctld to answer `scontrol ping`",
                    lambda: "slurmctld log:\n" + _tail(self.slurmctld_log))

    def _start_slurmd(self, node: str) -> subprocess.Popen[bytes]:
        ns = self.namespace(node)
        (self.dir / "spool" / node).mkdir(parents=True, exist_ok=True)
        # nsenter, not `ip netns exec`: that remounts /sys, and slurmd 22.05 fails without /sys/fs/cgroup even
        # with proctrack/linuxproc. Own mount namespace: the node's hosts file over /etc/hosts (n1..nN resolve
        # for slurmd and every job process). Own UTS namespace: `hostname` and gethostname() say nK on node nK
        # (gloo resolves it to the node's address).
        script = (f"mount --bind /etc/netns/{ns}/hosts /etc/hosts && hostname {node} && "
                  f"exec slurmd -D -N {node} -f {self.conf_path}")
        return self._spawn(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--propagation",
                            "private", "--", "sh", "-c", script], self.dir / "log" / f"slurmd.{node}.out")

    # ---- state ---------------------------------------------------------------------------------------------
    def scontrol(self, *args: str, timeout: float = 30) -> str:
        return _run(["scontrol", *args], env={**os.environ, **self.env}, timeout=timeout).stdout

    def node_states(self) -> dict[str, str]:
        """Node -> sinfo's long state in lower case (e.g. ``idle``, ``allocated``, ``down*``, ``drained``).
        A trailing ``*`` means slurmctld gets no answer from the node."""
        out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env={**os.environ, **self.env}, check=False, timeout=15)
        states = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1].lower()
        return states

    def node_info(self, node: str) -> dict[str, str]:
        """`scontrol show node -o <node>` as a dict (State, Reason, ...)."""
        self._check_node(node)
        return parse_record(self.scontrol("show", "node", "-o", node))

    def job_info(self, job_id: int | str) -> dict[str, str]:
        """`scontrol show job -o <id>` as a dict (JobState, NodeList, ExitCode, Reason, ...); {} once the job
        has left slurmctld's memory (MinJobAge after it ended): then use ``jobcomp_records``."""
        done = _run(["scontrol", "show", "job", "-o", str(job_id)], env={**os.environ, **self.env}, check=False)
        if done.returncode != 0:
            return {}
        return parse_record(done.stdout.splitlines()[0]) if done.stdout.strip() else {}

    def jobcomp_records(self) -> list[dict[str, str]]:
        """Every finished job in the jobcomp/filetxt file (JobId, JobState, NodeList, StartTime, EndTime, ...)."""
        try:
            text = self.jobcomp_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [parse_record(line) for line in text.splitlines() if line.strip()]

    def wait_node_state(self, node: str, states: Iterable[str], timeout: float) -> str:
        """Wait until the node's sinfo state (``*`` stripped) is one of ``states``; return the state seen."""
        wanted = {s.lower() for s in states}
        seen: dict[str, str] = {}

        def reached() -> bool:
            seen.update(self.node_states())
            return seen.get(node, "").rstrip("*~#$@^-!") in wanted

        _wait_until(reached, timeout, f"node {node} to be {'/'.join(sorted(wanted))}",
                    lambda: f"last state {seen.get(node)!r}; node: {self._node_reason(node)}\nslurmd log:\n"
                    + _tail(self.slurmd_log(node)), interval=0.5)
        return seen[node]

    def wait_idle(self, timeout: float = 60, slurmds: dict[str, subprocess.Popen[bytes]] | None = None) -> None:
        """Wait until every node is idle and answering (sinfo ``idle``, no ``*``). With ``slurmds`` (node ->
        the slurmd just started), a slurmd that exits fails the wait at once, quoting its log."""
        seen: dict[str, str] = {}

        def all_idle() -> bool:
            for node, child in (slurmds or {}).items():
                if child.poll() is not None:
                    raise ClusterError(f"slurmd of node {node} exited {child.returncode} at start:\n"
                                       f"{_tail(self.slurmd_log(node))}\n{_tail(self.dir / 'log' / f'slurmd.{node}.out')}")
            seen.clear()
            seen.update(self.node_states())
            return all(seen.get(n) in IDLE_STATES for n in self.node_names)

        def explain() -> str:
            bad = [n for n in self.node_names if seen.get(n) not in IDLE_STATES]
            parts = [f"node states {seen}"]
            for n in bad[:3]:
                parts.append(f"--- {n}: {self._node_reason(n)}; slurmd log tail:\n{_tail(self.slurmd_log(n), 1200)}")
            parts.append("--- slurmctld log tail:\n" + _tail(self.slurmctld_log, 1200))
            return "\n".join(parts)

        _wait_until(all_idle, timeout, "every node to be idle", explain, interval=0.5)

    def _node_reason(self, node: str) -> str:
        try:
            info = self.node_info(node)
        except ClusterError as e:
            return str(e)
        return f"State={info.get('State')} Reason={info.get('Reason')}"

    # ---- processes and namespaces --------------------------------------------------------------------------
    def pids_on(self, node: str) -> list[int]:
        """Every live process in the node's network namespace (slurmd, slurmstepd, the job's processes)."""
        return self._ns_pids(self.namespace(node))

    def link_bytes(self, node: str) -> int:
        """Bytes through the node's link so far (both directions, counted on the bridge side of its veth):
        the traffic between it and the rest of the cluster."""
        stats = Path(f"/sys/class/net/{self._host_veth(node)}/statistics")
        return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())

    def node_of_pid(self, pid: int) -> str | None:
        """The node whose network namespace the process runs in; None for the root namespace or a dead pid."""
        try:
            ino = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        for node in self.node_names:
            try:
                if os.stat(f"/run/netns/{self.namespace(node)}").st_ino == ino:
                    return node
            except OSError:
                continue
        return None

    def _ns_pids(self, ns: str) -> list[int]:
        done = _run(["ip", "netns", "pids", ns], check=False, timeout=15)
        return [int(p) for p in done.stdout.split() if p.isdigit() and _pid_alive(int(p))]

    @staticmethod
    def _kill_pids(pids: Iterable[int], sig: signal.Signals) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def _pidfile_pid(path: Path) -> int | None:
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return None

    # ---- faults --------------------------------------------------------------------------------------------
    def kill_node(self, node: str, cut_network: bool = True) -> list[int]:
        """A node that dies: (optionally first) cut its link, so peers see silence as from a powered-off host
        rather than connection resets, then SIGKILL every process in its namespace (slurmd, slurmstepd, the
        ranks). Returns the pids killed. slurmctld marks the node DOWN after about SlurmdTimeout."""
        ns = self.namespace(node)
        if cut_network:
            _run(["ip", "link", "set", self._host_veth(node), "down"])
        killed: set[int] = set()
        _wait_until(lambda: self._kill_round(ns, killed), self.config.stop_timeout_s,
                    f"every process of node {node} to die", lambda: f"left: {self._ns_pids(ns)}", interval=0.1)
        return sorted(killed)

    def _kill_round(self, ns: str, killed: set[int]) -> bool:
        pids = self._ns_pids(ns)
        killed.update(pids)
        self._kill_pids(pids, signal.SIGKILL)
        return not pids

    def freeze_node(self, node: str, jobs_only: bool = False) -> list[int]:
        """A hung node: SIGSTOP every process in its namespace (its TCP peers see no reset, slurmctld no pong,
        so Slurm sets it DOWN after SlurmdTimeout). ``jobs_only``: stop only the job's processes, not slurmd
        and slurmstepd: the ranks hang (a wedged GPU, a stuck collective) while Slurm keeps the node up."""
        pids = self.pids_on(node)
        if jobs_only:
            pids = [p for p in pids if not _is_slurm_daemon(p)]
        self._kill_pids(pids, signal.SIGSTOP)
        _wait_until(lambda: all(_proc_state(p) in ("T", "t", "") for p in pids), 10,
                    f"the processes of node {node} to stop", lambda: str({p: _proc_state(p) for p in pids}), 0.05)
        return pids

    def thaw_node(self, node: str) -> list[int]:
        """Undo ``freeze_node``: SIGCONT every process in the node's namespace."""
        pids = self.pids_on(node)
        self._kill_pids(pids, signal.SIGCONT)
        _wait_until(lambda: not any(_proc_state(p) == "T" for p in pids), 10,
                    f"the processes of node {node} to continue", lambda: str({p: _proc_state(p) for p in pids}), 0.05)
        return pids

    def slow_node(self, node: str, cpu_fraction: float) -> list[int]:
        """A slow node (thermal throttling, a noisy neighbour): every process in the node's namespace, slurmd
        included (so what it starts later inherits it), goes into a cpu cgroup capped at ``cpu_fraction`` of
        one CPU (CFS quota). Slurm still sees a healthy node; its ranks compute slower. Returns the pids moved.
        Raises ClusterUnavailable where this kernel offers no cpu cgroup controller."""
        if not 0.01 <= cpu_fraction <= 1.0:
            raise ValueError(f"cpu_fraction must be 0.01..1.0 (of one CPU), got {cpu_fraction}")
        cg = self._cpu_cgroup(node)
        if cg is None:
            raise ClusterUnavailable("slow_node needs the cpu cgroup controller (cgroup v1 /sys/fs/cgroup/cpu or "
                                     "v2 with cpu in /sys/fs/cgroup/cgroup.controllers)")
        cg.mkdir(exist_ok=True)
        period_us = 100_000
        quota_us = int(period_us * cpu_fraction)
        if (cg / "cpu.max").exists():  # v2
            (cg / "cpu.max").write_text(f"{quota_us} {period_us}")
        else:
            (cg / "cpu.cfs_period_us").write_text(str(period_us))
            (cg / "cpu.cfs_quota_us").write_text(str(quota_us))
        pids = self.pids_on(node)
        for pid in pids:
            try:
                (cg / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass
        return pids

    def unslow_node(self, node: str) -> None:
        """Undo ``slow_node``: the node's processes back into the root cpu cgroup, the cgroup removed."""
        self._remove_cpu_cgroup(node)

    def _cpu_cgroup(self, node: str) -> Path | None:
        root = _cpu_cgroup_root()
        return None if root is None else root / f"ulyssesd-{self.namespace(node)}"

    def _remove_cpu_cgroup(self, node: str) -> None:
        cg, root = self._cpu_cgroup(node), _cpu_cgroup_root()
        if cg is None or root is None or not cg.exists():
            return
        for _ in range(20):  # a process forked while we move the others lands in cg: move until empty
            try:
                pids = [p for p in (cg / "cgroup.procs").read_text().split() if p.isdigit()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                try:
                    (root / "cgroup.procs").write_text(pid)
                except (ProcessLookupError, OSError):
                    pass
        try:
            cg.rmdir()
        except OSError:
            pass

    def set_down(self, node: str, reason: str) -> None:
        """An operator (or health check) takes the node out: `scontrol update state=down reason=...`; the jobs
        on it end NODE_FAIL (JobRequeue=0, so they are not requeued behind the daemon's back)."""
        self._check_node(node)
        if not reason.strip():
            raise ValueError("set_down needs a reason (Slurm refuses state=down without one)")
        self.scontrol("update", f"nodename={node}", "state=down", f"reason={reason}")

    def restore_node(self, node: str, timeout: float | None = None) -> None:
        """Bring a killed, frozen or DOWN node back: link up, SIGCONT, slurmd started when not running,
        `state=resume`, and wait until the node is idle."""
        self._check_node(node)
        _run(["ip", "link", "set", self._host_veth(node), "up"])
        self.unslow_node(node)
        self.thaw_node(node)
        if not self._slurmd_running(node):
            self._start_slurmd(node)
        limit = self.config.start_timeout_s if timeout is None else timeout
        refusals: list[str] = []

        def idle_or_resume() -> bool:
            state = self.node_states().get(node, "")
            if state.startswith(("down", "drain")) and "*" not in state:
                # Slurm refuses a resume while the node is not DOWN/DRAINED any more (ReturnToService=2 already
                # returned it) or not yet answering; so ask whenever it is down and answering (bounded by the wait)
                done = _run(["scontrol", "update", f"nodename={node}", "state=resume"],
                            env={**os.environ, **self.env}, check=False)
                if done.returncode != 0:
                    refusals.append(done.stderr.strip())
            return state == "idle"

        _wait_until(idle_or_resume, limit, f"node {node} to be idle again",
                    lambda: f"node: {self._node_reason(node)}; last resume refusal: {refusals[-1:]}\n"
                    f"slurmd log:\n{_tail(self.slurmd_log(node))}", interval=0.5)

    def reset(self, timeout: float | None = None) -> None:
        """Between tests: cancel every job, undo ``slow_node``, bring back any node a test killed, froze or
        set DOWN, and wait until every node is idle."""
        _run(["scancel", "--full", "--user=root"], env={**os.environ, **self.env}, check=False)
        for node in self.node_names:
            self.unslow_node(node)
            if self.node_states().get(node) not in IDLE_STATES:
                state = self.node_states().get(node, "")
                if state.startswith(("down", "drain", "fail")) or state.endswith("*") or not self._slurmd_running(node):
                    self.restore_node(node, timeout)
        self.wait_idle(self.config.start_timeout_s if timeout is None else timeout)

    def _slurmd_running(self, node: str) -> bool:
        return any(_cmdline(p).startswith("slurmd ") for p in self.pids_on(node))


    def status(self) -> dict[str, object]:
        return {"dir": str(self.dir), "instance": self.instance, "SLURM_CONF": str(self.conf_path),
                "controller": f"{self.controller_addr}:{self.controller_port}",
                "nodes": {n: {"addr": self.node_addr(n), "state": s}
                          for n, s in {n: self.node_states().get(n, "?") for n in self.node_names}.items()}}


def _is_slurm_daemon(pid: int) -> bool:
    """slurmd or slurmstepd (it renames itself ``slurmstepd: [job.step]``)."""
    cmd = _cmdline(pid)
    return cmd.startswith(("slurmd ", "slurmstepd"))


def _proc_state(pid: int) -> str:
    """The process's state letter (R, S, T, Z, ...), "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _pids_with_cmdline_containing(text: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and text in _cmdline(int(entry.name)) and _pid_alive(int(entry.name)):
            out.append(int(entry.name))
    return out


CLAIM_GRACE_S = 60  # a claim this young may belong to a cluster still starting (no daemons yet): keep it


def _claim_is_stale(claim: Path) -> bool:
    """A claim nobody uses: its cluster dir is gone, or it is older than CLAIM_GRACE_S, its owning process
    (if one owns it) is gone and its slurmctld and munged are dead."""
    try:
        target = Path(os.readlink(claim))
        age = time.time() - os.lstat(claim).st_mtime
    except OSError:
        return True
    if not target.is_dir():
        return True
    if age < CLAIM_GRACE_S or _owner_alive(target):
        return False
    pids = [SlurmTestCluster._pidfile_pid(target / "run" / f"{n}.pid") for n in ("slurmctld", "munged")]
    return not any(p and _pid_alive(p) for p in pids)


def _holds_live_claim(base_dir: Path) -> bool:
    """Whether a cluster started in base_dir still holds its instance."""
    try:
        claim = CLAIMS_DIR / (base_dir / "instance").read_text().strip()
        return os.readlink(claim) == str(base_dir) and not _claim_is_stale(claim)
    except OSError:
        return False


def _owner_alive(base_dir: Path) -> bool:
    try:
        owner = (base_dir / "owner").read_text().strip()
    except OSError:
        return False
    return ":" in owner and not _owner_gone(base_dir)


def _cpu_cgroup_root() -> Path | None:
    """Where cpu cgroups are made: cgroup v1's cpu hierarchy, or the v2 root with the cpu controller
    delegated to its children; None when neither is here."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    try:
        if "cpu" in (v2 / "cgroup.controllers").read_text().split():
            if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
                (v2 / "cgroup.subtree_control").write_text("+cpu")
            return v2
    except OSError:
        return None
    return None


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _process_identity(pid: int) -> str:
    """``pid:start-time``: names one process, even after its pid is reused."""
    try:
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        start = "?"
    return f"{pid}:{start}"


def _owner_gone(base_dir: Path) -> bool:
    try:
        owner = (base_dir / "owner").read_text().strip()
    except OSError:
        return False
    if owner == "cli" or ":" not in owner:
        return False
    pid = int(owner.split(":")[0])
    return not _pid_alive(pid) or _process_identity(pid) != owner


def reap_orphans() -> list[Path]:
    """Tear down every claimed cluster whose owning process is gone (a test run killed before its teardown);
    returns their directories. CLI clusters (`up` from the command line) are left alone."""
    reaped = []
    if not CLAIMS_DIR.is_dir():
        return reaped
    for claim in sorted(CLAIMS_DIR.iterdir()):
        try:
            target = Path(os.readlink(claim))
        except OSError:
            continue
        if target.is_dir() and _owner_gone(target):
            try:
                cluster_from_dir(target).down(check=False)
            except ClusterError:
                continue
            claim.unlink(missing_ok=True)
            reaped.append(target)
    return reaped


def _orphaned_daemon_pids() -> list[int]:
    """munged/slurmctld/slurmd processes started by this module whose cluster directory no longer exists."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(int(entry.name)).split()
        if not argv or Path(argv[0]).name not in ("munged", "slurmctld", "slurmd"):
            continue
        for arg in argv:
            conf = None
            if arg.endswith("/slurm.conf"):
                conf = Path(arg)
            elif arg.startswith("--socket=") and arg.endswith("/munge/munge.socket.2"):
                conf = Path(arg.split("=", 1)[1]).parents[1] / "slurm.conf"
            if conf is not None and not conf.parent.exists():
                out.append(int(entry.name))
    return out


def cluster_from_dir(base_dir: Path) -> SlurmTestCluster:
    """The cluster a previous ``up`` (CLI) started in ``base_dir``, for ``status``/``down``."""
    try:
        instance = int((base_dir / "instance").read_text())
    except (OSError, ValueError) as e:
        raise ClusterError(f"{base_dir} holds no test cluster (no readable 'instance' file: {e})") from e
    conf = (base_dir / "slurm.conf").read_text() if (base_dir / "slurm.conf").exists() else ""
    nodes = conf.count("\nNodeName=") or 1
    cluster = SlurmTestCluster(ClusterConfig(base_dir=base_dir, nodes=nodes, instance=instance))
    cluster.instance = instance
    return cluster


MAX_NODES = 200  # ClusterConfig's bound: addresses 10.77.<I>.(10+K) stay inside the /24


def _node_count(text: str) -> int:
    """--nodes: an integer 1..MAX_NODES (a usage error otherwise, before anything is started)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of nodes") from None
    if not 1 <= n <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"{n} nodes: give 1..{MAX_NODES}")
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A real Slurm cluster on this machine (slurmd per network "
                                     "namespace) for tests; needs root and slurm-wlm + munge.")
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--nodes", type=_node_count, default=3, metavar="N",
                        help=f"compute nodes n1..nN, 1..{MAX_NODES} (up only; default 3)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ulyssesd-slurm"),
                        help="cluster directory: slurm.conf, logs, state (default /tmp/ulyssesd-slurm)")
    args = parser.parse_args(argv)
    base = args.dir.resolve()
    if args.action == "up" and (base.exists() and not base.is_dir()
                                or any(p.exists() and not p.is_dir() for p in base.parents)):
        print(f"error: --dir {base}: a file is in the way (the cluster directory must be a directory or not "
              f"exist yet)", file=sys.stderr)
        return 2
    try:
        if args.action == "up":
            if _holds_live_claim(base):
                print(f"a cluster is already up in {base}; `down --dir {base}` first", file=sys.stderr)
                return 1
            cluster = SlurmTestCluster(ClusterConfig(base_dir=base, nodes=args.nodes))
            cluster.up(owned=False)
            cluster._children.clear()  # they outlive this command; `down` stops them
            print(json.dumps(cluster.status(), indent=2))
            print(f"export SLURM_CONF={cluster.conf_path}")
        elif args.action == "down":
            cluster_from_dir(base).down()
            print(f"down: {base}")
        else:
            print(json.dumps(cluster_from_dir(base).status(), indent=2))
    except ClusterUnavailable as e:
        print(f"cannot run a test cluster here: {e}", file=sys.stderr)
        return 2
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the cluster directory cannot be made or written (read-only, full disk)
        print(f"error: cluster directory {base}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
