"""The planner with `model.offload_checkpoints`: the GPU keeps only the chunk inputs in flight, the host holds
all of them (pinned, in power-of-two blocks), `ulyssesctl plan` prints that host line and preflight refuses
a run whose offloaded inputs do not fit the host's RAM."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ulyssesd.daemon.operator.ctl_plan import preflight, register_plan
from ulyssesd.daemon.spec import load_run_spec
from ulyssesd.training.model.gpt import GPT
from ulyssesd.training.planner import Cluster, plan
from ulyssesd.training.planner.cost_model import OFFLOAD_IN_FLIGHT, checkpointed_inputs
from ulyssesd.training.spec import JobSpec, ModelSpec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GiB = 1 << 30
H200 = dict(gpus_per_node=1, nodes=1)
HOST_ITEM = "offloaded checkpointed inputs (pinned)"


def _plan(seq: int, host_gib: float = 128.0, train: dict | None = None, **model):
    job = JobSpec.model_validate({
        "model": {"preset": "gpt-1b", "max_seq_len": 1 << 20, "mlp_chunk_tokens": 16384, **model},
        "precision": {"dtype": "bf16"},
        "train": {"seq_len": seq, "activation_checkpoint_every": 1, "loss_chunk_tokens": 8192, **(train or {})}})
    return plan(job, Cluster.preset("h200-141g", host_mem_gib=host_gib, **H200), search=False)


def _items(p) -> dict[str, tuple[int, str]]:
    return {i.name: (i.bytes, i.where) for i in p.items}


def test_1m_tokens_gpu_drops_by_the_inputs_not_in_flight_and_the_host_holds_them_all():
    seq = 1 << 20
    each = seq * 2048 * 2                                     # b·s·h·bf16 = 4 GiB per block input
    plain, off = _plan(seq), _plan(seq, offload_checkpoints=True)
    assert plain.fits is False                               # 160 GiB peak: the reason for the option
    assert plain.gpu_peak_allocated - off.gpu_peak_allocated == (24 - OFFLOAD_IN_FLIGHT) * each
    assert off.fits is True and off.gpu_peak_allocated < 100 * GiB  # 93.0 GiB (fp32 LayerNorm copies)
    items = _items(off)
    assert items[HOST_ITEM] == (24 * each, "host")           # 96 GiB pinned
    assert off.host_required - plain.host_required == 24 * each
    assert items["checkpointed chunk inputs, in flight (2 of 24; the rest offloaded to host)"] == (2 * each, "gpu")
    assert off.summary["offloaded_checkpoint_bytes_per_rank"] == 24 * each
    assert HOST_ITEM not in _items(plain)


def test_pinned_blocks_are_rounded_up_to_a_power_of_two():
    seq = 3 << 18                                            # 768K: 3 GiB per input, 4 GiB pinned blocks
    items = _items(_plan(seq, offload_checkpoints=True))
    assert items[HOST_ITEM][0] == 24 * 4 * GiB


@pytest.mark.parametrize("train,count", [({"activation_checkpoint_every": 2}, 12),
                                         ({"activation_checkpoint_layers": 6}, 6),
                                         ({"activation_checkpoint_layers": 1}, 1)])
def test_chunks_and_selective_recompute_offload_one_input_per_checkpoint(train, count):
    seq = 1 << 18
    items = _items(_plan(seq, train=train, offload_checkpoints=True))
    assert items[HOST_ITEM][0] == count * seq * 2048 * 2
    gpu = [(n, b) for n, (b, w) in items.items() if "in flight" in n]
    assert gpu == [(gpu[0][0], min(2, count) * seq * 2048 * 2)]


def test_host_ram_that_cannot_hold_the_inputs_is_refused_and_enough_is_accepted():
    small = _plan(1 << 20, host_gib=64.0, offload_checkpoints=True)
    assert small.fits is False
    assert any(p.startswith("host: needs 103 GiB") and "64 GiB" in p for p in small.problems), small.problems
    assert not any(p.startswith("GPU") for p in small.problems)
    assert _plan(1 << 20, host_gib=128.0, offload_checkpoints=True).fits


def test_planner_count_and_bytes_equal_what_the_model_offloads():
    """Cross-check against the code: the tiny model's offloader stats for one forward."""
    for kw, k, ck in (({"checkpoint_every": 1}, 1, None), ({"checkpoint_every": 3}, 3, None),
                      ({"checkpoint_layers": 2}, 0, 2)):
        torch.manual_seed(0)
        cfg = ModelSpec(preset="tiny", offload_checkpoints=True).resolved()
        model = GPT(cfg, "math", **kw)
        b, s = 2, 32
        ids = torch.randint(0, 256, (b, s))
        model(ids, torch.arange(s).expand(b, s), ids).backward()
        count, each = checkpointed_inputs(b * s, cfg, 4, k, ck)
        assert (model.last_offload.tensors, model.last_offload.bytes) == (count, count * each), kw


