"""Failure notices that are not Python exceptions, read by their form rather than one framework's wording.

Three kinds, each `(kind, line number, message, attrs)` for `facts.extract` to wrap:
- `cuda_error`: a CUDA runtime/driver error in any framing — torch's `CUDA error: X`, THC's `cuda runtime error (30) :
  X at file:line`, NCCL's `Cuda failure N 'X'`, cuda-gdb's `CUDA Exception: X`, `CUDA_ERROR_X`, `cudaErrorX` — and the
  label its message or name stands for (the CUDA error enumeration: memory allocation, illegal address / launch failure /
  assert, unknown / ECC / lost GPU).
- `nonfinite`: the loss (or a loss-named metric) is NaN/Inf — a logged value (`loss_net: nan`, `val_loss=inf`) or a
  trainer's own notice that names a loss or metric, NaN/Inf and what it did about it (`Skipping backward and optimizer
  step for nan or inf in forwarding metrics/loss!`, `Loss is inf, stopping`, `NaN loss at step 300`), or a trainer that
  stopped because its loss diverged (`loss diverged, stopping`). A description of an option (`--skip-nan`, `... if the
  loss is nan`) is not one.
- `error_notice`: an error-shaped line in any program's wording: a severity word heading the message (`ERROR: ...`,
  `prog: fatal error: ...`), an `X error (N)` / `error N:` code, a C/C++ abort (`terminate called after throwing`,
  `Aborted (core dumped)`, `Assertion ... failed`, `Check failed:`), a `... failed` / `... timed out` outcome, a run
  that says it aborted, a severity word as the message's first word or in a banner (`Error executing job ...`),
  or a line its logger wrote at an error/fatal level (`[ERROR]`, `| ERROR |`, glog's `E1207 ...` / `[E file.cpp:N]`).
  Lines at a warning/info level (`WARNING`, `[W ...]`, `UserWarning`, `NCCL INFO`) and quoted source are not.
"""

from __future__ import annotations

import re
from typing import Any

from ulyssesd.remediation.diagnosis.normalizer import Line

Notice = tuple[str, int, str, dict[str, Any]]

# ---------------------------------------------------------------------------------------------------------- CUDA errors
# The message after any CUDA error framing (applied to the line as written).
_CUDA_FRAMED = re.compile(
    r"\bcuda(?:\s+(?:runtime|driver|kernel))?\s*(?:error|exception|failure)\b\s*(?:\(\s*-?\d+\s*\)|-?\d+)?\s*:?\s*['\"]?"
    r"\s*([A-Za-z][^'\"\n]{2,120})", re.I)
_CUDA_NAMED = re.compile(r"\b(?:CUDA_ERROR_|cudaError|CUDA_EXCEPTION_\d+,\s*)([A-Za-z_ ]{3,60})")
# The label each CUDA error stands for, by its message or enumeration name (lowercased, underscores as spaces).
_CUDA_CAUSES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"out of memory|memory ?allocation|alloc(?:ation)? failed"), "cuda_oom"),
    (re.compile(r"illegal ?(?:memory ?access|address|instruction)|misaligned ?address|launch ?failure|launch ?failed"
                r"|\bassert(?:ion)? triggered|\bassert\b|address out of bounds|out-of-range address"
                r"|invalid ?pc"), "illegal_memory_access"),
    (re.compile(r"unknown(?: error)?\b|\becc\b|uncorrectable|gpu is lost|fallen off|hardware ?stack ?error"
                r"|device ?unavailable|\bxid\b"), "gpu_hardware"),
)

# ------------------------------------------------------------------------------------------------- non-finite losses
_LOSS_WORD = r"(?:loss|losses|metrics?|objective)"
# A loss-named key with a non-finite value: "loss_net: nan", "val_loss=inf", "'train/loss': nan" (not loss_scale).
_LOSS_VALUE = re.compile(r"(?<![\w/.\-])([\w/.\-]*loss[\w/.\-]*)['\"]?\s*[:=]\s*['\"]?(?:tensor\()?[-+]?(nan|inf)\b", re.I)
# "NaN loss at step 120", "non-finite losses detected": the non-finite loss as the subject of an event (not "prevents
# nan losses by ...").
_NONFINITE_LOSS_EVENT = re.compile(r"\b(?:nan|inf|non-finite|infinite)[ -]loss(?:es)?\b"
                                   r"(?=\s+(?:at|in|on|detected|encountered|found|occurred|appeared|value)\b|\s*[.!:;,]|\s*$)",
                                   re.I)
_NONFINITE_WORD = r"(?:nan|inf|infinity|non-finite|not finite|infinite)"
# The loss word and the non-finite word close together (either order): one statement about the loss.
_LOSS_NONFINITE = re.compile(rf"\b{_LOSS_WORD}\b.{{0,60}}\b{_NONFINITE_WORD}\b|\b{_NONFINITE_WORD}\b.{{0,60}}\b{_LOSS_WORD}\b",
                             re.I)
