"""Log diagnosis: the tail of a crashed (or running) job's output + exit status -> one label with evidence.

Pure: text in, a `Diagnosis` out; no I/O, no clock. The labels are a fixed set (LABELS); the precedence,
patterns and how to add one are documented in docs/DIAGNOSIS.md.

How it decides (root cause beats consequence):
1. The text is normalised once: only the last `max_bytes` / `max_lines` are kept, ANSI codes stripped,
   carriage returns (progress bars) become line breaks.
2. Each label's lowercase key literals find candidate lines (`str.find`, C speed); only those lines meet
   the label's compiled regex. Lines matching the label's `exclude` pattern (benign noise) and source lines
   quoted in tracebacks do not count.
3. The exit status (argument, or torchrun/DeepSpeed launcher summaries in the log) adds signal evidence:
   SIGKILL -> host_oom_killed, SIGSEGV/SIGBUS -> segfault. In a torchrun summary only the "Root Cause"
   block counts: the other failures listed there are ranks the agent killed afterwards.
4. The first label of `PRECEDENCE` that has evidence wins. nccl_error vs nccl_timeout is decided by which
   appears first in the log (a network error makes peers time out; a hung rank's timeout makes its peers
   see remote errors). The fp16 overflow label needs a *storm* after warm-up, not a few calibration skips.
5. A plain Python exception (no rule matches its message) on the rank that failed first beats the
   communication errors of its peers, which are its consequences: the label is then `python_exception`
   with the exception line as evidence; see `_first_failure`. An uncaught exception with no other
   evidence is `python_exception` too.
6. Confidence: `healthy` is `high` only when the log shows training progressing (or the job exited 0); a
   text that is not a training log at all (empty, binary) says so in the reason, at `low`.
   `host_oom_killed` from a bare SIGKILL is `medium`: `refine_with_host` upgrades it with the host's OOM
   counters, or turns it into `killed` when they show no OOM kill.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import asdict, dataclass, field, replace

from ulyssesd.remediation.diagnosis_rules import PRECEDENCE, RULES

LABELS: tuple[str, ...] = (
    "cuda_oom", "host_oom_killed", "nccl_timeout", "nccl_error", "loss_scale_overflow", "loss_scale_min",
    "nan_loss", "illegal_memory_access", "gpu_hardware", "disk_full", "checkpoint_corrupt", "dataloader_crash",
    "launcher_error", "segfault", "killed", "config_rejected", "python_exception", "healthy",
)

# Bytes of the log end that callers should pass (and that `diagnose` keeps at most).
TAIL_BYTES = 512 * 1024


@dataclass(frozen=True)
class DiagnosisConfig:
    """Knobs of the log diagnosis (defaults suit DeepSpeed fp16 defaults: initial scale 2^16, window 1000)."""

    max_bytes: int = TAIL_BYTES  # only this many characters of the end of the text are scanned
    max_lines: int = 20_000  # ...and at most this many lines of it
    max_line_chars: int = 4_000  # longer lines (minified JSON, progress bars) are cut before matching
    max_evidence: int = 5  # evidence lines reported for the primary label
    overflow_warmup_steps: int = 100  # OVERFLOW lines at or before this step are loss-scale calibration
    overflow_storm_min: int = 8  # a storm needs at least this many post-warm-up OVERFLOW lines...
    overflow_storm_span_steps: int = 200  # ...within this many steps of each other
    overflow_storm_min_nostep: int = 24  # without step numbers in the log: this many OVERFLOW lines in the tail
    root_exception_window: int = 40  # an exception is the first failure only this many unindented lines before a comm error
    max_tracebacks: int = 64  # only the last this many tracebacks of the tail are read
    max_traceback_lines: int = 400  # a traceback's exception line is looked for this many lines after its header
    overflow_low_scale: float = 64.0  # OVERFLOW at an attempted scale <= this is far below fp16's 2^16 start...
    overflow_low_scale_min: int = 3  # ...and this many such lines are a storm, at any step
    overflow_skipped_fraction: float = 0.5  # DeepSpeed's "step=N, skipped=M": M/N >= this after warm-up is a storm
    progress_min_lines: int = 2  # healthy is `high` only with at least this many progress lines
    binary_fraction: float = 0.1  # text with more than this share of control/replacement characters is binary


@dataclass(frozen=True)
class Diagnosis:
    """One primary label, the verbatim (ANSI-stripped) lines that decided it, and why."""

    label: str  # one of LABELS
    evidence: list[str] = field(default_factory=list)  # the deciding lines, in log order
    confidence: str = "high"  # high | medium | low
    reason: str = ""  # one sentence naming the evidence
    secondary: list[str] = field(default_factory=list)  # other labels seen in the log, in precedence order

    def to_dict(self) -> dict:
        return asdict(self)


_RULE_BY_LABEL = {r.label: r for r in RULES}

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_NEWLINES = re.compile(r"\r\n|\r")
_FLAGS = re.IGNORECASE
_COMPILED = {r.label: re.compile("|".join(f"(?:{p})" for p in r.patterns), _FLAGS) for r in RULES}
_EXCLUDE = {r.label: re.compile(r.exclude, re.IGNORECASE) for r in RULES if r.exclude}
# Source lines quoted in a traceback ("    raise RuntimeError(f'DataLoader ...')", '  File "x.py"') are not
# evidence: the exception's own final line is.
_CODE_LINE = re.compile(r"""^(?:\[[^\]\n]*\]:?|\d+:)?\s+(?:raise\b|File ")""")

