"""Zero-code supervision: turn a training job's own log lines into telemetry records (pure: no I/O, no clock).

Every line is read structurally (`ulyssesd.remediation.logread.tokens`): key/number pairs with any separator,
the synonyms of step (step, iter, iteration, global_step, num_updates, batch, a progress bar's N/M) and of
the training loss (train_loss, reduced_train_loss, loss, lm loss; never an eval/val loss), JSON lines and
printed dicts, tqdm/rich/Lightning progress bars. That covers nanoGPT, Lightning, NeMo, torchtitan,
Megatron-LM, HF Trainer/axolotl dicts, fairseq, LitGPT, Accelerate scripts and a script's own wording
without one pattern per framework. On top of that, framework lines that carry no loss are merged into the
next step record:
- DeepSpeed: OVERFLOW/loss-scale (`skipped`, `loss_scale`), `step=N, skipped=K, lr=[...]` (`lr`), the
  throughput timer (`MemAllocated`, `MaxMemAllocated`), wall-clock-breakdown timers (`step_time_s`);
- Megatron: an interval whose iterations were all skipped prints no loss: its skips mark the next record;
- `Checkpoint <tag> is ready now!` and HF `Saving model checkpoint to <dir>` become `checkpoint_saved` events.
A line with a loss but no step takes the step of the last progress bar or step header (`[batch=3/100]:`),
and a printed dict without either is numbered in order. An explicit `pattern` (a regex with named groups
`step` and `loss`) is tried first, for wording nothing else reads.

Steps are checked against the run's own progress (`ulyssesd.remediation.logread.continuity`): one odd line is a
bad line (counted, sampled), a counter that goes backwards or jumps for good is a `step_discontinuity`
event, never a reason to drop what follows.

Multi-rank output: `[rank3]:`/`[default3]:` (torchrun), `3: ` (srun --label) and `host: ` (pdsh) prefixes are
stripped; loss lines of ranks other than the lowest one seen are dropped, and a step number that does not
advance (the same step printed by several unprefixed ranks) is dropped. tqdm's carriage-return redraws are
split into their segments. A record's `time` is the line's own timestamp, else the caller's `now`, else the
latest timestamp seen in the log (None when the log has none: replay then derives a clock from step times).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ulyssesd.remediation.logread.continuity import ContinuityConfig, StepContinuity
from ulyssesd.remediation.logread.options import compile_pattern
from ulyssesd.remediation.logread.tokens import NUM as _NUM
from ulyssesd.remediation.logread.tokens import LineFacts, line_timestamp, read_line
from ulyssesd.remediation.logread.tokens import num as _num

_RANK_PREFIX = re.compile(r"^\s*(?:\[(?:rank|default)(\d+)\]:|(\d+): |([A-Za-z][\w.-]*): (?=\[|\s*iteration|\{|step))")

_MEGATRON = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)")
_DS_PIPE = re.compile(rf"\bsteps: (\d+) loss: ({_NUM}) iter time \(s\): ({_NUM}) samples/sec: ({_NUM})")
_OVERFLOW = re.compile(r"OVERFLOW! (?:Rank (\d+) )?Skipping step\.(?: Attempted loss scale: ([\d.]+)"
                       r"(?:, reducing to ([\d.]+))?)?")
_DS_STEP = re.compile(r"\[Rank (\d+)\] step=(\d+), skipped=(\d+), lr=\[([^\]]*)\]")
_DS_THROUGHPUT = re.compile(rf"global_step=(\d+), RunningAvgSamplesPerSec=({_NUM}), CurrSamplesPerSec=({_NUM}), "
                            rf"MemAllocated=({_NUM})GB, MaxMemAllocated=({_NUM})GB")
_DS_TIMERS = re.compile(r"time \(ms\) \|(.*)")
_DS_CKPT = re.compile(r"Checkpoint (\S+) is ready now!")
_HF_SAVE = re.compile(r"Saving model checkpoint to (\S+)")
_SKIPPED = re.compile(r"(?<![\w/])skipped\s*[=:]\s*(True|False|true|false|1|0)\b")
_HINT = re.compile(r"loss|step|iter|epoch|batch", re.IGNORECASE)
_LOSS_HINT = re.compile(r"loss", re.IGNORECASE)
MAX_SAMPLE_CHARS = 300
MAX_PATTERN_CHARS = 8192  # the user's pattern sees a line's first 8 KiB (a regex on a 1 MiB line is unbounded)

_MEGATRON_KEYS = {
    "lm loss": "loss", "lm_loss": "loss", "loss": "loss", "loss scale": "loss_scale", "grad norm": "grad_norm",
    "learning rate": "lr", "elapsed time per iteration (ms)": "step_time_ms",
    "number of skipped iterations": "skipped_n", "number of nan iterations": "nan_n",
    "consumed tokens": "consumed_tokens", "global batch size": "global_batch", "actual seqlen": "seqlen",
}


def _jsonable(value: float) -> float | str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


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
    """What the parser made of a log (what `ulyssesctl replay` and `status` report)."""

    lines: int = 0
    records: int = 0
    step_records: int = 0
    by_format: dict[str, int] = field(default_factory=dict)
    dropped_other_rank: int = 0
    dropped_repeated_step: int = 0
    dropped_eval_lines: int = 0
    bad_lines: int = 0  # steps out of the run's progress (one odd line), dropped
    bad_samples: list[str] = field(default_factory=list)
    discontinuities: int = 0  # counters that went backwards or jumped for good (recorded as events)
    unparsed_sample: str | None = None  # the newest line that looked like progress but gave no record


class LogTelemetryParser:
    """Stateful line parser: `feed(line, now)` returns the telemetry records (contract dicts) it completes."""

    def __init__(self, attempt: int | None = None, config_version: int | None = None,
                 after_step: int | None = None, pattern: str | None = None, total_steps: int | None = None,
                 continuity: ContinuityConfig | None = None):
        """`after_step`: the last step already emitted for this attempt (a log re-read from an older offset);
        lines of steps up to it are dropped as repeated. `pattern`: the user's step-line regex (named groups
        `step`, `loss`; optional `lr`, `grad_norm`), tried before the built-in reading. `total_steps`: the
        declared length of the run, when known (a step far beyond it is a bad line)."""
        self.attempt = attempt
        self.config_version = config_version
        self.stats = LogParseStats()
        self.pattern = compile_pattern(pattern) if pattern else None
        self._pending = _Pending()
        self._after_step = after_step
        self._steps = StepContinuity(last_step=after_step, total=total_steps, cfg=continuity)
        self._declared_total = total_steps
        self._context_step: int | None = None  # the newest progress bar / step header without a loss
        self._train_bar: tuple[str, int] | None = None  # (label, total) of the bar that is the run's training progress
        self._context_bar: tuple[str, int] | None = None  # the bar _context_step came from (a candidate until used)
        self._context_from_bar = False
        self._not_train_bars: set[tuple[str, int]] = set()  # bars seen to finish without a loss taking their step
        self._context_step_time: float | None = None
        self._dict_count = 0
        self._dicts_counted = False  # a dict without a step was numbered in order (the run has no training bar)
        self._rank: int | None = None  # the lowest rank seen in a prefix: the one whose losses count
        self._last_time: float | None = None
        self._reports_skips = False  # the log has shown skip information: records without an overflow say False
        self._seen_pure_train = False  # a training loss line without an eval loss has been seen
        self._sample_rank = 0
        self._epoch_pos: tuple[int, int] | None = None  # (epoch, N) of the last keyed N/M beside an epoch
        self._epoch_relative = False

    def count_dicts_from(self, step: int | None) -> None:
        """Number dicts printed without a step from `step` + 1 on (a resumed or re-adopted attempt: the job's
        count goes on from there, not from 1)."""
        if step is not None and step > 0 and self._dict_count == 0:
            self._dict_count = step

    @property
    def _last_step(self) -> int | None:
        return self._steps.last_step

    # -------------------------------------------------------------------------------- public
    def feed(self, line: str, now: float | None = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self.stats.lines += 1
        for segment in line.split("\r"):
            if segment.strip():
                got = self._segment(segment.rstrip("\n"), now)
                if not got and any(c.isdigit() for c in segment):
                    # The example for the fix: the newest line that names a loss, else one that names progress
                    # (step, iter, epoch: also in a path such as `saved .../step_000300.pt`), else the newest line
                    # with a number.
                    rank = 2 if _LOSS_HINT.search(segment) else 1 if _HINT.search(segment) else 0
                    if rank >= self._sample_rank:
                        self.stats.unparsed_sample = segment.strip()[:MAX_SAMPLE_CHARS]
                        self._sample_rank = rank
                out.extend(got)
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
        ts = line_timestamp(seg)
        if ts is not None:
            self._last_time = ts if self._last_time is None else max(ts, self._last_time)
        t = ts if ts is not None else (now if now is not None else self._last_time)
        other_rank = rank is not None and self._rank is not None and rank != self._rank

        if self.pattern is not None:
            mp = self.pattern.search(seg[:MAX_PATTERN_CHARS])
            if mp:
                rec = self._from_pattern(mp)
                if rec is not None:
                    return self._emit_if_rank(rec, t, other_rank, "pattern")

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
            rec = self._megatron(mi)
            if "loss" in rec or rec.get("skipped"):
                return self._emit_if_rank(rec, t, other_rank, "megatron")
        if "time (ms) |" in seg:
            self._timers(seg)
            return []
        mp2 = _DS_PIPE.search(seg)
        if mp2:
            pipe = {"step": int(mp2.group(1)), "loss": _num(mp2.group(2)), "step_time_s": _num(mp2.group(3))}
            return self._emit_if_rank(pipe, t, other_rank, "deepspeed_pipe")
        ck = _DS_CKPT.search(seg) or _HF_SAVE.search(seg)
        if ck and not other_rank:
            self._count("checkpoint")
            tag = ck.group(1).rstrip("/").rsplit("/", 1)[-1]
            return [self._event("checkpoint_saved", t, tag=tag, source="log")]
        return self._generic(read_line(seg), seg, t, other_rank)

    def _generic(self, f: LineFacts, seg: str, t: float | None, other_rank: bool) -> list[dict[str, Any]]:
        if f.bar_step_time_s is not None and not other_rank:
            self._context_step_time = f.bar_step_time_s
        if f.summary:
            return []
        if f.epoch_counter is not None and not other_rank:
            f.step = self._epoch_counter_step(*f.epoch_counter)
        if f.loss is None:
            if f.step is not None and not other_rank:
                if not f.step_from_bar:
                    self._context_step, self._context_bar = f.step, None  # a step header: the next loss line's step
                    self._context_from_bar = False
                elif self._bar_is_training(f):
                    self._context_step, self._context_from_bar = f.step, True  # the training bar: the next loss's step
                    self._count("progress_bar")
            return []
        if f.eval_loss and self._seen_pure_train:
            # The log prints training losses on lines of their own: a line with an eval loss is an evaluation
            # summary (nanoGPT's `step 250: train loss 1.54, val loss 1.72`), not a training step.
            self.stats.dropped_eval_lines += 1
            return []
        step = f.step
        fmt = "key_value"
        if f.step_from_bar and f.bar is not None and not other_rank:
            self._train_bar = (f.bar_label, f.bar[1])  # a bar with the loss on it (Lightning, rich) is the training bar
        if step is None:
            if self._context_step is not None:
                step, fmt = self._context_step, "loss_after_step_header"
                if self._context_from_bar:
                    if self._context_bar is not None and self._train_bar is None:
                        self._train_bar = self._context_bar  # a loss took its step from this bar: the training bar
                    if step == 0 or step == self._last_step:
                        # A bar counts completed steps and tqdm redraws it after each printed line: a loss after
                        # `0/M`, or after the position the previous loss already took, is the next step (tqdm
                        # skips drawing updates closer than 0.1 s apart, so a fast run shows only the redraw).
                        step += 1
            elif f.dict_shaped:
                self._dict_count += 1
                self._dicts_counted = True
                step, fmt = self._dict_count, "dict_counted"
            else:
                return []  # a loss without any step: nothing to place it at
        if f.dict_shaped and fmt != "dict_counted":
            fmt = "dict"
        rec: dict[str, Any] = {"step": step, "loss": f.loss}
        rec.update(f.fields)
        if "step_time_s" not in rec and self._context_step_time is not None and fmt != "key_value":
            rec["step_time_s"] = self._context_step_time
        if f.total:
            rec["total_steps"] = f.total
        sk = _SKIPPED.search(seg)
        if sk:
            rec["skipped"] = sk.group(1) in ("True", "true", "1")
        out = self._emit_if_rank(rec, t, other_rank, fmt)
        if out and not f.eval_loss:
            self._seen_pure_train = True
        return out

    def _bar_is_training(self, f: LineFacts) -> bool:
        """Whether a progress bar without a loss is the run's training progress, whose position the next loss
        line (a printed dict) takes. A framework prints other bars in between (loading or writing checkpoint
        shards, `Map`, evaluation): taking their `1/1` would move the step backwards and drop every later
        record. So once the training bar is known (a loss line took its step, or it carries the loss, or its
        total is the declared total), only that bar (same description and total) counts; before, a bar counts
        as a candidate only while it is running (N < M), never when it would move the step backwards, and a
        candidate that finishes with no loss line having taken its step was not training progress."""
        assert f.bar is not None and f.step is not None
        key = (f.bar_label, f.bar[1])
        if self._train_bar is not None:
            return key == self._train_bar
        declared = self._declared_total
        if declared is not None and f.bar[1] == declared and f.step_rank == 0:
            self._train_bar, self._context_bar = key, key
            return True
        n, m = f.bar
        if n >= m:
            if key == self._context_bar:  # the candidate finished and no loss took its step
                self._not_train_bars.add(key)
                self._context_step = self._context_bar = None
            return False
        if key in self._not_train_bars or self._dicts_counted:
            return False  # (a run that numbers its printed dicts itself: a bar appearing later is not its progress)
        reached = max(x for x in (self._last_step, self._dict_count, -1) if x is not None)
        if f.step < reached:
            return False  # it would move the step backwards by itself
        self._context_bar = key
        return True

    def _epoch_counter_step(self, epoch: int, n: int, total: int) -> int:
        """A keyed N/M beside an epoch: N itself while the count goes on across epochs, E x M + N once the run
        showed it restarting when the epoch moved on (then it counts within the epoch, and stays so)."""
        last = self._epoch_pos
        self._epoch_pos = (epoch, n)
        if not self._epoch_relative and last is not None and epoch > last[0] and n < last[1]:
            self._epoch_relative = True
        return epoch * total + n if self._epoch_relative else n

    def _from_pattern(self, m: re.Match[str]) -> dict[str, Any] | None:
        try:
            step_f = float(m.group("step"))
            loss = _num(m.group("loss"))
        except (TypeError, ValueError):
            return None
        if not math.isfinite(step_f) or step_f < 0 or step_f != int(step_f):
            return None
        rec: dict[str, Any] = {"step": int(step_f), "loss": loss}
        for key in ("lr", "grad_norm"):
            if key in m.re.groupindex and m.group(key) is not None:
                try:
                    rec[key] = _num(m.group(key))
                except ValueError:
                    pass
        return rec

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
        rec: dict[str, Any] = {"step": int(m.group(1)), "total_steps": int(m.group(2))}
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
        total = rec.get("total_steps")
        if isinstance(total, int) and total >= 1 and self._declared_total is None:
            self._steps.total = total  # the run's own N/M: a step far beyond it is a bad line
        if self._after_step is not None and rec["step"] <= self._after_step:
            # A log re-read from an older offset: these steps are in the output already (not a reset).
            self.stats.dropped_repeated_step += 1
            return []
        self._after_step = None
        verdict = self._steps.offer(rec["step"], (rec, t, fmt))
        if verdict.repeated:
            self.stats.dropped_repeated_step += 1
            return []
        for _rec, _t, _fmt in verdict.dropped:
            self.stats.bad_lines += 1
            if len(self.stats.bad_samples) < 5:
                self.stats.bad_samples.append(f"step {_rec['step']} ({_fmt}) after step {self._last_step}")
        out: list[dict[str, Any]] = []
        if verdict.event is not None:
            frm, to, kind = verdict.event
            self.stats.discontinuities += 1
            out.append(self._event("step_discontinuity", t, step=to, change=kind,
                                   from_step=frm if frm >= 0 else None, to_step=to))
        for _rec, _t, _fmt in verdict.emit:
            out.append(self._step_record(_rec, _t, _fmt))
        return out

    def _step_record(self, rec: dict[str, Any], t: float | None, fmt: str) -> dict[str, Any]:
        step = rec["step"]
        self._count(fmt)
        p = self._pending
        merged: dict[str, Any] = dict(p.fields)
        merged.update({k: v for k, v in rec.items() if k not in ("step", "loss", "total_steps")})
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
        total = self._declared_total or rec.get("total_steps")
        if isinstance(total, int) and total >= 1:
            out["total_steps"] = total
        self.stats.records += 1
        self.stats.step_records += 1
        return out

    def _event(self, name: str, t: float | None, step: int | None = None, **fields: Any) -> dict[str, Any]:
        self.stats.records += 1
        return {"v": 1, "kind": "event", "time": t, "attempt": self.attempt,
                "step": step if step is not None else self._last_step, "event": name, **fields}


def parse_log_lines(lines: Iterable[str], attempt: int | None = None) -> Iterator[dict[str, Any]]:
    """Every telemetry record a log's lines yield, in order."""
    return LogTelemetryParser(attempt=attempt).feed_many(lines)


def looks_like_telemetry(first_line: str | bytes) -> bool:
    """True when a file's first non-blank line is a telemetry JSON record, False for a raw job log."""
    text = first_line.decode("utf-8", "replace") if isinstance(first_line, bytes) else first_line
    text = text.strip()
    return text.startswith("{") and '"kind"' in text
