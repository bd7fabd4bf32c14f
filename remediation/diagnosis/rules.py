"""The log diagnosis' pattern table: one `Rule` per label, and the precedence between labels.

Pure data (regex strings and lowercase key literals); `scanner.py` compiles it, `decide.py` applies it. Sources of
the patterns: the real logs of tests/fixtures/logs_real (public issue threads, each case cites its thread)
and the fixtures under tests/fixtures/logs. How to add one: docs/DIAGNOSIS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ulyssesd.remediation.diagnosis.oserrors import patterns as os_error_patterns

# OS error codes, names and messages of host memory exhaustion / a full disk, in every OS's framing (oserrors.py).
_OS_OOM, _OS_OOM_KEYS = os_error_patterns("host_oom_killed")
_OS_DISK, _OS_DISK_KEYS = os_error_patterns("disk_full")


@dataclass(frozen=True)
class Rule:
    """The lines that are evidence for one label."""

    label: str  # one of diagnosis.LABELS
    patterns: tuple[str, ...]  # regexes, matched per line, case-insensitively
    keys: tuple[str, ...]  # lowercase literals; every hit line contains one (cheap prefilter before the regex)
    exclude: str | None = None  # a hit line that also matches this is benign for this label
    what: str = ""  # short phrase for the reason sentence


# An exception's final line, optionally rank-prefixed ("[rank0]:", "[default0]:", "0: ").
EXC = r"^(?:\[[^\]\n]*\]:?|\d+:)?\s*(?:\w+\.)*"

RULES: tuple[Rule, ...] = (
    Rule("gpu_hardware", (
        r"\bXid\b[^\n]{0,80}?\b(?:13|31|43|45|48|61|62|63|64|74|79|92|94|95|119|120|123|140)\b",
        r"fallen off the bus",
        r"uncorrectable ECC error",
        r"cudaErrorECCUncorrectable",
        r"uncorrectable NVLink error",
        r"NVML_ERROR_GPU_IS_LOST|NV_ERR_GPU_IS_LOST|\bGPU is lost\b|GPU lost from the bus",
        r"NV_ERR_RESET_REQUIRED|\bReset required\b",
        r"Unable to determine the device handle for GPU",
        r"CUDA error: (?:unknown error|GPU is lost)",
        r"RmInitAdapter failed",
    ), ("xid", "fallen off the bus", "ecc", "nvlink error", "gpu is lost", "gpu_is_lost", "gpu lost from the bus", "reset required", "reset_required",
        "device handle for gpu",
        "cuda error: unknown error", "rminitadapter failed"),
        what="a GPU reported a hardware fault (Xid, uncorrectable ECC, or a lost GPU)"),
    Rule("disk_full", (
        r"No space left on device",
        r"\[Errno 28\]|\bENOSPC\b|errno: 28\b|\bcode: 28\b|\bStorageFull\b",
        r"Disk quota exceeded|\bEDQUOT\b|\[Errno 122\]",
        r"PytorchStreamWriter failed writing file",
        # torch.save's zip writer found fewer bytes on disk than it wrote (a short write: the disk filled).
        r"\bunexpected pos \d+ vs \d+",
        # torch.save's legacy writer: EIO from write() on a saturated disk (pytorch/pytorch#10577).
        r"write\(\): fd \d+ failed with Input/output error",
        # A read-only file system refuses writes the same way: reported with its own reason (see _reason).
        r"Read-only file system|\[Errno 30\]|\bEROFS\b",
        *_OS_DISK,
    ), ("no space left", "errno 28", "enospc", "errno: 28", "code: 28", "storagefull", "disk quota", "edquot",
        "errno 122", "pytorchstreamwriter", "unexpected pos", "input/output error", "read-only file system",
        "errno 30", "erofs", *_OS_DISK_KEYS),
        exclude=r"/dev/shm|shared memory", what="a write failed because the disk or quota is full"),
    Rule("checkpoint_corrupt", (
        r"PytorchStreamReader failed reading (?:zip archive|file)",
        r"RuntimeError: PytorchStreamReader\b",
        r"failed finding central directory",
        r"UnpicklingError",
        r"invalid load key",
        r"(?:checkpoint|manifest)[^\n]{0,80}(?:checksum mismatch|is corrupt|corrupted)",
        r"no valid checkpoint",
        r"SafetensorError: Error while deserializing",
        r"EOFError: Ran out of input",
    ), ("pytorchstreamreader", "central directory", "unpicklingerror", "invalid load key", "corrupt",
        "checksum mismatch", "no valid checkpoint", "safetensorerror", "ran out of input"),
        what="a checkpoint file could not be read (truncated or corrupt)"),
    Rule("config_rejected", (
        r"Check batch related parameters",
        r"validation errors? for DeepSpeed\w*Config",
        r"extra fields not permitted|Extra inputs are not permitted",
        r"Please correct the following DeepSpeed config values that mismatch",
        # PyTorch Lightning refuses a Trainer/strategy configuration before training starts.
        r"MisconfigurationException",
    ), ("check batch related parameters", "validation error", "extra fields not permitted",
        "extra inputs are not permitted", "please correct the following deepspeed config", "misconfigurationexception"),
        what="the job refused its configuration before training"),
    Rule("cuda_oom", (
        r"OutOfMemoryError",
        r"CUDA out of memory",
        r"CUDA error: out of memory",
        r"cudaErrorMemoryAllocation",
        r"CUBLAS_STATUS_ALLOC_FAILED",
        r"Cuda failure '?out of memory",
    ), ("outofmemoryerror", "out of memory", "cudaerrormemoryallocation", "cublas_status_alloc_failed"),
        what="CUDA ran out of device memory"),
    Rule("illegal_memory_access", (
        r"illegal memory access",
        r"cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS",
        # "CUDA error: misaligned address", also through Triton's wrapper ("Triton Error [CUDA]: misaligned address").
        r"CUDA\]?:? (?:error: )?misaligned address",
        r"CUDA error: an illegal instruction",
        r"device-side assert(?:ion)? triggered",
        # A kernel's own device-side assertion ("Indexing.cu:1231: ...: Assertion `srcIndex < ...` failed.").
        r"\.cu:\d+:[^\n]*Assertion `[^`\n]*`",
    ), ("illegal memory access", "illegaladdress", "illegal_address", "misaligned address", "illegal instruction",
        "device-side assert", "assertion `"),
        what="a CUDA kernel faulted (illegal memory access or device-side assert)"),
    Rule("host_oom_killed", (
        r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)",  # the second: Windows builds
        r"Out of memory: Kill(?:ed)? process",
        r"\boom-kill(?:er)?\b|\boom_reaper\b|invoked oom-killer|\boom_kill events?\b|\bglobal_oom\b",
        r"^\s*MemoryError\b|\bMemoryError: ",
        r"std::bad_alloc",
        r"Cannot allocate memory",
        r"task [\d,\-]+: Out Of Memory|\bOOM Killed\b",
        r"^\[[^\]]*\] Killed process \d+ \(",
        *_OS_OOM,
    ), ("defaultcpuallocator", "out of memory: kill", "oom-kill", "oom_reaper", "oom_kill", "global_oom",
        "memoryerror", "bad_alloc", "cannot allocate memory", "out of memory", "oom killed", "killed process",
        *_OS_OOM_KEYS),
        exclude=r"DataLoader worker|not a failure", what="the host ran out of memory"),
    Rule("dataloader_crash", (
        r"DataLoader worker \(pid",
        r"Caught \w+ in DataLoader worker process",
        r"Unexpected (?:bus error|segmentation fault) encountered in worker",
        r"DataLoader timed out after",
        # MXNet Gluon's DataLoader: its workers sent no batch within the timeout.
        r"^\s*Worker timed out after \d+ seconds",
        # Older torch re-raised a worker's exception with the worker's whole traceback packed into the message.
        r"^\s*(?:\w+\.)*\w+: '?Traceback \(most recent call last\):[^\n]*\bin _worker_loop\b",
    ), ("dataloader worker", "encountered in worker", "dataloader timed out", "worker timed out after", "_worker_loop"),
        what="a DataLoader worker died"),
    Rule("segfault", (
        r"Segmentation fault",
        r"\bSIGSEGV\b",
        r"\bBus error\b",
        r"\bSIGBUS\b",
        r"Fatal Python error: (?:Segmentation fault|Bus error)",
    ), ("segmentation fault", "sigsegv", "bus error", "sigbus"), exclude=r"encountered in worker|DataLoader worker",
        what="a process crashed with a memory fault (SIGSEGV/SIGBUS)"),
    Rule("loss_scale_min", (
        r"loss scale already at minimum",
        # fairseq's fp16 optimizer: "FloatingPointError: Minimum loss scale reached (0.0001)."
        r"Minimum loss scale reached",
    ), ("loss scale already at minimum", "minimum loss scale reached"), what="the fp16 loss scale hit its minimum"),
    Rule("nan_loss", (
        r"\bloss (?:is|became|was) (?:nan|inf|-inf|non-finite|not finite)\b",
        r"(?:\b|_)loss\b['\"]?\s*[:=]\s*['\"]?[-+]?(?:nan|inf)\b",
        r"\bloss\s+nan\b",
        r"\bnon-finite loss\b",
        r"returned nan values in its \d+\w* output",
        # A logged row whose loss collapsed to exactly zero while its gradient norm is NaN (bf16 has no loss scale to
        # skip the step): NaN gradients, not a skipped fp16 step (that row keeps a normal loss).
        r"\bloss['\"]?\s*[:=]\s*0(?:\.0+)?(?![.\d])[^\n]*\bgrad_norm['\"]?\s*[:=]\s*['\"]?nan\b",
        r"\bgrad_norm['\"]?\s*[:=]\s*['\"]?nan\b[^\n]*\bloss['\"]?\s*[:=]\s*0(?:\.0+)?(?![.\d])",
    ), ("loss", "returned nan values"), exclude=r"\bgoes to nan\b|\bif the loss\b", what="the loss became NaN/Inf"),
    Rule("nccl_error", (
        r"NCCL error in:",
        r"\bnccl(?:InternalError|SystemError|RemoteError|UnhandledCudaError|InvalidUsage|InvalidArgument)\b",
        r"remote process exited or there was a network error",
        r"NET/IB\s*:[^\n]*(?:completion|error)[^\n]*(?:error|status)",
        r"NET/OFI [^\n]*completed with error",
        r"unhandled (?:system|cuda) error",
        r"NCCL WARN Net : (?:Call to|Connection)",
        # NCCL's own sockets (bootstrap, proxy, NET/Socket): a connect/bind/accept that NCCL gave up on.
        r"NCCL WARN (?:\w+: )?(?:Connect to|Call to \w+)\b[^\n]*\bfailed\b",
        r"NCCL WARN Cuda failure (?!'?out of memory)",
        r"Proxy Service \d+\] Failed",
        r"gloo[^\n]*(?:Connection closed by peer|Connection reset by peer|Broken pipe)",
        r"(?:Connection closed by peer|Connection reset by peer)[^\n]*gloo",
    ), ("nccl error in:", "ncclinternalerror", "ncclsystemerror", "ncclremoteerror", "ncclunhandledcudaerror",
        "ncclinvalidusage", "ncclinvalidargument", "remote process exited", "net/ib", "net/ofi",
        "unhandled system error", "unhandled cuda error", "nccl warn net", "nccl warn cuda failure", "nccl warn call to",
        "nccl warn socket",
        "proxy service", "connection closed by peer", "connection reset by peer", "broken pipe"),
        exclude=r"NCCL INFO|collective operation timeout|Timed out waiting|gloo[^\n]*Timed out",
        what="a collective communication call failed (NCCL/gloo error)"),
    Rule("nccl_timeout", (
        r"Watchdog caught collective operation timeout",
        r"collective operation timeout",
        r"Timed out waiting \d+ms for (?:recv|send) operation",
        r"gloo[^\n]*Timed out",
        r"watchdog got stuck",
        # Newer ProcessGroupNCCL: "Terminating the process after attempting to dump debug info, due to ProcessGroupNCCL
        # watchdog hang." (a collective never completed, so the watchdog ends the rank).
        r"\bwatchdog hang\b",
        # The watchdog's C++ stack when it raises the timeout (the message line may be cut from the tail).
        r"WorkNCCL::checkTimeout\b",
        # Older ProcessGroupNCCL: a work item that timed out in wait() (also quoted as an aborted communicator's reason).
        r"WorkNCCL\([^\n]*\) timed out in call to wait",
    ), ("collective operation timeout", "timed out waiting", "timed out", "watchdog got stuck", "watchdog hang",
        "worknccl::checktimeout"),
        what="a collective timed out (a rank hung or fell behind)"),
    # The overflow storm is found by counting OVERFLOW lines (scanner.overflow_storm); this rule is a trainer's own
    # verdict on one: GPT-NeoX's overflow monitor ends the run after N skipped iterations in a row.
    Rule("loss_scale_overflow", (
        r"\bSkipped \d+ (?:iterations|steps) in a row due to overflow",
    ), ("in a row due to overflow",), what="fp16 overflows skipped every step until the trainer gave up"),
    Rule("killed", (
        r"CANCELLED AT \S+ DUE TO (?:TIME LIMIT|PREEMPTION|NODE FAIL\w*)",
        r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT",
        r"Received \d+ death signal, shutting down workers",
        r"\bNode failure on\b|\bNODE_FAIL\b",
        r"reason: kubernetes-pod-termination",
        r"tasks? [\d,\-]+: Terminated\s*$",
    ), ("cancelled at", "death signal", "node failure", "node_fail", "kubernetes-pod-termination",
        ": terminated"),
        what="the job was terminated from outside (the scheduler, a lost node or an operator)"),
    Rule("launcher_error", (
        r"Rendezvous\w*Error",
        r"The server socket has failed to (?:listen|bind)",
        r"Address already in use|EADDRINUSE|errno: 98\b",
        r"DistNetworkError",
        r"The client socket has timed out after",
        r"\bconnect\(\) timed out",
        r"can't open file [^\n]*No such file or directory",
        r"\b(?:torchrun|deepspeed|launch\.py|run\.py): error:",
        EXC + r"(?:ModuleNotFoundError|ImportError): No module named",
        r"\bcommand not found\b",
        r"\bSpecError\b|invalid run spec",
        r"srun: error: (?!.*: task)|ssh: connect to host|pdsh@[^\n]*exited with exit code",
        r"returned non-zero exit status 255|not reachable via ssh|Hostfile contains a bad entry",
        r"Timed out initializing process group in store based barrier",
        # The c10d TCPStore's server gave up before every rank joined the rendezvous.
        r"DistStoreError: Timed out after \d+ seconds waiting for",
        EXC + r"FileNotFoundError:",
    ), ("rendezvous", "server socket has failed", "address already in use", "eaddrinuse", "errno: 98",
        "distnetworkerror", "client socket has timed out", "connect() timed out", "can't open file", ": error:",
        "no module named", "command not found", "specerror", "invalid run spec", "srun: error", "ssh: connect",
        "pdsh@", "exit status 255", "reachable via ssh", "hostfile contains", "store based barrier", "diststoreerror",
        "filenotfounderror"),
        exclude=r"NCCL WARN", what="the launcher or the job setup failed"),
)

# Root cause first. Hardware, disk and corrupt inputs cause everything downstream; a configuration the job
# refuses is decided before anything runs; device faults beat the NCCL errors they trigger on peers; a
# killed/segfaulted rank beats its peers' NCCL errors; the loss family only matters when nothing crashed it;
# a termination from outside ends a job that had no failure of its own; launcher errors are the outermost
# layer. `python_exception` (an uncaught exception no rule explains) is decided in decide.py, after all of
# these.
PRECEDENCE: tuple[str, ...] = (
    "gpu_hardware", "disk_full", "checkpoint_corrupt", "config_rejected", "cuda_oom", "illegal_memory_access",
    "host_oom_killed", "dataloader_crash", "segfault", "loss_scale_min", "nan_loss",
    "nccl_error", "nccl_timeout", "killed", "loss_scale_overflow", "launcher_error",
)
