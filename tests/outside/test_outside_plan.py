"""Outside-in: an ML engineer whose GPT runs out of memory on an H100 80 GB asks "what do I change so it
fits, and what does it cost?" using only README.md, docs/ and the commands' --help (issue 30).

Every check runs the real commands as subprocesses (`ulyssesctl plan`, `ulyssesd run`, `ulyssesctl replay`,
`ulyssesctl diagnose`) on spec files written here (never the shipped configs). A check that fails because of
a product bug is `xfail(strict=True)` and asserts the correct behaviour; its reason says what goes wrong.

This CPU host has no GPU. Where the docs say how the daemon side is seen on a CPU host, that is used: the
preflight reads the GPUs with `nvidia-smi` (docs/PLANNER.md "About preflight"), so a stand-in `nvidia-smi`
on PATH that answers like an H100 80 GB host lets `ulyssesd run` preflight a spec as it would there (the
built-in job then refuses `train.device = "cuda"` on a host without CUDA, so nothing big is ever started);
a CUDA OOM in a built-in CPU job comes from the documented `cuda_oom` fault; memory spikes come from replayed
step records (`ulyssesctl replay --spec`).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent
ULYSSESCTL = str(BIN / "ulyssesctl")
ULYSSESD = str(BIN / "ulyssesd")

# The levers the docs say a fix may change (docs/PLANNER.md "Fixes first"): none of them is the model, the
# sequence length, the global batch, the SP/DP layout or the hardware.
MEMORY_LEVER_KEYS = re.compile(
    r"^(train\.(micro_batch_size|gradient_accumulation_steps|activation_checkpoint_every|"
    r"activation_checkpoint_layers|loss_chunk_tokens)"
    r"|model\.(checkpoint_keep_attention|mlp_chunk_tokens|offload_checkpoints)"
    r"|launcher\.env\.PYTORCH_CUDA_ALLOC_CONF"
    r"|deepspeed\.config\..*"
    r"|restart\.(standby|standby_preload)|checkpoint\.async_save)$"
)
EXPERIMENT_OR_HARDWARE = re.compile(r"^(cluster\.|parallel\.|model\.(preset|hidden_size|num_layers|"
                                    r"num_attention_heads|vocab_size|ffn_hidden_size)$|train\.seq_len$)")


# ---------------------------------------------------------------------------------------------- spec files

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def _toml(d: dict[str, Any], prefix: str = "") -> str:
    """A small TOML writer for the specs below (tables, arrays of tables, inline `env`)."""
    out: list[str] = []
    scalars = {k: v for k, v in d.items() if not isinstance(v, dict) or k == "env"}
    scalars = {k: v for k, v in scalars.items()
               if not (isinstance(v, list) and v and isinstance(v[0], dict))}
    if prefix and scalars:
        out.append(f"[{prefix}]")
    out += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    for k, v in d.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and k != "env":
            out.append(_toml(v, name))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                out.append(f"[[{name}]]")
                out += [f"{ik} = {_toml_value(iv)}" for ik, iv in item.items()]
    return "\n".join(out) + "\n"


def gpt_spec(*, model: dict[str, Any] | None = None, seq: int = 32768, mb: int = 4, accum: int = 1,
             sp: int = 1, gpus: int = 1, recompute: int = 0, train: dict[str, Any] | None = None,
             zero: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """My run: issue 30's shape by default (gpt-1b, 32K tokens, micro-batch 4, no recompute)."""
    spec: dict[str, Any] = {
        "run": {"name": "my-gpt"},
        "launcher": {"kind": "torchrun", "nproc_per_node": gpus},
        "model": dict(model or {"preset": "gpt-1b"}),
        "parallel": {"sequence_parallel_size": sp},
        "precision": {"dtype": "bf16"},
        "train": {"steps": 1000, "seq_len": seq, "micro_batch_size": mb, "gradient_accumulation_steps": accum,
                  "activation_checkpoint_every": recompute, "device": "cuda", **(train or {})},
        "deepspeed": {"config": {"zero_optimization": {"stage": 3, **(zero or {})}}},
        "data": {"kind": "synthetic"},
        "daemon": {"preflight": False},
    }
    for k, v in (extra or {}).items():
        spec.setdefault(k, {}).update(v) if isinstance(v, dict) else spec.__setitem__(k, v)
    return spec


def write_spec(spec: dict[str, Any], path: Path) -> Path:
    path.write_text(_toml(spec))
    return path


