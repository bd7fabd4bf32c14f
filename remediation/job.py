"""The engine's view of the job: its config values as dotted keys ("train.lr", "model.num_layers").

The engine never imports the job's spec classes (remediation imports neither the daemon nor the training
job): the daemon, which owns the spec, calls `job_values` with the values it validated and resolved —
the job config as configs/vN.json holds it, the preset's resolved layer count, the launcher env.
"""

from __future__ import annotations

from collections.abc import Mapping
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