# Exit status written in the log by torchrun / DeepSpeed's launcher / Python's subprocess.
_SIGNAL_IN_LOG = re.compile(
    r"Signal (\d+) \(SIG\w+\) received by PID"
    r"|exitcode\s*:\s*-(\d+)"
    r"|failed \(exitcode: -(\d+)\)"
    r"|exits with return code = -(\d+)"
    r"|died with <Signals\.SIG\w+: (\d+)>",
    re.IGNORECASE,
)
_SIGNAL_KEYS = ("received by pid", "exitcode", "return code =", "died with <signals")
# The shell's report of a SIGKILLed child: a bare "Killed" (maybe rank-prefixed; "已杀死" in a Chinese locale),
# "1234 Killed  python ...", or srun's "task 0: Killed".
_SHELL_KILLED = re.compile(
    r"^[^\S\n]*(?:\S+:[^\S\n]*)?(?:Killed|已杀死)[^\S\n]*$|\b\d+[^\S\n]+Killed(?:[^\S\n]+\S|[^\S\n]*$)"
    r"|\btasks? [\d,\-]+: Killed[^\S\n]*$", re.MULTILINE)
_SHELL_KILLED_KEYS = ("killed", "已杀死")
_EROFS = re.compile(r"Read-only file system|\[Errno 30\]|\bEROFS\b", re.IGNORECASE)
_CHILD_FAILED = re.compile(r"ChildFailedError|exits with return code = [1-9]|failed \(exitcode: [1-9]", re.IGNORECASE)
_OVERFLOW = re.compile(
    r"OVERFLOW! Rank \d+ Skipping step|Gradient overflow\.\s+Skipping step|Grad overflow on iteration"
    r"|Overflow detected\. Skipping step|Skipping step\. Attempted loss scale|Reducing dynamic loss scale from",
    re.IGNORECASE,
)
_OVERFLOW_KEYS = ("overflow", "skipping step", "reducing dynamic loss scale")
# The loss scale an overflow line names (the attempted one, or apex's new one): far below fp16's 2^16 start
# it means the scale is collapsing (applied to lowercased lines).
_OVERFLOW_SCALE = re.compile(r"(?:attempted loss scale:|reducing loss scale to|reducing dynamic loss scale from)\s*"
                             r"([0-9]+(?:\.[0-9]*)?(?:e[-+]?[0-9]+)?)")
# DeepSpeed's periodic "step=2000, skipped=1995": the share of skipped steps (lowercased lines).
_SKIPPED = re.compile(r"\bstep=(\d+), skipped=(\d+)")
# Megatron's iteration line: without "lm loss" and with no skipped iteration, the loss was NaN (Megatron
# drops a non-finite loss from the line; its nan counter stays 0 under DeepSpeed, Megatron-DeepSpeed PR 434).
_MEGATRON_ITER = re.compile(r"\biteration\s+\d+/\s*\d+ \|[^\n]*consumed samples")
_MEGATRON_SKIPPED = re.compile(r"number of skipped iterations:\s*(\d+)")
_MEGATRON_LOSS = re.compile(r"\b\w*[ _]loss:\s*[-+0-9]|grad norm: nan")
# A line that shows training progressing (lowercased): step counters, tqdm "12/345 [", loss reports.
_PROGRESS = re.compile(
    r"\b(?:global_step|step|steps|iter|iteration|epoch|batch)\b['\"]?\s*[=:]?\s*\[?\s*\d+"
    r"|\b\d+/\d+ \[\d|['\"](?:train_)?loss['\"]:\s*[0-9]|\bloss[=:]\s*[0-9]|\blm[ _]loss:\s*[0-9]"
)
_PROGRESS_KEYS = ("step", "iter", "epoch", "batch", "/", "loss")
# A bare exception line with no traceback header above it (a thread title, a one-line report).
_BARE_EXC = re.compile(r"^(?:\[[^\]\n]*\]:?\s*)?((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception))(?::\s|:?$)")
_FRAME = re.compile(r'^(?:\[[^\]\n]*\]:?)?\s+File "[^"]+", line \d+, in ')
_LAUNCHER_FRAMES = ("bin/torchrun", "torch/distributed/run.py", "torch/distributed/elastic", "accelerate-launch",
                    "accelerate/commands/launch", "deepspeed/launcher", "torch/distributed/launch.py")
_BARE_EXC_KEYS = ("error:", "exception:", "error\n", "exception\n")
# Applied to lowercased lines (case-sensitive is much faster than IGNORECASE in `re`).
_STEP = re.compile(r"\b(?:global_step|steps?|iteration|iter)\b['\"]?\s*[=:]?\s*(\d+)\b|\bloss is nan at step (\d+)")
# Rank/host/time prefixes removed only for de-duplicating evidence ("same message on 8 ranks").
_DIGITS = re.compile(r"\d+")
_PREFIX = re.compile(r"^(?:\s*(?:\[[^\]]*\]|\S+:\d*:?\d*|\d+:)\s*:?)+")

