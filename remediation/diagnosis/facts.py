"""Facts with structure, read from the normalised log: what failed, where it was raised, who ended the job.

Each `Fact` cites its line (1-based, in the normalised tail). Kinds:
- `exception`: one Python exception — its type, message, rank, the innermost traceback frames (file, function, the
  quoted source) and where it was raised (`where`: loading / saving a checkpoint, argument or config validation,
  a DataLoader worker, a process group, a launcher wrapper such as mp.spawn), and whether training went on after it.
- `signal`: a process ended by a signal, in any launcher's or shell's form (mp.spawn's ProcessExitedException, torchrun's
  summary, the shell's `Killed` / `Terminated` / `Segmentation fault`, a 128+N exit code, a Windows NTSTATUS code).
- `exit`: a non-zero exit status a launcher, scheduler or IDE reported.
- `scheduler`: a batch system or orchestrator ended the job, and why (`reason`: time, memory, disk, cancelled,
  preempted) — LSF `TERM_*`, PBS/Torque/Moab, SGE, Slurm, Kubernetes, rq.
- `validation`: an argument parser or config system refused the job's arguments (argparse's `prog: error:`).
- `kernel`: an Xid, ECC or OOM-killer line of the kernel.
- `loss_scale`: an fp16 overflow line and the loss scale it names, in any framework's wording.
- `comm`: an NCCL process group's watchdog or timeout line.
- `progress` / `completed`: training advanced / the trainer said it finished.
- `cuda_error`, `nonfinite`, `error_notice`: failure notices that are not Python exceptions (a CUDA error in any
  framing and the label it stands for, a NaN/Inf loss, an error-shaped line): `notices.py`.
`phase_at(facts, line)` tells the phase at a line: before the first step, training, or after training ended.
"""

from __future__ import annotations

import bisect
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import ulyssesd.remediation.diagnosis.notices as notices
from ulyssesd.remediation.diagnosis.model import DiagnosisConfig
from ulyssesd.remediation.diagnosis.normalizer import Line

_TB_HEADER = "Traceback (most recent call last):"
# Frames: CPython ('File "x.py", line 3, in f', a lost opening quote too), rich ('│ /x.py:42 in f'), IPython
# ('/x.py in f(a, b)' and '---> 10     code').
_FRAME = re.compile(r'^\s*File "?([^",]+)"?, line (\d+), in (\S+)')
_RICH_FRAME = re.compile(r"│\s*(\S+\.py):(\d+) in (\w+)")
_IPY_FRAME = re.compile(r"^(\S+\.py) in (\w+)\(")
_IPY_ARROW = re.compile(r"^-+> ?\d*\s+(.*)$")
_EXC = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Fault|Warning))(?::\s*(.*))?$"
                  r"|^((?:[A-Za-z_]\w*\.)+[A-Z]\w*[a-z]\w*):\s*(.*)$")
_SPAWN_SIGNAL = re.compile(r"process (\d+) terminated with signal (SIG[A-Z]+)")
_SIG_NUM = {"SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGILL": 4, "SIGABRT": 6, "SIGBUS": 7, "SIGFPE": 8,
            "SIGKILL": 9, "SIGUSR1": 10, "SIGSEGV": 11, "SIGUSR2": 12, "SIGPIPE": 13, "SIGTERM": 15}