def apply_overrides(spec: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A fix's or suggestion's dotted overrides into my spec file (and `cluster.*` into plan flags)."""
    spec = json.loads(json.dumps(spec))
    flags: list[str] = []
    for key, value in overrides.items():
        parts = key.split(".")
        if parts[0] == "cluster":
            flag = {"gpu": "--gpu", "host_mem_gib": "--host-mem", "nodes": "--nodes",
                    "gpus_per_node": "--gpus", "nvme_gib": "--nvme", "gpu_mem_gib": "--gpu-mem"}[parts[1]]
            flags += [flag, str(value)]
            continue
        node = spec
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return spec, flags


def run(cmd: list[str], timeout: float = 300, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def plan(spec_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return run([ULYSSESCTL, "plan", "--spec", str(spec_path), *flags])


def plan_json(spec_path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    p = plan(spec_path, *flags, "--json")
    assert p.returncode in (0, 1), (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return p.returncode, json.loads(p.stdout)


def numbered(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if re.match(r"^\s+\d+\. ", ln)]


# ------------------------------------------------------------------------------------ issue 30's spec

@pytest.fixture(scope="module")
def i30(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("i30")
    spec = gpt_spec()
    path = write_spec(spec, d / "gpt1b-32k-mb4.toml")
    text = plan(path, "--gpu", "h100-80g")
    rc, js = plan_json(path, "--gpu", "h100-80g")
    return {"spec": spec, "path": path, "dir": d, "text": text, "rc": rc, "json": js}


def test_i30_h100_does_not_fit_and_says_by_how_much(i30: dict[str, Any]) -> None:
    """`ulyssesctl plan --spec <gpt-1b 32K mb4> --gpu h100-80g`: exit 1, DOES NOT FIT, the GPU shortfall."""
    t = i30["text"]
    assert t.returncode == 1, t.stdout[-3000:]
    assert "DOES NOT FIT" in t.stdout
    assert re.search(r"GPU: needs [\d.]+ GiB per GPU .* has 79\.1 GiB: short by [\d.]+ GiB", t.stdout)
    js = i30["json"]
    assert js["fits"] is False and js["gpu_capacity_gib"] == pytest.approx(79.11, abs=0.01)
    assert js["gpu_required_gib"] > js["gpu_capacity_gib"]


def test_i30_first_listed_change_keeps_experiment_and_gpu(i30: dict[str, Any]) -> None:
    """Issue 30 "Done when": plan lists an experiment- and hardware-preserving fix first."""
    out = i30["text"].stdout
    fixes_at = out.index("Fixes that keep the experiment and the hardware")
    advice_at = out.index("Other changes that would fit")
    assert fixes_at < advice_at
    first = numbered(out)[0]
    assert first.startswith("1. ") and out.index(first) > fixes_at and out.index(first) < advice_at
    for word in ("H200", "sequence length", "node", "host RAM >=", "GPUs"):
        assert word not in first, first
    assert "global batch kept" in first or "micro-batch" not in first


def test_i30_every_fix_touches_only_memory_levers_and_keeps_global_batch(i30: dict[str, Any]) -> None:
    """JSON: each fix's overrides are memory levers only; micro-batch x accumulation stays 4."""
    fixes = i30["json"]["fixes"]
    assert fixes, "no fix found for issue 30's spec on an H100"
    for f in fixes:
        for key in f["overrides"]:
            assert MEMORY_LEVER_KEYS.match(key), (key, f["changes"])
            assert not EXPERIMENT_OR_HARDWARE.match(key), key
        mb = f["overrides"].get("train.micro_batch_size", 4)
        ga = f["overrides"].get("train.gradient_accumulation_steps", 1)
        assert mb * ga == 4, f["changes"]
        assert f["gpu_required_gib"] <= i30["json"]["gpu_capacity_gib"]


def test_i30_fixes_ranked_by_predicted_step_time_then_distance(i30: dict[str, Any]) -> None:
    fixes = i30["json"]["fixes"]
    keys = [(f["step_cost"], f["distance"]) for f in fixes]
    assert [k[0] for k in keys] == sorted(k[0] for k in keys)
    for a, b in zip(keys, keys[1:], strict=False):
        if a[0] == b[0]:
            assert a[1] <= b[1]
    # the text prints the same predicted step time as the JSON, fix by fix
    lines = numbered(i30["text"].stdout)[: len(fixes)]
    for f, line in zip(fixes, lines, strict=True):
        m = re.search(r"predicted step time \+([\d.]+)%", line)
        assert m and float(m.group(1)) == pytest.approx(100 * f["step_cost"], abs=0.051), line


def _expected_cost(fix: dict[str, Any], levers: dict[str, float], layers: int, mb0: int, seq_local: int) -> float | None:
    """The docs' cost table, added up: None when the fix uses a lever this check does not model."""
    o = fix["overrides"]
    keep = bool(o.get("model.checkpoint_keep_attention"))
    per_block = levers["recompute every block, keep attention" if keep else "recompute every block"]
    cost = 0.0
    for key, value in o.items():
        if key == "train.activation_checkpoint_layers":
            cost += per_block * value / layers
        elif key == "train.activation_checkpoint_every":
            cost += per_block * (1.0 if value >= 1 else 0.0)
        elif key == "train.loss_chunk_tokens":
            cost += levers["tiled loss"]
        elif key == "model.mlp_chunk_tokens":
            cost += levers["TiledMLP"]
        elif key == "train.micro_batch_size":
            halvings = int(round(math.log2(mb0 / value)))
            small = levers["micro-batch split (< 8K local tokens)"]
            cost += sum(small for h in range(1, halvings + 1) if (mb0 >> h) * seq_local < 8192)
        elif key in ("train.gradient_accumulation_steps", "model.checkpoint_keep_attention"):
            pass
        elif key == "launcher.env.PYTORCH_CUDA_ALLOC_CONF":
            cost += levers["expandable segments"]
        else:
            return None
    return cost


def test_i30_fix_costs_add_up_from_the_lever_table(i30: dict[str, Any]) -> None:
    """docs/PLANNER.md: one row per lever, "the costs add" (recompute: share of blocks recomputed)."""
    js = i30["json"]
    levers = {row["lever"]: row["step_time_fraction"] for row in js["lever_costs"]}
    for row in js["lever_costs"]:
        assert row["source"].startswith(("measured", "estimate")), row
    checked = 0
    for f in js["fixes"]:
        want = _expected_cost(f, levers, layers=24, mb0=4, seq_local=32768)
        if want is None:
            continue
        checked += 1
        assert f["step_cost"] == pytest.approx(want, abs=6e-4), (f["changes"], f["step_cost"], want)
    assert checked >= 3


def test_i30_hardware_and_experiment_changes_are_advice_listed_after_the_fixes(i30: dict[str, Any]) -> None:
    js = i30["json"]
    for s in js["suggestions"]:
        if any(EXPERIMENT_OR_HARDWARE.match(k) for k in s["overrides"]):
            assert s["advice"] is True, s["changes"]
    advice_lines = numbered(i30["text"].stdout)[len(js["fixes"]):]
    assert advice_lines, "no advice after the fixes"
    assert any("H200" in ln or "sequence length" in ln for ln in advice_lines)
    for ln in advice_lines:
        if "sequence length" in ln:
            assert "changes the experiment" in ln


@pytest.mark.slow
def test_i30_every_listed_fix_replans_to_a_fit_on_the_h100(i30: dict[str, Any]) -> None:
    """Written into my spec file, each fix must plan as FITS with the requirement the list printed."""
    for i, f in enumerate(i30["json"]["fixes"]):
        spec, flags = apply_overrides(i30["spec"], f["overrides"])
        assert not flags
        path = write_spec(spec, i30["dir"] / f"fix{i}.toml")
        rc, js = plan_json(path, "--gpu", "h100-80g")
        assert rc == 0 and js["fits"], (f["changes"], js["problems"])
        assert js["gpu_required_gib"] == pytest.approx(f["gpu_required_gib"], abs=0.05), f["changes"]


@pytest.mark.parametrize("gpu", ["a100-80g", "h200-141g"])
def test_first_listed_change_keeps_experiment_and_gpu_on_other_presets(i30: dict[str, Any], gpu: str) -> None:
    """The same spec for the other GPU presets: still a preserving fix first, every fix a memory lever."""
    rc, js = plan_json(i30["path"], "--gpu", gpu, "--host-mem", "512")
    assert rc == 1 and js["fixes"], js["fix_search"]
    for f in js["fixes"]:
        assert all(MEMORY_LEVER_KEYS.match(k) for k in f["overrides"]), f["overrides"]
        assert f["gpu_required_gib"] <= js["gpu_capacity_gib"]
    assert [f["step_cost"] for f in js["fixes"]] == sorted(f["step_cost"] for f in js["fixes"])


def test_expert_fix_fits_the_h100_with_room(tmp_path: Path) -> None:
    """The issue's expert fix: micro-batch 1 x accumulation 4, every layer recomputed, tiled loss."""
    path = write_spec(gpt_spec(mb=1, accum=4, recompute=1, train={"loss_chunk_tokens": 4096}), tmp_path / "e.toml")
    p = plan(path, "--gpu", "h100-80g")
    assert p.returncode == 0, p.stdout[-2000:]
    assert "FITS" in p.stdout and "Fixes that keep" not in p.stdout
    rc, js = plan_json(path, "--gpu", "h100-80g")
    assert 25 < js["gpu_peak_allocated_gib"] < 40, js["gpu_peak_allocated_gib"]


# --------------------------------------------------------------------------- which figures are assumed

def test_gpu_flag_says_host_ram_is_assumed_and_host_mem_replaces_it(i30: dict[str, Any]) -> None:
    origin = i30["json"]["cluster"]["origin"]
    assert "host RAM ASSUMED 2048 GiB" in origin and "--host-mem" in origin
    assert "h100-80g" in origin
    assert re.search(r"Figures: .*host RAM ASSUMED", i30["text"].stdout)
    rc, js = plan_json(i30["path"], "--gpu", "h100-80g", "--host-mem", "96")
    assert js["cluster"]["host_mem_gib"] == 96.0
    assert "ASSUMED" not in js["cluster"]["origin"], js["cluster"]["origin"]
    assert "96" in js["cluster"]["origin"]


def test_this_cpu_host_plan_says_every_figure_is_assumed(i30: dict[str, Any]) -> None:
    """Without --gpu on a host with no GPU: the a100-80g preset, said loudly, with the flags that fix it."""
    p = plan(i30["path"])
    assert p.returncode == 1
    fig = next(ln for ln in p.stdout.splitlines() if ln.startswith("Figures:"))
    assert "ASSUMED" in fig and "no GPU on this host" in fig and "--gpu" in fig and "--host-mem" in fig


def _meminfo_gib(field: str) -> float:
    for ln in Path("/proc/meminfo").read_text().splitlines():
        if ln.startswith(field + ":"):
            return int(ln.split()[1]) / 2**20
    raise AssertionError(field)


def test_this_host_ram_is_read_when_only_the_gpu_is_given(i30: dict[str, Any]) -> None:
    """`--gpu-mem` sets the GPU only; with no --host-mem and no GPU preset, which host RAM is planned must be
    said: this host's (/proc/meminfo) or an assumption named as such."""
    rc, js = plan_json(i30["path"], "--gpu-mem", "80")
    origin = js["cluster"]["origin"]
    host = js["cluster"]["host_mem_gib"]
    assert ("ASSUMED" in origin and "--host-mem" in origin) or host == pytest.approx(_meminfo_gib("MemTotal"), abs=1)


# ------------------------------------------------------------------------------- fits, and cannot fit

def test_a_spec_that_fits_trivially_exits_0_with_no_fixes(tmp_path: Path) -> None:
    path = write_spec(gpt_spec(seq=2048, mb=1), tmp_path / "small.toml")
    p = plan(path, "--gpu", "h100-80g", "--host-mem", "256")
    assert p.returncode == 0, p.stdout[-2000:]
    assert "VERDICT: FITS" in p.stdout
    assert "Fixes that keep" not in p.stdout and "Other changes" not in p.stdout
    rc, js = plan_json(path, "--gpu", "h100-80g", "--host-mem", "256")
    assert js["fits"] and js["fixes"] == [] and js["gpu_margin_gib"] > 40


@pytest.mark.slow
def test_gpu_too_small_for_anything_stops_clearly_with_advice(i30: dict[str, Any]) -> None:
    """A 0.5 GiB GPU: no lever fits (a CUDA context alone is 1 GiB): say so, then the advice."""
    p = plan(i30["path"], "--gpu-mem", "0.5", "--host-mem", "64")
    assert p.returncode == 1
    assert "No fix that keeps the experiment and the hardware fits" in p.stdout
    rc, js = plan_json(i30["path"], "--gpu-mem", "0.5", "--host-mem", "64")
    assert js["fixes"] == []
    assert js["suggestions"] and all(s["advice"] for s in js["suggestions"])


@pytest.mark.slow
def test_a_run_that_fits_nowhere_says_nothing_fits(tmp_path: Path) -> None:
    """The 176B preset at 1M tokens on one A100: no fix, no advice, a clear statement of both."""
    spec = gpt_spec(model={"preset": "gpt-176b", "max_seq_len": 1048576}, seq=1048576, mb=1)
    path = write_spec(spec, tmp_path / "huge.toml")
    p = plan(path, "--gpu", "a100-80g", "--host-mem", "64")
    assert p.returncode == 1
    assert "DOES NOT FIT" in p.stdout
    assert "No fix that keeps the experiment and the hardware fits" in p.stdout
    assert "No candidate change found that fits" in p.stdout


def test_host_bound_plan_lists_the_host_switch_first(tmp_path: Path) -> None:
    """docs/PLANNER.md: a plan that fails only for host RAM gets the [restart]/[checkpoint] switches as fixes."""
    spec = gpt_spec(seq=8192, mb=1, extra={"checkpoint": {"async_save": True}, "restart": {"standby": True}})
    path = write_spec(spec, tmp_path / "host.toml")
    p = plan(path, "--gpu", "h100-80g", "--host-mem", "32")
    assert p.returncode == 1
    assert re.search(r"host: needs [\d.]+ GiB .* node has 32 GiB", p.stdout)
    rc, js = plan_json(path, "--gpu", "h100-80g", "--host-mem", "32")
    first = js["fixes"][0]["overrides"]
    assert set(first) <= {"restart.standby_preload", "restart.standby", "checkpoint.async_save"}, first
    fixed, _ = apply_overrides(spec, first)
    rc2, js2 = plan_json(write_spec(fixed, tmp_path / "host-fixed.toml"), "--gpu", "h100-80g", "--host-mem", "32")
    assert rc2 == 0 and js2["host_required_gib"] <= 32


@pytest.mark.slow
def test_gpu_advice_keeps_the_host_ram_i_gave(i30: dict[str, Any]) -> None:
    rc, js = plan_json(i30["path"], "--gpu-mem", "0.5", "--host-mem", "16")
    h200 = [s for s in js["suggestions"] if s["overrides"].get("cluster.gpu") == "h200-141g"]
    assert h200
    for s in h200:
        job = {k: v for k, v in s["overrides"].items() if not k.startswith("cluster.host_mem")}
        spec, flags = apply_overrides(i30["spec"], job)
        rc2, js2 = plan_json(write_spec(spec, i30["dir"] / "h200-16g.toml"), *flags, "--host-mem", "16")
        if rc2 == 0:  # it fits the host I have: the advice must not ask for more RAM
            assert s["overrides"].get("cluster.host_mem_gib", 16.0) == 16.0, s["changes"]
            assert "2048 GiB host RAM" not in " ".join(s["changes"]), s["changes"]


# -------------------------------------------------------------------------- my own models and settings

VARIANTS = {
    # name: (spec kwargs, plan flags)
    "gpt1b-16k-mb8-a100": (dict(seq=16384, mb=8), ["--gpu", "a100-80g", "--host-mem", "512"]),
    "own-2.6b-16k-mb4-every4-h100": (dict(model={"hidden_size": 2560, "num_layers": 32, "num_attention_heads": 20,
                                                 "ffn_hidden_size": 10240, "vocab_size": 50304,
                                                 "max_seq_len": 16384},
                                          seq=16384, mb=4, recompute=4), ["--gpu", "h100-80g", "--host-mem", "256"]),
    "gpt7b-sp2-64k-2gpu-h100": (dict(model={"preset": "gpt-7b", "max_seq_len": 65536}, seq=65536, mb=1,
                                     accum=8, sp=2, gpus=2), ["--gpu", "h100-80g", "--host-mem", "512"]),
    "gpt1b-4k-mb32-h100": (dict(seq=4096, mb=32, train={"loss_chunk_tokens": 0}),
                           ["--gpu", "h100-80g", "--host-mem", "128"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_my_variants_fixes_keep_the_experiment_and_replan_to_fit(name: str, tmp_path: Path) -> None:
    kwargs, flags = VARIANTS[name]
    spec = gpt_spec(**kwargs)  # type: ignore[arg-type]
    path = write_spec(spec, tmp_path / f"{name}.toml")
    rc, js = plan_json(path, *flags)
    assert rc == 1, f"{name} was meant to be over the edge: {js['gpu_required_gib']} of {js['gpu_capacity_gib']}"
    assert js["fixes"], f"{name}: no preserving fix ({js['fix_search']})"
    gb = spec["train"]["micro_batch_size"] * spec["train"]["gradient_accumulation_steps"]
    costs = [f["step_cost"] for f in js["fixes"]]
    assert costs == sorted(costs)
    for i, f in enumerate(js["fixes"][:3]):
        o = f["overrides"]
        assert all(MEMORY_LEVER_KEYS.match(k) for k in o), o
        mb = o.get("train.micro_batch_size", spec["train"]["micro_batch_size"])
        assert mb * o.get("train.gradient_accumulation_steps", spec["train"]["gradient_accumulation_steps"]) == gb
        fixed, extra = apply_overrides(spec, o)
        rc2, js2 = plan_json(write_spec(fixed, tmp_path / f"{name}-fix{i}.toml"), *flags, *extra)
        assert rc2 == 0, (f["changes"], js2["problems"])
        assert js2["gpu_required_gib"] == pytest.approx(f["gpu_required_gib"], abs=0.05)
        assert js2["summary"]["seq_len"] == spec["train"]["seq_len"]
        assert js2["summary"]["params"] == js["summary"]["params"]


def test_micro_batch_split_costs_follow_the_lever_table(tmp_path: Path) -> None:
    """docs/PLANNER.md: a micro-batch split is free at >= 8K local tokens (+5 % per halving below); the
    tiled loss is one more head forward, a larger share of a 4K step than of a 32K one."""
    spec = gpt_spec(seq=4096, mb=32)
    path = write_spec(spec, tmp_path / "mb32.toml")
    rc, js = plan_json(path, "--gpu", "h100-80g", "--host-mem", "128")
    assert rc == 1 and js["fixes"]
    levers = {row["lever"]: row["step_time_fraction"] for row in js["lever_costs"]}
    seen = 0
    for f in js["fixes"]:
        want = _expected_cost(f, levers, layers=24, mb0=32, seq_local=4096)
        if want is None:
            continue
        seen += 1
        assert f["step_cost"] == pytest.approx(want, abs=6e-4), (f["changes"], f["step_cost"], want)
    assert seen
    assert levers["tiled loss"] > 0.0118  # gpt-1b at 32K: +1.2 %


def test_explicit_dims_without_preset_are_planned_as_written(tmp_path: Path) -> None:
    model = {"hidden_size": 3072, "num_layers": 28, "num_attention_heads": 24, "vocab_size": 32000,
             "max_seq_len": 32768}
    path = write_spec(gpt_spec(model=model, seq=8192, mb=1), tmp_path / "dims.toml")
    p = plan(path, "--gpu", "h100-80g", "--json")
    if p.returncode == 2:  # refusing is fine if it names the missing field
        assert "ffn_hidden_size" in p.stdout + p.stderr
        return
    js = json.loads(p.stdout)
    # 12·h²·L for the blocks with a 4h MLP, plus the embeddings: about 3.3B
    assert js["summary"]["params"] > 3.0e9, js["summary"]
    assert js["summary"]["model"] != "tiny"


def _offload_case(tmp_path: Path, *, offload: bool, mb: int = 32, accum: int = 1) -> Path:
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    return write_spec(gpt_spec(seq=4096, mb=mb, accum=accum, zero=zero), tmp_path / f"off{int(offload)}-{mb}.toml")


def test_a_30_gib_gpu_fits_my_4k_run_with_the_optimizer_on_the_host(tmp_path: Path) -> None:
    """gpt-1b, 4K tokens, micro-batch 32, a 30 GiB GPU and 128 GiB of host RAM: written by hand, micro-batch
    2 x accumulation 16 with the optimizer offloaded to CPU (both memory levers of the fix search) fits."""
    p = plan(_offload_case(tmp_path, offload=True, mb=2, accum=16), "--gpu-mem", "30", "--host-mem", "128")
    assert p.returncode == 0, p.stdout[-2500:]


@pytest.mark.slow
def test_a_fit_beyond_the_search_cap_is_found_or_not_called_impossible(tmp_path: Path) -> None:
    path = _offload_case(tmp_path, offload=False)
    p = plan(path, "--gpu-mem", "30", "--host-mem", "128")
    assert p.returncode == 1
    assert "No fix that keeps the experiment and the hardware fits" not in p.stdout
    rc, js = plan_json(path, "--gpu-mem", "30", "--host-mem", "128")
    assert js["fixes"], js["fix_search"]


# ----------------------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("flags,named", [
    (["--gpu", "h100"], "unknown GPU preset 'h100'"),
    (["--gpu", "H100-80G"], "unknown GPU preset"),
    (["--gpu", "rtx4090"], "known: a100-80g, h100-80g, h200-141g"),
    (["--gpu-mem", "0"], "--gpu-mem"),
    (["--gpu-mem", "nan"], "--gpu-mem"),
    (["--gpu-mem", "-3"], "--gpu-mem"),
    (["--gpu-mem", "5000"], "--gpu-mem"),
    (["--gpu-mem", "eighty"], "--gpu-mem"),
    (["--host-mem", "0"], "--host-mem"),
    (["--host-mem", "inf"], "--host-mem"),
    (["--nvme", "-1"], "--nvme"),
    (["--gpus", "0"], "--gpus"),
    (["--nodes", "0"], "--nodes"),
])
def test_bad_flags_exit_2_naming_the_flag(i30: dict[str, Any], flags: list[str], named: str) -> None:
    p = plan(i30["path"], *flags)
    assert p.returncode == 2, (flags, p.returncode, p.stdout[-500:])
    assert named in p.stdout + p.stderr


def test_empty_gpu_name_is_refused(i30: dict[str, Any]) -> None:
    p = plan(i30["path"], "--gpu", "")
    assert p.returncode == 2
    assert "GPU preset" in p.stdout + p.stderr


def test_plan_of_my_own_script_does_not_claim_it_fits(tmp_path: Path) -> None:
    (tmp_path / "ds_config.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 4,
                                                         "zero_optimization": {"stage": 3}}))
    spec = {"run": {"name": "mine"},
            "job": {"kind": "command", "command": ["python", "train.py", "--deepspeed_config", "{ds_config}"],
                    "ds_config": "ds_config.json", "checkpoint_dir": "ckpt"},
            "telemetry": {"source": "stdout"}}
    p = run([ULYSSESCTL, "plan", "--spec", str(write_spec(spec, tmp_path / "cmd.toml")), "--gpu", "h100-80g"],
            cwd=tmp_path)
    assert "VERDICT: FITS" not in p.stdout, p.stdout[:400]
    assert p.returncode == 2 and "command" in p.stdout + p.stderr


