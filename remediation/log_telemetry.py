"""Zero-code supervision: turn a training job's own log lines into telemetry records (pure: no I/O, no clock).

Formats understood (each line is tried against them in this order; unknown lines are ignored):
- Megatron(-LM/-DeepSpeed, GPT-NeoX) iteration lines: `iteration 100/ 1000 | ... | lm loss: 4.1E+00 |
  loss scale: 65536.0 | grad norm: 1.2 | number of skipped iterations: 0 | ...`;
- DeepSpeed pipeline engine: `steps: 10 loss: 2.3456 iter time (s): 0.512 samples/sec: 62.5`;
- Hugging Face Trainer log dicts: `{'loss': 2.31, 'grad_norm': 0.8, 'learning_rate': 5e-05, 'epoch': 0.1}`,
  their step from the tqdm progress bar (`380/2724 [14:02:33<86:01:24, 132.12s/it]`), else counted;
- a script's own `step=12 loss=2.31 lr=1e-4` / `step 12 | loss: 2.31` lines (key=value or key: value);
- DeepSpeed engine lines that carry no loss, merged into the next step record: OVERFLOW/loss-scale
  (`skipped`, `loss_scale`), `step=N, skipped=K, lr=[...]` (`lr`), the throughput timer (`MemAllocated`,
  `MaxMemAllocated`) and wall-clock-breakdown timers (`forward + backward + step` = `step_time_s`);
  `Checkpoint <tag> is ready now!` and the HF `Saving model checkpoint to <dir>` become `checkpoint_saved` events.

Multi-rank output: `[rank3]:`/`[default3]:` (torchrun), `3: ` (srun --label) and `host: ` (pdsh) prefixes are
stripped; loss lines of ranks other than the lowest one seen are dropped, and a step number that does not
advance (the same step printed by several unprefixed ranks) is dropped. tqdm's carriage-return redraws are
split into their segments. A record's `time` is the line's own timestamp, else the caller's `now`, else the
latest timestamp seen in the log (None when the log has none: replay then derives a clock from step times).
"""

from __future__ import annotations

import calendar
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|inf|Inf|-inf|Infinity)"

_RANK_PREFIX = re.compile(r"^\s*(?:\[(?:rank|default)(\d+)\]:|(\d+): |([A-Za-z][\w.-]*): (?=\[|\s*iteration|\{|step))")
_TIMESTAMP = re.compile(r"\[?(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[,.](\d+))?")

_MEGATRON = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)")
_DS_PIPE = re.compile(rf"\bsteps: (\d+) loss: ({_NUM}) iter time \(s\): ({_NUM}) samples/sec: ({_NUM})")
_HF_DICT = re.compile(r"\{'[A-Za-z_]+': .*\}")
_HF_PAIR = re.compile(rf"'([A-Za-z_/]+)':\s*'?({_NUM})'?")
_TQDM = re.compile(rf"(\d+)/(\d+) \[[\d:]+<[\d:?]+,\s*({_NUM})(s/it|it/s)")
_OVERFLOW = re.compile(r"OVERFLOW! (?:Rank (\d+) )?Skipping step\.(?: Attempted loss scale: ([\d.]+)"
                       r"(?:, reducing to ([\d.]+))?)?")
_DS_STEP = re.compile(r"\[Rank (\d+)\] step=(\d+), skipped=(\d+), lr=\[([^\]]*)\]")
_DS_THROUGHPUT = re.compile(rf"global_step=(\d+), RunningAvgSamplesPerSec=({_NUM}), CurrSamplesPerSec=({_NUM}), "
                            rf"MemAllocated=({_NUM})GB, MaxMemAllocated=({_NUM})GB")
