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

import re
from dataclasses import replace

from ulyssesd.remediation.diagnosis.cause import decide_by_cause, needs_facts
from ulyssesd.remediation.diagnosis.facts import extract
from ulyssesd.remediation.diagnosis.model import Diagnosis, DiagnosisConfig
from ulyssesd.remediation.diagnosis.normalizer import normalize
from ulyssesd.remediation.diagnosis.rules import PRECEDENCE
from ulyssesd.remediation.diagnosis.scanner import (
    CHILD_FAILED,
    COMM_WORDS,
    COMPILED,
    EROFS,
    FRAME,
    LAUNCHER_FRAMES,
    NOT_ROOT,
    RULE_BY_LABEL,
    SHELL_KILLED,
    SHELL_KILLED_KEYS,
    SIGBUS,
    SIGHUP,
    SIGINT,
    SIGKILL,
    SIGNAL_IN_LOG,
    SIGSEGV,
    SIGTERM,
    Exc,
    Scan,
    normalise,
    prefix_rank,
    signal_from_exit,
)


def diagnose(log_tail: str, exit_code: int | None = None, signal: int | None = None,
             config: DiagnosisConfig | None = None) -> Diagnosis:
    """Classify the end of a job's output. `exit_code` follows subprocess (negative = signal) or shell (128+N)
    conventions; `signal` is the terminating signal when known. Exit 0 is always `healthy`.

    The rule table names known messages; then the structured facts of the normalised log (who ended the job,
    where the first failure was raised) decide whenever the rules found no specific cause (`cause.decide_by_cause`)."""
    cfg = config or DiagnosisConfig()
    text = log_tail or ""
    not_log = _not_a_training_log(text, cfg)
    if not_log and exit_code in (None, 0) and not signal:
        return Diagnosis("healthy", [], "low", f"Not a training log: {not_log}; there is nothing to diagnose.")
    by_rules = _diagnose_by_rules(text, exit_code, signal, cfg)
    sig = signal_from_exit(exit_code, signal)
    if not needs_facts(by_rules, exit_code, sig):
        return by_rules
    lines = normalize(text, cfg)
    return decide_by_cause(by_rules, lines, extract(lines, cfg), exit_code, sig, cfg)


def _diagnose_by_rules(text: str, exit_code: int | None, signal: int | None, cfg: DiagnosisConfig) -> Diagnosis:
    """The rule table's answer: known messages, precedence, torchrun's summary, the first failing rank."""
    scan = Scan(normalise(text, cfg), cfg)
    hits = dict(scan.hits)
    _drop_removal_races(scan, hits)

    storm, n_over, n_early = scan.overflow_storm()
    if storm:
        hits["loss_scale_overflow"] = sorted(set(hits.get("loss_scale_overflow", []) + storm))
    megatron_nan = scan.megatron_nan()
    if megatron_nan:
        hits["nan_loss"] = sorted(set(hits.get("nan_loss", []) + megatron_nan))

    # Exit by signal: from the caller, or as reported by the launcher inside the log.
    sig = signal_from_exit(exit_code, signal)
    sig_lines = scan.signal_lines()
    killed_lines = scan.match(SHELL_KILLED, SHELL_KILLED_KEYS)
    kill_idx = [i for i, s in sig_lines if s == SIGKILL] + killed_lines
    segv_idx = [i for i, s in sig_lines if s in (SIGSEGV, SIGBUS)]
    term_idx = [i for i, s in sig_lines if s in (SIGTERM, SIGINT, SIGHUP)]
    signal_only: dict[str, bool] = {}
    oom_named = "host_oom_killed" in hits  # the log itself names the OOM killer / an allocation failure
    if kill_idx or sig == SIGKILL:
        if not oom_named:
            # The shell's "Killed" names the signal, not its sender: like a bare exit status, medium (the host is asked).
            signal_only["host_oom_killed"] = True
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
    first: tuple[Exc, str] | None = None
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
    """Name a SIGKILL's sender by the host's OOM evidence (pure: the daemon reads it, see daemon/host/host_oom.py).
    `oom_kills`: the cgroup's `memory.events` oom_kill count during the attempt (None: unreadable, or a count with no
    earlier one to compare with); `kernel_oom_lines`: OOM-killer lines of the kernel log during the attempt (None:
    unreadable).

    Only a `host_oom_killed` that is not already `high` (the log itself showed no OOM message) changes: evidence of
    an OOM kill makes it `high`; evidence that was readable and shows none makes it `killed` (sender unknown) — the
    cgroup counter and the kernel log each count; with nothing readable it stays `host_oom_killed` at medium."""
    if d.label != "host_oom_killed" or d.confidence == "high":
        return d
    lines = list(kernel_oom_lines or [])
    if (oom_kills or 0) > 0 or lines:
        what = (f"the cgroup's memory.events counts {oom_kills} oom_kill(s) during the attempt" if oom_kills
                else "the kernel log shows the OOM killer during the attempt")
        return replace(d, confidence="high", evidence=(d.evidence + lines)[: DiagnosisConfig().max_evidence],
                       reason=f"host_oom_killed: a rank was SIGKILLed and {what}.")
    readable = []
    if oom_kills == 0:
        readable.append("the cgroup's memory.events shows no oom_kill")
    if kernel_oom_lines is not None:
        readable.append("the kernel log has no OOM-killer line")
    if not readable:
        return d
    unread = ("" if oom_kills == 0 and kernel_oom_lines is not None else
              " (the kernel log was not readable)" if oom_kills == 0 else " (the cgroup counter was not readable)")
    return replace(d, label="killed", confidence="medium", secondary=["host_oom_killed", *d.secondary],
                   reason=f"killed: a rank was SIGKILLed but {' and '.join(readable)} during the attempt{unread}: "
                          "no OOM kill, so another process sent it (sender unknown).")


