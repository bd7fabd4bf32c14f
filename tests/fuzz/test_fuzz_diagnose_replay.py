"""Fuzz: `ulyssesctl diagnose` and `ulyssesctl replay` on hostile files. Logs are real fixture log lines
shuffled, cut, bit-flipped and mixed with random bytes, written to a file, read back through the bounded
tail reader and classified; telemetry files mix the fuzzed telemetry lines (deep nesting, huge ints,
binary) and go through the replay command's reader and the engine. Neither raises: diagnose returns one
label from the fixed set, replay counts every bad line and exits 0."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from fuzz_helpers import MIN_CASES, fuzz_settings, variants
from fuzz_strategies import telemetry_lines
from hypothesis import given
from hypothesis import strategies as st

from ulyssesd.daemon.operator.ctl_diagnose import LogReadError, read_log_tail
from ulyssesd.daemon.operator.ctl_offline import run_replay
from ulyssesd.remediation.diagnosis import LABELS, diagnose
from ulyssesd.remediation.records import RecordError, parse_line

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
LOG_LINES = sorted({line for p in FIXTURES.rglob("*.log") for line in p.read_bytes().splitlines() if line.strip()})
SIGNALS = st.one_of(st.none(), st.integers(-70, 300), st.sampled_from([-9, -15, 137, 143, 2**31, -(2**31)]))


def test_diagnose_reads_a_bounded_tail_and_returns_a_known_label(fuzz_dir):
    path = fuzz_dir / "job.log"
    cases = [0]

    @fuzz_settings(cases_per_example=6)
    @given(picks=st.lists(st.integers(0, len(LOG_LINES) - 1), max_size=40), noise=st.binary(max_size=64),
           exit_code=SIGNALS, signal=SIGNALS)
    def run(picks, noise, exit_code, signal):
        text = b"\n".join(LOG_LINES[i] for i in picks) + noise
        for data in variants(text):
            path.write_bytes(data)
            d = diagnose(read_log_tail(path, max_bytes=4096), exit_code=exit_code, signal=signal)
            assert d.label in LABELS and isinstance(d.reason, str) and isinstance(d.evidence, list)
            json.dumps(d.to_dict())  # what --json prints
            cases[0] += 1

    run()
    assert cases[0] >= MIN_CASES


def test_diagnose_refuses_what_is_not_a_regular_file_without_blocking(fuzz_dir):
    fifo = fuzz_dir / "fifo.log"
    os.mkfifo(fifo)  # nobody ever writes: opening it for reading the ordinary way blocks forever
    for path, what in ((fifo, "a FIFO"), (fuzz_dir, "a directory"), (Path("/dev/zero"), "a character device")):
        try:
            read_log_tail(path)
        except LogReadError as exc:
            assert what in str(exc) and str(path) in str(exc)
        else:
            raise AssertionError(f"{path} was read")
    big = fuzz_dir / "big.log"
    with open(big, "wb") as fh:  # sparse 8 GiB file: only the tail is read
        fh.truncate(8 << 30)
        fh.seek((8 << 30) - 6)
        fh.write(b"\nboom\n")
    assert read_log_tail(big, max_bytes=4096).endswith("\nboom\n")


def test_replay_counts_every_bad_line_and_never_raises(fuzz_dir):
    path = fuzz_dir / "telemetry.jsonl"
    cases = [0]

    @fuzz_settings(cases_per_example=6)
    @given(drawn=st.lists(telemetry_lines(), min_size=1, max_size=4), clean_steps=st.integers(1, 30),
           as_log=st.booleans())
    def run(drawn, clean_steps, as_log):
        # A first line that is a telemetry record makes it a telemetry file; else replay reads it as a raw job
        # log (only the lines it recognises count there, nothing is "bad").
        good = [json.dumps({"kind": "step", "step": s, "loss": 2.0, "step_time_s": 0.5}).encode()
                for s in range(clean_steps)]
        fuzzed = [v for line in drawn for v in variants(line, n_cuts=1, n_flips=1)]
        lines = [b"[rank0] starting the job", *fuzzed, *good] if as_log else [*good, *fuzzed]
        path.write_bytes(b"\n".join(lines) + b"\n")
        out, err = io.StringIO(), io.StringIO()
        assert run_replay(path, as_json=True, out=out, err=err) == 0
        reported = json.loads(out.getvalue())["bad_lines"]
        if not as_log:
            expected_bad = 0
            # the file's own lines: a flipped byte can itself be a newline and split a fuzzed line in two
            for line in b"\n".join(fuzzed).split(b"\n"):
                try:
                    parse_line(line) if line.strip() else None
                except RecordError:
                    expected_bad += 1
            assert len(reported) == expected_bad
        cases[0] += len(fuzzed)

    run()
    assert cases[0] >= MIN_CASES
