"""Live control of the built-in job (`{run_dir}/control.json`, docs/CONTRACTS.md): the client's
implementation (`ulyssesd.client`), re-exported under the names the job and the daemon import.

Rank 0 reads the file, every rank receives the same parsed state through one broadcast_object_list,
and a version is applied exactly once. Missing file or key = no change; a garbage file is logged once
and ignored.
"""

from __future__ import annotations

from ulyssesd.client.contract import (
    STACK_DUMP_DIR,
    ControlState,
    parse_control,
    stack_dump_files,
    stack_dump_path,
)
from ulyssesd.client.control import ControlPoller, engine_clip, set_engine_clip

__all__ = ["STACK_DUMP_DIR", "ControlPoller", "ControlState", "engine_clip", "parse_control", "set_engine_clip",
           "stack_dump_files", "stack_dump_path"]