def _not_a_training_log(text: str, cfg: DiagnosisConfig) -> str | None:
    """Why the text is not a log at all (empty, binary), or None."""
    if not text.strip():
        return "the log is empty" if not text else "the log holds only whitespace"
    head = text[:4096]
    bad = sum(1 for ch in head if (ord(ch) < 32 and ch not in "\n\r\t\x1b") or ch == "\ufffd")
    if bad > cfg.binary_fraction * len(head):
        return f"the text looks binary ({100 * bad // len(head)} % control or undecodable characters)"
    return None


# A FileNotFoundError raised by a delete: the job itself made the file and something (another rank) removed it first.
_FILE_NOT_FOUND = re.compile(r"\bFileNotFoundError\b")
_REMOVAL_CALL = re.compile(r"\b(?:os\.(?:rmdir|remove|removedirs|unlink)|shutil\.rmtree|\.unlink|\.rmdir)\(")


def _drop_removal_races(scan: Scan, hits: dict[str, list[int]]) -> None:
    """A FileNotFoundError whose last frame deletes the file is a race in the job's own clean-up (ranks removing the
    same old checkpoint), not a missing script or input of the launch: it is no launcher evidence (the exception
    then stands as the job's own, `python_exception`)."""
    idx = hits.get("launcher_error")
    if not idx:
        return
    keep = [i for i in idx if not (_FILE_NOT_FOUND.search(scan.lines[i])
                                   and any(_REMOVAL_CALL.search(ln) for ln in scan.lines[max(0, i - 2):i]))]
    if keep:
        hits["launcher_error"] = keep
    else:
        del hits["launcher_error"]


def _pick(seen: list[str], hits: dict[str, list[int]]) -> str | None:
    if not seen:
        return None
    primary = seen[0]
    if primary in ("nccl_error", "nccl_timeout") and "nccl_error" in hits and "nccl_timeout" in hits:
        # Both comm failures: the one that happened first in the log is the cause of the other.
        primary = "nccl_error" if hits["nccl_error"][0] <= hits["nccl_timeout"][0] else "nccl_timeout"
    return primary


def _first_failure(scan: Scan, anchor: int) -> tuple[Exc, str] | None:
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
    near: list[Exc] = []
    count, upto = 0, anchor
    for e in reversed([e for e in excs if e.line < anchor]):  # walk back from the anchor: one pass over the lines
        count += scan.unindented_between(e.line, upto, window - count)
        if count > window:
            break
        if not NOT_ROOT.match(e.name):
            near.append(e)
        count, upto = count + 1, e.line  # the exception line itself is unindented
    if not near:
        return None
    first = near[-1]
    who = f"rank {first.rank[1]}" if first.rank else "the first rank to fail"
    return first, f"{who} (first exception in the log)"


def _plain(scan: Scan, exc: Exc, hits: dict[str, list[int]]) -> bool:
    """A generic exception: its line is no rule's evidence and it is not about communication or an interrupt."""
    if NOT_ROOT.match(exc.name) or any(exc.line in idx for idx in hits.values()):
        return False
    return not COMM_WORDS.search(scan.lines[exc.line])


