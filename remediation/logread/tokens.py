"""What one log line says about training progress, read structurally (pure: no state, no I/O).

A line is tokenised into key/number pairs whatever the separator (`loss 2.95`, `loss: 2.95`, `loss=2.95`,
`'loss': 2.95`, `"loss": "2.95"`, `iteration 10/ 900`, `lm loss: 2.9E+00`, a printed tensor
`loss: tensor(2.95, device='cuda:0')`); each key is then classified by
its words, not by the framework that printed it:

- step: a key whose last word is step/steps/iter/iters/itr/iteration/batch/update(s)/upd or
  `global_step`/`gs`/`num_updates` (`it` and `gs` alone only as `N/M` or beside a loss: they are also words),
  unless a qualifier says it is not the position (`max`, `total`, `warmup`, `per`, `skipped`, `time`, ...).
  The most specific wins: global step > updates > step > iteration > batch > a progress bar's `N/M`.
  `N/M` gives a total M; a progress bar beside an epoch (`Epoch 3 ... 4/18`) is E·M + N; a keyed `N/M`
  beside an epoch is left to the parser, which sees whether the count restarts with each epoch;
- loss: a key with the word `loss` (not `loss scale`). A loss qualified by val/valid/eval/test/dev is an
  evaluation loss and never the training loss; among training losses one that says `train` ranks first
  (`reduced_train_loss`, `loss train`, `loss/train/total`), then a plain `loss`/`lm loss`/`total loss`, then
  any other `*_loss` (`avg_loss`, `mask_loss`) only when nothing better is in the line;
- lr / grad_norm / loss_scale / step time (`time 12.3ms`, `iter time: 110 ms`, `step_time_s`) / epoch;
- a tqdm / rich progress bar's `N/M [..` or `N/M 0:00:02` position and its `s/it`/`it/s` rate.
"""

from __future__ import annotations

import calendar
import math
import re
from dataclasses import dataclass, field

NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|NAN|inf|Inf|INF|Infinity)"
_WORD = r"[A-Za-z(][\w./()\-]*"
_PAIR = re.compile(
    rf"(?P<key>{_WORD}(?: {_WORD}){{0,4}})['\"]?\s*(?:[:=]\s*|\s+)['\"]?(?:tensor\(\[?)?"
    rf"(?P<val>{NUM})(?:\s*/\s*(?P<total>\d+))?(?P<unit>\s?(?:ms|s|sec|GiB|GB|%))?(?![\w.])")
_BAR = re.compile(rf"(?<![\w/.])(\d+)/(\d+)(?=\s*(?:\[|\d+:\d\d))(?:\s*\[[\d:]+<[\d:?]+,\s*({NUM})\s*(s/it|it/s))?")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
_SPLIT = re.compile(r"[\s_/.\-]+")
_LETTERS = re.compile(r"[A-Za-z]+")

_STEP_WORDS = {"step": 3, "steps": 3, "stp": 3, "globalstep": 5, "gs": 5, "gstep": 5, "iter": 2, "iters": 2,
               "itr": 2, "it": 2, "iteration": 2, "iterations": 2, "batch": 1, "update": 4, "updates": 4, "upd": 4,
               "updt": 4, "numupdates": 4, "nupdates": 4}
# Abbreviations that are also ordinary words or units (`it`, `gs`): a step only as `N/M` or beside a loss.
_WEAK_STEP_WORDS = {"it", "gs"}
_NOT_POSITION = {"max", "total", "warmup", "per", "skipped", "nan", "number", "num", "of", "time", "timing",
                 "remaining", "consumed", "eval", "val", "valid", "validation", "test", "size", "accum", "accumulation",
                 "interval", "every", "save", "log", "print", "sec", "s"}
_EVAL_WORDS = {"val", "valid", "validation", "eval", "evaluation", "test", "dev", "holdout"}
_SUMMARY_WORDS = {"runtime", "flos", "total"}
_EPOCH_WORDS = {"epoch", "ep", "epochs"}


