"""Decide by cause, from structured facts: who ended the job, where the first failure was raised, what it means.

The rule table (`rules.py`) names failures by their message. A message the table has never met must still land on
the right cause, so the facts decide whenever the rules found no specific cause (their answer is `healthy`, the
catch-all `python_exception` / `launcher_error`, or a SIGKILL read only from the exit status), in this order:

1. A scheduler or orchestrator ended the job (LSF `TERM_*`, PBS/Moab/SGE limits, Slurm, Kubernetes, rq): memory ->
   `host_oom_killed`, disk -> `disk_full`, time / cancellation / preemption -> `killed`. Its word is authoritative.
2. The first failure fact is the root cause; later ones are its consequences. A Python exception counts by where it
   was raised (its innermost frames): loading a checkpoint -> `checkpoint_corrupt` whatever the message; writing one
   (an OS-level error) -> `disk_full`; argument or config validation before the first training step ->
   `config_rejected`; argparse's `prog: error:` likewise (`launcher_error` when the program is the launcher).
   A process ended by a signal (mp.spawn, torchrun, the shell, a 128+N status, a Windows NTSTATUS code): SIGKILL ->
   `host_oom_killed` (medium: the host is asked), SIGSEGV/SIGBUS/access violation -> `segfault`, SIGTERM/SIGINT ->
   `killed`.
3. An fp16 loss scale collapsing in any framework's wording -> `loss_scale_overflow`; an NCCL watchdog line ->
   `nccl_timeout`.
   A CUDA error in any framing names its label by the CUDA error it reports (notices.py); a NaN/Inf loss notice or
   logged value that training did not survive -> `nan_loss`.
4. Failure evidence is never healthy: an uncaught exception, a non-zero exit, a kill -> `python_exception` or
   `killed` at low confidence with the deciding line; so is an error-shaped line in any wording (notices.py) with no
   healthy progress after it. `healthy` needs positive evidence of progress or the absence of any failure notice.

A specific label the rules found (an OOM message, an NCCL error, a NaN, ...) stands, except that a validation error
after training ended is not a refused configuration, and a SIGKILL the log shows a scheduler or user sending is not
the OOM killer.
"""

from __future__ import annotations

import bisect
import errno as _errno
import os as _os
import re
from dataclasses import replace

from ulyssesd.remediation.diagnosis.facts import NTSTATUS, Fact, phase_at, progressed_after
from ulyssesd.remediation.diagnosis.model import Diagnosis, DiagnosisConfig
from ulyssesd.remediation.diagnosis.normalizer import Line
from ulyssesd.remediation.diagnosis.rules import PRECEDENCE
from ulyssesd.remediation.diagnosis.scanner import COMPILED

# A save's error that names a cause other than room: an errno of a path/name/permission problem (its number, its
# name or the strerror text this OS prints for it), or a writer refusing the file name it was given (torch's zip
# writer: `[enforce fail at inline_container.cc:N] . invalid file name: ckpt/.tmp_5`).
_PATH_ERRNOS = tuple(getattr(_errno, n) for n in ("ENOENT", "EACCES", "EPERM", "EINVAL", "ENAMETOOLONG", "EISDIR",
                                                   "ENOTDIR", "EEXIST", "ELOOP") if hasattr(_errno, n))
_NOT_SPACE = re.compile("|".join([
    rf"\[Errno (?:{'|'.join(map(str, _PATH_ERRNOS))})\]",
    *(rf"\b{_errno.errorcode[n]}\b" for n in _PATH_ERRNOS),
    *(re.escape(_os.strerror(n)) for n in _PATH_ERRNOS),
    r"invalid (?:file ?name|path)",
]), re.I)

# Labels the rules reach only as a fallback: the facts may name the cause instead.
_FALLBACK = ("healthy", "python_exception", "launcher_error")
_SCHEDULER_LABEL = {"memory": "host_oom_killed", "disk": "disk_full", "time": "killed", "cancelled": "killed",
                    "preempted": "killed"}
_SCHEDULER_WHAT = {"memory": "ended the job at its memory limit", "disk": "ended the job at its disk quota",
                   "time": "ended the job at its time limit", "cancelled": "cancelled the job",
                   "preempted": "preempted the job"}