_SIGNAL_LINES: tuple[tuple[re.Pattern, Any], ...] = (
    (re.compile(r"Signal (\d+) \(SIG\w+\) received by PID|exitcode\s*:\s*-(\d+)|exits with return code = -(\d+)"
                r"|died with <Signals\.SIG\w+: (\d+)>|terminated with signal (SIG[A-Z]+)|killed by signal:? (SIG[A-Z]+)"),
     None),
    # any wording of a death by signal: "terminated by signal SIGKILL" (fish), "exited with signal 9 (SIGKILL)",
    # "The process was terminated by signal 11", "worker 3 was killed due to signal: 9"
    (re.compile(r"\b(?:killed|terminated|died|exited|ended|stopped|crashed|aborted)\b[^\n]{0,40}?"
                r"\b(?:by|with|due to|from|on)\s+(?:the\s+)?signal\s*:?\s*(SIG[A-Z]+|\d+)\b", re.I), None),
    # zsh's and job control's lowercase reports ("zsh: killed  python x.py", "[1]  + 1234 killed  python x.py"),
    # macOS bash's "Killed: 9"
    (re.compile(r"^(?:zsh: |(?:\[\d+\])?\s*[+-]?\s*\d+\s+)killed\b|^Killed: 9\s*$"), 9),
    (re.compile(r"^(?:zsh: |(?:\[\d+\])?\s*[+-]?\s*\d+\s+)terminated\b"), 15),
    # bash's report of a SIGKILLed child: "Killed" alone, or "[script: line N: ]PID Killed  command"
    (re.compile(r"^(?:\S+: )?(?:line \d+: +)?\d+ +Killed\b|^Killed\s*$|已杀死"), 9),
    # bash's report of a SIGTERMed child ("... 1234 Terminated", a bar ending "\\Terminated"), not a status field
    (re.compile(r"^(?!.*\b(?:State|Status|Reason|Phase)\s*:)(?:.*[\s\\|/-])?Terminated\s*$"
                r"|^(?:\S+: )?(?:line \d+: +)?\d+ +Terminated\b"), 15),
    (re.compile(r"Segmentation fault|Fatal Python error: Segmentation fault|\bSIGSEGV\b"), 11),
    (re.compile(r"^(?:\S+: )?(?:line \d+: +)?(?:\d+ +)?Bus error\b"), 7),
    (re.compile(r"^(?:\S+: )?(?:line \d+: +)?(?:\d+ +)?Illegal instruction\b"), 4),  # bash's SIGILL report
)
# Exit statuses in the forms launchers, schedulers and IDEs print them.
_EXIT = re.compile(
    r"(?:Exited with exit code|exit code|Exit Code:|Exit_status=|Exit Status:|exit_status|exited with code"
    r"|returned non-zero exit status|exit status)\s*(-?\d+|0x[0-9A-Fa-f]+)(?:\s*\((0x[0-9A-Fa-f]+)\))?")
# Windows NTSTATUS codes a crashed process exits with: (label, meaning).
NTSTATUS = {0xC0000005: ("segfault", "STATUS_ACCESS_VIOLATION"), 0xC00000FD: ("segfault", "STATUS_STACK_OVERFLOW"),
            0xC000001D: ("segfault", "STATUS_ILLEGAL_INSTRUCTION"),
            0xC0000409: ("segfault", "STATUS_STACK_BUFFER_OVERRUN (a fail-fast abort)"),
            0xC0000374: ("segfault", "STATUS_HEAP_CORRUPTION"), 0xC0000017: ("host_oom_killed", "STATUS_NO_MEMORY"),
            0xC000012D: ("host_oom_killed", "STATUS_COMMITMENT_LIMIT"),
            0xC0000135: ("launcher_error", "STATUS_DLL_NOT_FOUND")}
# Batch systems and orchestrators ending a job: (pattern, reason or a function of the match).
_LSF_REASON = {"RUNLIMIT": "time", "CPULIMIT": "time", "DEADLINE": "time", "WINDOW": "time", "MEMLIMIT": "memory",
               "SWAP": "memory", "OWNER": "cancelled", "ADMIN": "cancelled", "FORCE_OWNER": "cancelled",
               "FORCE_ADMIN": "cancelled", "PREEMPT": "preempted", "REQUEUE_OWNER": "preempted",
               "REQUEUE_ADMIN": "preempted", "UNKNOWN": "cancelled", "EXTERNAL_SIGNAL": "cancelled",
               "PROCESSLIMIT": "cancelled", "THREADLIMIT": "cancelled", "FILELIMIT": "disk"}
_RESOURCE_REASON = {"walltime": "time", "wallclock": "time", "cput": "time", "time": "time", "runtime": "time",
                    "mem": "memory", "vmem": "memory", "pmem": "memory", "pvmem": "memory", "memory": "memory",
                    "rss": "memory", "jobfs": "disk", "disk": "disk", "file": "disk", "quota": "disk"}


def _resource(word: str) -> str:
    return _RESOURCE_REASON.get(word.lower().replace(" ", ""), "cancelled")