def test_missing_spec_file_is_bad_input(tmp_path: Path) -> None:
    p = plan(tmp_path / "nope.toml", "--gpu", "h100-80g")
    assert p.returncode == 2 and "file not found" in p.stdout + p.stderr


@pytest.mark.parametrize("train,named", [
    ({"micro_batch_size": 0}, "train.micro_batch_size"),
    ({"micro_batch_size": -4}, "train.micro_batch_size"),
    ({"gradient_accumulation_steps": 0}, "train.gradient_accumulation_steps"),
    ({"seq_len": -32768}, "train.seq_len"),
    ({"seq_len": 0}, "train.seq_len"),
    ({"seq_len": 40000000}, "train.seq_len"),
    ({"activation_checkpoint_every": -1}, "train.activation_checkpoint_every"),
    ({"loss_chunk_tokens": -5}, "train.loss_chunk_tokens"),
    ({"micro_batch_size": "four"}, "train.micro_batch_size"),
    ({"activation_checkpoint_layers": 99}, "train.activation_checkpoint_layers"),
])
def test_nonsense_numbers_in_my_spec_exit_2_naming_the_key(tmp_path: Path, train: dict[str, Any],
                                                          named: str) -> None:
    path = write_spec(gpt_spec(train=train), tmp_path / "bad.toml")
    p = plan(path, "--gpu", "h100-80g")
    assert p.returncode == 2, (train, p.returncode, p.stdout[-800:])
    assert named in p.stdout + p.stderr


