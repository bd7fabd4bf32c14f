"""A Suggestion's or Fix's dotted overrides applied to the (job, cluster, DeepSpeed config) a plan is made of."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from ..spec import JobSpec
from .inputs import Cluster


def apply_overrides(job: JobSpec, cluster: Cluster, ds_config: dict[str, Any],
                    overrides: dict[str, Any]) -> tuple[JobSpec, Cluster, dict[str, Any]]:
    """Apply a Suggestion's `overrides` (dotted keys: `train.*`, `parallel.*`, `deepspeed.config.*`,
    `cluster.*`, ...) and return the changed (job, cluster, ds_config). `restart.*` keys (the daemon's
    section, not the job's) are left to `apply_restart_overrides`; `launcher.env.*` (the allocator) to the
    caller's allocator headroom."""
    data = job.model_dump()
    ds = copy.deepcopy(ds_config)
    for dotted, val in overrides.items():
        parts = dotted.split(".")
        if parts[0] in ("restart", "launcher"):
            continue
        if parts[0] == "cluster":
            if parts[1] == "gpu":
                cluster = Cluster.preset(val, cluster.gpus_per_node, cluster.nodes, host_mem_gib=cluster.host_mem_gib,
                                         nvme_gib=cluster.nvme_gib)
            else:
                cluster = replace(cluster, **{parts[1]: val})
            continue
        node = ds if parts[:2] == ["deepspeed", "config"] else data
        parts = parts[2:] if node is ds else parts
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = val
    return JobSpec.model_validate(data), cluster, ds
