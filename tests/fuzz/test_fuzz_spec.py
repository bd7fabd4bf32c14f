"""Fuzz: the spec loader. The shipped tiny CPU spec, with one field per section (or a new key) set to a hostile
value, rendered as TOML, then cut or bit-flipped, is written to a real file and loaded: the only outcomes are a
RunSpec or SpecError (whose problems are short strings), never another exception."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from fuzz_helpers import MIN_CASES, fuzz_settings, variants
from fuzz_strategies import VALUES
from hypothesis import given
from hypothesis import strategies as st

from ulyssesd.daemon.spec import DaemonSpec, RunSpec, load_run_spec
from ulyssesd.training.spec import JobSpec, SpecError, read_toml

BASE = read_toml(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml")
SECTIONS = {name: list(getattr(f.annotation, "model_fields", {}) or ["x"])
            for model in (DaemonSpec, JobSpec) for name, f in model.model_fields.items()}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string (a lone surrogate stays invalid: the loader must say so)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    return '""'  # None: TOML has no null


def to_toml(doc: dict) -> str:
    lines = []
    for section, body in doc.items():
        if isinstance(body, dict):
            lines.append(f"[{json.dumps(section)}]")
            lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in body.items() if v is not None]
        elif body is not None:
            lines.insert(0, f"{json.dumps(section)} = {_toml_value(body)}")
    return "\n".join(lines) + "\n"


def test_spec_loader_returns_a_spec_or_spec_error(fuzz_dir):
    path = fuzz_dir / "run.toml"
    cases = [0]

    @fuzz_settings(cases_per_example=4)
    @given(edits=st.lists(st.tuples(st.sampled_from(sorted(SECTIONS)), st.integers(0, 40), VALUES), max_size=3),
           whole_section=st.one_of(st.none(), st.sampled_from(sorted(SECTIONS))), replacement=VALUES)
    def run(edits, whole_section, replacement):
        doc = copy.deepcopy(BASE)
        for section, key_index, value in edits:
            keys = SECTIONS[section]
            key = keys[key_index] if key_index < len(keys) else f"unknown_{key_index}"
            body = doc.setdefault(section, {})
            if isinstance(body, dict):
                body[key] = value
        if whole_section is not None:
            doc[whole_section] = replacement  # e.g. [train] replaced by a number or a list
        for data in variants(to_toml(doc).encode(), n_cuts=2, n_flips=1):
            path.write_bytes(data)
            try:
                spec = load_run_spec(path)
            except SpecError as exc:
                assert exc.problems and all(isinstance(p, str) and len(p) < 5000 for p in exc.problems)
            else:
                assert isinstance(spec, RunSpec)
            cases[0] += 1

    run()
    assert cases[0] >= MIN_CASES


def test_a_nul_byte_in_a_path_is_a_spec_error_naming_the_key(tmp_path):
    # Found by the fuzz above: os.path.realpath raised ValueError("embedded null byte") out of the loader.
    (tmp_path / "run.toml").write_text('[data]\npath = "corpus\\u0000.bin"\n')
    with pytest.raises(SpecError) as err:
        load_run_spec(tmp_path / "run.toml")
    assert err.value.problems == ["data.path: a path may not contain a NUL byte"]
