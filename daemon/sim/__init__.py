"""Deterministic simulation of long runs (issue 32): the REAL supervisor, remediation engine and SQLite store,
driven by a simulated clock, job and host, with seeded faults and invariants checked after every event.

- `simos.py`: the OS seam (`OSInterface`) with a simulated clock and process table of simulated jobs.
- `job.py`: a simulated training job speaking the telemetry contract (docs/CONTRACTS.md): recorded loss and
  step-time curves, checkpoints as real files with manifests, signals, faults.
- `disk.py`: the checkpoint disk: a capacity, free space and a read-only flag, through the checkpoint package's
  seams (`ck.bytes_free`, `ck.filesystem_errno`).
- `faults.py`: the seeded fault process (published failure statistics plus the classes the daemon handles).
- `invariants.py`: what must hold after every event.
- `runner.py`: one seeded run, its event trace and replay; `cli.py`: `ulyssesd simulate`.

docs/SIMULATION.md says how to run it and what the invariants are.
"""
