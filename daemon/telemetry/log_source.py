"""`[telemetry] source = "stdout"`: telemetry for a job that only prints logs.

Each tick, before the telemetry reader runs, the attempt's log (`{run_dir}/logs/attempt-{N}.log`, which the
daemon already captures) is read from where the last tick stopped; complete lines go through the log parsers
(`ulyssesd.remediation.log_telemetry`) and the records they yield are appended to
`{run_dir}/telemetry-stdout.jsonl`, which the ordinary telemetry reader then tails (same cursor, store,
detectors and replay as a job that writes its own telemetry). Where each attempt's log was read up to is kept in
`telemetry-stdout.offsets.json` (log_offsets.py) so a re-adopting daemon neither re-reads nor skips lines; should
that file be behind (its last write lost), the lines re-read yield no second record: the parser starts after the
last step this attempt already has in the output file. A log truncated, replaced or rewritten outside the
daemon, or an offsets file that cannot be read, is read again from its start, and said (journal, log, webhook,
status). A record's `time` is the line's own timestamp or the time the daemon read it.

`source = "trainer_state" | "tensorboard"` read what the framework writes instead (daemon/telemetry/framework_files.py)
into the same output file. For every derived source, `{run_dir}/telemetry-stdout.health.json` says what the
current attempt's reading found (lines, step records, bad lines, counter discontinuities, the newest line that
looked like progress but gave no record) and whether it has been silent: no step record for
`[telemetry] silent_after_s` (900 s) while the attempt runs. Silence is said once per attempt in the journal,
as a `telemetry` webhook and in `ulyssesctl status`, with the setting that fixes it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO, cast

from ulyssesd.client.contract import encode_record
from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.safety.regular_file import NotRegularFile, open_regular, set_aside_if_not_regular
from ulyssesd.daemon.telemetry import log_offsets
from ulyssesd.remediation.log_telemetry import LogTelemetryParser
from ulyssesd.training.durable import temp_path_for

log = get_logger("ulyssesd.telemetry")

STDOUT_TELEMETRY_NAME = "telemetry-stdout.jsonl"
OFFSETS_NAME = "telemetry-stdout.offsets.json"
HEALTH_NAME = "telemetry-stdout.health.json"
DERIVED_SOURCES = ("stdout", "trainer_state", "tensorboard")
DEFAULT_SILENT_AFTER_S = 900.0
HEALTH_WRITE_EVERY_S = 5.0  # the health file is rewritten at most this often (and on every change of verdict)
MAX_READ_BYTES = 4 << 20  # bound one tick's work on a huge backlog
MAX_LINE_BYTES = 1 << 20  # a longer "line" (binary junk, a progress bar that never ends) is skipped
MAX_PARSE_S = 0.5  # bound one tick's parsing time (a 4 MiB backlog of dense lines takes seconds)
RESUME_TAIL_BYTES = 1 << 20  # how much of the output file's end is searched for the attempt's last step
_PIECE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")  # a line or a progress bar's redraw, with its terminator
_UNICODE_BREAK = re.compile("[\u2028\u2029\x85]")  # line breaks of Unicode that are no `\r`/`\n` byte
_DRAWN_BAR = re.compile(rb"^[^\r\n]{0,4000}\d+/\d+ \[[^\r\n\[\]]*\]\Z")  # a whole tqdm bar: `... N/M [...]`


def _telemetry(config: dict[str, Any]) -> dict[str, Any]:
    tel = config.get("telemetry") or {}
    return tel if isinstance(tel, dict) else {}


def source_kind(config: dict[str, Any]) -> str:
    """`[telemetry] source`: "job" (the job writes telemetry itself), "stdout", "trainer_state", "tensorboard"."""
    src = _telemetry(config).get("source")
    return src if isinstance(src, str) else "job"


def stdout_source(config: dict[str, Any]) -> bool:
    """The daemon derives the telemetry (log or framework files -> telemetry-stdout.jsonl); no control.json."""
    return source_kind(config) in DERIVED_SOURCES


def _declared_total(config: dict[str, Any]) -> int | None:
    job = config.get("job") or {}
    total = job.get("total_steps") if isinstance(job, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 1 else None


NO_PROGRESS_LINE_YET = "no output line looked like progress yet"


def fix_hint(source: str, sample: str | None) -> str:
    """The setting that makes a silent job's steps readable, with the line that was not understood."""
    if source == "stdout":
        seen = f"; the newest line that looked like progress was {sample!r}" if sample else \
            f"; {NO_PROGRESS_LINE_YET}"
        return ("print one line per step with a step and a loss (e.g. `step 12 loss 2.31`), or give "
                "[telemetry] pattern = '<regex with (?P<step>...) and (?P<loss>...)>' (docs/CLIENT.md, stdout "
                "telemetry)" + seen)
    if source == "trainer_state":
        return ("[telemetry] files must be the Trainer's output_dir (it holds trainer_state.json or "
                "checkpoint-N/trainer_state.json, written at each save); or use source = \"stdout\"")
    return ("[telemetry] files must be a directory holding the job's events.out.tfevents.* files with a training "
            "loss scalar (a tag such as train/loss); or use source = \"stdout\"")