# Python tracebacks. The exception line ends a traceback: "Type: message" (a dotted CapWords name) at the
# traceback's indentation, after the same rank prefix as its header; a bare name only when it looks like one.
_TB_HEADER = "Traceback (most recent call last):"
_EXC_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Z]\w*[a-z]\w*)(?::\s|:$)"
                       r"|^((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit|Iteration|Fault))$")
# Rank of a line prefix: torch's "[rank3]:" / srun -l "3:" / mpirun "[1,3]<stderr>:" are global ranks; torchrun
# --tee's "[default3]:" is the local rank.
_PREFIX_RANK = re.compile(r"\[rank(\d+)\]|^\s*(\d+):|\[\d+,(\d+)\]<std|\[default(\d+)\]")
# Indented lines after an optional rank prefix (traceback frames, source, carets, summary fields): not counted
# when measuring how far apart two events are in the log.
_INDENTED = re.compile(r"^(?:\[[^\]\n]*\]:?\s?|\d+:\s?)?\s")
# Exceptions that are never a root cause: interrupts, and the launcher agent's own (ChildFailedError, ...).
_NOT_ROOT = re.compile(r"^(?:KeyboardInterrupt|SystemExit|GeneratorExit|torch\.distributed\.elastic\.|SignalException"
                       r"|ChildFailedError|(?:\w+\.)*CalledProcessError)")
# An exception about communication is a communication failure even when no nccl_* pattern knows its wording.
_COMM_WORDS = re.compile(r"nccl|gloo|DistBackendError|DistNetworkError|DistStoreError|ProcessGroup|c10d", re.IGNORECASE)
# torchrun's failure summary: one entry per failed rank, "  field     : value".
_SUMMARY_ENTRY = re.compile(r"^\[\d+\]:\s*$")
_SUMMARY_FIELD = re.compile(r"^\s+(time|rank|exitcode)\s*:\s*(\S+)(?:\s*\(local_rank:\s*(\d+)\))?")

SIGKILL, SIGSEGV, SIGBUS, SIGTERM, SIGINT, SIGHUP = 9, 11, 7, 15, 2, 1


@dataclass(frozen=True)
class _Exc:
    """The final line of one Python traceback."""

    line: int  # index into the normalised lines
    name: str  # exception type as printed ("RuntimeError", "ulyssesd.training.faults.InjectedFault")
    rank: tuple[str, int] | None  # ("global" | "local", n) from the line's prefix; None when unprefixed


@dataclass(frozen=True)
class _SummaryEntry:
    """One rank's entry in torchrun's ChildFailedError summary."""

    time: str | None
    rank: int | None
    local_rank: int | None
    exitcode: int | None
    exc: _Exc | None  # the exception line of its inline traceback (only with @record's error files)


def _exc_name(text: str) -> str | None:
    m = _EXC_LINE.match(text)
    return (m.group(1) or m.group(2)) if m else None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _prefix_rank(prefix: str) -> tuple[str, int] | None:
    m = _PREFIX_RANK.search(prefix)
    if not m:
        return None
    g, srun, mpi, local = m.groups()
    return ("local", int(local)) if local is not None else ("global", int(g or srun or mpi))


def _normalise(text: str, cfg: DiagnosisConfig) -> list[str]:
    if len(text) > cfg.max_bytes:
        text = text[-cfg.max_bytes:]
        text = text[text.find("\n") + 1:] if "\n" in text else text  # drop the cut first line
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    text = _NEWLINES.sub("\n", text)
    lines = text.split("\n")
    if len(lines) > cfg.max_lines:
        lines = lines[-cfg.max_lines:]
    return [ln[: cfg.max_line_chars].rstrip() for ln in lines]


def _signal_from_exit(exit_code: int | None, signal: int | None) -> int | None:
    if signal:
        return signal
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code <= 128 + 64:  # shell convention: 128 + signal number
        return exit_code - 128
    return None