def _clip(text: str) -> str:
    return text if len(text) <= 200 else text[:197] + "..."


def _diag(label: str, fact: Fact, confidence: str, what: str, d: Diagnosis, extra: list[Fact] | None = None) -> Diagnosis:
    ev = [fact.text] + [f.text for f in extra or [] if f.text != fact.text]
    secondary = [lb for lb in [d.label, *d.secondary] if lb != label and lb != "healthy"]
    secondary = [lb for lb in PRECEDENCE if lb in secondary]
    return Diagnosis(label, ev[:5], confidence, f"{label}: {what}; deciding line {fact.line}: {_clip(fact.text)!r}.",
                     secondary)


def _signal_label(sig: int) -> tuple[str, str, str] | None:
    """(label, confidence, what) for a process ended by this signal."""
    if sig == 9:
        return ("host_oom_killed", "medium",
                "a process was killed by SIGKILL with no other sender shown, most likely by the kernel OOM killer")
    if sig in (11, 7, 4):
        return "segfault", "high", f"a process died of signal {sig} (a native crash)"
    if sig in (15, 2, 1):
        return "killed", "medium", f"a process was ended by signal {sig} sent from outside the job"
    return None


class _HealthyProgress:
    """The lines of healthy progress (a step line that itself reports a non-finite loss is not), counted after a line
    by bisection: a tail of thousands of notices and step lines costs O(n log n), not O(n^2)."""

    def __init__(self, facts: list[Fact]):
        bad = {g.line for g in facts if g.kind == "nonfinite"}
        self.lines = sorted(g.line for g in facts if g.kind == "progress" and g.line not in bad)

    def after(self, line: int) -> int:
        return len(self.lines) - bisect.bisect_right(self.lines, line)


def _survived(progress: _HealthyProgress, f: Fact, cfg: DiagnosisConfig, need: int | None = None) -> bool:
    """Training went on after this failure fact: at least `need` (default: more than `progress_min_lines`) lines of
    healthy progress follow it."""
    return progress.after(f.line) >= (cfg.progress_min_lines + 1 if need is None else need)


def _root_failure(facts: list[Fact], cfg: DiagnosisConfig) -> Fact | None:
    """The earliest failure fact that training did not survive (exceptions, signals, validation refusals, CUDA errors
    and non-finite losses in any framing)."""
    named = {f.line: f for f in facts if f.kind in ("cuda_error", "nonfinite")}
    progress = _HealthyProgress(facts)
    for f in facts:
        if f.kind in ("cuda_error", "nonfinite"):
            if not _survived(progress, f, cfg):
                return f
            continue
        if f.kind == "exception":
            if f.line in named and not _survived(progress, f, cfg):
                return named[f.line]  # "RuntimeError: cuda runtime error (2) : out of memory": the CUDA error names it
            if f.get("where") == "wrapper" or f.get("type", "").startswith(("KeyboardInterrupt", "SystemExit")):
                continue  # a launcher wrapper's report of its child (the child's own failure follows)
            if f.get("type", "").endswith("Warning"):
                continue
            if progressed_after(facts, f.line, cfg.progress_min_lines + 1):
                continue  # caught and logged: training went on
            return f
        if f.kind in ("signal", "validation"):
            if progressed_after(facts, f.line, cfg.progress_min_lines + 1):
                continue
            return f
        if f.kind == "exit" and ("ntstatus" in f.attrs or "signal" in f.attrs):
            return f
    return None


