"""`[telemetry] source = "trainer_state" | "tensorboard"`: step records from what the framework already writes.

- `trainer_state`: HF Trainer's `trainer_state.json` (`log_history`: `{"loss", "grad_norm", "learning_rate",
  "step", "epoch"}` per logging step; `max_steps` is the run's length). The newest one under
  `telemetry.files` is read: `output_dir/trainer_state.json` and each `checkpoint-N/trainer_state.json`
  (the Trainer writes it at every save, so records arrive at save time).
- `tensorboard`: every `events.out.tfevents.*` under `telemetry.files`, read incrementally (one loader per
  file keeps its offset). The loss is the scalar tag chosen by the same words as the log reader (`train/loss`,
  `train_loss`, `Loss/train`, `lm loss`; never an eval/val tag); the learning rate and grad norm likewise.

Records never go backwards past what was already emitted (`after_step`); the caller appends them to the
run's derived telemetry file like the log source does.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ulyssesd.daemon.safety.regular_file import read_regular_text
from ulyssesd.remediation.logread.tokens import _loss_rank, words_of

MAX_STATE_BYTES = 64 << 20  # a trainer_state.json larger than this is not read whole (months of logging)
MAX_EVENT_FILES = 256  # event files scanned per directory tree
#: Records from files arrive when the framework writes them (each save, each TensorBoard flush: 120 s by default
#: in PyTorch's SummaryWriter), not every step: a hang floor below this would kill a healthy job between writes.
MIN_HANG_FLOOR_S = 600.0


def file_source_problems(source: str, hang_timeout_floor_s: float) -> list[str]:
    """What a run spec must change for a file source: the hang floor must outlast the framework's write interval."""
    if source not in ("trainer_state", "tensorboard") or hang_timeout_floor_s >= MIN_HANG_FLOOR_S:
        return []
    when = "at each checkpoint save" if source == "trainer_state" else "at each TensorBoard flush (120 s by default)"
    return [f"telemetry.source={source!r} delivers step records only {when}: set [detectors] hang_timeout_floor_s "
            f"above that interval (at least {MIN_HANG_FLOOR_S:.0f}; it is {hang_timeout_floor_s:g}) or the healthy "
            f"job is killed as hung between writes; or use source = \"stdout\", read every step"]


def _finite_or_str(v: float) -> float | str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def newest_trainer_state(root: Path) -> Path | None:
    """The most recently written trainer_state.json in `root` or its `checkpoint-*` folders."""
    cands = [root / "trainer_state.json", *root.glob("checkpoint-*/trainer_state.json")]
    best: tuple[float, Path] | None = None
    for c in cands:
        try:
            m = c.stat().st_mtime
        except OSError:
            continue
        if best is None or m > best[0]:
            best = (m, c)
    return best[1] if best else None


def trainer_state_records(path: Path, after_step: int | None) -> tuple[list[dict[str, Any]], str | None]:
    """Step records of `log_history` entries after `after_step`, and a problem (None when read fine)."""
    try:
        if path.stat().st_size > MAX_STATE_BYTES:
            return [], f"{path} is larger than {MAX_STATE_BYTES >> 20} MiB; not read"
        state = json.loads(read_regular_text(path))
    except (OSError, ValueError) as exc:  # mid-write (the Trainer replaces it) or unreadable: next tick
        return [], f"{path}: {type(exc).__name__}: {exc}"
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        return [], f"{path} has no log_history list"
    total = state.get("max_steps") if isinstance(state.get("max_steps"), int) and state["max_steps"] > 0 else None
    out: list[dict[str, Any]] = []
    for entry in state["log_history"]:
        if not isinstance(entry, dict):
            continue
        step, loss = entry.get("step"), entry.get("loss")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(loss, int | float):
            continue  # eval entries (eval_loss), the final summary (train_loss, train_runtime)
        if after_step is not None and step <= after_step:
            continue
        rec: dict[str, Any] = {"step": step, "loss": _finite_or_str(float(loss))}
        if isinstance(entry.get("grad_norm"), int | float):
            rec["grad_norm"] = _finite_or_str(float(entry["grad_norm"]))
        if isinstance(entry.get("learning_rate"), int | float):
            rec["lr"] = float(entry["learning_rate"])
        if total:
            rec["total_steps"] = total
        out.append(rec)
    return out, None


