"""The HTTP surface: liveness, startup, readiness, JSON status and Prometheus metrics.

The asyncio loop publishes a fresh status dict after every event; the server threads only
read the latest one, so a slow scrape never holds up a decision.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.http import reply, reply_json

from .memory import memory_metrics

log = logging.getLogger("vlaunch.launcher")

PROBES = {
    "/livez": "started_ok",     # liveness: the launcher runs and is not failing
    "/startupz": "caches_ready",  # startup: every cache rank has loaded its shard
    "/readyz": "engine_ready",  # readiness: the engine is ready and not restarting
}


class MetricsCollector:
    """Turns the latest status into Prometheus gauges at scrape time."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.status()
        for name, key, doc in (("vlaunch_up", "started_ok", "Launcher alive and not failing."),
                               ("vlaunch_caches_ready", "caches_ready", "Every cache ready."),
                               ("vlaunch_engine_ready", "engine_ready", "Engine ready.")):
            yield GaugeMetricFamily(name, doc, value=float(bool(s.get(key))))
        ranks = s.get("ranks", {})
        up = GaugeMetricFamily("vlaunch_rank_ready", "Cache rank ready.", labels=["rank", "role"])
        held = GaugeMetricFamily("vlaunch_rank_bytes", "Bytes held by a cache rank.",
                                 labels=["rank", "role", "device"])
        leases = GaugeMetricFamily("vlaunch_rank_leases", "Clients holding a lease.",
                                   labels=["rank", "role"])
        loaded = GaugeMetricFamily("vlaunch_rank_loaded_bytes", "Bytes a cache rank has loaded "
                                   "of its shard (equal to the total once ready).",
                                   labels=["rank", "role"])
        total = GaugeMetricFamily("vlaunch_rank_total_bytes", "Bytes of a cache rank's shard "
                                  "(0 until its load begins).", labels=["rank", "role"])
        copies = GaugeMetricFamily("vlaunch_rank_copy_bytes", "Device bytes a GPU cache rank "
                                   "holds for copies it is making for copy-mode engines.",
                                   labels=["rank", "role"])
        changed = GaugeMetricFamily("vlaunch_checkpoint_changed", "A checkpoint file changed "
                                    "on disk since the cache rank read it.",
                                    labels=["rank", "role"])
        for rank, r in ranks.items():
            # a draft rank is named in its own group (rank 0 of the draft group), like its socket
            who = [str(r.get("group_rank", rank)), str(r.get("role", "target"))]
            up.add_metric(who, float(r.get("state") == "ready"))
            held.add_metric([*who, str(r.get("device", ""))], float(r.get("bytes", 0)))
            leases.add_metric(who, float(len(r.get("leases", []))))
            loaded.add_metric(who, float(r.get("loaded_bytes", 0)))
            total.add_metric(who, float(r.get("total_bytes", 0)))
            changed.add_metric(who, float(bool((r.get("checkpoint") or {}).get("changed"))))
            copies.add_metric(who, float((r.get("copies") or {}).get("bytes", 0)))
        yield from (up, held, leases, copies, changed, loaded, total)
        yield GaugeMetricFamily("vlaunch_loaded_bytes", "Bytes loaded by every cache rank of "
                                "this launcher.", value=float(s.get("loaded_bytes", 0)))
        engine = s.get("engine") or {}
        yield GaugeMetricFamily("vlaunch_engine_restarts", "Engine restarts so far.",
                                value=float(engine.get("restarts", 0)))
        yield from _hang_metrics(engine, s.get("standby") or {})
        swap = s.get("swap") or {}  # docs/swap.md
        yield GaugeMetricFamily("vlaunch_weights_version", "Version of the weights the caches "
                                "serve (0: as loaded; +1 with each swap).",
                                value=float(swap.get("version", 0)))
        yield GaugeMetricFamily("vlaunch_swap_in_progress", "A swap of the weights is under "
                                "way.", value=float(swap.get("state", "none") != "none"))
        yield GaugeMetricFamily("vlaunch_swap_rollbacks", "Swaps rolled back so far.",
                                value=float(swap.get("rollbacks", 0)))
        yield from _drain_metrics(s.get("drain"))
        yield from memory_metrics(s)