class _Scan:
    """Hits of every rule over one normalised tail.

    Python's `re` has no multi-pattern automaton: an alternation is tried at every position of the text.
    So each rule first finds candidate lines with `str.find` over the lowercased tail (C speed), and only
    those lines meet the regex — a 512 KiB tail diagnoses in tens of milliseconds.
    """

    def __init__(self, lines: list[str], cfg: DiagnosisConfig):
        self.lines = lines
        self.cfg = cfg
        self.lowered = lowered = [ln.lower() for ln in lines]  # per line: lower() may change a line's length
        self.lower = "\n".join(lowered)
        self.starts = [0]
        pos = 0
        for ln in lowered[:-1]:
            pos += len(ln) + 1
            self.starts.append(pos)
        self.hits: dict[str, list[int]] = {}
        for rule in RULES:
            idx = self.match(_COMPILED[rule.label], rule.keys)
            excl = _EXCLUDE.get(rule.label)
            if excl is not None:
                idx = [i for i in idx if not excl.search(lines[i])]
            idx = [i for i in idx if not _CODE_LINE.match(lines[i])]
            if idx:
                self.hits[rule.label] = idx

    def candidates(self, keys: tuple[str, ...]) -> list[int]:
        found: set[int] = set()
        text, starts = self.lower, self.starts
        for key in keys:
            pos = text.find(key)
            while pos != -1:
                i = bisect.bisect_right(starts, pos) - 1
                found.add(i)
                nxt = starts[i + 1] if i + 1 < len(starts) else len(text)
                pos = text.find(key, nxt)  # one hit per line is enough
        return sorted(found)

    def match(self, rx: re.Pattern, keys: tuple[str, ...]) -> list[int]:
        return [i for i in self.candidates(keys) if rx.search(self.lines[i])]

    def evidence(self, idx: list[int]) -> list[str]:
        seen: set[str] = set()
        out: list[str] = []
        for i in idx:
            line = self.lines[i].strip()
            key = _DIGITS.sub("#", _PREFIX.sub("", line))
            if key in seen or not line:
                continue
            seen.add(key)
            out.append(line)
            if len(out) >= self.cfg.max_evidence:
                break
        return out

    def signal_lines(self) -> list[tuple[int, int]]:
        """(line index, signal number) for every exit-by-signal the launcher reported as a cause.

        torchrun's summary lists "Failures:" (ranks it killed after the first one failed) before
        "Root Cause (first observed failure):"; signals inside the Failures block are consequences.
        """
        failures = self.candidates(("failures:",))
        roots = self.candidates(("root cause (first observed failure)",))
        out = []
        for i in self.candidates(_SIGNAL_KEYS):
            k = bisect.bisect_right(failures, i) - 1  # the Failures: header above this line, if any
            if k >= 0:
                r = bisect.bisect_right(roots, failures[k])  # the Root Cause header after that header
                if r < len(roots) and i < roots[r]:
                    continue  # inside the Failures: block
            for m in _SIGNAL_IN_LOG.finditer(self.lines[i]):
                out.append((i, int(next(g for g in m.groups() if g is not None))))
        return out

    def exceptions(self) -> list[_Exc]:
        """The exception line of each of the last `max_tracebacks` tracebacks, in log order.

        Ranks interleave: a traceback's lines are those with its header's prefix ("[rank1]: ", or none);
        the exception line is the first of them that is not indented (frames and source lines are).
        """
        out: list[_Exc] = []
        for h in self.candidates(("traceback (most recent call last):",))[-self.cfg.max_tracebacks:]:
            k = self.lines[h].find(_TB_HEADER)
            prefix = self.lines[h][:k].rstrip() if k >= 0 else None
            if prefix is None or prefix.endswith("traceback :"):
                continue  # torchrun's summary quotes @record tracebacks: read by summary()
            for i in range(h + 1, min(h + 1 + self.cfg.max_traceback_lines, len(self.lines))):
                line = self.lines[i]
                if not line.startswith(prefix):
                    continue  # another rank's line
                rest = line[len(prefix):]
                rest = rest[1:] if prefix and rest.startswith(" ") else rest
                if rest.startswith(_TB_HEADER):
                    break
                name = _exc_name(rest)
                if name:
                    out.append(_Exc(i, name, _prefix_rank(prefix)))
                    break
        return sorted(out, key=lambda e: e.line)

    def summary(self) -> tuple[_SummaryEntry | None, list[_SummaryEntry]]:
        """(Root Cause entry, Failures entries) of the last torchrun ChildFailedError summary in the tail."""
        roots = self.candidates(("root cause (first observed failure)",))
        if not roots:
            return None, []
        r = roots[-1]
        end = next((i for i in range(r + 1, min(r + 200, len(self.lines))) if self.lines[i].startswith("====")),
                   min(r + 200, len(self.lines)))
        fails = [i for i in self.candidates(("failures:",)) if i < r]
        failures = self._entries(fails[-1] + 1, r) if fails else []
        root = self._entries(r + 1, end)
        return (root[0] if root else None), failures

    def _entries(self, a: int, b: int) -> list[_SummaryEntry]:
        out: list[_SummaryEntry] = []
        fields: dict[str, str] = {}
        exc: _Exc | None = None
        in_tb = False

        def flush() -> None:
            if fields:
                out.append(_SummaryEntry(fields.get("time"), _int(fields.get("rank")), _int(fields.get("local_rank")),
                                         _int(fields.get("exitcode")), exc))

        for i in range(a, b):
            line = self.lines[i]
            if _SUMMARY_ENTRY.match(line):  # "[0]:" starts an entry
                flush()
                fields, exc, in_tb = {}, None, False
                continue
            m = _SUMMARY_FIELD.match(line)
            if m:
                fields[m.group(1)] = m.group(2)
                if m.group(3) is not None:
                    fields["local_rank"] = m.group(3)
                continue
            if _TB_HEADER in line and "traceback :" in line:
                in_tb = True
            elif in_tb and line.startswith("  ") and not line.startswith("   "):
                name = _exc_name(line[2:])  # @record's quoted traceback: its exception line is indented by 2
                if name:
                    exc = _Exc(i, name, None)
        flush()
        return out

    def unindented_between(self, a: int, b: int, limit: int) -> int:
        """How many non-blank, unindented lines lie strictly between a and b (counting stops past `limit`)."""
        n = 0
        for i in range(a + 1, b):
            line = self.lines[i]
            if line.strip() and not _INDENTED.match(line):
                n += 1
                if n > limit:
                    break
        return n

    def overflow_storm(self) -> tuple[list[int], int, int]:
        """(overflow line indexes if they form a storm else [], total overflows, early ones).

        A storm is either many OVERFLOW lines after warm-up (by step), or the loss scale itself collapsing:
        `overflow_low_scale_min` overflows at a scale <= `overflow_low_scale`, or any at a scale below 1
        (far below fp16's 2^16 start: calibration never goes there), or DeepSpeed's skipped counter showing
        most steps skipped after warm-up. The scale trajectory works when the job's `skipped` flag says
        nothing and when the log has no step numbers.
        """
        over = self.match(_OVERFLOW, _OVERFLOW_KEYS)
        storm, early = self._late_storm(over)
        if storm:
            return storm, len(over), early
        low = [i for i in over if self._low_scale(i)]
        if low and (len(low) >= self.cfg.overflow_low_scale_min or any(self._scale(i) < 1.0 for i in low)):
            return low, len(over), early
        return self._skipped_storm(), len(over), early

    def _late_storm(self, over: list[int]) -> tuple[list[int], int]:
        """(storm lines by step count, overflows during warm-up)."""
        if not over:
            return [], 0
        step_at: list[tuple[int, int]] = []  # (line index, last step number on that line), in line order
        for i in self.candidates(("step", "iter")):
            found = _STEP.findall(self.lowered[i])
            if found:
                a, b = found[-1]
                step_at.append((i, int(a or b)))
        if not step_at:
            # No step numbers: only a long run of OVERFLOW lines in the tail counts as a storm.
            if len(over) >= self.cfg.overflow_storm_min_nostep:
                return over, 0
            return [], len(over)
        step_lines = [li for li, _ in step_at]
        late: list[tuple[int, int]] = []
        early = 0
        for li in over:
            k = bisect.bisect_right(step_lines, li) - 1  # the last step reported at or before this line
            step = step_at[k][1] if k >= 0 else 0
            if step <= self.cfg.overflow_warmup_steps:
                early += 1
            else:
                late.append((li, step))
        n = self.cfg.overflow_storm_min
        for j in range(len(late) - n + 1):  # n late overflows inside one span of steps
            if late[j + n - 1][1] - late[j][1] <= self.cfg.overflow_storm_span_steps:
                return [li for li, _ in late[j:]], early
        return [], early

    def _scale(self, i: int) -> float:
        m = _OVERFLOW_SCALE.search(self.lowered[i])
        try:
            return float(m.group(1)) if m else float("inf")
        except ValueError:
            return float("inf")

    def _low_scale(self, i: int) -> bool:
        return self._scale(i) <= self.cfg.overflow_low_scale

    def _skipped_storm(self) -> list[int]:
        out = []
        for i in self.candidates(("skipped=",)):
            m = _SKIPPED.search(self.lowered[i])
            if m:
                step, skipped = int(m.group(1)), int(m.group(2))
                if step > self.cfg.overflow_warmup_steps and skipped >= self.cfg.overflow_skipped_fraction * step:
                    out.append(i)
        return out

    def megatron_nan(self) -> list[int]:
        """Megatron iteration lines whose loss vanished (or whose grad norm is NaN) without a skipped iteration.

        Megatron drops a non-finite loss from its iteration line; fp16 warm-up skips iterations without a loss
        too, so a line counts only when it reports 0 skipped iterations, or when it is cut before the counters
        and earlier iteration lines did print a loss."""
        out = []
        had_loss = False
        for i in self.candidates(("consumed samples",)):
            low = self.lowered[i]
            if not _MEGATRON_ITER.search(low):
                continue
            has_loss = bool(_MEGATRON_LOSS.search(low)) and "grad norm: nan" not in low
            m = _MEGATRON_SKIPPED.search(low)
            skipped = int(m.group(1)) if m else None
            if not has_loss and (skipped == 0 or (skipped is None and had_loss)):
                out.append(i)
            had_loss = had_loss or has_loss
        return out

    def progress_lines(self, limit: int) -> int:
        """How many lines show training progressing (counting stops at `limit`)."""
        n = 0
        for i in self.candidates(_PROGRESS_KEYS):
            if _PROGRESS.search(self.lowered[i]):
                n += 1
                if n >= limit:
                    break
        return n

    def bare_exceptions(self) -> list[_Exc]:
        """Unindented exception lines ("IndexError: list index out of range") anywhere in the tail."""
        out = []
        for i in self.candidates(("error", "exception")):
            m = _BARE_EXC.match(self.lines[i].strip())
            if m and not _NOT_ROOT.match(m.group(1)):
                out.append(_Exc(i, m.group(1), None))
        return out


