"""Resume decisions of the Trainer without DeepSpeed: tag choice, quarantine, `latest`, config re-applied."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ulyssesd.training.checkpoint import read_latest, write_manifest
from ulyssesd.training.control import ControlPoller, engine_clip
from ulyssesd.training.spec import job_spec_from_dict
from ulyssesd.training.telemetry import TelemetryWriter
from ulyssesd.training.train import Trainer, lr_at


def _trainer(tmp_path: Path, **sections) -> Trainer:
    t = Trainer(job_spec_from_dict(sections), tmp_path, attempt=2, config_version=3)
    t.rank, t.world = 0, 1
    t.tele = TelemetryWriter(tmp_path / "telemetry.jsonl", 2, 3)
    return t


def _tag(root: Path, step: int, valid: bool = True) -> Path:
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    if valid:
        write_manifest(d, step, 1.0, step, 1)
    return d


def test_latest_skips_and_quarantines_invalid_tags_and_rewrites_latest(tmp_path):
    root = tmp_path / "checkpoints"
    _tag(root, 2)
    _tag(root, 4)
    _tag(root, 6, valid=False)  # crash mid-save: no manifest
    (root / "latest").write_text("step-00000006")
    t = _trainer(tmp_path)
    assert t._choose_tag() == ("step-00000004", None)
    assert read_latest(root) == "step-00000004"
    assert any(p.name.startswith("step-00000006.corrupt-") for p in root.iterdir())
    t.tele.close()
    assert '"event":"checkpoint_invalid"' in (tmp_path / "telemetry.jsonl").read_text()


def test_explicit_tag_points_latest_at_it_upstream_8499(tmp_path):
    root = tmp_path / "checkpoints"
    _tag(root, 2)
    _tag(root, 4)
    (root / "latest").write_text("step-00000004")
    t = _trainer(tmp_path, checkpoint={"load": "step-00000002"})
    assert t._choose_tag() == ("step-00000002", None)
    assert read_latest(root) == "step-00000002"


def test_no_valid_tag_is_fatal_but_no_tags_is_a_fresh_start(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    assert _trainer(tmp_path)._choose_tag() == (None, None)
    _tag(root, 2, valid=False)
    tag, error = _trainer(tmp_path)._choose_tag()
    assert tag is None and "no valid checkpoint" in error
    assert _trainer(tmp_path, checkpoint={"load": "none"})._choose_tag() == (None, None)


def test_current_config_wins_after_load(tmp_path):
    t = _trainer(tmp_path, precision={"dtype": "fp16", "loss_scale": {"min_loss_scale": 4, "loss_scale_window": 50}},
                 train={"gradient_clipping": 0.5, "lr": 9e-4, "min_lr": 9e-5, "steps": 100})
    # What DeepSpeed leaves behind after load_checkpoint: the checkpoint's lr, clip and scaler.
    scaler = SimpleNamespace(min_scale=1.0, scale_window=1000, delayed_shift=2, cur_hysteresis=2, cur_scale=1024.0)
    opt = SimpleNamespace(clip_grad=1.0, loss_scaler=scaler, param_groups=[{"lr": 1e-3}, {"lr": 1e-3}])
    t.engine = SimpleNamespace(optimizer=opt, _config=SimpleNamespace(gradient_clipping=1.0))
    t.control = ControlPoller(None, 0, 1)
    t.step = 40
    t._reapply_config_after_load()
    assert engine_clip(t.engine) == 0.5 and t.engine._config.gradient_clipping == 0.5
    assert (scaler.min_scale, scaler.scale_window, scaler.cur_scale) == (4, 50, 1024.0)  # live scale kept
    assert all(g["lr"] == lr_at(41, t.spec) for g in opt.param_groups)