def num(text: str) -> float:
    """A number as printed (nan/inf spelled any common way)."""
    t = text.strip().lower()
    if t in ("nan", "-nan", "+nan"):
        return math.nan
    if t in ("inf", "+inf", "infinity", "+infinity"):
        return math.inf
    if t in ("-inf", "-infinity"):
        return -math.inf
    return float(t)


@dataclass
class LineFacts:
    """What a line says: each None when it does not say it."""

    step: int | None = None
    step_rank: int = 0  # how specific the step key was (global step 5 ... bar 0)
    total: int | None = None  # the M of an N/M step (not for an epoch-relative counter)
    loss: float | None = None
    loss_key: str | None = None
    eval_loss: bool = False  # the line carries an evaluation loss (alone or beside the training loss)
    epoch: float | None = None
    summary: bool = False  # an end-of-run summary (train_runtime, total_flos): not a step
    fields: dict[str, float] = field(default_factory=dict)
    bar: tuple[int, int] | None = None  # a progress bar's N/M
    bar_label: str = ""  # the bar's description, letters only (`writing model shards`, `epoch`, "" for none)
    step_from_bar: bool = False  # the step is the progress bar's position (no step key in the line)
    epoch_counter: tuple[int, int, int] | None = None  # (E, N, M) of a keyed N/M beside an epoch E
    bar_step_time_s: float | None = None
    dict_shaped: bool = False  # a printed dict / JSON object ({...})
    sample_keys: list[str] = field(default_factory=list)


def words_of(key: str) -> list[str]:
    k = key.strip("'\"[]{}|,;: ").lower().replace("(", " ").replace(")", " ")
    # camelCase → words; then split on separators.
    k = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", k)
    return [w for w in _SPLIT.split(k) if w]


def _loss_rank(words: list[str]) -> int:
    """0: not a loss; -1: an evaluation loss; 3 training loss named so; 2 plain loss; 1 any other loss."""
    if "loss" not in words and "losses" not in words:
        return 0
    if "scale" in words or "scaler" in words:
        return 0
    if any(w in _EVAL_WORDS for w in words):
        return -1
    if "train" in words or "training" in words:
        return 3
    rest = [w for w in words if w not in ("loss", "lm", "total", "reduced", "global", "mean", "step", "curr")]
    return 2 if not rest else 1


def _step_rank(words: list[str]) -> int:
    """How specific a step key is (0: not a step key)."""
    if words[-2:] == ["global", "step"] or words[-1] == "globalstep":
        return 5
    if words[-2:] in (["num", "updates"], ["n", "updates"]) or words[-1] in ("numupdates", "nupdates"):
        return 4
    rank = _STEP_WORDS.get(words[-1], 0)
    if not rank or any(w in _NOT_POSITION for w in words[:-1]):
        return 0
    return rank


MAX_LINE_CHARS = 8192  # real step lines are < 2 KiB (an HF dict with many keys); the rest is not read