class LogSource:
    """Tail one attempt's log into the run's stdout telemetry file."""

    def __init__(self, run_dir: Path, attempt: int, config_version: int | None = None,
                 pattern: str | None = None, total_steps: int | None = None, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.attempt = attempt
        self.log_path = self.run_dir / "logs" / f"attempt-{attempt}.log"
        self.out_path = self.run_dir / STDOUT_TELEMETRY_NAME
        self.notices: list[str] = []   # what the reader could not do as asked (said by `pump(sup)`, once each)
        self._log_missing = False      # the log could not be stat'ed (said once per spell)
        self.pos = log_offsets.LogPosition()
        if self.reads_log:
            self.pos, problem = log_offsets.load(self._offsets_path(), attempt)
            if problem:
                self.notices.append(f"{problem}: cannot resume reading attempt {attempt}'s log where it stopped; "
                                    f"reading it again from its start (steps already recorded are not recorded twice)")
        self.parser = LogTelemetryParser(attempt=attempt, config_version=config_version,
                                         after_step=self._last_emitted_step(), pattern=pattern,
                                         total_steps=total_steps)
        # Dicts printed without a step (HF Trainer with its bar off) are numbered in order: from the step this
        # attempt already reached (a re-adopting daemon), else from the checkpoint it resumed from.
        self.parser.count_dicts_from(self.parser._last_step if self.parser._last_step is not None else resume_step)
        self.skipped_long_lines = 0
        self._torn_tail = self._ends_mid_line()
        #: Set once the attempt's process has exited: nothing more will be written, so an unterminated last
        #: line (a `\r`-only progress redraw, a last print without newline) is read as the last line.
        self.job_ended = False
        self.exit_wait_since: float | None = None  # when the ended attempt's exit began waiting for this output
        #: The attempt's log, held open across pumps: a removed log is read on from it (`_stat_log`).
        self._held: BinaryIO | None = None
        self._log_unlinked = False
        self._out_blocked = False  # the output path holds something that could not be moved aside (said once)

    reads_log = True   # the attempt's log is what it reads (its position is kept in the offsets file)

    @property
    def offset(self) -> int:
        """How far the attempt's log has been read (bytes)."""
        return self.pos.offset

    def _offsets_path(self) -> Path:
        return self.run_dir / OFFSETS_NAME

    def _last_emitted_step(self) -> int | None:
        """The last step record of this attempt in the output file (its end: the current attempt's records
        are the newest), None when there is none."""
        try:
            with open_regular(self.out_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.out_path) - RESUME_TAIL_BYTES))
                tail = fh.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(tail):
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the first, cut line of the tail, or a torn last one
            if isinstance(rec, dict) and rec.get("kind") == "step" and rec.get("attempt") == self.attempt \
                    and isinstance(rec.get("step"), int):
                return rec["step"]
        return None

    def _ends_mid_line(self) -> bool:
        """Whether the output file ends in a torn record: the next append starts on a new line (one bad line)."""
        try:
            with open_regular(self.out_path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                return fh.read(1) != b"\n"
        except OSError:  # absent or empty
            return False

    def log_shortened(self, removed_bytes: int) -> None:
        """The log's first `removed_bytes` were cut away by the daemon (rotation, an ended attempt's log trimmed
        to its tail): what was read stays read (else the shorter file reads as new and its lines are parsed
        twice). The bytes before the offset are the same text; the file may be a new one (a trim replaces it)."""
        pos = self.pos
        pos.offset = max(0, pos.offset - removed_bytes)
        pos.tail = pos.tail[len(pos.tail) - min(len(pos.tail), pos.offset):]
        try:
            pos.inode = os.stat(self.log_path).st_ino
        except OSError:
            pos.inode = None
        self._save_offset()

    def _save_offset(self) -> None:
        """No fsync: the offset only bounds how much is re-read. A lost write leaves an older offset; the next
        daemon re-reads those lines and the parser drops them (it starts after this attempt's last step in the
        output file, `_last_emitted_step`); steps whose append was lost too are a gap, as after any restart."""
        log_offsets.save(self._offsets_path(), self.attempt, self.pos)

    def _stat_log(self) -> os.stat_result | None:
        try:
            st = os.stat(self.log_path)
            if not stat.S_ISREG(st.st_mode):  # a FIFO put there would block the read for ever: reported, not read
                raise NotRegularFile(errno.EINVAL, "is not a regular file; not read", str(self.log_path))
            if self._held is None or os.fstat(self._held.fileno()).st_ino != st.st_ino:
                fresh = cast(BinaryIO, open_regular(self.log_path, "rb"))  # before the old one is let go
                if self._held is not None:
                    self._held.close()
                self._held = fresh
            st, self._log_unlinked = os.fstat(self._held.fileno()), False
        except OSError as exc:
            if self._held is None:
                self._unreadable(exc)
                return None
            # Removed (a tmp cleaner, logrotate without copytruncate), or something that is no regular file put
            # at its path (a `mkdir -p` there): the job still writes to its open file, and this reader still
            # holds it open too, so its steps are read on from it whatever now sits at the path.
            if not self._log_unlinked:
                what = "was removed" if isinstance(exc, FileNotFoundError) else \
                    f"cannot be opened ({type(exc).__name__}: {exc})"
                self.notices.append(f"attempt {self.attempt}'s log {self.log_path} {what}; its steps are "
                                    f"read on from the file the job still writes (it is gone once the job ends)")
            self._log_unlinked = True
            return os.fstat(self._held.fileno())
        self._log_missing = False
        return st

    def _unreadable(self, exc: OSError) -> None:
        """Say (once per spell) that the log cannot be read."""
        if not self._log_missing and (self.pos.offset > 0 or self.pos.inode is not None):
            self.notices.append(f"attempt {self.attempt}'s log {self.log_path} cannot be read "
                                f"({type(exc).__name__}: {exc}): no step records from it until it is back")
        self._log_missing = True

    def _output_usable(self, now: float) -> bool:
        """Whether records can be appended: a non-file there is moved aside; one that cannot be blocks reading."""
        ok, said = set_aside_if_not_regular(self.out_path, now)
        if said and (ok or not self._out_blocked):
            self.notices.append(said + ("" if ok else "; the job's log is read on from where it stopped then"))
        self._torn_tail = self._torn_tail and not said
        self._out_blocked = not ok
        return ok

    def _start_over(self, why: str, st: os.stat_result) -> None:
        last = self.parser._last_step
        self.notices.append(f"attempt {self.attempt}'s log {self.log_path} {why}: cannot resume reading at byte "
                            f"{self.pos.offset}; reading it again from its start"
                            + (f" (steps up to {last}, already recorded, are not recorded twice)" if last is not None
                               else ""))
        self.pos = log_offsets.LogPosition(0, st.st_ino, b"")

    def pump(self, now: float) -> int:
        """Parse the log lines written since the last call; returns how many records were appended."""
        st = self._stat_log() if self._output_usable(now) else None
        if st is None:
            return 0
        pos = self.pos
        if st.st_size == pos.offset and st.st_ino == pos.inode:
            return 0
        why = log_offsets.moved_on(pos, st, None)   # replaced, or shorter than where reading stopped
        if why:
            self._start_over(why, st)
            pos = self.pos
        with contextlib.nullcontext(self._held) as fh:  # held open by `_stat_log` (read on if it is removed)
            assert fh is not None
            k = min(len(pos.tail), pos.offset)
            fh.seek(pos.offset - k)
            chunk = fh.read(k + MAX_READ_BYTES)
            # The bytes before the offset must be the text read there: else the log was rewritten (same inode,
            # as long or longer) and reading on from the offset would start inside other text.
            why = log_offsets.moved_on(pos, st, chunk[:k]) if k else None
            if why:
                self._start_over(why, st)
                fh.seek(0)
                chunk = fh.read(MAX_READ_BYTES)
            else:
                chunk = chunk[k:]
        pos = self.pos
        pos.inode = st.st_ino
        if not chunk:
            self._save_offset()
            return 0
        # Up to the last newline or carriage return: a progress bar redraws with `\r` and may print `\n` once an
        # epoch, so each redraw is read (and its record timed) when it is written, not at the epoch's end.
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if end >= 0 and chunk[end:end + 1] == b"\r" and _DRAWN_BAR.search(chunk[end + 1:]):
            # The newest redraw ends when the next one starts: a bar drawn whole (tqdm's `N/M [...]`, one
            # write) is read now, so that a job that hangs after it is reported at its step, not the one before.
            end = len(chunk) - 1
        if self.job_ended and end < len(chunk) - 1 and len(chunk) < MAX_READ_BYTES \
                and len(chunk) - end - 1 <= MAX_LINE_BYTES:
            end = len(chunk) - 1  # the job is gone and this is the log's end: its unterminated tail is a line
        if end < 0:
            if len(chunk) >= MAX_LINE_BYTES:  # no newline in a huge chunk: skip it, do not stall
                pos.offset += len(chunk)
                pos.tail = log_offsets.tail_after(pos.tail, chunk)
                self.skipped_long_lines += 1
                self._save_offset()
            return 0
        pieces = _PIECE.findall(chunk[:end + 1])  # each with its terminator: the offset counts the file's bytes
        if chunk[end:end + 1] not in (b"\n", b"\r"):
            # the drawn bar (or the ended job's last words) after the last `\r` or `\n`
            pieces.append(chunk[max(chunk.rfind(b"\r", 0, end), chunk.rfind(b"\n", 0, end)) + 1:end + 1])
        records = []
        consumed = 0
        t0 = SYSTEM.monotonic()
        for piece in pieces:
            consumed += len(piece)
            raw = piece.rstrip(b"\r\n")
            if len(raw) > MAX_LINE_BYTES:
                self.skipped_long_lines += 1
            elif raw:
                # U+2028/U+2029/NEL end lines too (a JSON logger that escapes nothing): each part is a line.
                for line in _UNICODE_BREAK.split(raw.decode("utf-8", errors="replace")):
                    if line:
                        records.extend(self.parser.feed(line, now=now))
            if SYSTEM.monotonic() - t0 > MAX_PARSE_S:
                break  # a backlog: the rest next tick (the tick's other work must not wait on a log)
        if records:
            with open(self.out_path, "a", encoding="utf-8") as out:
                out.write(("\n" if self._torn_tail else "") + "".join(encode_record(r) + "\n" for r in records))
                out.flush()
            self._torn_tail = False
        pos.offset += consumed
        pos.tail = log_offsets.tail_after(pos.tail, chunk[:consumed])
        self._save_offset()
        return len(records)


class FileSource(LogSource):
    """Records from the framework's own files (trainer_state.json, TensorBoard events) instead of the log."""

    reads_log = False

    def __init__(self, run_dir: Path, attempt: int, config_version: int | None, kind: str, files: Path):
        super().__init__(run_dir, attempt, config_version)
        self.kind = kind
        self.files = Path(files)
        self.after_step = self.parser._last_step
        self.problem: str | None = None
        from ulyssesd.daemon.telemetry.framework_files import TensorBoardReader

        self._tb = TensorBoardReader(self.files) if kind == "tensorboard" else None

    def pump(self, now: float) -> int:
        from ulyssesd.daemon.telemetry.framework_files import newest_trainer_state, trainer_state_records

        if self._tb is not None:
            found = self._tb.read(self.after_step)
        else:
            path = newest_trainer_state(self.files)
            found, self.problem = trainer_state_records(path, self.after_step) if path else ([], None)
        if not found or not self._output_usable(now):
            return 0
        records = []
        for rec in found:
            out = {"v": 1, "kind": "step", "time": now, "attempt": self.attempt, **rec}
            if self.parser.config_version is not None:
                out["config_version"] = self.parser.config_version
            records.append(out)
        with open(self.out_path, "a", encoding="utf-8") as fh:
            fh.write(("\n" if self._torn_tail else "") + "".join(encode_record(r) + "\n" for r in records))
        self._torn_tail = False
        self.after_step = records[-1]["step"]
        self.parser.stats.step_records += len(records)
        self.parser.stats.records += len(records)
        return len(records)


class SilenceWatch:
    """Whether the current attempt's derived telemetry has gone silent; says so once per silence."""

    def __init__(self, attempt: int, started: float, silent_after_s: float):
        self.attempt = attempt
        self.started = started
        self.silent_after_s = silent_after_s
        self.last_record: float | None = None
        self.reported = False
        self._last_write = 0.0
        self._last_verdict: bool | None = None
        self.read_problems: list[str] = []   # what the log reader could not do as asked (the last 5)

    def check(self, now: float, appended: int) -> bool:
        """True when the attempt is silent now (no step record for silent_after_s)."""
        if appended:
            self.last_record = now
        return now - (self.last_record if self.last_record is not None else self.started) > self.silent_after_s


def _write_health(run_dir: Path, data: dict[str, Any]) -> None:
    path = run_dir / HEALTH_NAME
    tmp = temp_path_for(path)
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the health file is a report: a failed write costs one update


def health_text(h: dict[str, Any]) -> str:
    """`ulyssesctl status`'s telemetry row: what the reading found; when silent, the fix."""
    bad = f", {h.get('bad_lines')} bad line(s)" if h.get("bad_lines") else ""
    jumps = f", {h.get('discontinuities')} counter reset(s)/jump(s)" if h.get("discontinuities") else ""
    text = f"{h.get('source')}: {h.get('step_records')} step records{bad}{jumps}"
    if h.get("silent"):
        text += f": no step record for over {h.get('silent_after_s')} s. Fix: {h.get('fix')}"
    problems = h.get("read_problems")
    if isinstance(problems, list) and problems:
        text += f"; {problems[-1]}" + (f" (and {len(problems) - 1} earlier)" if len(problems) > 1 else "")
    return text


def read_health(run_dir: str | Path | None) -> dict[str, Any] | None:
    """The health file of a run's derived telemetry (None when there is none or it is unreadable)."""
    if not run_dir:
        return None
    try:
        data = json.loads((Path(run_dir) / HEALTH_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def pump(sup: Any) -> None:
    """The supervisor's hook: keep a source for the current attempt and pump it (no-op for other jobs), then
    watch for silence."""
    if not stdout_source(sup.config) or not sup.attempt:
        return
    kind = source_kind(sup.config)
    tel = _telemetry(sup.config)
    src = getattr(sup, "_log_source", None)
    now = sup.os.time()
    if src is None or src.attempt != sup.attempt or src.run_dir != sup.run_dir:
        if kind == "stdout":
            src = LogSource(sup.run_dir, sup.attempt, sup.config_version, pattern=tel.get("pattern"),
                            total_steps=_declared_total(sup.config),
                            resume_step=getattr(sup, "attempt_resume_step", None))
        else:
            src = FileSource(sup.run_dir, sup.attempt, sup.config_version, kind, Path(str(tel.get("files") or ".")))
        sup._log_source = src
        silent_after = tel.get("silent_after_s")
        sup._telemetry_watch = SilenceWatch(sup.attempt, now, float(silent_after) if isinstance(
            silent_after, int | float) and not isinstance(silent_after, bool) else DEFAULT_SILENT_AFTER_S)
    stats = src.parser.stats
    bad_before, disc_before = stats.bad_lines, stats.discontinuities
    appended = src.pump(now)
    watch: SilenceWatch = sup._telemetry_watch
    problems = _say_read_problems(sup, src, watch, kind)
    silent = (watch.check(now, appended) if getattr(sup, "job", True) is not None  # ended: keeps its verdict (SILENT)
              else bool(watch._last_verdict and not appended))
    if stats.bad_lines > bad_before and (bad_before < 5 or stats.bad_lines // 100 > bad_before // 100):
        log.warning("telemetry step line out of the run's progress dropped", run_id=getattr(sup, "run_id", None),
                    attempt=sup.attempt, bad_lines=stats.bad_lines, examples=stats.bad_samples[:3])
    if stats.discontinuities > disc_before:
        log.info("step counter discontinuity recorded", run_id=getattr(sup, "run_id", None), attempt=sup.attempt,
                 discontinuities=stats.discontinuities, last_step=src.parser._last_step)
    sample = stats.unparsed_sample
    if silent and not watch.reported:
        watch.reported = True
        since = watch.last_record if watch.last_record is not None else watch.started
        fix = fix_hint(kind, sample)
        what = (f"no step record from the job's {'output' if kind == 'stdout' else kind} for {now - since:.0f} s "
                f"(attempt {sup.attempt}, {stats.step_records} step records so far): loss, NaN, spike, slow-step "
                f"and progress-based hang detection are blind")
        example = sample or NO_PROGRESS_LINE_YET
        log.warning("telemetry silent", run_id=getattr(sup, "run_id", None), attempt=sup.attempt, source=kind,
                    silent_s=round(now - since), step_records=stats.step_records, fix=fix, example_line=example)
        if hasattr(sup, "say"):
            sup.say(f"TELEMETRY SILENT: {what}. Fix: {fix}")
        if hasattr(sup, "alert"):
            sup.alert("telemetry", f"{what}. Fix: {fix}", source=kind, example_line=example,
                      step_records=stats.step_records)
    elif not silent and watch.reported:
        watch.reported = False
        log.info("telemetry readable again", run_id=getattr(sup, "run_id", None), attempt=sup.attempt,
                 step_records=stats.step_records)
    if silent != watch._last_verdict or appended or problems or now - watch._last_write >= HEALTH_WRITE_EVERY_S:
        watch._last_verdict, watch._last_write = silent, now
        _write_health(sup.run_dir, {
            "attempt": sup.attempt, "source": kind, "checked_at": now, "started_at": watch.started,
            "last_record_at": watch.last_record, "silent": silent, "silent_after_s": watch.silent_after_s,
            "lines": stats.lines, "step_records": stats.step_records, "bad_lines": stats.bad_lines,
            "bad_samples": stats.bad_samples, "discontinuities": stats.discontinuities,
            "unparsed_sample": sample, "problem": getattr(src, "problem", None),
            "read_problems": watch.read_problems,
            "fix": fix_hint(kind, sample) if silent else None})


def _say_read_problems(sup: Any, src: LogSource, watch: SilenceWatch, kind: str) -> int:
    """Say what the log reader could not do as asked (resume where it stopped, read the log): the journal, the
    daemon's log, a `telemetry` webhook and the health file (status). Returns how many there were."""
    notices, src.notices = src.notices, []
    for text in notices:
        log.warning("telemetry log reading", run_id=getattr(sup, "run_id", None), attempt=sup.attempt, problem=text)
        if hasattr(sup, "say"):
            sup.say(f"TELEMETRY: {text}")
        if hasattr(sup, "alert"):
            sup.alert("telemetry", text, source=kind)
        watch.read_problems = [*watch.read_problems, text][-5:]
    return len(notices)


def telemetry_file_of(run_dir: str | Path, spec: dict[str, Any] | None) -> Path:
    """The telemetry file the daemon reads for a run (as the supervisor's `telemetry_path`): the derived file
    for a derived source, `[telemetry] path`, else `{run_dir}/telemetry.jsonl`. For readers with only the
    stored spec (`ulyssesctl status` with the daemon down)."""
    spec = spec or {}
    if stdout_source(spec):
        return Path(run_dir) / STDOUT_TELEMETRY_NAME
    path = _telemetry(spec).get("path")
    return Path(path) if isinstance(path, str) and path else Path(run_dir) / "telemetry.jsonl"
