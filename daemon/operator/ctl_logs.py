"""`ulyssesctl logs [RUN] [-f] [--attempt N] [--rank R] [-n LINES]`: the job's output of one attempt.

The daemon stores each attempt's launcher output (stdout and stderr of torchrun / the DeepSpeed launcher /
srun and of every rank it started, interleaved) as `{run_dir}/logs/attempt-N.log`; the wrapper writes
`{run_dir}/attempts/N.exit` when the launcher exits. Both are plain files, so this command reads them with
the daemon down. The newest attempt is the highest N with a log file.

`--rank R` keeps the lines a launcher prefixed with rank R, without the prefix: torch's `[rank1]:`, torchrun
`--tee`'s `[default1]:` (a local rank), srun `-l`'s `1:` and mpirun's `[1,1]<stdout>:`. A log with no
prefixed line at all is refused (exit 2) rather than shown empty: the launcher was not asked to label.
The built-in job's own log lines (`2026-12-01 23:37:01,835 [rank0] INFO ...`) are labelled too; they are
kept whole. Unlabelled lines (a traceback printed by Python itself) belong to no rank and are left out.
When the spec gives torchrun a `--log-dir` (e.g. with `--redirects 3`), `--rank R` reads torchrun's own
files of local rank R instead (its stdout.log, then its stderr.log): the rank's whole output, unfiltered.
With `--rank R`, `-n N` is rank R's last N lines, not the file's (those may all be another rank's, or a hung
attempt's unlabelled stack dumps).

Terminal control sequences in the job's output (ESC, the other C0 controls but tab and newline, a lone
carriage return, DEL and the C1 controls such as CSI) are printed as visible text (the ESC byte as the four
characters `\\x1b`): a job's output can set the window title, clear the screen, plant hyperlinks or rewrite
what is shown, so it is never executed by the operator's terminal. `--raw` passes the bytes through
unchanged (for a pipe into a tool of your own).

`-f` prints what is there, then polls the file every `FOLLOW_POLL_S` until the attempt ends (its exit file
appears, a newer attempt starts, or the run ends), then prints the rest and exits 0. Ctrl-C ends it quietly.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, cast

import typer

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.operator.ctl_common import (
    CTX,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    current_run,
    db_path,
    die,
    reader_gone,
    store_exit_code,
)
from ulyssesd.daemon.safety.regular_file import NotRegularFile, open_regular

#: How often `-f` looks for new output and for the attempt's end (seconds).
FOLLOW_POLL_S = 0.25
#: How often `-f` reads the run's state from the store (a terminal run has no more output coming).
FOLLOW_STORE_CHECK_S = 2.0
#: Bytes read per chunk (output is streamed, never held whole: attempt logs of multi-day runs are large).
CHUNK = 1 << 16
#: The longest piece of one line held in memory; a longer line is passed on in pieces of about this size.
MAX_PIECE = 1 << 20
#: Rank prefixes: torch `[rank3]:`, torchrun --tee `[default3]:`, mpirun `[1,3]<stdout>:`, srun -l `3:`.
RANK_PREFIX = re.compile(rb"^\s*(?:\[(?:rank|default)(\d+)\]:|\[\d+,(\d+)\]<std(?:out|err)>:|(\d+):)\s?")
#: The built-in job's own log lines (training/__main__.py's logging format: `%(asctime)s [rankN] LEVEL ...`):
#: labelled mid-line, so they are kept whole.
JOB_LOG_LINE = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \[rank(\d+)\] ")
_ATTEMPT_LOG = re.compile(r"^attempt-(\d+)\.log$")
#: What a terminal would execute: C0 controls but tab and newline, a carriage return not ending a line, DEL
#: and the C1 controls as UTF-8 (U+0080-U+009F: 8-bit CSI and OSC). A lone byte 0x80-0xFF that is not UTF-8
#: is passed on: a UTF-8 terminal shows it as a replacement character, it executes nothing.
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n$)|\xc2[\x80-\x9f]")


_SHOWN = {bytes([c]): b"\\x%02x" % c for c in [*range(32), 127]} | {b"\r": b"\\r"} | {
    bytes([0xC2, c]): b"\\xc2\\x%02x" % c for c in range(0x80, 0xA0)}


def visible(line: bytes) -> bytes:
    """The line with every terminal control made visible text (`\\x1b`, `\\r`, `\\xc2\\x9b`)."""
    if not _CONTROL.search(line):
        return line
    return _CONTROL.sub(lambda m: _SHOWN[m.group()], line)


def attempt_logs(run_dir: Path) -> dict[int, Path]:
    """Attempt number -> its log file, for every `logs/attempt-N.log` in the run dir."""
    try:
        names = os.listdir(run_dir / "logs")
    except OSError:
        return {}
    return {int(m.group(1)): run_dir / "logs" / n for n in names if (m := _ATTEMPT_LOG.match(n))}


def rank_filter(lines: Iterator[bytes], rank: int | None, seen: list[bool],
                cont: list[bool | None] | None = None, ranks: set[int] | None = None) -> Iterator[bytes]:
    """The lines of `rank` without their prefix (all lines when rank is None); seen[0] is set once any line
    carried a rank prefix at all. An item without a final newline is a piece of an overlong line (`_lines`):
    its rest follows in the next items and goes where its first piece went; cont[0] carries that decision
    across calls (None: the next item starts a line). `ranks` collects every rank a line was labelled with."""
    cont = cont if cont is not None else [None]
    for line in lines:
        if rank is None:
            yield line
            continue
        if cont[0] is not None:  # the rest of an overlong line: kept or dropped with its first piece
            if cont[0]:
                yield line
            if line.endswith(b"\n"):
                cont[0] = None
            continue
        keep = False
        label = line_rank(line)
        if label is not None:
            seen[0] = True
            if ranks is not None:
                ranks.add(label[0])
            if label[0] == rank:
                keep = True
                yield line[label[1]:]
        if not line.endswith(b"\n"):
            cont[0] = keep


def line_rank(line: bytes) -> tuple[int, int] | None:
    """(rank, where its text starts) of a line a launcher prefixed (the prefix is cut) or of the built-in job's
    own log line (kept whole: its label is mid-line); None for an unlabelled line."""
    m = RANK_PREFIX.match(line)
    if m is not None:
        return int(next(g for g in m.groups() if g is not None)), m.end()
    job = JOB_LOG_LINE.match(line)
    return (int(job.group(1)), 0) if job is not None else None


def _lines(fh: BinaryIO, pending: bytearray, final: bool) -> Iterator[bytes]:
    """Complete lines read from fh's current position on; a trailing partial line waits in `pending` until
    its newline comes (or, with final, is given as is). A line longer than MAX_PIECE is given in pieces
    (each but the last without its newline): memory stays bounded and each byte is looked at once (a job
    that redraws a progress bar with a carriage return for days writes one endless line)."""
    while chunk := fh.read(CHUNK):
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            if pending:
                pending += chunk[start:nl + 1]
                yield bytes(pending)
                pending.clear()
            else:
                yield chunk[start:nl + 1]
            start = nl + 1
        pending += chunk[start:]
        if len(pending) >= MAX_PIECE:
            yield bytes(pending)
            pending.clear()
    if final and pending:
        yield bytes(pending)
        pending.clear()


def _seek_last_lines(fh: BinaryIO, n: int) -> None:
    """Position fh at the start of its last n lines (reading backwards in chunks, bounded by the file)."""
    fh.seek(0, os.SEEK_END)
    end = pos = fh.tell()
    newlines = 0
    while pos > 0:
        step = min(CHUNK, pos)
        pos -= step
        fh.seek(pos)
        block = fh.read(step)
        if pos + step == end and block.endswith(b"\n"):
            block = block[:-1]  # the file's final newline ends the last line, it does not start one
        i = len(block)
        while (i := block.rfind(b"\n", 0, i)) >= 0:  # rfind, not a byte loop: a 50 MiB line is one call
            newlines += 1
            if newlines == n:
                fh.seek(pos + i + 1)
                return
    fh.seek(0)


def _seek_last_rank_lines(fh: BinaryIO, n: int, rank: int) -> None:
    """Position fh at the start of the last n lines of `rank` (the file's start when it holds fewer): with
    --rank, -n counts that rank's lines. The file's own last lines may all be another rank's, or a stack dump
    nobody labelled (a hung attempt ends so), which left nothing to show and a false "no rank-prefixed lines".
    Looks back over a window of lines that grows 4x per pass, bounded by the file."""
    window = n
    while True:
        _seek_last_lines(fh, window)
        start = pos = fh.tell()
        starts: collections.deque[int] = collections.deque(maxlen=n)
        at_line_start = True
        for piece in _lines(fh, bytearray(), final=True):
            if at_line_start and (label := line_rank(piece)) is not None and label[0] == rank:
                starts.append(pos)
            pos += len(piece)
            at_line_start = piece.endswith(b"\n")
        if len(starts) == n or start == 0:
            fh.seek(starts[0] if len(starts) == n else 0)
            return
        window *= 4


def _attempt_over(run_dir: Path, attempt: int, run_id: str | None, last_check: list[float]) -> bool:
    if (run_dir / "attempts" / f"{attempt}.exit").exists():
        return True
    if any(n > attempt for n in attempt_logs(run_dir)):
        return True
    now = SYSTEM.monotonic()
    if run_id is None or now - last_check[0] < FOLLOW_STORE_CHECK_S:
        return False
    last_check[0] = now
    return _run_ended(run_id)


def _run_ended(run_id: str) -> bool:
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.store.enums import TERMINAL_RUN_STATES

    try:
        with open_store(db_path(), readonly=True) as store:
            return store.get_run(run_id).state in TERMINAL_RUN_STATES
    except Exception:  # noqa: BLE001 - a busy or missing store must not end a follow: files decide then
        return False


def _write(lines: Iterator[bytes], raw: bool = False) -> int:
    """Write the lines to stdout (controls made visible unless raw); how many there were."""
    out = sys.stdout.buffer
    count = 0
    for line in lines:
        out.write(line if raw else visible(line))
        count += 1
    out.flush()
    return count


def print_log(paths: list[Path], rank: int | None, lines: int | None, follow: bool, run_dir: Path,
              attempt: int, run_id: str | None, raw: bool = False) -> int:
    """The command's body (callable from tests): the files one after the other, then (with follow) each
    one's new lines per poll until the attempt is over. Returns the exit code."""
    seen = [False]
    ranks: set[int] = set()
    shown = 0
    last_check = [SYSTEM.monotonic()]
    with contextlib.ExitStack() as stack:
        no_piece: list[bool | None] = [None]
        files = [(stack.enter_context(cast(BinaryIO, open_regular(p, "rb"))), bytearray(), list(no_piece)) for p in paths]
        for fh, _, _ in files:
            if lines is not None and rank is not None:
                _seek_last_rank_lines(fh, lines, rank)
            elif lines is not None:
                _seek_last_lines(fh, lines)
        over = not follow or _attempt_over(run_dir, attempt, run_id, last_check)
        while True:
            for fh, pending, cont in files:
                if os.fstat(fh.fileno()).st_size < fh.tell():  # truncated under us: start over, like tail -F
                    fh.seek(0)
                    pending.clear()
                    cont[0] = None
                shown += _write(rank_filter(_lines(fh, pending, final=over), rank, seen, cont, ranks), raw)
            if over:
                break
            SYSTEM.sleep(FOLLOW_POLL_S)
            over = _attempt_over(run_dir, attempt, run_id, last_check)
    if rank is not None and not seen[0]:
        print(f"error: {paths[0]} has no rank-prefixed lines; --rank needs a launcher that labels its output "
              f"(torchrun --tee 3, srun -l, ...) or torchrun's own per-rank files (--log-dir)", file=sys.stderr)
        return EXIT_USAGE
    if rank is not None and not shown:  # say why the output is empty: rank R printed nothing of its own
        print(f"note: {paths[0].name} has no line of rank {rank}; its labelled lines are of rank(s) "
              f"{', '.join(map(str, sorted(ranks)))}", file=sys.stderr)
    return EXIT_OK


def torchrun_rank_files(spec: dict | None, run_dir: Path, run_id: str, attempt: int, rank: int) -> list[Path]:
    """torchrun's own files of one local rank of an attempt, when the spec's `launcher.extra_args` give it a
    `--log-dir`: `<log-dir>/<rdzv-id>_<random>/attempt_<k>/<rank>/{stdout,stderr}.log`, the rendezvous id
    being the daemon's `<run_id>-<attempt>` (a relative log dir is the launcher's cwd, the run dir). Only the
    files that exist, stdout first; [] when there are none."""
    launcher = (spec or {}).get("launcher") or {}
    if launcher.get("kind") != "torchrun":
        return []
    args = [str(a) for a in launcher.get("extra_args") or []]
    log_dir = None
    for i, arg in enumerate(args):
        if arg in ("--log-dir", "--log_dir") and i + 1 < len(args):
            log_dir = args[i + 1]
        elif arg.startswith(("--log-dir=", "--log_dir=")):
            log_dir = arg.split("=", 1)[1]
    if not log_dir:
        return []
    base = run_dir / log_dir  # an absolute log_dir replaces run_dir
    dirs = sorted(base.glob(f"{glob.escape(run_id)}-{attempt}_*/attempt_*/{rank}"), key=lambda d: d.stat().st_mtime)
    if not dirs:
        return []
    return [f for f in (dirs[-1] / "stdout.log", dirs[-1] / "stderr.log") if f.is_file()]


def _run_dir_of(run_id: str | None) -> tuple[Path, str | None, dict | None]:
    """The run's directory, id and spec from the store; a run dir under the state dir (no id, no spec) when
    the store cannot say."""
    from ulyssesd.daemon.spec import run_id_problem
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.store.errors import StoreError

    if run_id:
        CTX.run = run_id
    try:
        store = open_store(db_path(), readonly=True)
    except StoreError as exc:  # no or a damaged database: the run dir alone still has the logs
        if run_id and (bad_id := run_id_problem(run_id)):  # `../../x` must not read a dir outside the state dir
            die(f"{bad_id}; {exc}", EXIT_USAGE, False)
        fallback = CTX.state_dir / "runs" / (run_id or "")
        if run_id and (fallback / "logs").is_dir():
            return fallback, None, None
        die(f"{exc} (name the run, `ulyssesctl logs RUN`, to read its run dir without the database)",
            store_exit_code(exc) or EXIT_NOT_FOUND, False)
    try:
        run = current_run(store, False)
    finally:
        store.close()
    return Path(run.run_dir or CTX.state_dir / "runs" / run.id), run.id, run.spec


def logs(run_id: str = typer.Argument(None, metavar="RUN", help="run id (default: the --run option, else the "
                                      "latest run)"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new output until the attempt "
                                     "ends (Ctrl-C stops)"),
         attempt: int = typer.Option(None, "--attempt", min=1, metavar="N", help="attempt number (default: the newest)"),
         rank: int = typer.Option(None, "--rank", min=0, metavar="R", help="only this rank's lines, without their prefix"),
         lines: int = typer.Option(None, "--lines", "-n", min=1, metavar="N", help="start with the last N lines only"),
         raw: bool = typer.Option(False, "--raw", help="pass terminal control sequences through unchanged "
                                  "(default: shown as visible text such as \\x1b, never executed)")) -> None:
    """The job's output of one attempt. The launcher's and every rank's lines; works with the daemon down."""
    run_dir, known_id, spec = _run_dir_of(run_id)
    logs_by_attempt = attempt_logs(run_dir)
    if not logs_by_attempt:
        die(f"no attempt logs in {run_dir / 'logs'}", EXIT_NOT_FOUND, False)
    number = attempt if attempt is not None else max(logs_by_attempt)
    if number not in logs_by_attempt:
        die(f"no log of attempt {number} in {run_dir / 'logs'} (attempts with logs: "
            f"{', '.join(map(str, sorted(logs_by_attempt)))})", EXIT_NOT_FOUND, False)
    paths = [logs_by_attempt[number]]
    if attempt is None and not follow and number - 1 in logs_by_attempt and _is_empty(paths[0]):
        # Right after a relaunch the newest log has nothing yet; an empty answer read as a broken command.
        print(f"note: attempt {number}'s log is empty so far; the one before: --attempt {number - 1}", file=sys.stderr)
    if rank is not None and known_id is not None:  # torchrun's own per-rank files beat filtering by prefix
        paths = torchrun_rank_files(spec, run_dir, known_id, number, rank) or paths
    try:
        code = print_log(paths, None if paths[0] != logs_by_attempt[number] else rank, lines, follow, run_dir,
                         number, known_id, raw)
    except KeyboardInterrupt:
        code = EXIT_OK
    except NotRegularFile as exc:  # a FIFO put at the log's path would block the read for ever
        print(f"ulyssesctl logs: {exc.filename} {exc.strerror}", file=sys.stderr)
        code = EXIT_NOT_FOUND
    except BrokenPipeError:  # `| head`: the reader left; exit quietly like other Unix tools
        reader_gone()
        code = EXIT_OK
    raise typer.Exit(code)


def _is_empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


def register_logs(app: typer.Typer) -> None:
    """Add `logs` to ulyssesctl."""
    app.command("logs")(logs)