def diagnose(log_tail: str, exit_code: int | None = None, signal: int | None = None,
             config: DiagnosisConfig | None = None) -> Diagnosis:
    """Classify the end of a job's output. `exit_code` follows subprocess (negative = signal) or shell (128+N)
    conventions; `signal` is the terminating signal when known. Exit 0 is always `healthy`."""
    cfg = config or DiagnosisConfig()
    text = log_tail or ""
    not_log = _not_a_training_log(text, cfg)
    if not_log and exit_code in (None, 0) and not signal:
        return Diagnosis("healthy", [], "low", f"Not a training log: {not_log}; there is nothing to diagnose.")
    scan = _Scan(_normalise(text, cfg), cfg)
    hits = dict(scan.hits)

    storm, n_over, n_early = scan.overflow_storm()
    if storm:
        hits["loss_scale_overflow"] = storm
    megatron_nan = scan.megatron_nan()
    if megatron_nan:
        hits["nan_loss"] = sorted(set(hits.get("nan_loss", []) + megatron_nan))

    # Exit by signal: from the caller, or as reported by the launcher inside the log.
    sig = _signal_from_exit(exit_code, signal)
    sig_lines = scan.signal_lines()
    killed_lines = scan.match(_SHELL_KILLED, _SHELL_KILLED_KEYS)
    kill_idx = [i for i, s in sig_lines if s == SIGKILL] + killed_lines
    segv_idx = [i for i, s in sig_lines if s in (SIGSEGV, SIGBUS)]
    term_idx = [i for i, s in sig_lines if s in (SIGTERM, SIGINT, SIGHUP)]
    signal_only: dict[str, bool] = {}
    oom_named = "host_oom_killed" in hits  # the log itself names the OOM killer / an allocation failure
    if kill_idx or sig == SIGKILL:
        if not oom_named:
            signal_only["host_oom_killed"] = not killed_lines
        hits["host_oom_killed"] = sorted(set(hits.get("host_oom_killed", []) + kill_idx))
    if "killed" in hits and "host_oom_killed" in hits and not oom_named:
        # The scheduler or an operator is shown as the sender of the SIGKILL / "Killed": not the OOM killer.
        del hits["host_oom_killed"]
    if term_idx and "killed" not in hits:
        hits["killed"] = term_idx  # torchrun's Root Cause: a rank ended by SIGTERM/SIGINT/SIGHUP from outside
        signal_only["killed"] = True
    if segv_idx or sig in (SIGSEGV, SIGBUS):
        hits["segfault"] = sorted(set(hits.get("segfault", []) + segv_idx))

    seen = [lb for lb in PRECEDENCE if lb in hits]

    if exit_code == 0 and not signal:
        return Diagnosis("healthy", [], "high",
                         "The job exited 0" + (f"; also seen in the log: {', '.join(seen)}." if seen else "."),
                         seen)

    primary = _pick(seen, hits)
    first: tuple[_Exc, str] | None = None
    if primary in (None, "nccl_error", "nccl_timeout"):
        # Why: the rank that failed first is the root cause. When it died of a plain Python exception (a bug,
        # an injected `raise`), its peers then fail in their next collective ("Connection closed by peer",
        # ncclRemoteError, watchdog timeouts): those are consequences and must not pick the crash ladder.
        comm = [hits[lb][0] for lb in ("nccl_error", "nccl_timeout") if lb in hits]
        first = _first_failure(scan, min(comm) if comm else len(scan.lines))
        if first is not None and not _plain(scan, first[0], hits):
            first = None  # the first failure's own message is a known category (NCCL, OOM, ENOSPC, ...)
    if primary is None:
        return _no_pattern(scan, exit_code, sig, n_over, n_early, first)
    if first is not None:
        exc, how = first
        ev = scan.evidence([exc.line])
        comm_seen = [lb for lb in seen if lb != "python_exception"]
        return Diagnosis(
            "python_exception", ev, "medium",
            f"python_exception: {how} failed first, with an uncaught Python exception ({exc.name}) that no narrower label "
            f"explains; its peers' later errors ({', '.join(comm_seen)}) are consequences; deciding line: "
            f"{_clip(ev[0])!r}.",
            comm_seen)

    idx = hits[primary]
    ev = scan.evidence(idx)  # may be empty when the exit status alone decided (SIGKILL/SIGSEGV)
    confidence = "high"
    if signal_only.get(primary):
        # SIGKILL without an oom-killer/"Killed" hint: the OOM killer is only the usual sender (the daemon asks
        # the host, see refine_with_host); a bare SIGTERM in torchrun's summary: someone outside sent it.
        confidence = "medium"
    reason = _reason(primary, ev, sig, exit_code)
    return Diagnosis(primary, ev, confidence, reason, [lb for lb in seen if lb != primary])


