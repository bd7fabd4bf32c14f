"""The operator's commands and the daemon's signals, as the supervisor's loop handles them.

`handle` answers a control-socket request (status, pause, resume, stop, restart, ack) on the supervisor's
thread, validating its arguments (a bad one is `bad_request` naming the field; an exception is `internal`,
with no internals in the answer, the traceback in the daemon log). Signals are queued by their handlers
(`CommandsRun.enqueue`) and done here by `drain_events`.
"""

from __future__ import annotations

import collections
import signal
from typing import Any, Protocol

from ulyssesd.daemon.core.housekeeping import StepGuard
from ulyssesd.daemon.core.relaunch import Relaunch
from ulyssesd.daemon.core.states import TERMINAL
from ulyssesd.daemon.core.termination import TerminationPlan
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.ports import HostSide, Lifecycle, Records, RunFiles
from ulyssesd.daemon.store.enums import RunState
from ulyssesd.daemon.store.errors import NotFoundError
from ulyssesd.daemon.store.repository.runs import OPERATOR_REASON_PREFIX
from ulyssesd.remediation.records import INT64_MAX, bounded_repr

log = get_logger("ulyssesd.supervisor")
S = RunState


class CommandsRun(RunFiles, Records, Lifecycle, HostSide, Protocol):
    """What the control-socket requests and signals use of the run."""

    notifier: Any  # sd_notify (host/sdnotify.py) or None
    guard: StepGuard  # runs each request's body (core/housekeeping.py)
    events: collections.deque[tuple[str, Any]]  # queued signals and requests, drained by the loop
    detach: bool  # leave the job running and end the daemon

    def status_dict(self) -> dict[str, Any]: ...


def drain_events(sup: CommandsRun) -> None:
    """Do what signal handlers and `enqueue` queued, in order, on the loop's thread."""
    while sup.events:
        kind, payload = sup.events.popleft()
        if kind == "signal":
            on_signal(sup, payload)
        elif kind == "command":
            handle(sup, payload)


def on_signal(sup: CommandsRun, signum: int) -> None:
    """SIGTERM/SIGINT: detach (the job keeps training; the next daemon re-adopts it); SIGHUP, SIGUSR1, SIGUSR2:
    logged and ignored (a stray signal never ends supervision)."""
    if signum in (signal.SIGTERM, signal.SIGINT):
        # Detach: the job keeps training; the next daemon re-adopts it (KillMode=process).
        log.info("signal: detaching, the job keeps running", signal=signal.Signals(signum).name)
        sup.say(f"daemon got {signal.Signals(signum).name}: detaching, job keeps running")
        if sup.notifier is not None:
            sup.notifier.stopping("detaching; the job keeps running")
        sup.detach = True
    elif signum == signal.SIGHUP:
        log.info("SIGHUP ignored (no reloadable settings)")
    elif signum in (signal.SIGUSR1, signal.SIGUSR2):
        log.warning("signal ignored: the daemon has no use for it (was it meant for a rank?)",
                    signal=signal.Signals(signum).name)


def operator_reason(what: str, peer: dict[str, Any] | None = None) -> str:
    """The reason an operator command records: "operator stop by uid 1000", or "operator resume" when the peer's
    uid is unknown. It starts with the store's OPERATOR_REASON_PREFIX, which is how the store tells an operator
    relaunch from a restart (its relaunch counts depend on it)."""
    uid = (peer or {}).get("uid")
    return f"{OPERATOR_REASON_PREFIX}{what}" + (f" by uid {uid}" if type(uid) is int else "")


#: The commands `handle` answers; a request that raises is recorded under its own command's name, so that
#: the next request of that command handled cleanly resolves its incident (and no other command's does).
COMMANDS = ("status", "pause", "resume", "stop", "restart", "ack")


def guard_step(cmd: object) -> str:
    """The guard's step for a request of `cmd`: "control_request:pause"; "control_request" for anything else
    (a client's arbitrary command names must not grow the guard's table)."""
    return f"control_request:{cmd}" if isinstance(cmd, str) and cmd in COMMANDS else "control_request"