def test_sp_must_divide_the_world_the_flags_ask_for(i30: dict[str, Any], tmp_path: Path) -> None:
    path = write_spec(gpt_spec(sp=2, gpus=2), tmp_path / "sp2.toml")
    p = plan(path, "--gpu", "h100-80g", "--gpus", "3")
    assert p.returncode == 2
    assert "--gpus" in p.stdout + p.stderr and "sequence_parallel_size=2" in p.stdout + p.stderr


def test_nodes_flag_with_a_standby_is_not_planned_as_fitting(tmp_path: Path) -> None:
    spec = gpt_spec(seq=8192, mb=1, extra={"restart": {"standby": True}})
    path = write_spec(spec, tmp_path / "standby.toml")
    assert plan(path, "--gpu", "h100-80g").returncode == 0  # one node: fits
    two = json.loads(json.dumps(spec))
    two["launcher"].update({"nnodes": 2, "rdzv_endpoint": "node0:29500"})
    refused = plan(write_spec(two, tmp_path / "standby-2n.toml"), "--gpu", "h100-80g")
    assert refused.returncode == 2 and "restart.standby" in refused.stdout + refused.stderr
    p = plan(path, "--gpu", "h100-80g", "--nodes", "2")
    assert p.returncode != 0 and "VERDICT: FITS" not in p.stdout
    assert "restart.standby" in p.stdout + p.stderr