def refine_with_host(d: Diagnosis, oom_kills: int | None, kernel_oom_lines: list[str] | None = None) -> Diagnosis:
    """Sharpen a SIGKILL diagnosis with the host's OOM evidence (pure: the daemon reads it, see
    daemon/host_oom.py). `oom_kills`: the cgroup's `memory.events` oom_kill count during the attempt (None:
    unreadable); `kernel_oom_lines`: OOM-killer lines of the kernel log during the attempt (None: unreadable).

    Only a `host_oom_killed` that is not already `high` changes: evidence of a kill makes it `high`; counters
    that were readable and show no kill make it `killed` (someone else sent the SIGKILL)."""
    if d.label != "host_oom_killed" or d.confidence == "high":
        return d
    lines = list(kernel_oom_lines or [])
    if (oom_kills or 0) > 0 or lines:
        what = (f"the cgroup's memory.events counts {oom_kills} oom_kill(s) during the attempt" if oom_kills
                else "the kernel log shows the OOM killer during the attempt")
        return replace(d, confidence="high", evidence=(d.evidence + lines)[: DiagnosisConfig().max_evidence],
                       reason=f"host_oom_killed: a rank was SIGKILLed and {what}.")
    if oom_kills == 0 and kernel_oom_lines is not None:
        return replace(d, label="killed", confidence="medium", secondary=["host_oom_killed", *d.secondary],
                       reason="killed: a rank was SIGKILLed but the host's OOM counters (cgroup memory.events, "
                              "kernel log) show no OOM kill during the attempt: another process sent it.")
    if oom_kills == 0:
        return replace(d, label="killed", confidence="medium", secondary=["host_oom_killed", *d.secondary],
                       reason="killed: a rank was SIGKILLed but the cgroup's memory.events shows no oom_kill "
                              "during the attempt (the kernel log was not readable): another process sent it.")
    return d


