"""Which inner launcher restarts workers inside an attempt, and what that means for the launch command.

`[launcher] inner_restarts` (docs/COEXISTENCE.md): `off` - the daemon alone restarts (torchrun gets
`--max-restarts=0`); `torchrun` - torchrun restarts a failed worker group up to `inner_max_restarts` times in
one attempt; `nvrx` - NVIDIA's resiliency extension's `ft_launcher` does (same arguments as torchrun, plus its
rank heartbeat monitor); `auto` - read from `extra_args` (`--max-restarts N` > 0: torchrun, `--ft-*` flags:
nvrx). This module takes plain values (no spec import: the spec validates with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

TORCHRUN_MODULE = "torch.distributed.run"
NVRX_MODULE = "nvidia_resiliency_ext.fault_tolerance.launcher"
_MAX_RESTART_FLAGS = ("--max-restarts", "--max_restarts")
# ft_launcher's flags for its rank heartbeat timeout (the dashed spelling is 0.4's; the others its aliases).
_NVRX_HB_FLAGS = ("--ft-rank-heartbeat-timeout", "--ft-rank_heartbeat_timeout", "--ft-param-rank_heartbeat_timeout")


class LauncherLike(Protocol):
    """What of `[launcher]` (daemon/spec.py's LauncherSection) the modes read."""

    @property
    def kind(self) -> str: ...
    @property
    def extra_args(self) -> list[str]: ...
    @property
    def inner_restarts(self) -> str: ...
    @property
    def inner_max_restarts(self) -> int: ...
    @property
    def inner_hang(self) -> str: ...
    @property
    def inner_hang_timeout_s(self) -> float | None: ...


@dataclass(frozen=True)
class InnerRestarts:
    """The resolved mode of one run."""

    tool: str  # "off" | "torchrun" | "nvrx"
    max_restarts: int  # restarts the inner launcher makes per attempt (0 when off)
    hang_owner: str  # "daemon" | "nvrx": who acts first on a hang
    hang_timeout_s: float | None  # NVRx's heartbeat timeout when it owns hangs

    @property
    def on(self) -> bool:
        return self.tool != "off"


def flag_value(args: list[str], names: tuple[str, ...]) -> str | None:
    """The last value given to one of `names` (`--x=V` or `--x V`), as argparse would take it."""
    found: str | None = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(n + "="):
                found = a[len(n) + 1:]
    return found


def _extra_max_restarts(launcher: LauncherLike) -> int | None:
    raw = flag_value(list(launcher.extra_args), _MAX_RESTART_FLAGS)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"launcher.extra_args: --max-restarts {raw!r} is not a whole number") from None


def resolve(launcher: LauncherLike) -> InnerRestarts:
    """The run's mode; raises ValueError naming the setting when the spec contradicts itself."""
    extra = _extra_max_restarts(launcher)
    tool = launcher.inner_restarts
    if tool == "auto":
        if launcher.kind == "torchrun" and any(a.startswith("--ft-") for a in launcher.extra_args):
            tool = "nvrx"
        elif launcher.kind == "torchrun" and extra is not None and extra > 0:
            tool = "torchrun"
        else:
            tool = "off"
    if tool == "off":
        if extra:
            raise ValueError(f"launcher.extra_args sets --max-restarts={extra} but launcher.inner_restarts='off': "
                             "torchrun would restart the workers and the daemon would restart on top; set "
                             "launcher.inner_restarts='torchrun' or drop the flag")
        return InnerRestarts("off", 0, "daemon", None)
    if launcher.kind != "torchrun":
        raise ValueError(f"launcher.inner_restarts={tool!r} needs launcher.kind='torchrun' (ft_launcher takes "
                         f"torchrun's arguments); got {launcher.kind!r}")
    n = extra if extra is not None else launcher.inner_max_restarts
    if n < 1:
        raise ValueError(f"launcher.inner_restarts={tool!r} with --max-restarts={n} in launcher.extra_args: the "
                         "launcher would never restart; drop the flag or set inner_restarts='off'")
    hang_owner, timeout = launcher.inner_hang, launcher.inner_hang_timeout_s
    if tool == "nvrx" and timeout is None:
        given = flag_value(list(launcher.extra_args), _NVRX_HB_FLAGS)
        timeout = float(given) if given is not None else None
    if hang_owner == "nvrx":
        if tool != "nvrx":
            raise ValueError(f"launcher.inner_hang='nvrx' needs launcher.inner_restarts='nvrx' (is {tool!r})")
        if timeout is None:
            raise ValueError("launcher.inner_hang='nvrx' needs launcher.inner_hang_timeout_s (NVRx's rank heartbeat "
                             "timeout): the daemon waits past it before it acts on a hang itself")
    return InnerRestarts(tool, n, hang_owner, timeout if hang_owner == "nvrx" else None)


def daemon_hang_floor_s(mode: InnerRestarts) -> float | None:
    """The shortest daemon hang timeout that never races NVRx: its heartbeat timeout, then its check interval,
    kill and "will restart" line (a margin of half the timeout, at least 30 s). Once that line is read the
    restarted group is in its start-up phase, whose longer timeout applies."""
    if mode.hang_owner != "nvrx" or mode.hang_timeout_s is None:
        return None
    return mode.hang_timeout_s + max(30.0, 0.5 * mode.hang_timeout_s)


def coexist_problems(launcher: LauncherLike, detectors: Any, standby: bool) -> list[str]:
    """The spec's coexistence settings, checked (run_spec_from_dict adds these to its problems)."""
    try:
        mode = resolve(launcher)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    floor = daemon_hang_floor_s(mode)
    if floor is not None and float(detectors.hang_timeout_floor_s) < floor:
        problems.append(f"detectors.hang_timeout_floor_s={detectors.hang_timeout_floor_s} is shorter than NVRx's "
                        f"heartbeat timeout and its restart (launcher.inner_hang_timeout_s={mode.hang_timeout_s}): "
                        f"the daemon and NVRx would both act on one hang; set it to at least {floor:g}, or "
                        "launcher.inner_hang='daemon'")
    if mode.on and standby:
        problems.append(f"restart.standby with launcher.inner_restarts={mode.tool!r}: the inner launcher's restarts "
                        "start cold anyway; turn one of them off")
    return problems


def launcher_argv(mode: InnerRestarts, python: str) -> list[str]:
    """The launcher's own command and restart flags (before nnodes/rdzv/extra_args)."""
    module = NVRX_MODULE if mode.tool == "nvrx" else TORCHRUN_MODULE
    out = [python, "-m", module, f"--max-restarts={mode.max_restarts}"]
    if mode.tool == "nvrx" and mode.hang_timeout_s is not None:
        out.append(f"--ft-rank-heartbeat-timeout={mode.hang_timeout_s:g}")
    return out


def launcher_env(mode: InnerRestarts, env: dict[str, str]) -> dict[str, str]:
    """The inner launcher's environment. torchrun says "will restart worker group" at INFO, which it prints only
    with LOGLEVEL=INFO (its default is WARNING); ft_launcher prints INFO already. torchrun's workers share its
    rendezvous TCPStore by default, and a restarted group reads the previous group's keys (gloo: "connectFullMesh
    failed ... Connection refused", pytorch/pytorch#135712): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each
    group a store of its own. What the user set is kept."""
    out: dict[str, str] = {}
    if mode.tool == "torchrun" and "LOGLEVEL" not in env:
        out["LOGLEVEL"] = "INFO"
    if mode.on and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env:
        out["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return out