def test_typo_in_a_model_key_is_named(tmp_path: Path) -> None:
    path = write_spec(gpt_spec(model={"preset": "gpt-1b", "hidden": 4096}), tmp_path / "typo.toml")
    p = plan(path, "--gpu", "h100-80g")
    assert p.returncode == 2 and "model.hidden: unknown key" in p.stdout + p.stderr


# ----------------------------------------------------------------- the daemon side, as seen on this host

def _fake_h100_path(tmp_path: Path) -> dict[str, str]:
    """An `nvidia-smi` that answers like one H100 80 GB (the preflight reads the GPUs with nvidia-smi)."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho \"NVIDIA H100 80GB HBM3, 81559\"\n")
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


def _daemon_spec(spec: dict[str, Any]) -> dict[str, Any]:
    spec = json.loads(json.dumps(spec))
    spec["daemon"] = {"preflight": True, "checkpoint_anchors": 1, "set_aside_keep": 0}
    spec["checkpoint"] = {"keep_last": 1, **spec.get("checkpoint", {})}
    spec["remediation"] = {"max_crash_restarts": 1}
    # if a launch happens, the job stops before it builds anything (and refuses "cuda" on this host anyway)
    spec["faults"] = [{"kind": "exit_at_start", "attempts": [1, 2, 3, 4]}]
    return spec


# A small-parameter model (0.13B: 2 GiB checkpoint tags) with long sequences: the memory preflight decides,
# never the checkpoint-disk preflight of a shared disk whose free space varies (gpt-1b's tags are 15.8 GiB).
SMALL = {"hidden_size": 1024, "num_layers": 8, "num_attention_heads": 16, "ffn_hidden_size": 4096,
         "vocab_size": 32000, "max_seq_len": 1048576}


def _over_the_edge() -> dict[str, Any]:
    """128K tokens x micro-batch 4, no recompute: ~366 GiB on one H100."""
    return gpt_spec(model=SMALL, seq=131072, mb=4)


def _daemon_run(spec: dict[str, Any], tmp_path: Path, env: dict[str, str],
                timeout: float = 180) -> subprocess.CompletedProcess[str]:
    path = write_spec(_daemon_spec(spec), tmp_path / "run.toml")
    return run([ULYSSESD, "run", "--spec", str(path), "--state-dir", str(tmp_path / "state")], env=env,
               timeout=timeout)


def test_preflight_on_an_h100_host_refuses_a_run_over_the_edge(tmp_path: Path) -> None:
    p = _daemon_run(_over_the_edge(), tmp_path, _fake_h100_path(tmp_path))
    assert p.returncode == 11, (p.returncode, p.stderr[-2000:])
    err = p.stdout + p.stderr
    assert "preflight refused the run" in err and re.search(r"GPU: needs [\d.]+ GiB .* short by", err), err[-800:]


def test_preflight_refusal_says_what_to_change(tmp_path: Path) -> None:
    p = _daemon_run(_over_the_edge(), tmp_path, _fake_h100_path(tmp_path))
    assert p.returncode == 11
    err = p.stdout + p.stderr
    assert re.search(r"GPU: needs [\d.]+ GiB .* short by", err), err[-800:]
    assert "ulyssesctl plan" in err or "micro-batch 4 -> 1" in err or "recompute" in err, err[-1500:]


def test_preflight_fails_closed_on_an_unreadable_gpu_memory(tmp_path: Path) -> None:
    """docs/PLANNER.md: a planner that raises refuses the launch like a plan that does not fit."""
    bindir = tmp_path / "nabin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text("#!/bin/sh\necho \"NVIDIA H100 80GB HBM3, [N/A]\"\n")
    (bindir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    p = _daemon_run(gpt_spec(model=SMALL, seq=2048, mb=1), tmp_path, env)
    assert p.returncode == 11, (p.returncode, p.stderr[-1500:])
    assert "preflight refused the run: the planner failed" in p.stdout + p.stderr, p.stderr[-800:]


def test_preflight_reads_this_hosts_ram(tmp_path: Path) -> None:
    """Checkpointed inputs offloaded to pinned host RAM (1M tokens, 16 blocks: 32 GiB) on this host."""
    if _meminfo_gib("MemTotal") > 34:
        pytest.skip("this host has enough RAM for the spec")
    spec = gpt_spec(model={**SMALL, "num_layers": 16, "offload_checkpoints": True}, seq=1048576, mb=1,
                    recompute=1, train={"loss_chunk_tokens": 8192})
    p = _daemon_run(spec, tmp_path, _fake_h100_path(tmp_path))
    assert p.returncode == 11, (p.returncode, p.stderr[-2000:])
    err = p.stdout + p.stderr
    m = re.search(r"host: needs [\d.]+ GiB .* the node has (\d+) GiB", err)
    assert m, err[-1500:]
    assert abs(int(m.group(1)) - _meminfo_gib("MemTotal")) <= 1
    assert "offload_checkpoints = false" in err


@pytest.mark.slow
def test_preflight_lets_the_plans_first_fix_through(tmp_path: Path) -> None:
    """The run over the edge with `plan --gpu h100-80g`'s first fix written in: the H100 preflight launches it."""
    spec = _over_the_edge()
    rc, js = plan_json(write_spec(spec, tmp_path / "plan.toml"), "--gpu", "h100-80g")
    assert rc == 1 and js["fixes"]
    fixed, _ = apply_overrides(spec, js["fixes"][0]["overrides"])
    p = _daemon_run(fixed, tmp_path, _fake_h100_path(tmp_path), timeout=400)
    assert p.returncode != 11, p.stderr[-2000:]
    assert "preflight refused" not in p.stdout + p.stderr
    inc = run([ULYSSESCTL, "--state-dir", str(tmp_path / "state"), "incidents", "--json"])
    assert inc.returncode == 0
    assert any(i["attempt"] >= 1 for i in json.loads(inc.stdout)), "no attempt was launched"


