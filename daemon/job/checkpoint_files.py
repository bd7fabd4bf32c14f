"""A command job's checkpoints, read from its `[job] checkpoint_dir` on disk (not from its log wording).

One look (`look`) lists the entries of the checkpoint directory (or the matches of `[job] checkpoint_pattern`,
a glob relative to it) and recognises the layouts training frameworks write, each with its step and, where
the format has one, its completion marker:

| layout | step from | complete when |
|---|---|---|
| any dir with ulyssesd's `manifest.json` | the manifest | the manifest validates (sizes) |
| HF Trainer `checkpoint-N/` | `trainer_state.json` `global_step` | `trainer_state.json` is there |
| DeepSpeed tag `global_stepN/` (+ `latest`) | the tag's number | `latest` names this tag or a later one |
| Megatron `iter_NNNNNNN/` (+ `latest_checkpointed_iteration.txt`) | the number | the tracker file says >= N |
| torch DCP dir (`*.distcp`) | the dir's number | `.metadata` is there (DCP writes it last) |
| Lightning `*.ckpt` file (`epoch=0-step=40.ckpt`) | `step=N`, else the number | a whole torch zip |
| plain file `step_000040.pt` / `.pth` / `.bin` / `.safetensors` | the number | a whole torch zip / safetensors |
| plain dir `step_N/` | the number | every torch zip / safetensors file in it whole |

and in every case the size is stable across two looks at least `settle_s` apart (`Watch`): a save still being
written is never "complete". A "whole torch zip" is a file `torch.save` wrote completely: its zip end record is
there (a killed save leaves a file without one); a pre-1.6 pickle file (not a zip) counts on size alone.
Directory checkpoints must also hold every `[job] resume_requires` file. Names without a number (`latest`,
`last.ckpt`, `logs/`) and entries set aside (`*.rolledback-*`, `*.corrupt-*`) are not checkpoints.

Choosing: `resume_point` is the checkpoint a launch hands the job as `{resume}`: complete (marker + two equal
looks), at or before a rollback's step, not written by a trajectory a rollback abandoned. `set_aside_after`
renames every checkpoint past a rollback point `NAME.rolledback-UNIXTIME` (evidence: never resumed, never
deleted). `RollbackBounds` (`{run_dir}/rollback-bounds.json`) keeps every rollback's (step, time): a checkpoint
past a bound's step whose files are older than that rollback was saved by the abandoned (poisoned) trajectory
and is never a resume point, also after later unrelated crashes and daemon restarts; one the new trajectory
saves later (files newer than the rollback) is.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.safety.regular_file import open_regular, read_regular_text

#: Where set-aside and quarantined checkpoints' names carry their mark (never resumed, kept as evidence).
SET_ASIDE_MARKS = (".rolledback-", ".corrupt-")
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
_STEP_KEY = re.compile(r"(?:^|[^a-z])(?:global_step|step|iter|iteration|it)[=_-]?(\d+)", re.IGNORECASE)
_TORCH_FILE = (".pt", ".pth", ".bin", ".ckpt", ".tar")
_SAFETENSORS = ".safetensors"
#: Files of a directory checkpoint whose structure is checked (bounded: a sharded save can have thousands).
MAX_FILES_CHECKED = 4096
#: A sidecar the checkpoint dir may hold that is not a checkpoint (DeepSpeed's helper script, trackers).
_NOT_CHECKPOINTS = {"latest", "latest_checkpointed_iteration.txt", "zero_to_fp32.py", "last.ckpt"}


@dataclass(frozen=True)
class Found:
    """One checkpoint candidate of one look."""

    path: Path
    name: str              # relative to the checkpoint dir: the tag the store, status and report show
    step: int
    layout: str            # manifest | hf | deepspeed | megatron | dcp | lightning | file | dir
    marker_ok: bool        # the format's completion marker (or structure check) passed
    why_not: str           # when not marker_ok: what is missing
    signature: tuple[int, int, int]   # (files, bytes, newest mtime_ns): equal across two looks = size stable
    mtime: float           # newest file's mtime (s): which trajectory wrote it (rollback bounds)


def step_of_name(name: str) -> int | None:
    """A checkpoint's step from its name: `step=40`, `global_step40`, `iter_0000040`, `step_000040`, else the
    last number in it; None when it has no number."""
    base = name.rsplit("/", 1)[-1]
    m = _STEP_KEY.search(base)
    if m:
        return int(m.group(1))
    m = _LAST_NUMBER.search(base)
    return int(m.group(1)) if m else None


def is_set_aside(name: str) -> bool:
    return any(mark in name for mark in SET_ASIDE_MARKS)


def _signature(path: Path) -> tuple[int, int, int, list[Path]]:
    """(files, bytes, newest mtime_ns, the files) of a file or a directory tree (symlinks not followed)."""
    if path.is_file():
        st = path.stat()
        return 1, st.st_size, st.st_mtime_ns, [path]
    files, total, newest, listed = 0, 0, 0, []
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            p = Path(dirpath) / n
            try:
                st = p.lstat()
            except OSError:
                continue  # removed between the listing and the stat: the next look sees the new state
            files += 1
            total += st.st_size
            newest = max(newest, st.st_mtime_ns)
            listed.append(p)
    return files, total, newest, listed


def whole_torch_file(path: Path) -> tuple[bool, str]:
    """Whether `torch.save` finished writing `path`: a zip-format save ends with the zip's end record (a save
    killed midway has none). A legacy pickle save (not a zip) cannot be told apart: size stability decides."""
    try:
        with open_regular(path, "rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        return False, f"{path.name}: unreadable ({exc.strerror})"
    if head[:2] != b"PK":
        return True, ""
    if zipfile.is_zipfile(path):
        return True, ""
    return False, f"{path.name}: torch zip without its end record (save not finished)"


def whole_safetensors(path: Path) -> tuple[bool, str]:
    """A safetensors file is whole when its size is 8 + header + the largest tensor end the header names."""
    try:
        size = path.stat().st_size
        with open_regular(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            if n <= 0 or 8 + n > size or n > 100 << 20:
                return False, f"{path.name}: safetensors header length {n} does not fit the file ({size} bytes)"
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error) as exc:
        return False, f"{path.name}: unreadable safetensors header ({exc})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    if 8 + n + max(ends, default=0) != size:
        return False, f"{path.name}: {size} bytes, its header needs {8 + n + max(ends, default=0)} (save not finished)"
    return True, ""


def _files_whole(files: list[Path]) -> tuple[bool, str]:
    for p in files[:MAX_FILES_CHECKED]:
        if p.suffix in _TORCH_FILE:
            ok, why = whole_torch_file(p)
        elif p.suffix == _SAFETENSORS:
            ok, why = whole_safetensors(p)
        else:
            continue
        if not ok:
            return False, why
    return True, ""


def _read_int(path: Path) -> int | None:
    try:
        text = read_regular_text(path, errors="replace").strip()[:200]
    except OSError:
        return None
    m = _LAST_NUMBER.search(text)
    return int(m.group(1)) if m else None


def classify(path: Path, root: Path, requires: tuple[str, ...] = ()) -> Found | None:
    """One entry of the checkpoint dir as a checkpoint (or None: not one, e.g. no step in its name)."""
    from ulyssesd.client.manifest import MANIFEST_NAME, read_manifest, validate_manifest

    name = path.relative_to(root).as_posix()
    base = path.name
    if base in _NOT_CHECKPOINTS or base.startswith(".") or is_set_aside(base) or path.is_symlink():
        return None
    is_dir = path.is_dir()
    if not is_dir and path.suffix not in (*_TORCH_FILE, _SAFETENSORS):
        return None
    try:
        files, total, newest, listed = _signature(path)
    except OSError:
        return None
    sig = (files, total, newest)
    mtime = newest / 1e9
    step = step_of_name(name)
    ok, why, layout = True, "", "dir" if is_dir else "file"
    if not is_dir:
        if path.suffix == ".ckpt":
            layout = "lightning"
        ok, why = (whole_safetensors(path) if path.suffix == _SAFETENSORS else whole_torch_file(path))
    elif (path / MANIFEST_NAME).exists():
        layout = "manifest"
        ok, why = validate_manifest(path, verify_checksums=False)[:2]
        if ok:
            try:
                step = int(read_manifest(path)["step"])
            except Exception:  # noqa: BLE001 - validated just now; a race with a rewrite: the next look decides
                ok, why = False, "manifest unreadable"
    elif base.startswith("checkpoint-") or (path / "trainer_state.json").exists():
        layout = "hf"
        state = path / "trainer_state.json"
        if not state.exists():
            ok, why = False, "no trainer_state.json yet (the Trainer writes it at the end of a save)"
        else:
            try:
                step = int(json.loads(read_regular_text(state))["global_step"])
            except (OSError, ValueError, KeyError, TypeError):
                ok, why = False, "trainer_state.json unreadable or without global_step"
    elif base.startswith("iter_") and (path.parent / "latest_checkpointed_iteration.txt").exists():
        layout = "megatron"
        done = _read_int(path.parent / "latest_checkpointed_iteration.txt")
        if done is None or step is None or step > done:
            ok, why = False, f"latest_checkpointed_iteration.txt says {done}: iteration {step} not finished"
    elif (path / ".metadata").exists() or any(p.suffix == ".distcp" for p in listed[:MAX_FILES_CHECKED]):
        layout = "dcp"
        if not (path / ".metadata").exists():
            ok, why = False, "no .metadata yet (torch.distributed.checkpoint writes it last)"
    elif (path.parent / "latest").is_file() and any(p.name.endswith(("model_states.pt", "optim_states.pt"))
                                                   for p in listed[:MAX_FILES_CHECKED]):
        layout = "deepspeed"
        latest = read_regular_text(path.parent / "latest", errors="replace").strip()
        done = step_of_name(latest) if latest else None
        if latest != base and (done is None or step is None or step > done):
            ok, why = False, f"`latest` names {latest!r}: tag {base} not finished"
    if step is None:
        return None
    if ok and is_dir:
        missing = [r for r in requires if not (path / r).exists()]
        if missing:
            ok, why = False, f"missing {', '.join(missing)} ([job] resume_requires)"
        else:
            ok, why = _files_whole(listed)
    if is_dir and files == 0:
        ok, why = False, "empty"
    return Found(path=path, name=name, step=step, layout=layout, marker_ok=ok, why_not=why, signature=sig,
                 mtime=mtime)


def entries(root: Path, pattern: str | None = None) -> list[Path]:
    """The entries a look examines: the pattern's matches, else the checkpoint dir's children."""
    try:
        if pattern:
            return sorted(p for p in root.glob(pattern) if not is_set_aside(p.as_posix()))
        return sorted(root.iterdir())
    except OSError:
        return []


def _uses_manifests(listed: list[Path]) -> bool:
    from ulyssesd.client.manifest import MANIFEST_NAME

    return any((p / MANIFEST_NAME).is_file() for p in listed)


def _examine(p: Path, root: Path, requires: tuple[str, ...], uses_manifests: bool) -> Found | None:
    """`classify`, and once the job writes manifests (ulyssesd.client) a directory without one is a save
    not finished."""
    try:
        f = classify(p, root, requires)
    except OSError:
        return None
    if f is not None and uses_manifests and f.marker_ok and f.layout not in ("manifest", "file", "lightning"):
        f = Found(f.path, f.name, f.step, f.layout, False, "no manifest.json (the job writes one after each save; "
                  "this save has not finished)", f.signature, f.mtime)
    return f


def look(root: Path, pattern: str | None = None, requires: tuple[str, ...] = (),
         skip: frozenset[str] | set[str] = frozenset()) -> tuple[list[Found], list[str]]:
    """One look: (the checkpoints recognised, the names of entries that are not). `skip`: names not examined
    (already reported: a look must not re-read every file of every old checkpoint)."""
    root = Path(root)
    found, other = [], []
    listed = entries(root, pattern)
    uses_manifests = _uses_manifests(listed)
    for p in listed:
        if skip and p.relative_to(root).as_posix() in skip:
            continue
        f = _examine(p, root, tuple(requires), uses_manifests)
        if f is None:
            if not is_set_aside(p.name) and p.name not in _NOT_CHECKPOINTS and not p.name.startswith("."):
                other.append(p.name)
        else:
            found.append(f)
    return found, other


BOUNDS_NAME = "rollback-bounds.json"
#: How long `resume_point` waits between its two looks when no earlier look is at hand (the job has exited).
RELOOK_S = 0.2
#: Second looks one launch may take (files that keep changing while the job is down: an uploader, a copy).
MAX_RELOOKS = 5
#: Bounds kept (oldest dropped): enough for any run's rollbacks, small enough to read every launch.
MAX_BOUNDS = 64


@dataclass(frozen=True)
class WatchConfig:
    """What the watch looks at ([job] of the spec)."""

    root: Path                              # [job] checkpoint_dir
    pattern: str | None = None              # [job] checkpoint_pattern: a glob relative to root
    requires: tuple[str, ...] = ()          # [job] resume_requires: files a checkpoint dir must hold
    settle_s: float = 2.0                   # [job] checkpoint_settle_s: the two looks' minimum distance
    unknown_after_s: float = 900.0          # [job] checkpoint_unknown_after_s: running this long with files
                                            # in root but no checkpoint recognised is reported


#: A bound's `why` for the checkpoints found in checkpoint_dir at the run's first launch (never resumed).
BEFORE_RUN = "before_run"


class RollbackBounds:
    """The run's rollback points, persisted in the run dir (replaced whole, temp + rename)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / BOUNDS_NAME

    def read(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        return [b for b in data if isinstance(b, dict) and isinstance(b.get("to_step"), int)
                and isinstance(b.get("since"), (int, float))] if isinstance(data, list) else []

    def add(self, to_step: int, since: float, why: str | None = None) -> None:
        """A rollback to `to_step` at `since`; `why = "before_run"` (with `to_step` -1): the checkpoints already
        in checkpoint_dir when the run started, another run's lineage (`poisoned` names them so)."""
        entry: dict[str, Any] = {"to_step": int(to_step), "since": float(since)}
        if why:
            entry["why"] = why
        bounds = [*self.read(), entry]
        first = [b for b in bounds if b.get("why") == BEFORE_RUN][:1]   # kept whatever the count of rollbacks
        bounds = first + [b for b in bounds if b.get("why") != BEFORE_RUN][-MAX_BOUNDS:]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(bounds) + "\n")
        os.replace(tmp, self.path)

    def poisoned(self, f: Found) -> str | None:
        """Why `f` belongs to an abandoned trajectory (None: it does not)."""
        for b in self.read():
            if f.step > b["to_step"] and f.mtime < b["since"] and b.get("why") == BEFORE_RUN:
                return (f"in checkpoint_dir before this run started "
                        f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(b['since']))}): another run's; "
                        f"[job] resume_first = true continues from such checkpoints")
            if f.step > b["to_step"] and f.mtime < b["since"]:
                return (f"saved at step {f.step} before the rollback to step {b['to_step']} "
                        f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(b['since']))}): the abandoned trajectory")
        return None