_SCHEDULER: tuple[tuple[str, re.Pattern, Any], ...] = (
    ("lsf", re.compile(r"\bTERM_([A-Z_]+):"), lambda m: _LSF_REASON.get(m.group(1), "cancelled")),
    ("pbs", re.compile(r"PBS: job killed: (\w+)", re.I), lambda m: _resource(m.group(1))),
    ("pbs", re.compile(r"Job exceeded a? ?(memory|walltime|cpu ?time)", re.I), lambda m: _resource(m.group(1))),
    ("pbs", re.compile(r"killed due to exceeding (\w+) (?:quota|limit)", re.I), lambda m: _resource(m.group(1))),
    ("moab", re.compile(r"job exceeded (wallclock|walltime|memory) limit", re.I), lambda m: _resource(m.group(1))),
    ("sge", re.compile(r"exceeded hard (wallclock|memory)|enforced h_(rt|vmem)", re.I),
     lambda m: "time" if (m.group(1) or m.group(2) or "").lower() in ("wallclock", "rt") else "memory"),
    ("slurm", re.compile(r"CANCELLED AT \S+ DUE TO (TIME LIMIT|PREEMPTION|JOB REQUEUE|NODE FAILURE)"),
     lambda m: "time" if m.group(1) == "TIME LIMIT" else "preempted"),
    ("slurm", re.compile(r"\*\*\* (?:JOB|STEP) \S+ .*CANCELLED AT"), "cancelled"),
    ("slurm", re.compile(r"Exceeded (?:job|step) memory limit|Detected \d+ oom[-_]kill event", re.I), "memory"),
    ("slurm", re.compile(r"this job is preempted", re.I), "preempted"),
    ("kubernetes", re.compile(r"(?<![\"'])\bOOMKilled\b(?![\"']\s*:)"), "memory"),
    ("kubernetes", re.compile(r"node was low on resource: memory|Evicted.*\bmemory\b", re.I), "memory"),
    ("kubernetes", re.compile(r"\bDeadlineExceeded\b|activeDeadlineSeconds"), "time"),
    ("rq", re.compile(r"Killed horse pid|Job stopped by user|Work-horse (?:process )?was terminated", re.I),
     "cancelled"),
    ("any", re.compile(r"(?:deleted|cancell?ed|killed|stopped|terminated) (?:at (?:the )?request of|by) "
                       r"(?:the )?(?:user|root|admin\w*|operator|owner)\b", re.I), "cancelled"),
)
_KERNEL = re.compile(r"NVRM: Xid|uncorrectable ECC|double bit ECC|Out of memory: Kill|invoked oom-killer|oom-kill:"
                     r"|oom_reaper", re.I)
# An fp16 overflow line and the scale it leaves: "setting loss scale to: 64.0", "reducing loss scale to 8e-202",
# "Attempted loss scale: 8, reducing to 4", "Reducing dynamic loss scale from 8.0 to 4.0" (lowercased lines).
_OVERFLOW_WORD = re.compile(r"overflow")
_SCALE_NUM = re.compile(r"\bscale\b[^0-9\n\]]{0,24}?(\d+(?:\.\d*)?(?:e[-+]?\d+)?)")
_COMM = re.compile(r"Watchdog caught collective|WorkNCCL\(.*\) ran for \d+ milliseconds before timing out"
                   r"|ProcessGroupNCCL.*\btimed out\b", re.I)
_PROGRESS = re.compile(
    r"\b(?:global_step|global step|step|steps|iter|iteration|epoch|batch|num_updates)\b['\"]?\s*[=:]?\s*\[?\s*\d+"
    r"|\b\d+/\d+ \[\d|\b\d+it \[|['\"](?:train_)?loss['\"]:\s*[0-9]|\bloss[=:]\s*[0-9]|\blm[ _]loss:\s*[0-9]"
    r"|\bloss (?:=|is)?\s*[0-9]", re.I)
_COMPLETED = re.compile(r"`?Trainer\.fit`? stopped|Successfully completed\.|Training (?:completed|finished)"
                        r"|Finished training|training done", re.I)
# argparse: "usage: prog ..." then "prog: error: message" (the program may be a launcher: launcher_error then).
_ARGPARSE_ERROR = re.compile(r"^([\w.\-]+): error: (.+)$")
# argparse's own message templates (any program that uses argparse says these; srun's "error: task 0: Killed" is not)
_ARGPARSE_MESSAGE = re.compile(r"unrecognized arguments|the following arguments are required|^argument [-\w/ ,]+: "
                               r"|expected (?:one|\d+|at least one) arguments?|invalid choice|ambiguous option"
                               r"|not allowed with argument|invalid \w+ value")
LAUNCHER_PROGS = ("torchrun", "deepspeed", "accelerate", "launch.py", "run.py", "srun", "mpirun", "python", "python3")