def _scalar(value: Any) -> float | None:
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor"):
        from tensorboard.util import tensor_util

        try:
            arr = tensor_util.make_ndarray(value.tensor)
        except Exception:  # noqa: BLE001 - a tensor that is not a scalar summary
            return None
        if arr.size == 1:
            return float(arr.reshape(()))
    return None


def tag_role(tag: str) -> tuple[str, int] | None:
    """What a scalar tag is: ("loss", rank) for a training loss, ("lr"|"grad_norm", 1), else None."""
    words = words_of(tag)
    rank = _loss_rank(words)
    if rank > 0:
        return "loss", rank
    if rank < 0 or not words:
        return None
    if words[-1] == "lr" or words[-2:] == ["learning", "rate"]:
        return "lr", 1
    if words[-2:] == ["grad", "norm"] or words[-1] in ("gradnorm", "gnorm"):
        return "grad_norm", 1
    return None


class TensorBoardReader:
    """Incremental reader of the event files under a directory."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._loaders: dict[Path, Any] = {}
        self._loss_rank = 0
        self._steps: dict[int, dict[str, Any]] = {}  # step -> fields seen so far (a loss makes it a record)
        self._prev: tuple[int, float] | None = None  # the last emitted step and its wall time

    def _files(self) -> list[Path]:
        found: list[Path] = []
        for dirpath, _dirs, names in os.walk(self.root):
            for n in names:
                if n.startswith("events.out.tfevents."):
                    found.append(Path(dirpath) / n)
                    if len(found) >= MAX_EVENT_FILES:
                        return sorted(found)
        return sorted(found)

    def read(self, after_step: int | None) -> list[dict[str, Any]]:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        for path in self._files():
            loader = self._loaders.get(path)
            if loader is None:
                loader = self._loaders[path] = EventFileLoader(str(path))
            try:
                for event in loader.Load():
                    if not event.HasField("summary"):
                        continue
                    for value in event.summary.value:
                        role = tag_role(value.tag)
                        if role is None:
                            continue
                        v = _scalar(value)
                        if v is None:
                            continue
                        name, rank = role
                        fields = self._steps.setdefault(int(event.step), {})
                        fields.setdefault("wall_time", float(event.wall_time))
                        if name == "loss":
                            if rank < self._loss_rank:
                                continue
                            if rank > self._loss_rank:  # a better loss tag: it decides from now on
                                self._loss_rank = rank
                            fields["loss"] = v
                        else:
                            fields.setdefault(name, v)
            except Exception:  # noqa: BLE001 - a torn last event is read again next tick; a bad file costs itself
                continue
        out = []
        for step in sorted(self._steps):
            fields = self._steps[step]
            if "loss" not in fields or (after_step is not None and step <= after_step):
                continue
            rec: dict[str, Any] = {"step": step, "loss": _finite_or_str(fields["loss"])}
            for k in ("lr", "grad_norm"):
                if k in fields:
                    rec[k] = _finite_or_str(fields[k])
            wt = fields.get("wall_time")
            if wt and self._prev is not None and step > self._prev[0] and wt > self._prev[1]:
                rec["step_time_s"] = (wt - self._prev[1]) / (step - self._prev[0])  # the events' own clock
            if wt:
                self._prev = (step, wt)
            out.append(rec)
        # Only the steps not yet complete stay (a loss may come before its lr in another file).
        newest = out[-1]["step"] if out else after_step
        self._steps = {s: f for s, f in self._steps.items() if newest is None or s > newest}
        return out
