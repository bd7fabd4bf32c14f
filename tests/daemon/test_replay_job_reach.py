"""`ulyssesctl replay --spec` builds its engine with the spec's job reach (remediation/job.py `JobReach`), as the
live daemon does: on a command job's log it recommends only the rungs that job can take, with the skipped ones
and why; without a spec (the built-in job) the clip rung comes first as before."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

from ulyssesd.daemon.operator.ctl_offline import run_replay


def _log(tmp: Path) -> Path:
    """A healthy falling loss, then a blow-up (8x for 60 steps) that the loss ladder acts on."""
    rng = random.Random(0)
    lines = []
    for s in range(1, 301):
        loss = (3.0 - s / 300) * (1 + 0.02 * rng.gauss(0, 1))
        if 200 <= s < 260:
            loss *= 8
        lines.append(f"step {s} loss {loss:.4f}\n")
    path = tmp / "attempt-1.log"
    path.write_text("".join(lines))
    return path


def _decisions(log: Path, spec: Path | None) -> list[dict]:
    out, err = io.StringIO(), io.StringIO()
    assert run_replay(log, spec=spec, as_json=True, out=out, err=err) == 0, err.getvalue()
    return [it for it in json.loads(out.getvalue())["items"] if it["type"] == "decision"]


def _spec(tmp: Path, extra: str = "") -> Path:
    spec = tmp / "run.toml"
    spec.write_text('[job]\nkind = "command"\ncommand = ["train.py", "--resume", "{resume}"]\n' + extra
                    + '[telemetry]\nsource = "stdout"\n')
    return spec


def test_replay_without_spec_recommends_the_clip_rung_of_the_built_in_job(tmp_path):
    first = _decisions(_log(tmp_path), None)[0]
    assert first["action_kind"] == "lower_clip", first


def test_replay_of_a_command_job_without_ds_config_skips_what_cannot_reach_it(tmp_path):
    decisions = _decisions(_log(tmp_path), _spec(tmp_path))
    assert decisions, "the blow-up is acted on"
    kinds = {d["action_kind"] for d in decisions}
    assert not kinds & {"lower_clip", "fp32_layers", "lower_lr"}, kinds
    first = decisions[0]
    assert "lower_clip skipped" in first["reason"] and "without [job] ds_config" in first["reason"], first["reason"]
    assert "train.gradient_clipping" not in first["config_patch"]


def test_replay_of_a_command_job_with_ds_config_takes_the_clip(tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0}))
    first = _decisions(_log(tmp_path), _spec(tmp_path, f"ds_config = {json.dumps(str(ds))}\n"))[0]
    # The clip reaches it through its ds_config (the daemon applies a hot rung to such a job as a restart).
    assert first["action_kind"] == "lower_clip" and "train.gradient_clipping" in first["config_patch"], first


def test_replay_of_a_command_job_knows_its_checkpoint_files_and_never_rolls_back_to_scratch(tmp_path):
    """The daemon learns a command job's saves from its checkpoint dir, not its log: replay looks at the same
    files, so a NaN after saves rolls back to the newest clean save before it; set-aside copies are not targets.
    Without the dir (the negative control) there is no save to go back to: from scratch, said as such."""
    import torch

    log = tmp_path / "attempt-1.log"
    log.write_text("".join(f"iter {s}: loss {'nan' if s == 45 else f'{3 - s / 100:.4f}'}, time 12.00ms\n"
                           for s in range(1, 49)))
    ck = tmp_path / "ck"
    ck.mkdir()
    for s in (10, 20, 30, 40):
        torch.save({"step": s}, ck / f"ckpt_{s:05d}.pt")
    torch.save({"step": 50}, ck / "ckpt_00050.pt.rolledback-1700000000")  # a poisoned save, set aside
    spec = _spec(tmp_path, f'checkpoint_dir = "{ck}"\n')
    rollbacks = [d for d in _decisions(log, spec) if d["action_kind"] == "rollback_skip"]
    assert rollbacks and "from scratch" not in rollbacks[0]["reason"], rollbacks
    assert "ckpt_00040.pt" in json.dumps(rollbacks[0]), rollbacks[0]
    for p in ck.iterdir():
        p.unlink()
    rollbacks = [d for d in _decisions(log, spec) if d["action_kind"] == "rollback_skip"]
    assert rollbacks and "from scratch" in rollbacks[0]["reason"], rollbacks
