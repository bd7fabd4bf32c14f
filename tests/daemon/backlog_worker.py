"""A daemon process ingesting a telemetry backlog, for test_telemetry_backlog.py (run as a script).

    backlog_worker.py SPEC first|again STOP_AFTER_BATCHES

`first`: starts the run on the tests' fake OS (no real job), appends the backlog the parent wrote beside the
spec to its telemetry file, and ticks; after STOP_AFTER_BATCHES stored cursors, its next incident insert
prints "MID-BATCH" and waits to be SIGKILLed (the batch half acted upon, its cursor not yet stored).
`again`: a fresh daemon adopting that run (the fake job still alive) ticks until the file is read to its
end, then prints "DONE".
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_daemon_unit_fakeos import FakeOS  # noqa: E402

from ulyssesd.daemon.spec import load_run_spec  # noqa: E402
from ulyssesd.daemon.store import open_store  # noqa: E402
from ulyssesd.daemon.supervisor import Supervisor  # noqa: E402
from ulyssesd.daemon.telemetry.engine_snapshot import SnapshotPolicy  # noqa: E402


def main(spec_path: str, mode: str, stop_after: int) -> None:
    spec = load_run_spec(Path(spec_path))
    fos = FakeOS()
    if mode == "again":  # the job the first daemon launched (pid 1000) is still running
        fos.jobs[1000] = {"alive": True, "status": None, "ranks": [1001, 1002], "log": Path(spec_path).parent / "log"}
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), fos)
    sup.start()
    if mode == "first":
        backlog = Path(spec_path).with_name("backlog.jsonl").read_bytes()
        with sup.telemetry_path.open("ab") as fh:
            fh.write(backlog)
        assert sup.reader is not None
        sup.reader.max_batch_bytes = 8192  # many batches: the kill lands inside one of them
        sup.snapshots.policy = SnapshotPolicy(every_records=100)  # engine snapshots before the kill, too
        stored = [0]
        store_cursor, record = sup.store.set_telemetry_cursor, sup.store.record_incident

        def counted_cursor(*a, **kw):
            stored[0] += 1
            return store_cursor(*a, **kw)

        def record_or_hang(*a, **kw):
            iid = record(*a, **kw)
            if stored[0] >= stop_after:
                print("MID-BATCH", kw.get("step"), flush=True)
                time.sleep(600)  # the parent's SIGKILL ends this
            return iid

        sup.store.set_telemetry_cursor = counted_cursor  # type: ignore[method-assign]
        sup.store.record_incident = record_or_hang  # type: ignore[method-assign]
    size = sup.telemetry_path.stat().st_size
    for _ in range(10_000):
        sup.tick()
        if sup.reader is not None and sup.reader.cursor.offset >= size:
            break
    print("DONE", sup.reader.cursor.offset if sup.reader else None, size, sup.last_step, sup.state.value,
          sup.snapshots.restored_from, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