# Where an exception was raised, from its innermost frames (file path, function, quoted source).
_LOAD_CALL = re.compile(r"\btorch\.load\(|\bload_checkpoint|\breload_checkpoint|\bload_state_dict\b|\bsafe_open\("
                        r"|\bload_file\(|\bresume_from_checkpoint|\bload_from_checkpoint|\b_load_checkpoint"
                        r"|\bload_pretrained|\brestore_checkpoint|\bload_model_ensemble|\bload_checkpoint_to_cpu")
_LOAD_FUNC = re.compile(r"^(?:_?load(?:_\w+)?|_open_zipfile_reader|_open_file_like|_open_file|reload_\w+|restore\w*"
                        r"|\w*load_(?:checkpoint|state|pretrained|model|weights)\w*|\w*(?:checkpoint|ckpt)\w*load\w*)$")
_SAVE_CALL = re.compile(r"\btorch\.save\(|\bsave_checkpoint|\bsave_file\(|\bsave_pretrained|\bsave_model\b")
_SAVE_FUNC = re.compile(r"^(?:_?save\w*|_open_zipfile_writer|\w*save_(?:checkpoint|state|model|pretrained)\w*)$")
# Configuration code, by structure (see `where_raised`): a frame in an argument/config library, in a module named for
# configuration or arguments, a dataclass's `__post_init__`, or a function whose name says it parses or validates
# arguments/config. A bare `validate` / `check_*` counts only inside such a module: in a trainer it is a model pass.
_CONFIG_LIB = re.compile(r"(?:^|/)(?:argparse\.py|hydra/|omegaconf/|pydantic/|pydantic_core/|jsonargparse/|simple_parsing/"
                         r"|absl/flags/|ml_collections/config)")
_CONFIG_MODULE = re.compile(r"(?:^|/|_)(?:config|configs|configuration|conf|cfg|args|arg|arguments|argparser|arg_parser"
                            r"|options|opts|settings|hparams|flags)(?:_\w*)?\.py$")
_CONFIG_WORDS = r"(?:args|arguments|argv|config|configs|cfg|conf|options|opts|params|parameters|settings|hparams|flags)"
_CONFIG_FUNC = re.compile(
    r"^(?:parse_args\w*|parse_known_args|_parse\w*args\w*|parse_(?:config|cfg|options|opts|flags|hparams)\w*|__post_init__"
    r"|compose_config|load_configuration|_apply_overrides_to_config"
    rf"|_?\w*(?:validat|check|verif|sanity|assert|error_check)\w*_{_CONFIG_WORDS}\w*"
    rf"|_?\w*{_CONFIG_WORDS}_(?:validat|check|verif|sanity)\w*)$")
_GENERIC_CHECK = re.compile(r"^(?:error|_?\w*(?:validat|check|verif|sanity|assert)\w*)$")
# A trainer's loops: an exception whose nearest known-role frame is one of these was raised by a model pass (training
# or evaluation), not by configuration, whatever the function is called ("validate" is a validation *epoch* here).
_LOOP_FUNC = re.compile(
    r"^_?(?:validate|validation(?:_\w+)?|\w+_validation(?:_\w+)?|valid|\w+_valid(?:ate)?(?:_\w+)?|evaluate\w*"
    r"|\w+_evaluate\w*|evaluation\w*|eval|eval_\w+|\w+_eval(?:_\w+)?|test_step|test_epoch\w*|\w+_test_(?:step|epoch|loop)\w*"
    r"|predict_step|train|training_step|train_step|train_epoch\w*|train_one_epoch|train_loop|training_loop|fit|fit_loop"
    r"|run_training\w*|_run_train\w*)$")
_VALIDATION_TYPE = re.compile(r"(?:ArgumentError|ArgumentTypeError|ConfigCompositionException|ConfigAttributeError"
                              r"|ConfigKeyError|ConfigTypeError|MissingMandatoryValue|ValidationError"
                              r"|MisconfigurationException|OverrideParseException|InterpolationResolutionError)$")
_WORKER_FILE = re.compile(r"torch/utils/data/_utils/worker\.py|DataLoader worker")
_PG_FILE = re.compile(r"torch/distributed/distributed_c10d\.py|ProcessGroup")
_WRAPPER_FILE = re.compile(r"torch/multiprocessing/spawn\.py|torch/distributed/(?:run|launch)\.py"
                           r"|torch/distributed/elastic/|bin/torchrun|accelerate/commands/launch|deepspeed/launcher"
                           r"|bin/deepspeed|bin/accelerate")


