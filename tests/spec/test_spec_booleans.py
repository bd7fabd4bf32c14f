"""Booleans in a run spec are TOML booleans: `tensorboard = 1` or `csv = "yes"` is refused with the key path and
`true`/`false` in the message (pydantic's lax mode took 1, "yes", "on", "1" as true and 0, "no", "off" as false,
so `standby = "false"`… was `False` only by luck and `csv = "no"` never said it was a string). Walks every
boolean field of every section, daemon and job side, so a new one cannot slip back to lax parsing."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from ulyssesd.daemon.spec import DaemonSpec, JobSection, load_run_spec, run_spec_from_dict
from ulyssesd.training.spec import JobSpec, SpecError, load_job_spec

REPO = Path(__file__).resolve().parents[2]


def _is_bool(annotation) -> bool:
    """bool, or bool | None, also when wrapped in Annotated (pydantic's StrictBool inside an Optional)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return len(members) == 1 and _is_bool(members[0])
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0] is bool
    return annotation is bool


def _bool_fields() -> list[tuple[str, str, object]]:
    """(section, key, default) of every boolean key of the run spec's tables."""
    found = []
    sections: dict[str, type[BaseModel]] = {"job": JobSection}
    for top in (DaemonSpec, JobSpec):
        for name, field in top.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                sections[name] = field.annotation
    for section, model in sections.items():
        for key, field in model.model_fields.items():
            if _is_bool(field.annotation):
                found.append((section, key, field.default))
    return found


BOOL_FIELDS = _bool_fields()


def test_the_walk_finds_the_booleans_of_both_sides():
    keys = {f"{s}.{k}" for s, k, _ in BOOL_FIELDS}
    assert {"scalars.tensorboard", "scalars.csv", "restart.standby", "daemon.preflight", "job.resume_first",
            "detectors.drift_enabled", "remediation.bf16_supported", "model.tie_embeddings"} <= keys, keys


@pytest.mark.parametrize("value", [1, 0, "yes", "true", "false", 1.0], ids=repr)
@pytest.mark.parametrize(("section", "key", "default"), BOOL_FIELDS, ids=[f"{s}.{k}" for s, k, _ in BOOL_FIELDS])
def test_a_non_boolean_is_refused_naming_the_key(section, key, default, value):
    with pytest.raises(SpecError) as exc:
        run_spec_from_dict({section: {key: value}}, "run.toml")
    assert len(exc.value.problems) == 1, exc.value.problems
    problem = exc.value.problems[0]
    assert f"{key}={value!r}" in problem, problem
    assert problem.startswith(f"[job] {key}=") if section == "job" else f"{section}.{key}=" in problem, problem
    assert "true or false" in problem, problem


@pytest.mark.parametrize(("section", "key", "default"), BOOL_FIELDS, ids=[f"{s}.{k}" for s, k, _ in BOOL_FIELDS])
def test_a_boolean_still_loads(section, key, default):
    value = default if isinstance(default, bool) else False
    spec = run_spec_from_dict({section: {key: value}}, "run.toml")
    target = spec.job_section if section == "job" else getattr(spec, section, None) or getattr(spec.job, section)
    assert getattr(target, key) is value


def test_a_toml_file_with_an_integer_flag_is_refused_by_both_readers(tmp_path):
    """The daemon's reader and the job's own (`ulysses-train --spec`) give the same line."""
    spec = tmp_path / "run.toml"
    spec.write_text('[scalars]\ntensorboard = 1\ncsv = "yes"\n[checkpoint]\nasync_save = true\n')
    for load in (load_run_spec, load_job_spec):
        with pytest.raises(SpecError) as exc:
            load(spec)
        assert exc.value.problems == [
            "scalars.tensorboard=1: must be true or false (a TOML boolean)",
            "scalars.csv='yes': must be true or false (a TOML boolean)",
        ], exc.value.problems


def test_configs_with_booleans_load(tmp_path):
    spec = tmp_path / "run.toml"
    spec.write_text((REPO / "configs" / "tiny-cpu.toml").read_text() + '\n[scalars]\ntensorboard = true\ncsv = false\n')
    loaded = load_run_spec(spec)
    assert loaded.job.scalars.tensorboard is True and loaded.job.scalars.csv is False
