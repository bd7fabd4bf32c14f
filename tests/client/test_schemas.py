"""The shipped JSON Schemas and the parsers the daemon and the job really use accept exactly the same
documents, on valid and invalid samples of each: a telemetry line (remediation.records.parse_record),
control.json (client.contract.parse_control) and a checkpoint manifest (training.checkpoint.read_manifest).
Every record the client's Reporter writes is valid under the telemetry schema and the producer validator."""

from __future__ import annotations

import hashlib
import json

import jsonschema
import pytest

from ulyssesd.client import Reporter, parse_control, read_manifest, schema, validate_record
from ulyssesd.client.manifest import ManifestError
from ulyssesd.remediation.records import RecordError, parse_record


def _validator(name: str) -> jsonschema.protocols.Validator:
    doc = schema(name)
    cls = jsonschema.validators.validator_for(doc)
    cls.check_schema(doc)
    return cls(doc)


TELEMETRY = [
    ({"kind": "step", "step": 1, "loss": 2.3}, True),
    ({"v": 1, "kind": "step", "time": 1.5, "attempt": 3, "step": 1200, "loss": 2.31, "grad_norm": 0.84,
      "lr": 1.2e-4, "loss_scale": None, "skipped": False, "step_time_s": 2.92, "tokens": 32768,
      "samples": [0, 8], "config_version": 2}, True),
    ({"kind": "step", "step": 0, "loss": "nan", "grad_norm": "inf"}, True),
    ({"kind": "step", "step": 4, "loss": "-Infinity"}, True),
    ({"kind": "step", "step": 4, "loss": 1.0, "unknown_field": {"x": 1}}, True),  # unknown: ignored
    ({"kind": "step", "step": 4, "loss": 1.0, "tokens": 5.0}, True),  # JSON integer 5.0
    ({"kind": "event", "event": "started"}, True),
    ({"kind": "event", "event": "checkpoint_saved", "step": None, "time": 17.5, "tag": "t"}, True),
    ({"kind": "event", "event": "x", "time": "nan"}, False),             # time is the clock: finite
    ({"kind": "step", "step": 1, "loss": 1.0, "time": "inf"}, False),
    ({"kind": "step", "step": 2**63, "loss": 1.0}, False),               # past SQLite's INTEGER
    ({"kind": "step", "step": 1, "loss": 1.0, "tokens": -(2**63) - 1}, False),
    ({"kind": "step", "step": 2**63 - 1, "loss": 1.0}, True),
    ({"kind": "step", "step": 1}, False),                               # no loss
    ({"kind": "step", "loss": 1.0}, False),                             # no step
    ({"kind": "step", "step": -1, "loss": 1.0}, False),
    ({"kind": "step", "step": 1.5, "loss": 1.0}, False),
    ({"kind": "step", "step": True, "loss": 1.0}, False),
    ({"kind": "step", "step": 1, "loss": "big"}, False),
    ({"kind": "step", "step": 1, "loss": 1.0, "skipped": "no"}, False),
    ({"kind": "step", "step": 1, "loss": 1.0, "grad_norm": True}, False),
    ({"kind": "step", "step": 1, "loss": 1.0, "slowest_rank": 0.5}, False),
    ({"kind": "step", "step": 1, "loss": 1.0, "samples": [1]}, False),
    ({"kind": "step", "step": 1, "loss": 1.0, "samples": [1, "2"]}, False),
    ({"kind": "step", "step": 1, "loss": 1.0, "v": "1"}, False),
    ({"kind": "event", "event": ""}, False),
    ({"kind": "event", "step": 3}, False),
    ({"kind": "event", "event": "x", "step": -2}, False),
    ({"kind": "weird", "step": 1, "loss": 1.0}, False),
    ({"step": 1, "loss": 1.0}, False),
    ([1, 2], False),
    ("step", False),
]


@pytest.mark.parametrize("doc, ok", TELEMETRY, ids=[f"t{i}" for i in range(len(TELEMETRY))])
def test_telemetry_schema_matches_the_daemons_parser(doc, ok):
    schema_ok = _validator("telemetry-record").is_valid(doc)
    try:
        parse_record(doc)
        parser_ok = True
    except RecordError:
        parser_ok = False
    assert (schema_ok, parser_ok) == (ok, ok)


