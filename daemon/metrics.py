"""Optional Prometheus metrics on 127.0.0.1:PORT (off by default: `daemon.prometheus_port` unset).

The main loop calls `Metrics.update(...)` with whatever it knows each tick (None = unchanged); the
prometheus_client HTTP server thread only reads. Disabled (`port=None`) means every call is a no-op and
no socket is opened. Own registry per instance: no process-wide globals, tests can run several.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Info, start_http_server

from ulyssesd.daemon.logging import get_logger

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


class Metrics:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host
        self.enabled = False
        self._server: WSGIServer | None = None
        self._states: set[str] = set()
        self._symptoms: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step = Gauge("ulyssesd_step", "Last training step seen in telemetry.", registry=r)
        self.loss = Gauge("ulyssesd_loss", "Loss of the last step (NaN if non-finite).", registry=r)
        self.tokens_per_s = Gauge("ulyssesd_tokens_per_second", "Training throughput of the last step.", registry=r)
        self.mem_allocated = Gauge("ulyssesd_memory_allocated_gib", "Allocated accelerator memory (rank 0).", registry=r)
        self.mem_max_allocated = Gauge("ulyssesd_memory_max_allocated_gib",
                                       "Max allocated accelerator memory over ranks.", registry=r)
        self.state = Gauge("ulyssesd_state", "1 for the supervisor's current state, 0 for states seen before.",
                           ["state"], registry=r)
        self.restarts = Gauge("ulyssesd_restarts", "Job restarts in this run.", registry=r)
        self.incidents = Gauge("ulyssesd_incidents", "Incidents in this run by symptom.", ["symptom"], registry=r)
        self.config_version = Gauge("ulyssesd_config_version", "Active config version.", registry=r)
        self.last_update = Gauge("ulyssesd_last_update_timestamp_seconds", "When the main loop last updated.",
                                 registry=r)
        self.run_info = Info("ulyssesd_run", "The supervised run.", registry=r)

    def start(self) -> bool:
        """Listen on host:port if enabled; False (logged, never raised) if the port cannot be bound."""
        if self.port is None or self._server is not None:
            return self._server is not None
        try:
            result = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            get_logger("ulyssesd.metrics").error("cannot serve Prometheus metrics; continuing without",
                                                 address=f"{self.host}:{self.port}", error=str(exc))
            return False
        self._server = result[0] if isinstance(result, tuple) else result
        self.enabled = True
        return True

    def update(self, *, run_id: str | None = None, step: int | None = None, loss: float | None = None,
               tokens_per_s: float | None = None, mem_allocated_gib: float | None = None,
               mem_max_allocated_gib: float | None = None, state: str | None = None,
               restarts: int | None = None, incidents_by_symptom: Mapping[str, int] | None = None,
               config_version: int | None = None, now: float | None = None) -> None:
        """Set what is known; None leaves a value unchanged. Cheap no-op when disabled."""
        if not self.enabled:
            return
        if run_id is not None:
            self.run_info.info({"run_id": run_id})
        for gauge, value in ((self.step, step), (self.loss, loss), (self.tokens_per_s, tokens_per_s),
                             (self.mem_allocated, mem_allocated_gib), (self.mem_max_allocated, mem_max_allocated_gib),
                             (self.restarts, restarts), (self.config_version, config_version)):
            if value is not None:
                gauge.set(float(value))  # also takes telemetry's "nan"/"inf" strings
        if state is not None:
            self._states.add(state)
            for s in self._states:
                self.state.labels(state=s).set(1 if s == state else 0)
        if incidents_by_symptom is not None:
            # Symptoms that disappeared (e.g. a new run) drop to 0 rather than vanish: rates stay sane.
            for symptom in self._symptoms | set(incidents_by_symptom):
                self.incidents.labels(symptom=symptom).set(incidents_by_symptom.get(symptom, 0))
            self._symptoms |= set(incidents_by_symptom)
        if now is not None:
            self.last_update.set(now)
        else:
            self.last_update.set_to_current_time()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.enabled = False

