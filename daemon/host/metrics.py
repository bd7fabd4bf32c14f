"""Prometheus metrics of the supervised run, served on `daemon.prometheus_address:daemon.prometheus_port`.

Off unless the spec sets `daemon.prometheus_port`; the address defaults to 127.0.0.1 (loopback: the
endpoint has no authentication; bind 0.0.0.0 only on a trusted network or behind a proxy). The main loop
calls `Metrics.update(...)` with whatever it knows each tick (None = unchanged) and the HTTP server's
threads only read a snapshot under a lock. The server is `metrics_server.MetricsServer`: a fixed pool of
threads, a cap on open connections and a per-request timeout (not prometheus_client's thread per connection). Own registry per instance: no process-wide globals.

Names follow Prometheus conventions: base units (bytes, seconds), counters end in `_total` (they count
from the run's store, so they survive daemon restarts), `_timestamp_seconds` are Unix times. METRIC_NAMES
lists every exposed family; docs/grafana/ulyssesd.json uses only these (a test checks).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from ulyssesd.daemon.clock import SYSTEM
from ulyssesd.daemon.host.logging import get_logger
from ulyssesd.daemon.host.metrics_server import MetricsServer

if TYPE_CHECKING:
    from ulyssesd.daemon.store.records import RelaunchCounts

GIB = 1024 ** 3

#: family name (as scraped, counters with their `_total`) -> (type, help). The exposition contract.
METRICS: dict[str, tuple[str, str]] = {
    "ulyssesd_run_info": ("info", "The supervised run (label run_id)."),
    "ulyssesd_state": ("gauge", "1 for the supervisor's current state (label state), 0 for states seen before."),
    "ulyssesd_step": ("gauge", "Last training step seen in telemetry."),
    "ulyssesd_last_step_timestamp_seconds": ("gauge", "Unix time of the last step record (its own time)."),
    "ulyssesd_loss": ("gauge", "Loss of the last step (NaN if non-finite)."),
    "ulyssesd_tokens_per_second": ("gauge", "Training throughput of the last step (tokens over the slowest rank)."),
    "ulyssesd_rank_step_duration_seconds": ("gauge", "Step time of the last step by rank (label rank): rank 0 and, "
                                                      "with per-rank telemetry, the slowest rank."),
    "ulyssesd_memory_allocated_bytes": ("gauge", "Allocated accelerator memory on rank 0 at the last step."),
    "ulyssesd_memory_max_allocated_bytes": ("gauge", "Peak allocated accelerator memory over ranks, last step."),
    "ulyssesd_config_version": ("gauge", "Active config version."),
    "ulyssesd_restarts_total": ("counter", "Relaunches the daemon decided on in this run (crash, hang, remediation, "
                                           "requeue): `ulyssesctl status`'s restarts."),
    "ulyssesd_operator_relaunches_total": ("counter", "Relaunches an operator command led to in this run (pause + "
                                                      "resume, restart): not failures."),
    "ulyssesd_incidents_total": ("counter", "Incidents recorded in this run, by symptom (label symptom)."),
    "ulyssesd_actions_total": ("counter", "Remediation actions recorded by this daemon, by kind (label kind)."),
    "ulyssesd_last_update_timestamp_seconds": ("gauge", "Unix time the main loop last updated these metrics."),
}
METRIC_NAMES = frozenset(METRICS)


def _num(value: Any) -> float:
    return float(value)  # also takes telemetry's "nan"/"inf" strings


class _Snapshot:
    """What the loop last published; collect() turns it into metric families."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, float] = {}
        self.run_id: str | None = None
        self.states: dict[str, float] = {}
        self.rank_step_s: dict[str, float] = {}
        self.incidents: dict[str, float] = {}
        self.actions: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            values, states, ranks = dict(self.values), dict(self.states), dict(self.rank_step_s)
            incidents, actions, run_id = dict(self.incidents), dict(self.actions), self.run_id
        if run_id is not None:
            info = InfoMetricFamily("ulyssesd_run", METRICS["ulyssesd_run_info"][1])
            info.add_metric([], {"run_id": run_id})
            yield info
        labelled = {"ulyssesd_state": ("state", states), "ulyssesd_rank_step_duration_seconds": ("rank", ranks)}
        counters = {"ulyssesd_incidents_total": ("symptom", incidents), "ulyssesd_actions_total": ("kind", actions)}
        for name, (kind, doc) in METRICS.items():
            if name in labelled:
                label, series = labelled[name]
                gauge = GaugeMetricFamily(name, doc, labels=[label])
                for key, v in sorted(series.items()):
                    gauge.add_metric([key], v)
                yield gauge
            elif name in counters:
                label, series = counters[name]
                counter = CounterMetricFamily(name.removesuffix("_total"), doc, labels=[label])
                for key, v in sorted(series.items()):
                    counter.add_metric([key], v)
                yield counter
            elif kind == "counter" and name in values:
                yield CounterMetricFamily(name.removesuffix("_total"), doc, value=values[name])
            elif kind == "gauge" and name in values:
                yield GaugeMetricFamily(name, doc, value=values[name])


