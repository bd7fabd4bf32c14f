"""ulyssesd.client: what a training script needs to be supervised by ulyssesd (docs/CLIENT.md).

Importable without torch or deepspeed:
- `Reporter`: steps and events to the run's telemetry.jsonl (buffered, a writer thread, never blocks);
- `Control`: poll control.json between steps; apply lr scale / clipping to a DeepSpeed engine or a torch
  optimizer; `suspect` says whether a SIGTERM may save;
- `write_manifest` / `validate_manifest`: the manifest of any checkpoint directory;
- `install_signal_handlers`: SIGTERM -> a stop flag, SIGUSR1 -> per-rank stack dumps;
- `ulyssesd.client.deepspeed.attach(engine)` and `ulyssesd.client.hf.UlyssesCallback` (they import their
  framework when you import them);
- `schema(name)`: the shipped JSON Schemas ("telemetry-record", "control", "checkpoint-manifest").
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from ulyssesd.client.contract import (
    EVENTS,
    SCHEMA_VERSION,
    ControlState,
    encode_record,
    parse_control,
    stack_dump_files,
    stack_dump_path,
    validate_record,
)
from ulyssesd.client.control import Control, ControlPoller
from ulyssesd.client.manifest import ManifestError, read_manifest, validate_manifest, write_manifest
from ulyssesd.client.reporter import Reporter, ReporterConfig
from ulyssesd.client.signals import GracefulStop, install_signal_handlers, register_stack_dumps

SCHEMA_NAMES = ("telemetry-record", "control", "checkpoint-manifest")


def schema(name: str) -> dict[str, Any]:
    """A shipped JSON Schema by name (one of SCHEMA_NAMES)."""
    if name not in SCHEMA_NAMES:
        raise ValueError(f"unknown schema {name!r}; expected one of {', '.join(SCHEMA_NAMES)}")
    text = resources.files("ulyssesd.client").joinpath("schemas", f"{name}.schema.json").read_text()
    return json.loads(text)


__all__ = [
    "EVENTS", "SCHEMA_NAMES", "SCHEMA_VERSION", "Control", "ControlPoller", "ControlState", "GracefulStop",
    "ManifestError", "Reporter", "ReporterConfig", "encode_record", "install_signal_handlers", "parse_control",
    "read_manifest", "register_stack_dumps", "schema", "stack_dump_files", "stack_dump_path",
    "validate_manifest", "validate_record", "write_manifest",
]
