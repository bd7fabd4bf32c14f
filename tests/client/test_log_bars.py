"""Which progress bar sets the step of a printed loss dict: only the run's training bar (issue 28)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ulyssesd.remediation.log_telemetry import LogTelemetryParser

HF = Path(__file__).resolve().parents[1] / "fixtures" / "logs_hf"


def _steps(lines, **kw) -> tuple[list[int], LogTelemetryParser]:
    p = LogTelemetryParser(**kw)
    recs = [r for line in lines for r in p.feed(line) if r["kind"] == "step"]
    return [r["step"] for r in recs], p


@pytest.mark.parametrize("name", ["hf_trainer_5_25_no_tqdm_saves.log", "hf_trainer_5_25_tqdm_saves.log"])
def test_hf_trainer_saves_do_not_reset_the_step(name):
    text = (HF / name).read_text(errors="replace")
    truth = [round(64 * float(e)) for e in re.findall(r"'loss': '[^']*', .*?'epoch': '([\d.]+)'", text)]
    assert truth == list(range(1, 31)) and text.count("Writing model shards") >= 3
    steps, p = _steps(text.splitlines(keepends=True))
    assert steps == truth
    assert p.stats.bad_lines == 0 and p.stats.discontinuities == 0


def _hf_dict(i: int) -> str:
    return f"{{'loss': {2.5 - i / 1000:.4f}, 'grad_norm': 0.8, 'learning_rate': 5e-05, 'epoch': {i / 100:.2f}}}\n"


def test_dicts_numbered_in_order_keep_their_count_across_save_load_map_and_eval_bars():
    """HF 4.x/5.x without the Trainer's bar, saves every 10 steps; the other bars transformers and datasets print."""
    lines = ["Loading checkpoint shards: 100%|██████████| 2/2 [00:01<00:00,  1.50it/s]\n",
             "Map:  50%|█████     | 500/1000 [00:00<00:00, 9000.00 examples/s]\rMap: 100%|██████████| 1000/1000"
             " [00:00<00:00, 9100.00 examples/s]\n"]
    for i in range(1, 61):
        lines.append(_hf_dict(i))
        if i % 10 == 0:
            lines.append("Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]"
                         "\rWriting model shards: 100%|██████████| 1/1 [00:00<00:00, 220.27it/s]\n")
            lines.append("\r  0%|          | 0/8 [00:00<?, ?it/s]\r 50%|█████     | 4/8 [00:00<00:00, 30.1it/s]"
                         "\r100%|██████████| 8/8 [00:00<00:00, 31.0it/s]\n")
            lines.append(f"{{'eval_loss': 2.4, 'eval_runtime': 0.3, 'epoch': {i / 100:.2f}}}\n")
    lines[40:40] = ["{'loss': nan, 'grad_norm': nan, 'learning_rate': 5e-05, 'epoch': 0.61}\n"]
    steps, p = _steps(lines)
    assert steps[:60] == list(range(1, 61))
    assert p.stats.bad_lines == 0


def test_the_training_bar_sets_the_step_and_other_bars_between_do_not():
    lines = []
    for i in range(1, 41):
        lines.append(f"\r{i * 100 // 40:3d}%|█         | {i}/40 [00:0{i % 10}<00:10,  1.50s/it]")
        lines.append(f"\r{_hf_dict(i)}")
        if i % 10 == 0:
            lines.append("Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 220.27it/s]\n")
            lines.append("Evaluating: 100%|██████████| 8/8 [00:00<00:00, 31.0it/s]\n")
            lines.append(" 50%|█████     | 4/8 [00:00<00:00, 30.1it/s]\n")
    steps, p = _steps(lines)
    assert steps == list(range(1, 41)) and p.stats.bad_lines == 0


def test_a_bar_with_the_declared_total_is_the_training_bar_from_the_start():
    lines = ["Loading checkpoint shards:  50%|█████     | 1/2 [00:01<00:01,  1.50it/s]\n",
             "Loading checkpoint shards: 100%|██████████| 2/2 [00:01<00:00,  1.50it/s]\n"]
    for i in range(1, 21):
        lines.append(f" {i * 5}%|█         | {i}/20 [00:0{i % 10}<00:10,  1.50s/it]\n")
        lines.append(_hf_dict(i))
    steps, _ = _steps(lines, total_steps=20)
    assert steps == list(range(1, 21))


@pytest.mark.parametrize("line,step,loss", [
    ("ep 0 it 41/300 train-loss=0.0366", 41, 0.0366),
    ("itr 5 loss 2.3", 5, 2.3),
    ("iters: 10, loss: 1.0", 10, 1.0),
    ("upd 7 | loss 3.5", 7, 3.5),
    ("updates=7 loss=3.5", 7, 3.5),
    ("gs=12 loss=1.25", 12, 1.25),
    ("global_step 5 loss 1.5", 5, 1.5),
    ("it 41/300 loss 0.5", 41, 0.5),
])
def test_step_abbreviations(line, step, loss):
    steps, p = _steps([line + "\n"])
    assert steps == [step]


def test_it_and_gs_alone_are_words_not_step_headers():
    steps, _ = _steps(["took it 3 times\n", "it 3\n", "{'loss': 2.0}\n"])
    assert steps == [1]  # the dict is numbered in order, not placed at "step 3"


def test_a_scripts_own_it_wording_across_epochs():
    lines = [f"ep {i // 100} it {i}/300 train-loss={0.05 - i / 1e5:.4f}\n" for i in range(1, 301)]
    steps, p = _steps(lines)
    assert steps == list(range(1, 301)) and p.stats.bad_lines == 0


def test_a_resumed_attempts_dicts_are_numbered_on_from_its_checkpoint(tmp_path):
    """HF without its bar, resumed from checkpoint-20: the dicts are steps 21.. (not 1..), also after a save."""
    from ulyssesd.daemon.telemetry.log_source import STDOUT_TELEMETRY_NAME, LogSource

    (tmp_path / "logs").mkdir()
    lines = [_hf_dict(i) for i in range(21, 41)]
    lines.insert(10, "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 220.27it/s]\n")
    (tmp_path / "logs" / "attempt-2.log").write_text("".join(lines))
    LogSource(tmp_path, 2, resume_step=20).pump(1000.0)
    import json

    recs = [json.loads(x) for x in (tmp_path / STDOUT_TELEMETRY_NAME).read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(21, 41))
    # A re-adopting daemon's new source goes on from the attempt's last record, not from the checkpoint.
    with (tmp_path / "logs" / "attempt-2.log").open("a") as fh:
        fh.write(_hf_dict(41))
    LogSource(tmp_path, 2, resume_step=20).pump(1001.0)
    recs = [json.loads(x) for x in (tmp_path / STDOUT_TELEMETRY_NAME).read_text().splitlines()]
    assert recs[-1]["step"] == 41 and len(recs) == 21