def _not_a_training_log(text: str, cfg: DiagnosisConfig) -> str | None:
    """Why the text is not a log at all (empty, binary), or None."""
    if not text.strip():
        return "the log is empty" if not text else "the log holds only whitespace"
    head = text[:4096]
    bad = sum(1 for ch in head if (ord(ch) < 32 and ch not in "\n\r\t\x1b") or ch == "\ufffd")
    if bad > cfg.binary_fraction * len(head):
        return f"the text looks binary ({100 * bad // len(head)} % control or undecodable characters)"
    return None


def _pick(seen: list[str], hits: dict[str, list[int]]) -> str | None:
    if not seen:
        return None
    primary = seen[0]
    if primary in ("nccl_error", "nccl_timeout") and "nccl_error" in hits and "nccl_timeout" in hits:
        # Both comm failures: the one that happened first in the log is the cause of the other.
        primary = "nccl_error" if hits["nccl_error"][0] <= hits["nccl_timeout"][0] else "nccl_timeout"
    return primary


def _first_failure(scan: _Scan, anchor: int) -> tuple[_Exc, str] | None:
    """The exception line of the rank that failed first, and how it was found; None when the tail shows none.

    1. torchrun's "Root Cause (first observed failure)" entry names the rank that exited first: its quoted
       traceback (with @record) or that rank's last rank-prefixed traceback. Not trusted when another rank
       crashed on its own in the same second (torchrun then names the lowest rank) or the root was a signal.
    2. Otherwise line order: a rank writes its traceback before it exits and its peers' collectives fail only
       once it has exited, so the first exception within `root_exception_window` unindented lines before the
       first communication error (`anchor`; the end of the log when there is none) is the first failure.
       An exception further back was caught and logged while training went on.
    """
    root, failures = scan.summary()
    trusted = (root is not None and root.exitcode is not None and root.exitcode > 0
               and not any(f.time == root.time and (f.exitcode or 0) > 0 for f in failures))
    excs = scan.exceptions()
    if root is not None and trusted:
        who = f"rank {root.rank}" if root.rank is not None else "the first failed rank"
        if root.exc is not None:
            return root.exc, f"{who} (torchrun's Root Cause entry)"
        mine = [e for e in excs if e.rank is not None
                and e.rank == (("global", root.rank) if e.rank[0] == "global" else ("local", root.local_rank))]
        if mine:
            return mine[-1], f"{who} (torchrun's Root Cause entry)"
    window = scan.cfg.root_exception_window
    near: list[_Exc] = []
    count, upto = 0, anchor
    for e in reversed([e for e in excs if e.line < anchor]):  # walk back from the anchor: one pass over the lines
        count += scan.unindented_between(e.line, upto, window - count)
        if count > window:
            break
        if not _NOT_ROOT.match(e.name):
            near.append(e)
        count, upto = count + 1, e.line  # the exception line itself is unindented
    if not near:
        return None
    first = near[-1]
    who = f"rank {first.rank[1]}" if first.rank else "the first rank to fail"
    return first, f"{who} (first exception in the log)"


def _plain(scan: _Scan, exc: _Exc, hits: dict[str, list[int]]) -> bool:
    """A generic exception: its line is no rule's evidence and it is not about communication or an interrupt."""
    if _NOT_ROOT.match(exc.name) or any(exc.line in idx for idx in hits.values()):
        return False
    return not _COMM_WORDS.search(scan.lines[exc.line])


def _clip(line: str) -> str:
    return line if len(line) <= 200 else line[:197] + "..."