def complete(cfg: WatchConfig, earlier: dict[str, tuple[int, int, int]] | None = None,
             relook_s: float = RELOOK_S) -> tuple[list[Found], list[Found]]:
    """(complete, not complete) checkpoints now. Size stability needs two looks: against `earlier` signatures
    where given (the watch's last look), else a second look `relook_s` later (the job is not running)."""
    first, _ = look(cfg.root, cfg.pattern, cfg.requires)
    if earlier is None:
        earlier = {f.name: f.signature for f in first}
        if first:
            SYSTEM.sleep(relook_s)
        second, _ = look(cfg.root, cfg.pattern, cfg.requires)
    else:
        second = first
    done = [f for f in second if f.marker_ok and earlier.get(f.name) == f.signature]
    names = {f.name for f in done}
    return done, [f for f in second if f.name not in names]


def resume_point(cfg: WatchConfig, bounds: RollbackBounds | None = None, max_step: int | None = None,
                 earlier: dict[str, tuple[int, int, int]] | None = None,
                 relook_s: float = RELOOK_S) -> tuple[Found | None, list[str]]:
    """The checkpoint to resume from (None: none) and why newer ones were passed over. Examined newest first
    by the step in their names, stopping at the first that is complete, within `max_step` and not from an
    abandoned trajectory: a launch reads one checkpoint's files twice, not every file of every checkpoint.
    Size stability: against `earlier` signatures where given, else a second look `relook_s` later."""
    root = Path(cfg.root)
    listed = entries(root, cfg.pattern)
    uses_manifests = _uses_manifests(listed)

    def name_step(p: Path) -> int:
        step = step_of_name(p.relative_to(root).as_posix())
        return -1 if step is None else step

    notes: list[str] = []
    relooks = 0
    for p in sorted(listed, key=lambda p: (name_step(p), p.name), reverse=True):
        if max_step is not None and name_step(p) > max_step:
            continue
        f = _examine(p, root, cfg.requires, uses_manifests)
        if f is None or not f.marker_ok or (max_step is not None and f.step > max_step):
            continue
        why = bounds.poisoned(f) if bounds is not None else None
        if why:
            notes.append(f"{f.name} passed over: {why}")
            continue
        if earlier is not None:
            stable = earlier.get(f.name) == f.signature
        elif relooks < MAX_RELOOKS:
            relooks += 1
            SYSTEM.sleep(relook_s)
            g = _examine(p, root, cfg.requires, uses_manifests)
            stable = g is not None and g.marker_ok and g.signature == f.signature
        else:
            stable = False
        if stable:
            return f, notes
        notes.append(f"{f.name} passed over: still being written (its files changed between two looks)")
    return None, notes


def set_aside_after(cfg: WatchConfig, step: int, now: float | None = None) -> list[tuple[str, str]]:
    """Rename every checkpoint (complete or not) past `step` to `NAME.rolledback-UNIXTIME`; [(old, new)]."""
    stamp = int(now if now is not None else SYSTEM.time())
    moved = []
    found, _ = look(cfg.root, cfg.pattern, cfg.requires)
    for f in sorted(found, key=lambda f: f.step):
        if f.step <= step:
            continue
        target = f.path.with_name(f"{f.path.name}.rolledback-{stamp}")
        n = 1
        while target.exists():
            target = f.path.with_name(f"{f.path.name}.rolledback-{stamp}-{n}")
            n += 1
        os.rename(f.path, target)
        moved.append((f.name, target.name))
    return moved