class Metrics:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host
        self.enabled = False
        self._server: MetricsServer | None = None
        self._snap = _Snapshot()
        self._relaunches_at_attempt: int | None = None  # the attempt the relaunch counters were read at
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._snap)  # type: ignore[arg-type]  # any object with collect()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> bool:
        """Listen on host:port if enabled; False (logged, never raised) if the port cannot be bound."""
        if self.port is None or self._server is not None:
            return self._server is not None
        try:
            self._server = MetricsServer(self.host, self.port, lambda: generate_latest(self.registry))
        except OSError as exc:
            get_logger("ulyssesd.metrics").error("cannot serve Prometheus metrics; continuing without",
                                                 address=self.address, error=str(exc))
            return False
        self.enabled = True
        get_logger("ulyssesd.metrics").info("serving Prometheus metrics", url=f"http://{self.address}/metrics")
        return True

    def update(self, *, run_id: str | None = None, step: int | None = None, step_time: float | None = None,
               loss: float | None = None, tokens_per_s: float | None = None,
               step_time_s: float | None = None, step_time_max_s: float | None = None,
               slowest_rank: int | None = None,
               mem_allocated_gib: float | None = None, mem_max_allocated_gib: float | None = None,
               state: str | None = None, attempt: int | None = None,
               relaunch_counts: Callable[[], RelaunchCounts] | None = None,
               incidents_by_symptom: Mapping[str, int] | None = None,
               actions_by_kind: Mapping[str, int] | None = None,
               config_version: int | None = None, now: float | None = None) -> None:
        """Set what is known; None leaves a value unchanged. Memory comes in GiB (telemetry's unit) and is
        exposed in bytes. `relaunch_counts` (the store's `relaunch_counts(run_id)`, the same rule as
        `ulyssesctl status`) is called only when `attempt` differs from the last call's: a relaunch is a new
        attempt, so the store is not queried every tick. Cheap no-op when disabled."""
        if not self.enabled:
            return

        relaunches = self._read_relaunches(attempt, relaunch_counts)

        snap = self._snap
        with snap.lock:
            if run_id is not None:
                snap.run_id = run_id
            for name, value, scale in (
                    ("ulyssesd_step", step, 1), ("ulyssesd_last_step_timestamp_seconds", step_time, 1),
                    ("ulyssesd_loss", loss, 1), ("ulyssesd_tokens_per_second", tokens_per_s, 1),
                    ("ulyssesd_memory_allocated_bytes", mem_allocated_gib, GIB),
                    ("ulyssesd_memory_max_allocated_bytes", mem_max_allocated_gib, GIB),
                    ("ulyssesd_restarts_total", relaunches.restarts if relaunches else None, 1),
                    ("ulyssesd_operator_relaunches_total", relaunches.operator_relaunches if relaunches else None, 1),
                    ("ulyssesd_config_version", config_version, 1)):
                if value is not None:
                    v = _num(value)
                    snap.values[name] = v * scale if math.isfinite(v) else v
            if step_time_s is not None or step_time_max_s is not None:
                ranks = {}
                if step_time_s is not None:
                    ranks["0"] = _num(step_time_s)
                if step_time_max_s is not None and slowest_rank is not None:
                    ranks[str(slowest_rank)] = _num(step_time_max_s)
                snap.rank_step_s = ranks  # the slowest rank changes: only this step's ranks are current
            if state is not None:
                snap.states = {s: 0.0 for s in snap.states}
                snap.states[state] = 1.0
            # Kinds that disappear (a new run) stay at their last count rather than vanish: counters never
            # go back, and rate() over them stays sane.
            if incidents_by_symptom is not None:
                snap.incidents.update({k: float(v) for k, v in incidents_by_symptom.items()})
            if actions_by_kind is not None:
                snap.actions.update({k: float(v) for k, v in actions_by_kind.items()})
            snap.values["ulyssesd_last_update_timestamp_seconds"] = SYSTEM.time() if now is None else now

    def _read_relaunches(self, attempt: int | None,
                         relaunch_counts: Callable[[], RelaunchCounts] | None) -> RelaunchCounts | None:
        """The store's counts when the attempt changed, else None (unchanged). A store error is logged and
        retried at the next tick (the counters keep their last values): metrics never break the loop."""
        if relaunch_counts is None or attempt is None or attempt == self._relaunches_at_attempt:
            return None
        try:
            counts = relaunch_counts()
        except Exception as exc:  # noqa: BLE001 - any store failure: keep the last values, try again next tick
            get_logger("ulyssesd.metrics").warning("cannot read the relaunch counts; metrics keep the last values",
                                                   error=str(exc))
            return None
        self._relaunches_at_attempt = attempt
        return counts

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.enabled = False