_ACTED = re.compile(r"\b(?:skip(?:s|ping|ped)?|abort(?:s|ing|ed)?|stop(?:s|ping|ped)?|exit(?:s|ing)?|halt(?:s|ing|ed)?"
                    r"|terminat(?:e|es|ing|ed)|giving up|discard(?:s|ing|ed)?|ignor(?:e|es|ing|ed)|detected|encountered"
                    r"|found|became|is|was)\b", re.I)
# A trainer stopping because its loss diverged ("loss diverged, stopping", "Loss exploded to 1e38, aborting"): the
# closest label is nan_loss (the loss is no longer finite in any useful sense).
_DIVERGED = re.compile(rf"\b{_LOSS_WORD}\b.{{0,60}}\b(?:diverg\w*|explod\w*|blew up|blown up)\b", re.I)
_STOPPED = re.compile(r"\b(?:skip(?:s|ping|ped)?|abort(?:s|ing|ed)?|stop(?:s|ping|ped)?|exit(?:s|ing)?|halt(?:s|ing|ed)?"
                      r"|terminat(?:e|es|ing|ed)|giving up)\b", re.I)
_NONFINITE_ANY = re.compile(r"\b(?:nan|inf|infinity|non-finite|not finite|infinite|diverg\w*|explod\w*|blew up|blown up)\b")
# A description of behaviour, not an event: an option's help, a condition.
_DESCRIBES = re.compile(r"^\s*-|\b(?:if|whether|whenever|unless)\b", re.I)

# --------------------------------------------------------------------------------------------------- error notices
# A warning/info level anywhere on the line as written: logging levels, glog/c10 "[W ...]" / "W1207 ...", Python's
# "*Warning:", NCCL's "NCCL INFO".
_BENIGN_LEVEL = re.compile(r"\b(?:WARN|INFO|DEBUG)\b|\bwarns?\b|warnings?\b"
                           r"|\[[WID]\d{0,4}(?:[ \d:.]*)?\s*[\w.]+\.(?:cpp|cc|cu|h|hpp|py):\d+\]|^\s*[WID]\d{4} \d\d:", re.I)
# Anchored forms (tried with .match: cheap on every candidate line).
_ERROR_HEAD = re.compile(
    # a severity word heading the message, after an optional program name: "ERROR: x", "luajit: fatal error: x"
    r"(?:[\w.\-/]+:\s+)?\[?(?:fatal(?: error)?|error|critical|panic|emerg(?:ency)?|failed|failure)\]?\s*[:!]"
    r"(?!\s*[-+]?[\d.]+(?:e-?\d+)?%?\s*$)"
    # ... or as the message's first word, its subject ("Error executing job ...", "Failed to initialise the store"),
    # not a metric's name ("Error rate 0.1", "error: 0.21")
    r"|(?:error|fatal|failed|failure)\b(?!\s*(?:rate|count|bars?|analysis|metrics?|feedback|correction|term|norm)\b)"
    r"(?!\s*[:=]?\s*[-+\d.])"
    # ... or in a banner ("!!! Exception during processing !!!", "*** Error in `python'") or a thread's report
    r"|[!*#=]{2,}\s*(?:error|exception|fatal|failed|failure)\b|Exception in thread\b"
    r"|\s*abort(?:ing|ed)?\b", re.I)
# Forms anywhere in the line, each tried only when its literal (lowercase) is in the line: one big alternation of
# unanchored words costs ~0.1 ms a line in `re`, and INFO-heavy tails have thousands of candidate lines.
_ERROR_ANYWHERE: tuple[tuple[tuple[str, ...], re.Pattern | None], ...] = (
    # an error with its code: "cuda runtime error (30) : x", "error 1455:", "error code 3"
    (("error",), re.compile(r"\berror\s*\(\s*-?[1-9]\d*\s*\)|\berror (?:code )?-?[1-9]\d*\s*:"
                            r"|\berror code[:=]?\s*-?[1-9]\d*\b", re.I)),
    # C/C++/Rust aborts
    (("terminate called after throwing",), None),
    (("what():",), re.compile(r"\bwhat\(\):\s")),
    (("core dumped",), re.compile(r"\bcore dumped\b", re.I)),
    (("fatal python error",), None),
    (("panicked at",), re.compile(r"\bpanicked at\b")),
    (("assertion",), re.compile(r"\bAssertion\b.{0,200}\bfailed\b", re.I)),
    (("check failed:",), None),
    # an outcome that failed / timed out, a run that aborted
    (("failed",), re.compile(r"\bfailed(?: with| because| due to| at| on| while)?\b[^a-z]*$"
                             r"|\bfailed (?:with|because|due to)\b", re.I)),
    (("timed out",), re.compile(r"\btimed out(?: after\b| waiting\b|[.!]?\s*$)", re.I)),
    (("abort",), re.compile(r"\bAborted\b(?: \(core dumped\))?\s*$|\babort(?:ing|ed)? (?:training|the run|run|job)\b",
                            re.I)),
    (("aborted", "crashed", "killed", "terminated"),
     re.compile(r"\b(?:training|run|job|process|program|worker|task)s? (?:was |has been |is )?"
                r"(?:aborted|crashed|killed|terminated)\b", re.I)),
)


