"""`ulyssesctl replay TELEMETRY.jsonl|JOB.log [--spec run.toml] [--json]`: what the daemon would have found
and decided on a recorded run, step by step, without running anything. A raw job log is turned into
records by `ulyssesd.remediation.log_telemetry` (the `[telemetry] source = "stdout"` parsers).

`register(app)` adds the command to ulyssesctl's typer app. The only I/O of the replay path lives here:
the file is read line by line; garbage lines are reported with their line number and skipped.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer

from ulyssesd.daemon.operator.ctl_common import EXIT_NOTHING_PARSED
from ulyssesd.remediation.config import DetectorsConfig, RemediationConfig
from ulyssesd.remediation.detectors import Finding
from ulyssesd.remediation.log_telemetry import looks_like_telemetry
from ulyssesd.remediation.records import MAX_LINE_BYTES, Record, RecordError, parse_line, parse_record
from ulyssesd.remediation.replay import ReplayItem, replay


@dataclasses.dataclass
class BadLine:
    line: int
    error: str


def _first_line(path: Path) -> bytes:
    with path.open("rb") as fh:
        for line in fh:
            if not line.isspace():
                return line[:4096]
    return b""


def read_log_records(path: Path, bad: list[BadLine], parser: Any = None) -> Iterator[Record]:
    """Stream records from a job's raw log (DeepSpeed, Megatron, HF Trainer, `step=N loss=X` lines);
    lines that are no telemetry are ignored (a log is mostly other output), not reported as bad."""
    from ulyssesd.remediation.log_telemetry import LogTelemetryParser

    parser = parser or LogTelemetryParser()
    with path.open("r", encoding="utf-8", errors="replace", newline="\n") as fh:
        for no, line in enumerate(fh, 1):
            for rec in parser.feed(line):
                try:
                    yield parse_record(rec)
                except RecordError as exc:
                    bad.append(BadLine(no, str(exc)))


def read_records(path: Path, bad: list[BadLine], parser: Any = None) -> Iterator[Record]:
    """Stream records from a telemetry file, or from a raw job log when its first line is not a telemetry
    record (read by `parser`, a LogTelemetryParser, when given); each unparsable telemetry line is appended to
    `bad` and skipped."""
    if not looks_like_telemetry(_first_line(path)):
        yield from read_log_records(path, bad, parser)
        return
    with path.open("rb") as fh:  # bytes: no decode step (orjson takes bytes; bad UTF-8 is reported per line)
        # readline(limit), not `for line in fh`: a line longer than the bound is never held in memory whole.
        readline, limit, no = fh.readline, MAX_LINE_BYTES + 1, 0
        while line := readline(limit):
            no += 1
            if len(line) == limit and not line.endswith(b"\n"):
                size = len(line)
                while (rest := readline(limit)) and not rest.endswith(b"\n"):
                    size += len(rest)
                bad.append(BadLine(no, f"line is {size + len(rest)} bytes long; telemetry lines are at most "
                                       f"{MAX_LINE_BYTES}"))
                continue
            if line.isspace():  # blank lines are no records (an empty `line` ends the loop)
                continue
            try:
                yield parse_line(line)
            except RecordError as exc:
                bad.append(BadLine(no, str(exc)))


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def item_to_dict(it: ReplayItem) -> dict[str, Any]:
    body = dataclasses.asdict(it.item)
    return _jsonable({"type": it.kind, "step": it.step, "time": it.time, **body})


def load_configs(spec: Path | None) -> tuple[DetectorsConfig, RemediationConfig, Any]:
    if spec is None:
        return DetectorsConfig(), RemediationConfig(), None
    # Imported lazily: pulls in the job's spec models.
    from ulyssesd.daemon.spec import engine_job_values, load_run_spec

    rs = load_run_spec(spec)
    return rs.detectors, rs.remediation, engine_job_values(rs.job.model_dump(mode="json"), rs.launcher.env)


def load_reach(spec: Path | None) -> Any:
    """What of remediation's changes reach the spec's job (remediation/job.py `JobReach`), as the daemon's
    engine has it: a command job's replay recommends only the rungs that job can take (no spec: the built-in
    job, every rung)."""
    from ulyssesd.remediation.job import BUILTIN

    if spec is None:
        return BUILTIN
    from ulyssesd.daemon.job.command import job_reach
    from ulyssesd.daemon.spec import load_run_spec

    rs = load_run_spec(spec)
    return job_reach(rs.job_section, rs.job.model_dump(mode="json"))


def run_replay(telemetry: Path, spec: Path | None = None, as_json: bool = False,
               out: Any = None, err: Any = None) -> int:
    """The command's body (callable from tests): returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    if not telemetry.is_file():
        print(f"error: telemetry file {telemetry} does not exist", file=err)
        return 2
    try:
        det, pol, job = load_configs(spec)
        reach = load_reach(spec)
    except Exception as exc:  # noqa: BLE001 - SpecError or a pydantic error: show it, exit 2
        print(f"error: cannot load run spec {spec}: {exc}", file=err)
        return 2
    bad: list[BadLine] = []
    from ulyssesd.remediation.log_telemetry import LogTelemetryParser
    from ulyssesd.remediation.replay import CountingRecords

    raw_log = not looks_like_telemetry(_first_line(telemetry))
    parser = LogTelemetryParser(pattern=_spec_pattern(spec)) if raw_log else None
    counted = CountingRecords(with_checkpoint_files(read_records(telemetry, bad, parser),
                                                    spec_checkpoints(spec, telemetry.parent)))
    from ulyssesd.remediation.engine import RemediationEngine

    items = replay(counted, engine=RemediationEngine(det, pol, job, reach=reach))
    if as_json:
        collected = [item_to_dict(it) for it in items]
        from ulyssesd.daemon.operator.ctl_common import json_text  # strict JSON: a NaN loss as "NaN"

        out.write(json_text({"telemetry": str(telemetry), "items": collected,
                             "bad_lines": [dataclasses.asdict(b) for b in bad],
                             "parsed": {"step_records": counted.steps, "events": counted.events,
                                   "untimed_step_records": counted.untimed, "not_judged": counted.untimed_note(),
                                        "summary": counted.summary(str(telemetry), parser.stats if parser else None)}},
                            indent=1))
        out.write("\n")
    else:
        _print_table(items, out, judged=lambda: counted.steps > 0)
    for b in bad:
        print(f"warning: {telemetry}:{b.line}: skipped: {b.error}", file=err)
    if as_json and counted.untimed and counted.steps:
        print("warning: " + counted.untimed_note(), file=err)   # unknown is loud, also beside --json
    if not as_json or counted.steps == 0:
        print(("error: " if counted.steps == 0 else "") + counted.summary(str(telemetry), parser.stats if parser else None),
              file=err)
    # Unknown is loud: nothing parsed is not "no findings" (a script or CI check reads 0 as a clean run).
    return 0 if counted.steps > 0 else EXIT_NOTHING_PARSED