@dataclass(frozen=True)
class Frame:
    file: str
    func: str
    code: str = ""  # the quoted source line, when printed


@dataclass(frozen=True)
class Fact:
    """One structured fact and the line it was read from."""

    kind: str  # exception | signal | exit | scheduler | validation | kernel | loss_scale | comm | progress | completed
    #            | cuda_error | nonfinite | error_notice (notices.py)
    line: int  # 1-based line number in the normalised tail
    text: str  # that line's message
    attrs: dict[str, Any] = field(default_factory=dict)  # kind-specific: type, where, signal, code, reason, scale...

    def get(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


def _exc_match(text: str) -> tuple[str, str] | None:
    if text.startswith((" ", "\t")):
        return None
    m = _EXC.match(text.strip())
    if not m:
        return None
    return (m.group(1), m.group(2) or "") if m.group(1) else (m.group(3), m.group(4) or "")


def _is_config_frame(f: Frame) -> bool:
    """A frame of configuration code: an argument/config library, a config/args module, a function that parses or
    validates arguments/config (any `validate`/`check_*` inside a config module)."""
    if f.file.endswith("subprocess.py"):
        return False  # check_call / check_output: a child process failed
    if _CONFIG_LIB.search(f.file) or _CONFIG_FUNC.match(f.func):
        return True
    return bool(_CONFIG_MODULE.search(f.file)) and bool(_GENERIC_CHECK.match(f.func))


def where_raised(frames: list[Frame], exc_type: str, cfg: DiagnosisConfig) -> str | None:
    """The place an exception was raised, from its innermost frames (and the source they quote): the nearest frame of
    a known role decides — checkpoint loading/saving, configuration (`_is_config_frame`), or a training/evaluation loop
    (`loop`: a model pass, never configuration)."""
    inner = frames[-cfg.root_frames:]
    if any(_WRAPPER_FILE.search(f.file) for f in frames[-2:]):
        return "wrapper"  # raised by a launcher (mp.spawn, torchrun, deepspeed's runner) about its children or hosts
    if _VALIDATION_TYPE.search(exc_type or ""):
        return "validation"
    if any(_WORKER_FILE.search(f.file) for f in inner):
        return "dataloader_worker"
    for f in reversed(inner):
        if _PG_FILE.search(f.file):
            # A collective failed (a save's barrier included): its peer died or hung, not the disk or the file.
            return "process_group"
        if _SAVE_FUNC.match(f.func) or _SAVE_CALL.search(f.code):
            return "saving"
        if _LOAD_FUNC.match(f.func) or _LOAD_CALL.search(f.code):
            return "loading"
        if _is_config_frame(f):
            return "validation"
        if _LOOP_FUNC.match(f.func):
            return "loop"  # raised by a training/evaluation pass: not configuration (and training had started)
    if any(_PG_FILE.search(f.file) for f in inner):
        return "process_group"
    return None


def _exceptions(lines: list[Line], cfg: DiagnosisConfig, index: _Index) -> list[Fact]:
    """Every traceback (per rank stream) and every bare exception line, in log order."""
    out: list[Fact] = []
    open_tb: dict[int | None, dict[str, Any]] = {}
    used: set[int] = set()

    def close(rank: int | None, exc_line: Line | None, exc: tuple[str, str] | None) -> None:
        tb = open_tb.pop(rank)
        frames: list[Frame] = tb["frames"]
        etype, msg = exc if exc else ("", "")
        line = exc_line if exc_line is not None else tb["header"]
        out.append(Fact("exception", line.no, line.text.strip(),
                        {"type": etype, "message": msg, "rank": rank, "frames": frames,
                         "where": where_raised(frames, etype, cfg), "cut": exc is None, "header": tb["header"].no}))
        used.add(line.no)

    for ln in lines:
        text, rank = ln.text, ln.rank
        if _TB_HEADER in text:
            if rank in open_tb:
                close(rank, None, None)
            open_tb[rank] = {"header": ln, "frames": []}
            continue
        tb = open_tb.get(rank)
        if tb is None:
            continue
        m = _FRAME.match(text)
        if m:
            tb["frames"].append(Frame(m.group(1).replace("\\", "/"), m.group(3)))
            continue
        m2 = _RICH_FRAME.search(text)
        if m2:
            tb["frames"].append(Frame(m2.group(1), m2.group(3)))
            continue
        if text.startswith((" ", "\t")) or not text.strip() or set(text.strip()) <= set("^~│─╭╰╮╯ "):
            if tb["frames"] and text.strip() and not tb["frames"][-1].code:
                last = tb["frames"][-1]
                tb["frames"][-1] = Frame(last.file, last.func, text.strip())
            continue
        exc = _exc_match(text)
        if exc:
            close(rank, ln, exc)
    for rank in list(open_tb):
        close(rank, None, None)
    # Exception lines outside any traceback: a one-line report, IPython's "---> 10 code" style, a thread title.
    ipy: list[Frame] = []
    for i in index.candidates(("error", "exception", "exit", "interrupt", "fault", "warning", ".py in ", "-> ")):
        ln = lines[i]
        t = ln.text.strip()
        m = _IPY_FRAME.match(t)
        if m:
            ipy.append(Frame(m.group(1), m.group(2)))
            continue
        a = _IPY_ARROW.match(t)
        if a:
            ipy.append(Frame("", "", a.group(1)))
            continue
        if ln.no in used or ln.repeat_of is not None:
            continue
        exc = _exc_match(ln.text)
        if exc and not ln.text.startswith(("usage:",)):
            out.append(Fact("exception", ln.no, t, {"type": exc[0], "message": exc[1], "rank": ln.rank,
                                                    "frames": list(ipy), "where": where_raised(ipy, exc[0], cfg),
                                                    "cut": False, "header": None}))
            ipy = []
    return sorted(out, key=lambda f: f.line)


# Lowercase literals every line of a kind contains: candidate lines are found with str.find over the joined tail
# (C speed) and only those meet the kind's regexes, so a 512 KiB tail reads in tens of milliseconds.
_KEYS = {
    "scheduler": ("term_", "job killed", "exceed", "enforced h_", "cancelled at", "memory limit", "oom-kill", "oom_kill",
                  "preempted", "oomkilled", "low on resource", "evicted", "deadline", "horse", "request of", " by user",
                  " by root", " by admin", " by operator", " by owner", " by the user"),
    "signal": ("signal", "exitcode", "return code", "killed", "已杀死", "terminated", "segmentation fault", "sigsegv",
               "bus error", "illegal instruction"),
    "exit": ("exit code", "exit_status", "exit status", "exited with code", "non-zero exit"),
    "validation": (": error: ",),
    "kernel": ("xid", "ecc", "out of memory: kill", "oom-killer", "oom-kill:", "oom_reaper"),
    "loss_scale": ("overflow",),
    "comm": ("watchdog caught", "before timing out", "timed out"),
    "completed": ("stopped", "successfully completed", "training completed", "training finished", "finished training",
                  "training done"),
    "progress": ("step", "iter", "epoch", "batch", "num_updates", "it [", "loss", "it/s", "s/it"),
}


class _Index:
    """Candidate lines per kind (indexes into `lines`), by literal keys over the lowercased, joined tail."""

    def __init__(self, lines: list[Line]):
        lowered = [ln.text.lower() for ln in lines]
        self.text = "\n".join(lowered)
        self.starts = [0]
        pos = 0
        for low in lowered[:-1]:
            pos += len(low) + 1
            self.starts.append(pos)

    def candidates(self, keys: tuple[str, ...]) -> list[int]:
        found: set[int] = set()
        for key in keys:
            pos = self.text.find(key)
            while pos != -1:
                i = bisect.bisect_right(self.starts, pos) - 1
                found.add(i)
                nxt = self.starts[i + 1] if i + 1 < len(self.starts) else len(self.text)
                pos = self.text.find(key, nxt)
        return sorted(found)


def _read_line(kind: str, ln: Line) -> list[Fact]:
    """The facts of one kind on one candidate line."""
    t = ln.text.strip()
    low = t.lower()
    if kind == "scheduler":
        for who, rx, reason in _SCHEDULER:
            m = rx.search(t)
            if m:
                return [Fact("scheduler", ln.no, t, {"scheduler": who,
                                                      "reason": reason(m) if callable(reason) else reason})]
    elif kind == "signal":
        for rx, num in _SIGNAL_LINES:
            m = rx.search(t)
            if m:
                sig = num
                if sig is None:
                    g = next(x for x in m.groups() if x is not None)
                    sig = _SIG_NUM.get(g, 0) if g.startswith("SIG") else int(g)
                return [Fact("signal", ln.no, t, {"signal": sig})]
    elif kind == "exit":
        m = _EXIT.search(t)
        if m:
            code_s = m.group(2) or m.group(1)
            code = int(code_s, 16) if code_s.lower().startswith("0x") else int(code_s)
            if code != 0:
                u32 = code & 0xFFFFFFFF
                attrs: dict[str, Any] = {"code": code}
                if u32 in NTSTATUS:
                    attrs["ntstatus"] = u32
                elif 128 < code <= 192:
                    attrs["signal"] = code - 128
                elif 256 < code <= 320:  # PBS: 256 + signal
                    attrs["signal"] = code - 256
                return [Fact("exit", ln.no, t, attrs)]
    elif kind == "validation":
        m = _ARGPARSE_ERROR.match(t)
        if m and _ARGPARSE_MESSAGE.search(m.group(2)):
            return [Fact("validation", ln.no, t, {"program": m.group(1), "message": m.group(2),
                                                  "launcher": m.group(1) in LAUNCHER_PROGS})]
    elif kind == "kernel":
        if _KERNEL.search(t):
            return [Fact("kernel", ln.no, t)]
    elif kind == "loss_scale":
        nums = _SCALE_NUM.findall(low)
        if nums:  # the first scale the line names: DeepSpeed's attempted one, fairseq's/apex's new one
            return [Fact("loss_scale", ln.no, t, {"scale": float(nums[0])})]
    elif kind == "comm":
        if _COMM.search(t):
            return [Fact("comm", ln.no, t)]
    elif kind == "completed":
        if _COMPLETED.search(t):
            return [Fact("completed", ln.no, t)]
    elif kind == "progress":
        if _PROGRESS.search(t) and not t.startswith(("usage:", "File ")) and not _COMPLETED.search(t):
            return [Fact("progress", ln.no, t)]
    return []


def extract(lines: list[Line], cfg: DiagnosisConfig | None = None) -> list[Fact]:
    """Every fact of the normalised tail, in line order."""
    cfg = cfg or DiagnosisConfig()
    index = _Index(lines)
    facts = _exceptions(lines, cfg, index)
    for kind, keys in _KEYS.items():
        for i in index.candidates(keys):
            ln = lines[i]
            if ln.repeat_of is None and ln.text.strip():
                facts += _read_line(kind, ln)
    for kind, keys in notices.KEYS.items():
        found = index.candidates(keys)
        if kind == "error_level":  # a logger's level the normalizer stripped: the line had a level prefix
            found = sorted(set(found) | {i for i, ln in enumerate(lines) if "level" in ln.prefixes or "nemo" in ln.prefixes})
        for i in found:
            ln = lines[i]
            if ln.repeat_of is None:
                facts += [Fact(k, no, text, attrs) for k, no, text, attrs in notices.read(kind, ln)]
    # mp.spawn reports a signal as an exception: that exception is the signal fact, not a Python failure.
    for f in list(facts):
        if f.kind == "exception":
            m = _SPAWN_SIGNAL.search(f.text)
            if m:
                facts.remove(f)
                if not any(g.kind == "signal" and g.line == f.line for g in facts):
                    facts.append(Fact("signal", f.line, f.text, {"signal": _SIG_NUM.get(m.group(2), 0)}))
    facts.sort(key=_by_line)
    return facts


_by_line = operator.attrgetter("line")


def scheduler_ended(line: str) -> str | None:
    """The reason (time, memory, disk, cancelled, preempted) when this line is a scheduler ending the job, else None."""
    for _who, rx, reason in _SCHEDULER:
        m = rx.search(line)
        if m:
            return reason(m) if callable(reason) else reason
    return None


def phase_at(facts: list[Fact], line: int) -> str:
    """'after_training' (the trainer said it finished), 'training' (progress before), or 'before_first_step'."""
    before = [f for f in facts if f.line < line and f.kind in ("progress", "completed")]
    if any(f.kind == "completed" for f in before):
        return "after_training"
    return "training" if before else "before_first_step"


def progressed_after(facts: list[Fact], line: int, n: int) -> bool:
    """Training went on after this line (at least n progress lines): a failure there was caught."""
    return sum(1 for f in facts if f.kind == "progress" and f.line > line) >= n
