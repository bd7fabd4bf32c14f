"""The engine's view of the job: its config values as dotted keys ("train.lr", "model.num_layers").

The engine never imports the job's spec classes (remediation imports neither the daemon nor the training
job): the daemon, which owns the spec, calls `job_values` with the values it validated and resolved —
the job config as configs/vN.json holds it, the preset's resolved layer count, the launcher env.

What of remediation's changes reach the job (`JobReach`): a rung whose change cannot reach it is skipped with why.

The built-in job takes every key of its config. A command job (any program) takes only what the daemon can
hand it: keys with a DeepSpeed equivalent in its own ds_config (docs/CLIENT.md, "Remediation of a command
job"), launcher environment variables, control.json values when its client reads control.json, and a
rollback to an earlier checkpoint of its own. A change the job never sees is a restart for nothing, so the
ladder moves on to a rung that applies (rollback, alert, stop) instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: DeepSpeed's own ZeRO-3 defaults (deepspeed 0.19.8, `DeepSpeedZeroConfig`) for the memory knobs the
#: remediation ladders move and the memory planner reads: the one owner of these numbers (remediation
#: imports neither daemon nor training, so training's planner imports them from here).
ZERO3_DEFAULTS: dict[str, int] = {
    "stage3_param_persistence_threshold": 100_000,  # params with numel <= this stay gathered on every GPU
    "stage3_max_live_parameters": 1_000_000_000,  # cap on gathered (unpartitioned) numel
    "stage3_prefetch_bucket_size": 50_000_000,  # numel gathered ahead of use
    "reduce_bucket_size": 500_000_000,  # numel of the gradient reduce bucket
}


def job_values(config: Mapping[str, Any] | None, *, num_layers: int | None = None,
               launcher_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Flatten a job config (nested like configs/vN.json, dotted, or both) into dotted keys; lists stay leaves.

    `num_layers` is the model's resolved layer count (a preset leaves `model.num_layers` unset in the
    config; the fp32-first-layers rung needs it); `launcher_env` becomes `launcher.env.NAME` keys.
    Raises TypeError naming the type when `config` is not a mapping (a spec object must be dumped first)."""
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise TypeError(f"job_values needs the job config as a mapping (e.g. JobSpec.model_dump(mode='json')), "
                        f"got {type(config).__name__}")
    out: dict[str, Any] = {}

    def walk(prefix: str, d: Mapping[str, Any]) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, Mapping) and v:
                walk(key + ".", v)
            else:
                out[key] = v

    walk("", config)
    if num_layers is not None:
        out["model.num_layers"] = num_layers
    for name, value in (launcher_env or {}).items():
        out[f"launcher.env.{name}"] = value
    return out


#: The data skip ranges of a rollback (the built-in job's sampler): a rollback without them still applies.
K_SKIP = "data.skip_ranges"


@dataclass(frozen=True)
class JobReach:
    """Which changes reach the job; None = all of that kind (the built-in job)."""

    #: Dotted config keys (or prefixes ending in ".") a relaunch hands the job; None = every key.
    config_keys: frozenset[str] | None = None
    #: control.json values the job applies while it runs; None = every one the contract defines.
    hot_controls: frozenset[str] | None = None
    #: Why the config keys are limited (said in the skip reason), e.g. "a command job without a ds_config".
    why_limited: str = ""

    def takes_key(self, key: str) -> bool:
        if self.config_keys is None:
            return True
        return any(key == k or (k.endswith(".") and key.startswith(k)) for k in self.config_keys)

    def takes_hot(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        return bool(keys) and (self.hot_controls is None or all(k in self.hot_controls for k in keys))

    def why_not(self, apply: str, patch: dict[str, Any], hot_control: dict[str, Any]) -> str | None:
        """None when the rung's change reaches the job; else why it does not (the rung's skip reason).

        A rung with no config change (stop, alert, a plain restart or rollback) always applies; a rollback's
        own skip ranges are not its change. A hot rung applies when the job applies its control.json values,
        else (it becomes a restart) when its config change reaches the job. One key of a change reaching the
        job is enough (an LR cut's min_lr rides along with the LR)."""
        change = [k for k in patch if k != K_SKIP]
        if apply in ("stop", "none") or (not change and not hot_control):
            return None
        if apply == "hot" and self.takes_hot(k for k in hot_control if k not in ("suspect", "dump_stacks")):
            return None
        if change and any(self.takes_key(k) for k in change):
            return None
        if not change:
            return "the job does not apply control.json values ([telemetry] source reads its log)"
        where = f" ({self.why_limited})" if self.why_limited else ""
        return f"{', '.join(sorted(change))} does not reach the job{where}"


#: The built-in job: every change reaches it.
BUILTIN = JobReach()