def handle(sup: CommandsRun, req: dict[str, Any]) -> dict[str, Any]:
    """Control-socket requests (answered on the main loop's thread).

    A refusal (`bad_state`, `bad_request`, `not_found`, `unknown_command`) is an answer, not an incident: the
    daemon did its job. A request that raises is the daemon's bug: answered `internal`, logged once per
    distinct error and recorded as one `internal_error` incident through the step guard (never bounded: the
    operator's call, not the loop spinning); the next request of the same command that is handled without
    raising, whatever its answer, resolves it. One the run outlives unretried is resolved when it completes.
    """
    cmd = req.get("cmd")
    answer: dict[str, Any] = {}
    raised: list[BaseException] = []

    def answer_it() -> None:
        try:
            answer.update(_answer(sup, cmd, req))
        except Exception as exc:
            raised.append(exc)  # its type goes into the answer; the guard logs and records it
            raise

    if sup.guard.run(guard_step(cmd), answer_it, bounded=False):
        return answer
    # No exception text to the client: it may hold paths or internals; the daemon log has it all.
    what = type(raised[0]).__name__ if raised else "unknown"
    return {"ok": False, "code": "internal",
            "error": f"internal error handling {bounded_repr(cmd)} ({what}); see the daemon log"}


def _answer(sup: CommandsRun, cmd: object, req: dict[str, Any]) -> dict[str, Any]:
    """The answer to one request; raises only on a bug (`handle` turns that into `internal`)."""
    args = req.get("args") or {}
    peer = req.get("peer") or {}
    if cmd == "status":
        return {"ok": True, "status": sup.status_dict()}
    if cmd == "pause":
        if sup.state in (S.PAUSED,) or sup.state in TERMINAL:
            return {"ok": False, "code": "bad_state", "error": f"run is {sup.state.value}"}
        sup.stop_run(operator_reason("pause", peer), pause=True)
        return {"ok": True, "state": sup.state.value}
    if cmd == "resume":
        if sup.state != S.PAUSED:
            return {"ok": False, "code": "bad_state", "error": f"run is {sup.state.value}, not PAUSED"}
        sup.launch(operator_reason("resume", peer))
        return {"ok": True, "state": sup.state.value}
    if cmd == "stop":
        if sup.state in TERMINAL:
            return {"ok": False, "code": "bad_state", "error": f"run is already {sup.state.value}"}
        sup.stop_run(operator_reason("stop", peer))
        return {"ok": True, "state": sup.state.value}
    if cmd == "restart":
        if sup.job is None or sup.state not in (S.RUNNING, S.STARTING):
            return {"ok": False, "code": "bad_state", "error": f"run is {sup.state.value}; nothing to restart"}
        why = operator_reason("restart", peer)
        sup.set_state(S.RESTARTING, why)
        sup.begin_termination(why, TerminationPlan.relaunching(Relaunch(why, None, counts_against_budget=False)),
                              grace=sup.dcfg.stop_grace_s)
        return {"ok": True, "state": sup.state.value}
    if cmd == "ack":
        iid = args.get("id")
        if type(iid) is not int or not 0 < iid <= INT64_MAX:
            return {"ok": False, "code": "bad_request",
                    "error": f"'args.id' must be a positive integer incident id, got {bounded_repr(iid)}"}
        by = args.get("by")
        if by is not None and (not isinstance(by, str) or len(by) > 200):
            return {"ok": False, "code": "bad_request",
                    "error": f"'args.by' must be an operator name (a string of at most 200 characters), "
                             f"got {bounded_repr(by)}"}
        try:
            uid = peer.get("uid")
            sup.store.ack_incident(iid, by.strip() if by and by.strip() else
                                   (f"uid:{uid}" if type(uid) is int else "an operator (uid unknown)"))
        except NotFoundError:
            return {"ok": False, "code": "not_found", "error": f"no incident {iid}"}
        return {"ok": True, "id": iid}
    return {"ok": False, "code": "unknown_command", "error": f"unknown command {bounded_repr(cmd)}"}