_DS_TIMERS = re.compile(r"time \(ms\) \|(.*)")
_DS_CKPT = re.compile(r"Checkpoint (\S+) is ready now!")
_HF_SAVE = re.compile(r"Saving model checkpoint to (\S+)")
_GENERIC_STEP = re.compile(r"(?<![\w/])(?:global[_ ]step|step|iter(?:ation)?)\s*[=:]?\s*(\d+)\b", re.IGNORECASE)
_GENERIC_LOSS = re.compile(rf"(?<![\w/])(?:train[_ ])?loss\s*[=:]\s*({_NUM})\b", re.IGNORECASE)
_GENERIC_FIELDS = {
    "lr": re.compile(rf"(?<![\w/])(?:lr|learning[_ ]rate)\s*[=:]\s*({_NUM})", re.IGNORECASE),
    "grad_norm": re.compile(rf"(?<![\w/])(?:grad[_ ]norm|gnorm)\s*[=:]\s*({_NUM})", re.IGNORECASE),
    "loss_scale": re.compile(rf"(?<![\w/])loss[_ ]scale\s*[=:]\s*({_NUM})", re.IGNORECASE),
    "step_time_s": re.compile(rf"(?<![\w/])step[_ ]time(?:_s)?\s*[=:]\s*({_NUM})\s*s?\b", re.IGNORECASE),
    "tokens_per_s": re.compile(rf"(?<![\w/])(?:tokens|tok)(?:/s|_per_s(?:ec)?)\s*[=:]\s*({_NUM})", re.IGNORECASE),
}
_GENERIC_SKIPPED = re.compile(r"(?<![\w/])skipped\s*[=:]\s*(True|False|true|false|1|0)\b")

_MEGATRON_KEYS = {
    "lm loss": "loss", "lm_loss": "loss", "loss": "loss", "loss scale": "loss_scale", "grad norm": "grad_norm",
    "learning rate": "lr", "elapsed time per iteration (ms)": "step_time_ms",
    "number of skipped iterations": "skipped_n", "number of nan iterations": "nan_n",
    "consumed tokens": "consumed_tokens", "global batch size": "global_batch", "actual seqlen": "seqlen",
}


def _num(text: str) -> float:
    t = text.strip().lower()
    if t in ("nan", "-nan"):
        return math.nan
    if t in ("inf", "+inf", "infinity"):
        return math.inf
    if t in ("-inf", "-infinity"):
        return -math.inf
    return float(t)


def _jsonable(value: float) -> float | str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _timestamp(line: str) -> float | None:
    m = _TIMESTAMP.search(line)
    if not m:
        return None
    y, mo, d, h, mi, s, frac = m.groups()
    base = calendar.timegm((int(y), int(mo), int(d), int(h), int(mi), int(s), 0, 0, 0))
    return base + (float("0." + frac) if frac else 0.0)


@dataclass
class _Pending:
    """What DeepSpeed's loss-less lines said since the last step record."""

    overflows: int = 0
    loss_scale: float | None = None
    lr: float | None = None
    ds_skipped_total: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class LogParseStats:
    """How many lines each format matched (what `ulyssesctl replay` reports for a raw log)."""

    lines: int = 0
    records: int = 0
    by_format: dict[str, int] = field(default_factory=dict)
    dropped_other_rank: int = 0
    dropped_repeated_step: int = 0