def _drain_metrics(drain: dict[str, Any] | None) -> Iterator[GaugeMetricFamily]:
    """Engines replaced on purpose, and what dying engines lost (--listen only)."""
    if drain is None:
        return
    yield GaugeMetricFamily("vlaunch_engines_drained", "Engines replaced on purpose that "
                            "answered what they held and exited so far.",
                            value=float(drain.get("drained", 0)))
    yield GaugeMetricFamily("vlaunch_engines_drain_killed", "Engines replaced on purpose that "
                            "were SIGKILLed past --drain-timeout so far.",
                            value=float(drain.get("killed", 0)))
    yield GaugeMetricFamily("vlaunch_lost_connections", "Connections of the launcher's "
                            "sockets that engines held when they died (killed, crashed, "
                            "hung): their requests failed.",
                            value=float(drain.get("lost_connections", 0)))


def _hang_metrics(engine: dict[str, Any], standby: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    """The engine's probes and hangs (--engine-unhealthy-after), the parked standby's hangs."""
    yield GaugeMetricFamily("vlaunch_engine_hangs", "Engines found hung (failing for "
                            "--engine-unhealthy-after) and stopped so far; an engine that "
                            "exited on its own is not counted.",
                            value=float(engine.get("hangs", 0)))
    yield GaugeMetricFamily("vlaunch_engine_unhealthy_seconds", "Seconds the ready engine's "
                            "probes have failed without a break (0: healthy).",
                            value=float(engine.get("unhealthy_for", 0.0)))
    failing = GaugeMetricFamily("vlaunch_engine_probe_failing", "1 while this probe of the "
                                "ready engine fails.", labels=["probe"])
    for probe in ("health", "liveness", "watchdog"):
        failing.add_metric([probe], float(probe in engine.get("failing", ())))
    yield failing
    yield GaugeMetricFamily("vlaunch_standby_hangs", "Parked standby engines whose watchdog "
                            "pings stopped, killed and replaced so far.",
                            value=float(standby.get("hangs", 0)))


class HealthServer:
    """A threaded HTTP server over the launcher's latest status."""

    def __init__(self, host: str, port: int) -> None:
        self._status: dict[str, Any] = {}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(MetricsCollector(lambda: self._status))  # type: ignore[arg-type]
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                status = owner._status
                if path in PROBES:
                    ok = bool(status.get(PROBES[path]))
                    reply_json(self, 200 if ok else 503, {"ok": ok, "phase": status.get("phase")})
                elif path == "/status":
                    reply_json(self, 200, status)
                elif path == "/metrics":
                    body = generate_latest(registry)
                    reply(self, 200, body, "text/plain; version=0.0.4")
                else:
                    reply_json(self, 404, {"error": f"no such endpoint {path}",
                                     "endpoints": [*PROBES, "/status", "/metrics"]})

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http: " + fmt, *args)

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise _bind_error(host, port, exc) from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="vlaunch-http",
                                        daemon=True)

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def publish(self, status: dict[str, Any]) -> None:
        """Replace the status the endpoints answer from."""
        self._status = status

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()


def check_port(host: str, port: int) -> None:
    """Raise UsageError now if the health server could not listen on host:port."""
    try:
        with socket.create_server((host, port), reuse_port=False) as sock:
            sock.close()
    except OSError as exc:
        raise _bind_error(host, port, exc) from None


def _bind_error(host: str, port: int, exc: OSError) -> UsageError:
    """The usage error for a health address that cannot be listened on."""
    if exc.errno == errno.EADDRINUSE:
        return UsageError(f"health port {port} on {host} is already in use; pick another "
                          "--health-port (0: a free one, -1: no HTTP)")
    return UsageError(f"cannot serve health on {host}:{port} ({exc.strerror or exc}); fix "
                      "--health-host or --health-port")