def _from_fact(f: Fact, facts: list[Fact], d: Diagnosis) -> Diagnosis | None:
    """The label a root failure fact names by its structure, or None when it names no specific cause."""
    if f.kind == "validation":
        if f.get("launcher"):
            return _diag("launcher_error", f, "medium", f"the launcher {f.get('program')} refused its arguments", d)
        if phase_at(facts, f.line) == "before_first_step":
            return _diag("config_rejected", f, "medium",
                         f"the job's argument parser ({f.get('program')}) refused its arguments before the first step", d)
        return None
    if f.kind == "cuda_error":
        return _diag(f.get("label"), f, "medium", f"a CUDA error ({_clip(f.get('message'))}) stands for {f.get('label')} "
                     "by the CUDA error it names", d)
    if f.kind == "nonfinite":
        return _diag("nan_loss", f, "medium", "the loss is NaN/Inf (the trainer's own notice or logged value) and "
                     "training did not go on with finite losses", d)
    if f.kind == "signal":
        got = _signal_label(f.get("signal", 0))
        return _diag(got[0], f, got[1], got[2], d) if got else None
    if f.kind == "exit":
        if "ntstatus" in f.attrs:
            label, meaning = NTSTATUS[f.get("ntstatus")]
            return _diag(label, f, "medium", f"the process exited with the Windows status {meaning}", d)
        got = _signal_label(f.get("signal", 0))
        return _diag(got[0], f, got[1], f"{got[2]} (exit status {f.get('code')})", d) if got else None
    where, etype = f.get("where"), f.get("type") or "an exception (its line is cut off)"
    if where == "loading":
        return _diag("checkpoint_corrupt", f, "medium",
                     f"{etype} was raised while loading a checkpoint (in {_frame_names(f)}): it cannot be resumed from", d)
    if where == "saving":
        os_level = etype.split(".")[-1] in ("OSError", "IOError", "RuntimeError", "PermissionError", "")
        named = _NOT_SPACE.search(f.text) if os_level else None
        if named:  # the writer said what is wrong, and it is not room: the save failed, the disk is not full
            return _diag("python_exception", f, "medium",
                         f"{etype} was raised while writing a checkpoint (in {_frame_names(f)}): the save failed on "
                         f"its path or name ({named.group(0)!r}), not for lack of space", d)
        if os_level:
            return _diag("disk_full", f, "low",
                         f"{etype} was raised while writing a checkpoint (in {_frame_names(f)}): the write failed, most "
                         "often a full or unwritable disk", d)
        return None
    if where == "dataloader_worker":
        return _diag("dataloader_crash", f, "medium", f"{etype} was raised inside a DataLoader worker", d)
    if where == "validation":
        if phase_at(facts, f.line) == "before_first_step":
            return _diag("config_rejected", f, "medium",
                         f"{etype} was raised by argument/config validation before the first training step", d)
        return None
    return None


def _frame_names(f: Fact) -> str:
    frames = f.get("frames") or []
    names = [fr.func or fr.code[:40] for fr in frames[-3:] if fr.func or fr.code]
    return " > ".join(names) or "its frames"


def needs_facts(d: Diagnosis, exit_code: int | None, sig: int | None) -> bool:
    """Whether the facts can change the rules' answer (reading them is skipped otherwise: a known cause stands)."""
    if exit_code == 0 and not sig:
        return False
    return (d.label in (*_FALLBACK, "killed", "config_rejected") or (d.label == "host_oom_killed" and d.confidence != "high")
            or not d.evidence)


