"""The scanner: one normalised log tail, and every rule's hit lines in it (the evidence `decide` weighs).

Normalisation (tail cut, ANSI stripped, carriage returns as line breaks), the compiled rule table, the
launcher/traceback/overflow patterns, and `Scan`, which finds candidate lines with `str.find` before any regex.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from ulyssesd.remediation.diagnosis.model import DiagnosisConfig
from ulyssesd.remediation.diagnosis.rules import RULES

RULE_BY_LABEL = {r.label: r for r in RULES}

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_NEWLINES = re.compile(r"\r\n|\r")
_FLAGS = re.IGNORECASE
COMPILED = {r.label: re.compile("|".join(f"(?:{p})" for p in r.patterns), _FLAGS) for r in RULES}
_EXCLUDE = {r.label: re.compile(r.exclude, re.IGNORECASE) for r in RULES if r.exclude}
# Source lines quoted in a traceback ("    raise RuntimeError(f'DataLoader ...')", '  File "x.py"') are not
# evidence: the exception's own final line is.
_CODE_LINE = re.compile(r"""^(?:\[[^\]\n]*\]:?|\d+:)?\s+(?:raise\b|File ")""")

# Exit status written in the log by torchrun / DeepSpeed's launcher / Python's subprocess.
SIGNAL_IN_LOG = re.compile(
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
SHELL_KILLED = re.compile(
    r"^[^\S\n]*(?:\S+:[^\S\n]*)?(?:Killed|已杀死)[^\S\n]*$|\b\d+[^\S\n]+Killed(?:[^\S\n]+\S|[^\S\n]*$)"
    r"|\btasks? [\d,\-]+: Killed[^\S\n]*$", re.MULTILINE)
SHELL_KILLED_KEYS = ("killed", "已杀死")
EROFS = re.compile(r"Read-only file system|\[Errno 30\]|\bEROFS\b", re.IGNORECASE)
CHILD_FAILED = re.compile(r"ChildFailedError|exits with return code = [1-9]|failed \(exitcode: [1-9]", re.IGNORECASE)
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
FRAME = re.compile(r'^(?:\[[^\]\n]*\]:?)?\s+File "[^"]+", line \d+, in ')
LAUNCHER_FRAMES = ("bin/torchrun", "torch/distributed/run.py", "torch/distributed/elastic", "accelerate-launch",
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
NOT_ROOT = re.compile(r"^(?:KeyboardInterrupt|SystemExit|GeneratorExit|torch\.distributed\.elastic\.|SignalException"
                       r"|ChildFailedError|(?:\w+\.)*CalledProcessError)")
# An exception about communication is a communication failure even when no nccl_* pattern knows its wording.
COMM_WORDS = re.compile(r"nccl|gloo|DistBackendError|DistNetworkError|DistStoreError|ProcessGroup|c10d", re.IGNORECASE)
# torchrun's failure summary: one entry per failed rank, "  field     : value".
_SUMMARY_ENTRY = re.compile(r"^\[\d+\]:\s*$")
_SUMMARY_FIELD = re.compile(r"^\s+(time|rank|exitcode)\s*:\s*(\S+)(?:\s*\(local_rank:\s*(\d+)\))?")

SIGKILL, SIGSEGV, SIGBUS, SIGTERM, SIGINT, SIGHUP = 9, 11, 7, 15, 2, 1


@dataclass(frozen=True)
class Exc:
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
    exc: Exc | None  # the exception line of its inline traceback (only with @record's error files)


def _exc_name(text: str) -> str | None:
    m = _EXC_LINE.match(text)
    return (m.group(1) or m.group(2)) if m else None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def prefix_rank(prefix: str) -> tuple[str, int] | None:
    m = _PREFIX_RANK.search(prefix)
    if not m:
        return None
    g, srun, mpi, local = m.groups()
    return ("local", int(local)) if local is not None else ("global", int(g or srun or mpi))


def normalise(text: str, cfg: DiagnosisConfig) -> list[str]:
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


def signal_from_exit(exit_code: int | None, signal: int | None) -> int | None:
    if signal:
        return signal
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code <= 128 + 64:  # shell convention: 128 + signal number
        return exit_code - 128
    return None


class Scan:
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
            idx = self.match(COMPILED[rule.label], rule.keys)
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
            for m in SIGNAL_IN_LOG.finditer(self.lines[i]):
                out.append((i, int(next(g for g in m.groups() if g is not None))))
        return out

    def exceptions(self) -> list[Exc]:
        """The exception line of each of the last `max_tracebacks` tracebacks, in log order.

        Ranks interleave: a traceback's lines are those with its header's prefix ("[rank1]: ", or none);
        the exception line is the first of them that is not indented (frames and source lines are).
        """
        out: list[Exc] = []
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
                    out.append(Exc(i, name, prefix_rank(prefix)))
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
        exc: Exc | None = None
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
                    exc = Exc(i, name, None)
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

    def bare_exceptions(self) -> list[Exc]:
        """Unindented exception lines ("IndexError: list index out of range") anywhere in the tail."""
        out = []
        for i in self.candidates(("error", "exception")):
            m = _BARE_EXC.match(self.lines[i].strip())
            if m and not NOT_ROOT.match(m.group(1)):
                out.append(Exc(i, m.group(1), None))
        return out
