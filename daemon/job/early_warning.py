"""The engine's early warnings, as the daemon gives them: said, logged and alerted as warnings (no incident
until a detector finds the blow-up); with `[remediation] early_warning_clip` on, a grad-norm warning's
pre-emptive clip (remediation/learned/preempt.py) is applied hot through control.json, recorded as an action
(no incident: nothing was found yet) with the warning as its evidence and its own config version, and its
verification (effective / ineffective) recorded when the engine has it."""

from __future__ import annotations

from typing import Any, Protocol

from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.job import config as jc
from ulyssesd.daemon.ports import JobConfig, Records, RunFiles
from ulyssesd.daemon.store.enums import ActionKind, ApplyMode
from ulyssesd.daemon.telemetry import log_source

log = get_logger("ulyssesd.supervisor")


class EarlyWarningRun(RunFiles, JobConfig, Records, Protocol):
    """What the early-warning path uses of the run."""

    engine: Any  # the remediation engine


def early_warnings(sup: EarlyWarningRun) -> None:
    """Drain the engine's new warnings (and a pre-emptive clip's verification)."""
    for w in sup.engine.new_warnings:
        log.warning("early warning", run_id=sup.run_id, step=w.get("step"), signal=w.get("signal"), z=w.get("z"),
                    source=w.get("source"))
        sup.say(f"  early warning: {w.get('message')}")
        sup.alert("incident", f"early warning at step {w.get('step')}: {w.get('message')}", warning=True,
                  evidence={k: v for k, v in w.items() if k not in ("message", "action")})
        act = w.get("action")
        if isinstance(act, dict) and "patch" in act:
            preempt(sup, w, act)
        elif isinstance(act, dict) and act.get("skipped"):
            sup.say(f"  pre-emptive clip skipped: {act['skipped']}")
    sup.engine.new_warnings = []
    verified(sup)


def preempt(sup: EarlyWarningRun, w: dict[str, Any], act: dict[str, Any]) -> None:
    evidence = {k: v for k, v in w.items() if k not in ("message", "action")}
    params = {"rung": "preemptive_clip", "warning": evidence, "rule": act["rule"], "uses": act["uses"]}
    observe = sup.spec.remediation.mode == "observe"
    if not observe and log_source.stdout_source(sup.config):
        sup.say("  pre-emptive clip not applied: the job reads no control.json ([telemetry] source = stdout)")
        return
    if observe:
        aid = sup.incidents.action(None, ActionKind.hot_control, params, {}, ApplyMode.hot, observe_only=True)
        sup.say(f"  observe-only: would lower the clip {act['from']} -> {act['to']} ({act['rule']})")
    else:
        from_v = sup.config_version
        try:
            to_v, diff = sup.new_config_version(act["patch"], f"early warning at step {w.get('step')}: "
                                                              f"pre-emptive clip ({act['rule']})")
            ctl = jc.write_control(sup.run_dir, gradient_clipping=act["to"])
        except (OSError, ValueError) as exc:   # a full disk, a config the job would refuse: said, not applied
            sup.engine.preempt.pending = None
            log.warning("pre-emptive clip not applied", run_id=sup.run_id, error=repr(exc))
            sup.say(f"  pre-emptive clip not applied: {exc}")
            return
        aid = sup.incidents.action(None, ActionKind.hot_control, {**params, "control": ctl}, diff, ApplyMode.hot,
                                   from_v, to_v)
        sup.say(f"  action: pre-emptive clip {act['from']} -> {act['to']} hot via control.json v{ctl['version']} "
                f"({act['rule']})")
    if sup.engine.preempt.pending is not None:
        sup.engine.preempt.pending["action_id"] = aid   # its verdict names it (PreemptiveClip.outcomes)


def verified(sup: EarlyWarningRun) -> None:
    """Record the engine's verdicts on pre-emptive clips (effective: its window passed clean)."""
    outcomes = sup.engine.preempt.outcomes
    for o in outcomes:
        aid = o.get("action_id")
        if not isinstance(aid, int):
            continue
        sup.store.verify_action(aid, o["outcome"], {"why": o["why"], "at_step": o["at_step"]})
        sup.say(f"  pre-emptive clip (action #{aid}) {o['outcome']}: {o['why']}")
    outcomes.clear()