def decide_by_cause(d: Diagnosis, lines: list[Line], facts: list[Fact], exit_code: int | None, sig: int | None,
           cfg: DiagnosisConfig) -> Diagnosis:
    """The rules' diagnosis `d`, corrected or completed by the facts (see the module doc)."""
    if exit_code == 0 and not sig:
        return d  # the job finished: healthy by contract (suspicious lines stay in `secondary`)
    scheduler = [f for f in facts if f.kind == "scheduler"]
    oom_named = d.label == "host_oom_killed" and any(COMPILED["host_oom_killed"].search(e) for e in d.evidence)
    if scheduler and (d.label in _FALLBACK or (d.label in ("host_oom_killed", "killed") and not oom_named)):
        f = scheduler[0]
        reason = f.get("reason")
        label = _SCHEDULER_LABEL[reason]
        return _diag(label, f, "high", f"the {f.get('scheduler')} scheduler {_SCHEDULER_WHAT[reason]}", d, scheduler[1:3])
    if d.label == "config_rejected":
        first = next((f for f in facts if f.kind in ("exception", "validation") and f.text in d.evidence), None)
        if first is not None and phase_at(facts, first.line) == "after_training":
            return _diag("python_exception", first, "medium",
                         "an uncaught exception after training had ended (not a configuration refused before the "
                         "first step)", d)
        return d
    if d.label not in _FALLBACK and not (d.label == "host_oom_killed" and d.confidence != "high"):
        return _cite_status_line(d, facts)
    if sig == 15 and d.label == "healthy":
        return d  # the caller says the job was stopped by SIGTERM and the log shows no failure of its own
    root = _root_failure(facts, cfg)
    if root is not None:
        got = _from_fact(root, facts, d)
        if got is not None:
            if got.label == d.label and d.evidence:  # the rules' evidence stands; a failed save says so
                return replace(d, reason=got.reason) if root.get("where") == "saving" else d
            return got
    over = [f for f in facts if f.kind == "loss_scale"]
    low = [f for f in over if f.get("scale") <= cfg.overflow_low_scale]
    if low and (len(low) >= cfg.overflow_low_scale_min or any(f.get("scale") < 1.0 for f in low)) \
            and d.label in ("healthy", "python_exception"):
        return _diag("loss_scale_overflow", low[0], "medium",
                     f"fp16 overflows drove the loss scale down to {min(f.get('scale') for f in low):g}", d, low[-2:])
    comm = [f for f in facts if f.kind == "comm"]
    if comm and d.label in ("healthy", "launcher_error"):
        return _diag("nccl_timeout", comm[0], "medium", "an NCCL process group's watchdog timed out", d)
    if d.label == "healthy":
        return _never_healthy(d, facts, root, cfg)
    if d.label == "launcher_error" and not d.evidence:
        notice = _last_notice(facts, cfg)  # a failed job with no known cause still cites the error line it printed
        if notice is not None:
            return replace(d, evidence=[notice.text], reason=f"{d.reason} The last error line of the log, line "
                                                             f"{notice.line}: {_clip(notice.text)!r}.")
    return d


def _last_notice(facts: list[Fact], cfg: DiagnosisConfig) -> Fact | None:
    """The last failure notice (an error-shaped line, a CUDA error, a non-finite loss) that is not followed by the
    `progress_min_lines` lines of healthy progress that make a log healthy at all."""
    progress = _HealthyProgress(facts)
    return next((f for f in reversed(facts) if f.kind in ("error_notice", "cuda_error", "nonfinite")
                 and not _survived(progress, f, cfg, cfg.progress_min_lines)), None)


def _cite_status_line(d: Diagnosis, facts: list[Fact]) -> Diagnosis:
    """A label the exit status alone decided: cite the log's own line of that status when it has one."""
    if d.evidence or d.label == "healthy":
        return d
    status = next((f for f in facts if f.kind in ("exit", "signal")), None)
    if status is None:
        return d
    return replace(d, evidence=[status.text], reason=f"{d.reason} The log reports it at line {status.line}: "
                                                     f"{_clip(status.text)!r}.")


def _never_healthy(d: Diagnosis, facts: list[Fact], root: Fact | None, cfg: DiagnosisConfig) -> Diagnosis:
    """Failure evidence in a log the rules called healthy: the least specific failure label, at low confidence."""
    if root is not None and root.kind == "exception":
        return _diag("python_exception", root, "low",
                     f"an uncaught {root.get('type') or 'exception (its line is cut off)'} ended the job and no narrower "
                     "cause is known", d)
    if root is not None and root.kind == "validation":
        return _diag("python_exception", root, "low", "the job refused its arguments after training had started", d)
    kill = next((f for f in facts if f.kind in ("signal", "exit")
                 and not progressed_after(facts, f.line, cfg.progress_min_lines + 1)), None)
    if kill is not None:
        return _diag("killed", kill, "low", "the job was ended by a signal or a non-zero exit and no cause is known", d)
    # An error-shaped line in any program's wording (a severity word heading it, an error code, a C/C++ abort, a
    # `... failed`) with no healthy progress after it: failure evidence, so not healthy (healthy needs progress).
    notice = _last_notice(facts, cfg)
    if notice is not None:
        return _diag("python_exception", notice, "low",
                     "an error-shaped line with no training progress after it ended the log, and no narrower cause is "
                     "known", d)
    return d