def _no_pattern(scan: _Scan, exit_code: int | None, sig: int | None, n_over: int, n_early: int,
                first: tuple[_Exc, str] | None = None) -> Diagnosis:
    benign = f" ({n_over} OVERFLOW line(s) seen, {n_early} during loss-scale warm-up, not a storm)" if n_over else ""
    child = scan.match(_CHILD_FAILED, ("childfailederror", "return code =", "failed (exitcode"))
    crashed = (exit_code not in (None, 0)) or (sig not in (None, SIGTERM)) or bool(child)
    if sig == SIGTERM and not child:
        return Diagnosis("healthy", [], "medium", f"The job was stopped by SIGTERM and no failure pattern was found{benign}.")
    if first is None:
        first = _uncaught(scan)
    if first is not None:
        # An uncaught exception no narrower label covers: its own label, with the exception line as evidence.
        exc, how = first
        ev = scan.evidence([exc.line, *child])
        status = f"the job failed ({_status(exit_code, sig)}); " if crashed else ""
        return Diagnosis("python_exception", ev, "medium",
                         f"python_exception: {status}{how} raised an uncaught Python exception ({exc.name}) that no narrower label "
                         f"explains; deciding line: {_clip(ev[0])!r}.")
    if not crashed:
        n = scan.progress_lines(scan.cfg.progress_min_lines)
        if n >= scan.cfg.progress_min_lines:
            return Diagnosis("healthy", [], "high", f"No failure pattern in the log tail and training is progressing{benign}.")
        return Diagnosis("healthy", [], "medium",
                         f"No failure pattern in the log tail{benign}, but it shows no training progress either.")
    ev = scan.evidence(child)
    return Diagnosis(
        "launcher_error", ev, "low",
        f"The job failed ({_status(exit_code, sig)}) with no recognised root cause"
        + (f"; the launcher reported: {ev[0]!r}." if ev else "; no launcher summary in the tail."),
    )


def _status(exit_code: int | None, sig: int | None) -> str:
    return f"exit code {exit_code}" if exit_code is not None else (f"signal {sig}" if sig else "a failed child")


def _uncaught(scan: _Scan) -> tuple[_Exc, str] | None:
    """The last exception of the tail that training did not survive (no progress after it), if any.

    Without a complete traceback, a bare exception line ("IndexError: ...") counts, and last a traceback
    header the tail ends in (the exception line cut off)."""
    excs = [e for e in scan.exceptions() if not _NOT_ROOT.match(e.name)]
    how = "the job (a traceback)"
    if not excs:
        excs = scan.bare_exceptions()
        how = "the job (an exception line)"
    if not excs:
        headers = scan.candidates(("traceback (most recent call last):",))
        ended = [e.line for e in scan.exceptions()]  # tracebacks that do end in an exception line (any)
        headers = [h for h in headers[-1:] if (not ended or h > ended[-1]) and not _launcher_traceback(scan, h)]
        excs = [_Exc(h, "exception (its line is cut off)", _prefix_rank(scan.lines[h])) for h in headers]
        how = "the job (a traceback cut off before its exception line)"
    if not excs:
        # Last resort: the tail ends in traceback frames whose header and exception line were both cut off.
        frames = [i for i in scan.candidates(('  file "',)) if _FRAME.match(scan.lines[i])]
        if len(frames) >= 2 and frames[-1] >= len(scan.lines) - 4 and not _launcher_traceback(scan, frames[0] - 1):
            excs = [_Exc(frames[-1], "exception (only its traceback frames are in the tail)", None)]
            how = "the job (traceback frames at the end of the tail)"
    if not excs:
        return None
    last = excs[-1]
    after = _Scan(scan.lines[last.line + 1:], scan.cfg).progress_lines(scan.cfg.progress_min_lines + 1)
    if after > scan.cfg.progress_min_lines:
        return None  # caught and logged: training went on
    if last.rank is not None:
        how = f"rank {last.rank[1]}"
    return last, how


def _launcher_traceback(scan: _Scan, header: int) -> bool:
    """A traceback whose first frames are the launcher's own (torchrun's agent, accelerate launch): its cut-off
    exception is the launcher reporting the failed child, not the job's exception."""
    frames = "\n".join(scan.lowered[header + 1: header + 4])
    return any(k in frames for k in _LAUNCHER_FRAMES)


def _reason(label: str, ev: list[str], sig: int | None, exit_code: int | None) -> str:
    what = _RULE_BY_LABEL[label].what if label in _RULE_BY_LABEL else ""
    if label == "loss_scale_overflow":
        what = ("fp16 overflows kept skipping steps long after loss-scale warm-up, or the loss scale collapsed "
                "(an overflow storm)")
    if label == "host_oom_killed" and not any(_COMPILED["host_oom_killed"].search(e) for e in ev):
        what = "a rank was killed by SIGKILL, most likely by the kernel OOM killer"
    if label == "disk_full" and any(_EROFS.search(e) for e in ev):
        what = "a write failed because the file system is read-only (EROFS: remount or move the output, pruning will not help)"
    if label == "killed" and ev and all(_SIGNAL_IN_LOG.search(e) for e in ev):
        what = "a rank was ended by a signal from outside the job (SIGTERM/SIGINT/SIGHUP in torchrun's root cause)"
    if label == "segfault" and not ev:
        what = f"the job died with signal {sig} (SIGSEGV/SIGBUS)"
    if label == "nan_loss" and ev and not any(_COMPILED["nan_loss"].search(e) for e in ev):
        what = "the loss became NaN (Megatron's iteration line lost its lm loss / shows grad norm nan)"
    if ev:
        line = ev[0] if len(ev[0]) <= 200 else ev[0][:197] + "..."
        return f"{label}: {what}; deciding line: {line!r}."
    return f"{label}: {what} (exit code {exit_code}, signal {sig}); the log tail has no message about it."
