"""An ended attempt's exit is judged only once its stdout was read to its end (safety/attempt_log.output_read):
tick after tick while reading progresses, never for ever (no progress, or EXIT_WAIT_MAX_S)."""

from __future__ import annotations

from types import SimpleNamespace

from ulyssesd.daemon.safety import attempt_log


class _Clock:
    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        return self.t


def _run(size: int):
    src = SimpleNamespace(attempt=1, offset=0, job_ended=False, exit_wait_since=None)
    return SimpleNamespace(attempt=1, _log_source=src), src, size


def test_the_exit_waits_while_the_output_is_read_and_is_judged_once_it_is(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(attempt_log, "SYSTEM", clock)
    sup, src, size = _run(100)

    def pump(run, budget_s):  # 30 bytes of the log a call (a loaded box), caught up at its end
        src.offset = min(size, src.offset + 30)
        clock.t += budget_s
        return src.offset >= size

    monkeypatch.setattr(attempt_log, "drain_pump", pump)
    answers = [attempt_log.output_read(sup) for _ in range(4)]
    assert answers == [False, False, False, True] and src.job_ended and src.offset == size


def test_no_progress_or_a_long_wait_judges_the_exit_with_what_was_read(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(attempt_log, "SYSTEM", clock)
    sup, src, _ = _run(10**12)
    monkeypatch.setattr(attempt_log, "drain_pump", lambda run, budget_s: False)  # a partial last line: stuck
    assert attempt_log.output_read(sup) is True

    def slow(run, budget_s):  # progress, but a log that never ends in time
        src.offset += 1
        clock.t += 60.0
        return False

    monkeypatch.setattr(attempt_log, "drain_pump", slow)
    waits = 0
    while not attempt_log.output_read(sup):
        waits += 1
        assert waits < 1000
    assert attempt_log.EXIT_WAIT_MAX_S / 60 - 2 <= waits <= attempt_log.EXIT_WAIT_MAX_S / 60 + 2