class LogTelemetryParser:
    """Stateful line parser: `feed(line, now)` returns the telemetry records (contract dicts) it completes."""

    def __init__(self, attempt: int | None = None, config_version: int | None = None,
                 after_step: int | None = None):
        """`after_step`: the last step already emitted for this attempt (a log re-read from an older offset);
        lines of steps up to it are dropped as repeated."""
        self.attempt = attempt
        self.config_version = config_version
        self.stats = LogParseStats()
        self._pending = _Pending()
        self._last_step: int | None = after_step
        self._progress_step: int | None = None
        self._progress_step_time: float | None = None
        self._hf_count = 0
        self._rank: int | None = None  # the lowest rank seen in a prefix: the one whose losses count
        self._last_time: float | None = None
        self._reports_skips = False  # the log has shown skip information: records without an overflow say False

    # -------------------------------------------------------------------------------- public
    def feed(self, line: str, now: float | None = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self.stats.lines += 1
        for segment in line.split("\r"):
            if segment.strip():
                out.extend(self._segment(segment.rstrip("\n"), now))
        return out

    def feed_many(self, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        for line in lines:
            yield from self.feed(line)

    # ------------------------------------------------------------------------------ internals
    def _count(self, fmt: str) -> None:
        self.stats.by_format[fmt] = self.stats.by_format.get(fmt, 0) + 1

    def _segment(self, seg: str, now: float | None) -> list[dict[str, Any]]:
        rank = None
        m = _RANK_PREFIX.match(seg)
        if m:
            if m.group(1) is not None or m.group(2) is not None:
                rank = int(m.group(1) if m.group(1) is not None else m.group(2))
                if self._rank is None or rank < self._rank:
                    self._rank = rank
            seg = seg[m.end():]
        ts = _timestamp(seg)
        if ts is not None:
            self._last_time = ts if self._last_time is None else max(ts, self._last_time)
        t = ts if ts is not None else (now if now is not None else self._last_time)
        other_rank = rank is not None and self._rank is not None and rank != self._rank

        # tqdm may share a line with anything (it redraws without a newline): take its position first.
        tq = _TQDM.search(seg)
        if tq and not other_rank:
            self._progress_step = int(tq.group(1))
            rate = _num(tq.group(3))
            if rate > 0:
                self._progress_step_time = rate if tq.group(4) == "s/it" else 1.0 / rate
            self._count("tqdm")

        if "OVERFLOW!" in seg:
            mo = _OVERFLOW.search(seg)
            if mo:
                self._pending.overflows += 1
                if mo.group(2):
                    self._pending.loss_scale = float(mo.group(2))
                self._count("deepspeed_overflow")
            return []
        if "] step=" in seg:
            ms = _DS_STEP.search(seg)
            if ms:
                self._ds_step(ms)
                return []
        if "RunningAvgSamplesPerSec" in seg:
            mt = _DS_THROUGHPUT.search(seg)
            if mt:
                self._pending.fields["mem_allocated_gib"] = _num(mt.group(4))
                self._pending.fields["mem_max_allocated_gib"] = _num(mt.group(5))
                self._count("deepspeed_throughput")
                return []
        mi = _MEGATRON.search(seg)
        if mi:
            return self._emit_if_rank(self._megatron(mi), t, other_rank, "megatron")
        if "time (ms) |" in seg:
            self._timers(seg)
            return []
        mp = _DS_PIPE.search(seg)
        if mp:
            pipe = {"step": int(mp.group(1)), "loss": _num(mp.group(2)), "step_time_s": _num(mp.group(3))}
            return self._emit_if_rank(pipe, t, other_rank, "deepspeed_pipe")
        if "{'" in seg:
            mh = _HF_DICT.search(seg)
            if mh:
                rec = self._hf(mh.group(0))
                if rec is not None:
                    return self._emit_if_rank(rec, t, other_rank, "hf_trainer")
        ck = _DS_CKPT.search(seg) or _HF_SAVE.search(seg)
        if ck and not other_rank:
            self._count("checkpoint")
            tag = ck.group(1).rstrip("/").rsplit("/", 1)[-1]
            return [self._event("checkpoint_saved", t, tag=tag, source="log")]
        ml = _GENERIC_LOSS.search(seg)
        if ml:
            mstep = _GENERIC_STEP.search(seg)
            if mstep:
                return self._emit_if_rank(self._generic(seg, int(mstep.group(1)), _num(ml.group(1))), t,
                                          other_rank, "key_value")
        return []

    def _ds_step(self, m: re.Match[str]) -> None:
        total = int(m.group(3))
        if self._pending.ds_skipped_total is not None and total > self._pending.ds_skipped_total:
            self._pending.overflows = max(self._pending.overflows, 1)
        self._pending.ds_skipped_total = total
        lrs = [x for x in m.group(4).split(",") if x.strip()]
        if lrs:
            try:
                self._pending.lr = _num(lrs[0])
            except ValueError:
                pass
        self._count("deepspeed_step")

    def _timers(self, seg: str) -> None:
        m = _DS_TIMERS.search(seg)
        if not m:
            return
        vals: dict[str, float] = {}
        for part in m.group(1).split("|"):
            name, _, value = part.partition(":")
            try:
                vals[name.strip()] = float(value)
            except ValueError:
                continue
        # DeepSpeed's global (per optimizer step) timers; *_microstep lines and Megatron's timers are not a step.
        names = [("forward", "backward", "step"), ("fwd", "bwd", "step")]
        for fwd, bwd, stp in names:
            if fwd in vals and bwd in vals and stp in vals:
                self._pending.fields["step_time_s"] = (vals[fwd] + vals[bwd] + vals[stp]) / 1000.0
                self._count("deepspeed_timers")
                return

    def _megatron(self, m: re.Match[str]) -> dict[str, Any]:
        rec: dict[str, Any] = {"step": int(m.group(1))}
        raw: dict[str, float] = {}
        for part in m.group(3).split("|"):
            key, sep, value = part.rpartition(":")
            key = key.strip()
            if not sep or key not in _MEGATRON_KEYS:
                continue
            try:
                raw[_MEGATRON_KEYS[key]] = _num(value)
            except ValueError:
                continue
        if "loss" in raw:
            rec["loss"] = raw["loss"]
        for k in ("loss_scale", "grad_norm", "lr"):
            if k in raw:
                rec[k] = raw[k]
        if "step_time_ms" in raw:
            rec["step_time_s"] = raw["step_time_ms"] / 1000.0
        if "skipped_n" in raw:
            rec["skipped"] = raw["skipped_n"] > 0
        if "global_batch" in raw and "seqlen" in raw:
            rec["tokens"] = int(raw["global_batch"] * raw["seqlen"])
            if rec.get("step_time_s"):
                rec["tokens_per_s"] = rec["tokens"] / rec["step_time_s"]
        return rec

    def _hf(self, text: str) -> dict[str, Any] | None:
        pairs = {}
        for k, v in _HF_PAIR.findall(text):
            try:
                pairs[k] = _num(v)
            except ValueError:
                continue
        if "loss" not in pairs:
            return None  # eval dicts, the final train_runtime summary
        self._hf_count += 1
        step = self._progress_step if self._progress_step is not None else self._hf_count
        rec: dict[str, Any] = {"step": step, "loss": pairs["loss"]}
        if "grad_norm" in pairs:
            rec["grad_norm"] = pairs["grad_norm"]
        if "learning_rate" in pairs:
            rec["lr"] = pairs["learning_rate"]
        if self._progress_step_time is not None:
            rec["step_time_s"] = self._progress_step_time
        return rec

    def _generic(self, seg: str, step: int, loss: float) -> dict[str, Any]:
        rec: dict[str, Any] = {"step": step, "loss": loss}
        for key, rx in _GENERIC_FIELDS.items():
            mf = rx.search(seg)
            if mf:
                try:
                    rec[key] = _num(mf.group(1))
                except ValueError:
                    pass
        sk = _GENERIC_SKIPPED.search(seg)
        if sk:
            rec["skipped"] = sk.group(1) in ("True", "true", "1")
        return rec

    def _emit_if_rank(self, rec: dict[str, Any], t: float | None, other_rank: bool, fmt: str) -> list[dict[str, Any]]:
        if other_rank:
            self.stats.dropped_other_rank += 1
            return []
        if "loss" not in rec:
            # A Megatron interval in which every iteration was skipped prints no loss: its skips count for
            # the next record (a loss is required for a step record; none is invented).
            if rec.get("skipped"):
                self._pending.overflows += 1
            return []
        step = rec["step"]
        if self._last_step is not None and step <= self._last_step:
            self.stats.dropped_repeated_step += 1
            return []
        self._last_step = step
        self._count(fmt)
        p = self._pending
        merged: dict[str, Any] = dict(p.fields)
        merged.update({k: v for k, v in rec.items() if k not in ("step", "loss")})
        if p.lr is not None and "lr" not in merged:
            merged["lr"] = p.lr
        if p.loss_scale is not None and "loss_scale" not in merged:
            merged["loss_scale"] = p.loss_scale
        if p.overflows or p.ds_skipped_total is not None or "skipped" in merged:
            self._reports_skips = True
        if p.overflows:
            merged["skipped"] = True
        elif "skipped" not in merged and self._reports_skips:
            merged["skipped"] = False
        # DeepSpeed logs a loss scale only when an overflow lowers it: the record of that step carries the
        # scale it attempted; later records carry none (the scale grows again without a log line).
        self._pending = _Pending(ds_skipped_total=p.ds_skipped_total)
        out: dict[str, Any] = {"v": 1, "kind": "step", "time": t, "attempt": self.attempt, "step": step,
                               "loss": _jsonable(rec["loss"])}
        if self.config_version is not None:
            out["config_version"] = self.config_version
        for k, v in merged.items():
            out[k] = _jsonable(v) if isinstance(v, float) else v
        self.stats.records += 1
        return [out]

    def _event(self, name: str, t: float | None, **fields: Any) -> dict[str, Any]:
        self.stats.records += 1
        return {"v": 1, "kind": "event", "time": t, "attempt": self.attempt, "step": self._last_step,
                "event": name, **fields}


def parse_log_lines(lines: Iterable[str], attempt: int | None = None) -> Iterator[dict[str, Any]]:
    """Every telemetry record a log's lines yield, in order."""
    return LogTelemetryParser(attempt=attempt).feed_many(lines)


def looks_like_telemetry(first_line: str | bytes) -> bool:
    """True when a file's first non-blank line is a telemetry JSON record, False for a raw job log."""
    text = first_line.decode("utf-8", "replace") if isinstance(first_line, bytes) else first_line
    text = text.strip()
    return text.startswith("{") and '"kind"' in text