CONTROL = [
    ({"version": 4, "lr_scale": 0.9, "gradient_clipping": 0.5, "suspect": False, "dump_stacks": False}, True),
    ({"version": 1}, True),
    ({"version": 1.0}, True),
    ({"version": 2, "lr_scale": None, "gradient_clipping": 0}, True),
    ({"version": 2, "lr_scale": 10}, True),
    ({"version": 2, "future_key": "x"}, True),
    ({"lr_scale": 0.9}, False),
    ({"version": "1"}, False),
    ({"version": True}, False),
    ({"version": 1, "lr_scale": 0}, False),
    ({"version": 1, "lr_scale": 10.5}, False),
    ({"version": 1, "lr_scale": -1}, False),
    ({"version": 1, "gradient_clipping": -0.1}, False),
    ({"version": 1, "gradient_clipping": True}, False),
    ({"version": 1, "suspect": "yes"}, False),
    ({"version": 1, "dump_stacks": 1}, False),
    ([], False),
]


@pytest.mark.parametrize("doc, ok", CONTROL, ids=[f"c{i}" for i in range(len(CONTROL))])
def test_control_schema_matches_the_jobs_parser(doc, ok):
    schema_ok = _validator("control").is_valid(doc)
    parsed, reason = parse_control(json.dumps(doc))
    assert (schema_ok, parsed is not None) == (ok, ok), reason


_FILES = {"mp_rank_00_model_states.pt": {"size": 10, "sha256": "ab"}}
_CHUNK_LIST = hashlib.sha256(bytes.fromhex("a" * 64 + "b" * 64)).hexdigest()
MANIFEST = [
    ({"step": 5, "files": _FILES}, True),
    ({"v": 1, "tag": "checkpoint-5", "step": 5, "loss": "nan", "samples_seen": 40, "config_version": None,
      "time": 1.0, "files": {"sub/dir/x.bin": {"size": 0, "sha256": "cd"}}, "extra": {}}, True),
    ({"step": 5, "files": {"a..b": {"size": 1, "sha256": "x"}}}, True),  # '..' inside a name is fine
    ({"files": _FILES}, False),
    ({"step": 5}, False),
    ({"step": "5", "files": _FILES}, False),
    ({"step": True, "files": _FILES}, False),
    ({"step": 5, "files": {}}, False),
    ({"step": 5, "files": []}, False),
    ({"step": 5, "files": {"x": {"size": "10", "sha256": "ab"}}}, False),
    ({"step": 5, "files": {"x": {"size": 10}}}, False),
    ({"v": 3, "step": 5, "files": {"x": {"size": 8192, "chunk_bytes": 4096, "chunk_sha256": ["a" * 64, "b" * 64],
                                         "chunk_list_sha256": _CHUNK_LIST}}}, True),   # v3: chunk digests only
    ({"v": 3, "step": 5, "files": {"x": {"size": 8192, "chunk_list_sha256": _CHUNK_LIST}}}, False),
    ({"step": 5, "files": {"/etc/passwd": {"size": 1, "sha256": "x"}}}, False),
    ({"step": 5, "files": {"../up": {"size": 1, "sha256": "x"}}}, False),
    ({"step": 5, "files": {"a/../../up": {"size": 1, "sha256": "x"}}}, False),
    (["step"], False),
]


@pytest.mark.parametrize("doc, ok", MANIFEST, ids=[f"m{i}" for i in range(len(MANIFEST))])
def test_manifest_schema_matches_the_checkpoint_reader(doc, ok, tmp_path):
    schema_ok = _validator("checkpoint-manifest").is_valid(doc)
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    try:
        read_manifest(tmp_path)
        reader_ok = True
    except ManifestError:
        reader_ok = False
    assert (schema_ok, reader_ok) == (ok, ok)


def test_every_record_the_reporter_writes_is_valid(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    with Reporter(path, attempt=2, config_version=1, rank=0) as rep:
        rep.step(1, 2.5, grad_norm=float("inf"), lr=1e-4, skipped=True, samples=[0, 8], tokens=64)
        rep.step(2, float("nan"))
        rep.event("checkpoint_saved", 2, tag="step-00000002", seconds=0.1, bytes=5)
        rep.event("exiting", 2, reason="completed")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["step", "step", "event", "event"]
    tele = _validator("telemetry-record")
    for r in recs:
        assert tele.is_valid(r), r
        assert validate_record(r) == [], r
        parse_record(r)
    assert recs[1]["loss"] == "nan" and recs[0]["grad_norm"] == "inf"