def read_line(line: str) -> LineFacts:
    """The facts of one log line (already stripped of rank prefixes). Bounded: only the first
    `MAX_LINE_CHARS` characters are read, and a line without a digit is not tokenised."""
    seg = _ANSI.sub("", line[:MAX_LINE_CHARS])
    f = LineFacts(dict_shaped=seg.lstrip().startswith("{") and "}" in seg)
    if not any(c.isdigit() for c in seg):
        return f
    bar = _BAR.search(seg)
    if bar:
        f.bar = (int(bar.group(1)), int(bar.group(2)))
        f.bar_label = " ".join(_LETTERS.findall(seg[:bar.start()])).lower()[-80:]
        if bar.group(3):
            rate = num(bar.group(3))
            if rate > 0 and math.isfinite(rate):
                f.bar_step_time_s = rate if bar.group(4) == "s/it" else 1.0 / rate
    best_loss = 0
    weak_step = False
    for m in _PAIR.finditer(seg):
        words = words_of(m.group("key"))
        if not words:
            continue
        try:
            value = num(m.group("val"))
        except ValueError:
            continue
        if len(f.sample_keys) < 12:
            f.sample_keys.append(" ".join(words))
        if any(w in _SUMMARY_WORDS for w in words) and words[-1] in ("runtime", "flos"):
            f.summary = True
        lr = _loss_rank(words)
        if lr == -1:
            f.eval_loss = True
            continue
        if lr > best_loss:
            best_loss, f.loss, f.loss_key = lr, value, " ".join(words)
            continue
        if lr:
            continue
        sr = _step_rank(words) if words[-1] not in _WEAK_STEP_WORDS or len(words) == 1 else 0
        if sr and math.isfinite(value) and value >= 0 and value == int(value):
            if sr > f.step_rank:
                f.step, f.step_rank = int(min(value, 2.0 ** 63)), sr
                f.total = int(m.group("total")) if m.group("total") else None
                weak_step = words[-1] in _WEAK_STEP_WORDS
            continue
        if words[-1] in _EPOCH_WORDS and math.isfinite(value):
            if f.epoch is None:
                f.epoch = value
            continue
        _field(f, words, value, (m.group("unit") or "").strip())
    if weak_step and f.total is None and f.loss is None:
        f.step, f.step_rank = None, 0  # `it 3` / `gs 5` alone: a word, not a step header
    from_bar = f.step is None and f.bar is not None
    if from_bar:
        assert f.bar is not None
        f.step, f.total = f.bar
        f.step_from_bar = True
    if f.step is not None and f.total and f.step_rank <= 3 and f.epoch is not None \
            and f.epoch == int(f.epoch) and f.epoch >= 0:
        if from_bar:
            # A progress bar beside an epoch (Lightning's `Epoch 3: ... 4/18`) counts within the epoch.
            f.step, f.total = int(f.epoch) * f.total + f.step, None
        else:
            # `Epoch: 0/100 Step: 10/965` or `[epoch=1][batch=3/100]`: within the epoch or of the run? The
            # parser decides from the run's own lines (the count restarting when the epoch moves on).
            f.epoch_counter = (int(f.epoch), f.step, f.total)
            f.total = None
    return f


def _field(f: LineFacts, words: list[str], value: float, unit: str) -> None:
    last = words[-1]
    if last in ("lr", "rate") and (last == "lr" or "learning" in words):
        f.fields.setdefault("lr", value)
    elif last in ("norm", "gnorm", "gradnorm") and ("grad" in words or last in ("gnorm", "gradnorm")):
        f.fields.setdefault("grad_norm", value)
    elif ("time" in words or "timing" in words) and any(w in ("step", "iter", "iteration", "batch", "time")
                                                       for w in words) and not any(
            w in ("data", "dataloader", "wall", "elapsed", "remaining", "total", "eval", "val") for w in words[:-1]):
        scale = 1e-3 if unit == "ms" or "ms" in words else 1.0
        if "s" in words or "sec" in words or unit in ("s", "sec", "ms") or "ms" in words or words[-1] in ("time",):
            f.fields.setdefault("step_time_s", value * scale)


# A log line's own time: ISO-like `2024-05-01 12:00:03,123` / `[2024-05-01T12:00:03.1]` (UTC assumed).
_TIMESTAMP = re.compile(r"\[?(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[,.](\d+))?")


def line_timestamp(line: str) -> float | None:
    m = _TIMESTAMP.search(line)
    if not m:
        return None
    y, mo, d, h, mi, s, frac = m.groups()
    try:
        base = calendar.timegm((int(y), int(mo), int(d), int(h), int(mi), int(s), 0, 0, 0))
    except (ValueError, OverflowError):
        return None
    return base + (float("0." + frac) if frac else 0.0)