def _clip(line: str) -> str:
    return line if len(line) <= 200 else line[:197] + "..."


def _no_pattern(scan: Scan, exit_code: int | None, sig: int | None, n_over: int, n_early: int,
                first: tuple[Exc, str] | None = None) -> Diagnosis:
    benign = f" ({n_over} OVERFLOW line(s) seen, {n_early} during loss-scale warm-up, not a storm)" if n_over else ""
    child = scan.match(CHILD_FAILED, ("childfailederror", "return code =", "failed (exitcode"))
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


def _uncaught(scan: Scan) -> tuple[Exc, str] | None:
    """The last exception of the tail that training did not survive (no progress after it), if any.

    Without a complete traceback, a bare exception line ("IndexError: ...") counts, and last a traceback
    header the tail ends in (the exception line cut off)."""
    excs = [e for e in scan.exceptions() if not NOT_ROOT.match(e.name)]
    how = "the job (a traceback)"
    if not excs:
        excs = scan.bare_exceptions()
        how = "the job (an exception line)"
    if not excs:
        headers = scan.candidates(("traceback (most recent call last):",))
        ended = [e.line for e in scan.exceptions()]  # tracebacks that do end in an exception line (any)
        headers = [h for h in headers[-1:] if (not ended or h > ended[-1]) and not _launcher_traceback(scan, h)]
        excs = [Exc(h, "exception (its line is cut off)", prefix_rank(scan.lines[h])) for h in headers]
        how = "the job (a traceback cut off before its exception line)"
    if not excs:
        # Last resort: the tail ends in traceback frames whose header and exception line were both cut off.
        frames = [i for i in scan.candidates(('  file "',)) if FRAME.match(scan.lines[i])]
        if len(frames) >= 2 and frames[-1] >= len(scan.lines) - 4 and not _launcher_traceback(scan, frames[0] - 1):
            excs = [Exc(frames[-1], "exception (only its traceback frames are in the tail)", None)]
            how = "the job (traceback frames at the end of the tail)"
    if not excs:
        return None
    last = excs[-1]
    after = Scan(scan.lines[last.line + 1:], scan.cfg).progress_lines(scan.cfg.progress_min_lines + 1)
    if after > scan.cfg.progress_min_lines:
        return None  # caught and logged: training went on
    if last.rank is not None:
        how = f"rank {last.rank[1]}"
    return last, how


def _launcher_traceback(scan: Scan, header: int) -> bool:
    """A traceback whose first frames are the launcher's own (torchrun's agent, accelerate launch): its cut-off
    exception is the launcher reporting the failed child, not the job's exception."""
    frames = "\n".join(scan.lowered[header + 1: header + 4])
    return any(k in frames for k in LAUNCHER_FRAMES)


def _reason(label: str, ev: list[str], sig: int | None, exit_code: int | None) -> str:
    what = RULE_BY_LABEL[label].what if label in RULE_BY_LABEL else ""
    if label == "loss_scale_overflow" and not any(COMPILED["loss_scale_overflow"].search(e) for e in ev):
        what = ("fp16 overflows kept skipping steps long after loss-scale warm-up, or the loss scale collapsed "
                "(an overflow storm)")
    if label == "host_oom_killed" and not any(COMPILED["host_oom_killed"].search(e) for e in ev):
        what = "a rank was killed by SIGKILL, most likely by the kernel OOM killer"
    if label == "disk_full" and any(EROFS.search(e) for e in ev):
        what = "a write failed because the file system is read-only (EROFS: remount or move the output, pruning will not help)"
    if label == "killed" and ev and all(SIGNAL_IN_LOG.search(e) for e in ev):
        what = "a rank was ended by a signal from outside the job (SIGTERM/SIGINT/SIGHUP in torchrun's root cause)"
    if label == "segfault" and not ev:
        what = f"the job died with signal {sig} (SIGSEGV/SIGBUS)"
    if label == "nan_loss" and ev and not any(COMPILED["nan_loss"].search(e) for e in ev):
        what = "the loss became NaN (Megatron's iteration line lost its lm loss / shows grad norm nan)"
    if ev:
        line = ev[0] if len(ev[0]) <= 200 else ev[0][:197] + "..."
        return f"{label}: {what}; deciding line: {line!r}."
    return f"{label}: {what} (exit code {exit_code}, signal {sig}); the log tail has no message about it."