@pytest.mark.slow
def test_preflight_skipped_for_want_of_a_gpu_is_said(tmp_path: Path) -> None:
    bindir = tmp_path / "badbin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                   "driver.\"\nexit 9\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    p = _daemon_run(_over_the_edge(), tmp_path, env, timeout=400)
    assert p.returncode == 10, p.stderr[-1500:]  # launched without a plan; the job then refuses "cuda" here
    inc = run([ULYSSESCTL, "--state-dir", str(tmp_path / "state"), "incidents", "--json"])
    said = (p.stdout + p.stderr + inc.stdout).replace(str(tmp_path), "<tmp>")  # the test's name has "preflight"
    assert re.search(r"(memory plan|preflight)[^\n]*(skipped|no GPU)|no GPU[^\n]*(plan|preflight)", said, re.I), \
        said[-1500:]


def _steps(path: Path, alloc: tuple[float, float], reserved: tuple[float, float], n: int = 120,
           at: int = 70) -> Path:
    lines = []
    for s in range(1, n + 1):
        late = s >= at
        lines.append(json.dumps({"kind": "step", "step": s, "loss": 3.0 - 0.001 * s, "time": 1000 + 1.2 * s,
                                 "step_time_s": 1.2, "tokens_per_s": 27000,
                                 "mem_max_allocated_gib": alloc[late], "mem_reserved_gib": reserved[late]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _replay_decisions(telemetry: Path, spec: Path) -> list[dict[str, Any]]:
    p = run([ULYSSESCTL, "replay", str(telemetry), "--spec", str(spec), "--json"])
    assert p.returncode == 0, p.stderr[-2000:]
    return [i for i in json.loads(p.stdout)["items"] if i["type"] == "decision"]


def test_replayed_fragmentation_spike_gets_expandable_segments(tmp_path: Path) -> None:
    spec = gpt_spec(mb=1, extra={"detectors": {"device_memory_gib": 79.1, "warmup_steps": 5}})
    path = write_spec(spec, tmp_path / "spec.toml")
    decisions = _replay_decisions(_steps(tmp_path / "t.jsonl", (60.0, 70.0), (62.0, 79.0)), path)
    assert decisions and decisions[0]["symptom"] == "memory_spike"
    assert decisions[0]["config_patch"] == {"launcher.env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "fragmentation" in decisions[0]["reason"]


def test_replayed_spike_skips_rungs_already_in_place_and_never_touches_the_experiment(tmp_path: Path) -> None:
    spec = gpt_spec(mb=1, zero={"stage3_param_persistence_threshold": 1e6},
                    extra={"detectors": {"device_memory_gib": 79.1, "warmup_steps": 5},
                           "launcher": {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}})
    path = write_spec(spec, tmp_path / "spec.toml")
    decisions = _replay_decisions(_steps(tmp_path / "t.jsonl", (60.0, 77.0), (61.0, 77.5)), path)
    assert decisions
    d = decisions[0]
    assert "expandable_segments skipped" in d["reason"] and "raise_persistence_threshold skipped" in d["reason"]
    for key, value in d["config_patch"].items():
        assert not EXPERIMENT_OR_HARDWARE.match(key), key
        assert d["previous"].get(key) != value, (key, value)


def _oom_log(path: Path) -> Path:
    path.write_text(
        "step 41 loss 3.1102 lr 3.0e-04\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 88, in <module>\n'
        "    loss.backward()\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of "
        "79.11 GiB of which 3.21 GiB is free. Including non-PyTorch memory, this process has 75.88 GiB memory in "
        "use. Of the allocated memory 73.40 GiB is allocated by PyTorch, and 1.62 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\n")
    return path


def test_diagnose_labels_an_h100_oom_log(tmp_path: Path) -> None:
    p = run([ULYSSESCTL, "diagnose", str(_oom_log(tmp_path / "job.log")), "--exit-code", "1", "--json"])
    assert p.returncode == 0, p.stderr[-1000:]
    assert json.loads(p.stdout)["label"] == "cuda_oom"


def _cpu_oom_spec(at_step: int, zero: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    launcher: dict[str, Any] = {"kind": "torchrun", "nproc_per_node": 1}
    if env:
        launcher["env"] = env
    return {
        "run": {"name": "cpu-oom"}, "launcher": launcher, "model": {"preset": "tiny"},
        "parallel": {"sequence_parallel_size": 1}, "precision": {"dtype": "fp32"},
        "train": {"steps": 16, "seq_len": 128, "micro_batch_size": 4, "gradient_accumulation_steps": 1,
                  "device": "cpu"},
        "deepspeed": {"config": {"zero_optimization": {"stage": 3, **zero}}},
        "data": {"kind": "synthetic"}, "checkpoint": {"interval_steps": 4, "keep_last": 2},
        "faults": [{"kind": "cuda_oom", "at_step": at_step}],
    }


def _memory_actions(state: Path) -> list[dict[str, Any]]:
    p = run([ULYSSESCTL, "--state-dir", str(state), "incidents", "--json"])
    assert p.returncode == 0, p.stderr
    return [a for i in json.loads(p.stdout) if i["symptom"] == "cuda_oom" for a in i["actions"]]


@pytest.mark.slow
def test_cpu_job_oom_mid_run_far_above_its_peak_relaunches_unchanged(tmp_path: Path) -> None:
    """docs/REMEDIATION.md "A transient spike mid-run": steady steps, then an OOM with 52 GiB allocated."""
    state = tmp_path / "state"
    path = write_spec(_cpu_oom_spec(6, {}), tmp_path / "run.toml")
    p = run([ULYSSESD, "run", "--spec", str(path), "--state-dir", str(state)], timeout=500)
    assert p.returncode == 0, p.stderr[-2000:]
    acts = _memory_actions(state)
    assert acts and acts[0]["parameters"]["rung"] == "relaunch_unchanged"
    assert acts[0]["config_diff"] == {} and acts[0]["to_config_version"] == acts[0]["from_config_version"]
    assert acts[0]["parameters"]["evidence"]["cause"] == "transient"


@pytest.mark.slow
def test_cpu_job_oom_at_first_step_takes_the_first_rung_that_changes_something(tmp_path: Path) -> None:
    state = tmp_path / "state"
    zero = {"stage3_param_persistence_threshold": 1e6, "stage3_max_live_parameters": 1e7,
            "stage3_prefetch_bucket_size": 1e6}
    spec = _cpu_oom_spec(1, zero, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    path = write_spec(spec, tmp_path / "run.toml")
    p = run([ULYSSESD, "run", "--spec", str(path), "--state-dir", str(state)], timeout=500)
    assert p.returncode == 0, p.stderr[-2000:]
    acts = _memory_actions(state)
    assert acts
    diff = acts[0]["config_diff"]
    assert diff and all(old != new for old, new in diff.values()), diff
    for key in diff:
        assert not EXPERIMENT_OR_HARDWARE.match(key), key
    assert diff.get("train.micro_batch_size") == [4, 2] and diff.get("train.gradient_accumulation_steps") == [1, 2]