def _offload_1m_spec(tmp_path: Path) -> Path:
    text = (CONFIGS / "gpt-1b-1xh200.toml").read_text()
    text = text.replace('preset = "gpt-1b"', 'preset = "gpt-1b"\nmax_seq_len = 1048576\noffload_checkpoints = true\n'
                        'mlp_chunk_tokens = 16384', 1)
    text = re.sub(r"(?m)^seq_len = \d+", "seq_len = 1048576", text)
    text = re.sub(r"(?m)^activation_checkpoint_every = \d+", "activation_checkpoint_every = 1", text)
    # As bench/gpu_long_seq.sh runs it: no async saves, no warm standby (their 33 GiB of host RAM would not fit
    # beside the 96 GiB of pinned inputs on a 128 GiB host: tests/planner/test_planner_standby.py).
    text = re.sub(r"(?m)^async_save = true", "async_save = false", text)
    text = re.sub(r"(?m)^standby = true", "standby = false", text)
    path = tmp_path / "gpt-1b-1m-offload.toml"
    path.write_text(text)
    return path


def test_ulyssesctl_plan_shows_the_host_line_and_preflight_refuses_a_small_host(tmp_path):
    import typer

    app = typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    register_plan(app)
    spec = _offload_1m_spec(tmp_path)
    ok = CliRunner().invoke(app, ["plan", "--spec", str(spec), "--gpu", "h200-141g", "--host-mem", "128"])
    assert ok.exit_code == 0, ok.output
    assert re.search(r"offloaded checkpointed inputs \(pinned\)\s+96\.0", ok.output), ok.output
    assert "required host RAM" in ok.output
    small = CliRunner().invoke(app, ["plan", "--spec", str(spec), "--gpu", "h200-141g", "--host-mem", "64"])
    assert small.exit_code == 1 and "host: needs" in small.output, small.output
    run_spec = load_run_spec(spec)
    refused, p = preflight(run_spec, Cluster.preset("h200-141g", host_mem_gib=64.0, **H200))
    assert not refused and any(x.startswith("host:") for x in p.problems)
    accepted, _ = preflight(run_spec, Cluster.preset("h200-141g", host_mem_gib=128.0, **H200))
    assert accepted


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_search_suggests_tiled_mlp_and_offload_for_1m_tokens_and_the_suggestion_fits():
    from ulyssesd.training.planner import apply_overrides

    long_job = JobSpec.model_validate({"model": {"preset": "gpt-1b", "max_seq_len": 1 << 20},
                                       "precision": {"dtype": "bf16"},
                                       "train": {"seq_len": 1 << 20, "activation_checkpoint_every": 1,
                                                 "loss_chunk_tokens": 8192}})
    p = plan(long_job, Cluster.preset("h200-141g", host_mem_gib=128.0, **H200))
    assert not p.fits
    best = p.suggestions[0]
    assert best.overrides == {"model.mlp_chunk_tokens": 16384, "model.offload_checkpoints": True}, best
    job, cluster, ds = apply_overrides(long_job, p.cluster, {}, best.overrides)
    assert job.model.offload_checkpoints is True
    assert plan(job, cluster, ds, search=False).fits
    # 32K already fits: nothing to suggest.
    short = plan(JobSpec.model_validate({"model": {"preset": "gpt-1b"}, "precision": {"dtype": "bf16"},
                                         "train": {"seq_len": 32768, "activation_checkpoint_every": 1}}),
                 Cluster.preset("h200-141g", host_mem_gib=128.0, **H200))
    assert short.fits and not short.suggestions


def test_keep_last_moves_n_inputs_from_the_host_to_the_gpu():
    seq = 1 << 20
    each = seq * 2048 * 2
    full, kept = _plan(seq, offload_checkpoints=True), _plan(seq, offload_checkpoints=True, offload_keep_last=10)
    assert _items(kept)[HOST_ITEM] == (14 * each, "host")
    assert kept.gpu_peak_allocated - full.gpu_peak_allocated == 10 * each
    assert full.host_required - kept.host_required == 10 * each
    gpu = {n: b for n, (b, w) in _items(kept).items() if "in flight" in n}
    assert gpu == {"checkpointed chunk inputs, 10 kept + in flight (12 of 24; the rest offloaded to host)": 12 * each}
    # Keeping them all: nothing pinned, every input on the GPU (as without offload).
    assert HOST_ITEM not in _items(_plan(seq, offload_checkpoints=True, offload_keep_last=24))


def test_planner_keep_last_count_equals_what_the_model_offloads():
    torch.manual_seed(0)
    cfg = ModelSpec(preset="tiny", offload_checkpoints=True, offload_keep_last=3).resolved()
    model = GPT(cfg, "math", checkpoint_every=1)
    b, s = 2, 32
    ids = torch.randint(0, 256, (b, s))
    model(ids, torch.arange(s).expand(b, s), ids).backward()
    job = JobSpec.model_validate({"model": {"preset": "tiny", "offload_checkpoints": True, "offload_keep_last": 3},
                                  "precision": {"dtype": "fp32"},
                                  "train": {"seq_len": s, "micro_batch_size": b, "activation_checkpoint_every": 1}})
    p = plan(job, Cluster.preset("h200-141g", **H200), search=False)
    assert model.last_offload.tensors == 1
    assert _items(p)[HOST_ITEM][0] == model.last_offload.tensors * _pinned(model.last_offload.bytes)


def _pinned(nbytes: int) -> int:
    return 1 << max(0, nbytes - 1).bit_length()