def spec_checkpoints(spec: Path | None, run_dir: Path) -> list[tuple[int, str]]:
    """(step, name) of the complete checkpoints a command job's checkpoint dir holds now (the daemon learns a
    command job's saves from its files, not its log: replay looks at the same files). Set-aside copies are not
    rollback targets. Empty without a spec, for the built-in job (its saves are telemetry events) or no dir."""
    if spec is None:
        return []
    from ulyssesd.daemon.job.checkpoint_files import is_set_aside, look
    from ulyssesd.daemon.job.command import watch_config
    from ulyssesd.daemon.spec import load_run_spec

    job = load_run_spec(spec).job_section
    if job.kind != "command":
        return []
    cfg = watch_config(job, run_dir)
    if not cfg.root.is_dir():
        return []
    found, _ = look(cfg.root, cfg.pattern, cfg.requires)
    return sorted((f.step, f.name) for f in found if f.marker_ok and not is_set_aside(f.name))


def with_checkpoint_files(records: Iterator[Record], saves: list[tuple[int, str]]) -> Iterator[Record]:
    """`records` with a `checkpoint_saved` event for each of `saves` once the stream reaches its step, unless the
    stream reports that checkpoint itself."""
    from ulyssesd.remediation.records import EventRecord, StepRecord

    reported: set[str] = set()
    i = 0
    for rec in records:
        if isinstance(rec, EventRecord) and rec.event == "checkpoint_saved":
            reported.add(str(rec.fields.get("tag")))
        yield rec
        while isinstance(rec, StepRecord) and i < len(saves) and saves[i][0] <= rec.step:
            step, name = saves[i]
            i += 1
            if name not in reported:
                yield EventRecord("checkpoint_saved", step=step, time=rec.time, attempt=rec.attempt,
                                  fields={"tag": name, "source": "files"})


def _spec_pattern(spec: Path | None) -> str | None:
    """The spec's `[telemetry] pattern` (a raw log is read as the daemon would read it)."""
    if spec is None:
        return None
    from ulyssesd.daemon.spec import load_run_spec

    return load_run_spec(spec).job.telemetry.pattern


def _print_table(items: Iterator[ReplayItem], out: Any, judged: Callable[[], bool] = lambda: True) -> None:
    from rich.console import Console
    from rich.markup import escape  # messages quote logs and patches: `[patch: …]` was eaten as a style tag
    from rich.table import Table

    table = Table(title="replay: findings and decisions", show_lines=False)
    for col in ("step", "type", "symptom", "action", "apply", "detail"):
        table.add_column(col, overflow="fold")
    n = 0
    for it in items:
        n += 1
        o = it.item
        if isinstance(o, Finding):
            table.add_row(str(it.step), "finding", o.symptom, "", o.severity, escape(o.message))
        else:
            apply = o.apply if o.would_apply is None else f"none (would: {o.would_apply})"
            detail = o.reason + (f" [patch: {o.diff()}]" if o.config_patch else "")
            table.add_row(str(it.step), "decision", o.symptom, o.action_kind, apply, escape(detail))
    console = Console(file=out, width=200 if not getattr(out, "isatty", lambda: False)() else None)
    if n:
        console.print(table)
    elif judged():
        console.print("replay: no findings, no decisions")
    else:
        console.print("replay: nothing judged: no step records were parsed (see the error below)")


def register(app: typer.Typer) -> None:
    """Add `replay` to ulyssesctl."""

    @app.command("replay")
    def replay_cmd(
        telemetry: Path = typer.Argument(..., metavar="TELEMETRY", help="telemetry.jsonl of a run (docs/CONTRACTS.md), or a job's raw log "
                                         "(DeepSpeed, Megatron, HF Trainer lines: detected from its first line)."),
        spec: Path | None = typer.Option(None, "--spec", help="Run spec TOML: its [detectors], [remediation] and job values."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Replay a recorded run. The findings and decisions the daemon would have taken, step by step."""
        raise typer.Exit(run_replay(telemetry, spec, as_json))