def _error_shaped(t: str) -> bool:
    """The message has a failure-like form (see the module doc)."""
    if _ERROR_HEAD.match(t):
        return True
    low = t.lower()
    return any(any(k in low for k in keys) and (rx is None or rx.search(t)) for keys, rx in _ERROR_ANYWHERE)


# An error/fatal level in the line's logger prefix (the normalizer strips it from the message): "[ERROR]", fairseq's
# "| ERROR |", NeMo's "[NeMo E ...]", glog/c10's "[E file.cpp:N]" / "E1207 12:00:00 ... file.cc:N]" / "F1207 ...".
_ERROR_LEVEL = re.compile(r"\[(?:ERROR|CRITICAL|FATAL)\]|\|\s*(?:ERROR|CRITICAL|FATAL)\s*\||\[NeMo [EC] "
                          r"|\[[EF]\d{0,4}(?:[ \d:.]*)?\s*[\w.]+\.(?:cpp|cc|cu|h|hpp|py):\d+\]|^\s*(?:\[\w+\]:)?[EF]\d{4} \d\d:")
_ERROR_LEVEL_KEYS = ("ERROR", "CRITICAL", "FATAL", "[NeMo E", "[NeMo C", "[E", "[F", "E0", "E1", "F0", "F1")
# Lines that say something about overflow skips (loss-scale calibration: read as loss_scale facts), quoted source.
_NOT_NOTICE = re.compile(r"overflow|loss scale|^\s*(?:raise|File \")|^\s*(?:#|//)", re.I)

KEYS = {
    "cuda_error": ("cuda", "cudaerror"),
    "nonfinite": ("nan", "inf", "finite", "diverg", "explod", "blew up", "blown up"),
    "error_notice": ("error", "fatal", "critical", "panic", "emerg", "terminate called", "what():", "abort", "exception",
                     "core dumped", "panicked", "assertion", "check failed", "failed", "crashed", "killed", "terminated",
                     "timed out"),
    # glog/c10 prefixes stay in the message; stripped logger levels are found by the Line's prefixes (facts.extract)
    "error_level": ("[e", "e1", "e0", "[f", "f1", "f0"),
}


def cuda_cause(message: str) -> str | None:
    """The label a CUDA error message or enumeration name stands for, or None."""
    low = message.lower().replace("_", " ")
    for rx, label in _CUDA_CAUSES:
        if rx.search(low):
            return label
    return None


def read(kind: str, ln: Line) -> list[Notice]:
    """The notices of one kind on one candidate line (normalised, not another rank's repeat)."""
    t = ln.text.strip()
    if not t or ln.text.startswith(("  ", "\t")):
        return []
    if kind == "cuda_error":
        for rx in (_CUDA_FRAMED, _CUDA_NAMED):
            for found in rx.finditer(t):
                label = cuda_cause(found.group(1))
                if label:
                    return [("cuda_error", ln.no, t, {"label": label, "message": found.group(1).strip()})]
        return []
    if kind == "nonfinite":
        low = t.lower()
        if not ("loss" in low or "metric" in low or "objective" in low) or not _NONFINITE_ANY.search(low) \
                or _DESCRIBES.search(t):
            return []  # every form names a loss or a metric and a whole non-finite/divergence word ("info" is not)
        m = _LOSS_VALUE.search(t)
        if m and "scale" not in m.group(1).lower():
            return [("nonfinite", ln.no, t, {"what": m.group(1), "value": m.group(2).lower()})]
        if ((_LOSS_NONFINITE.search(t) and _ACTED.search(t)) or _NONFINITE_LOSS_EVENT.search(t)) \
                and "overflow" not in t.lower():
            return [("nonfinite", ln.no, t, {"what": "notice"})]
        if _DIVERGED.search(t) and _STOPPED.search(t):
            return [("nonfinite", ln.no, t, {"what": "diverged"})]
        return []
    if kind in ("error_notice", "error_level"):
        # the cheap, rarely-true test first: most candidate lines are INFO lines or words that merely contain "error"
        if kind == "error_notice" and not _error_shaped(t):
            return []
        if kind == "error_level" and (not any(k in ln.raw for k in _ERROR_LEVEL_KEYS) or not _ERROR_LEVEL.search(ln.raw)
                                      or _error_shaped(t)):
            return []  # (a shaped line is read once, as an error_notice candidate)
        if _NOT_NOTICE.search(t) or _BENIGN_LEVEL.search(ln.raw):
            return []
        return [("error_notice", ln.no, t, {"level": kind == "error_level"})]
    return []
