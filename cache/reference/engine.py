"""The reference engine: greedy generation of a Llama checkpoint over HTTP, a process per rank.

    python -m vlaunch.cache.reference.engine --model DIR [--tensor-parallel-size N]
        [--device cpu|cuda]
        [--mode share|copy|copy-release] [--no-fallback] [--timeout S] [--host H] [--port P]
        [--port-file FILE] [--socket-dir DIR] [--no-engine-layout] [--tp-backend B]
        [--warmup-tokens N] [--standby-keep-memory]

Rank 0 is the process started by hand or by `vlaunch run`; it starts ranks 1..N-1 as its own
children at once (workers.py), serves HTTP (http.py) and runs every request in its main
thread, one at a time (this module). The options are parsed in options.py. Each rank keeps its
weights in the engine's own layout (layout.py: fused qkv and gate_up, padded vocabulary):
mapped from its cache when the cache holds that layout, else built from the raw shard and
handed back to the cache (weights.py, docs/engine-layout.md). Before it reports ready, or
parked as a standby, every rank warms up on a dummy prompt (warmup.py).

Exit statuses: 0 after SIGTERM/SIGINT; 78 (EX_CONFIG) for a configuration error that a restart
cannot fix (config.json, model path, tensor-parallel size, options, devices); 1 otherwise,
including a worker's death.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from types import FrameType
from typing import Any

import psutil

from vlaunch.cache.contract.activation import socket_passed
from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.exitcodes import CONFIG_ERROR_STATUSES
from vlaunch.cache.contract.logs import setup_logging
from vlaunch.cache.contract.notify import SdNotify, Watchdog, parse_fields
from vlaunch.cache.contract.standby import (
    StandbyError,
    is_standby,
    parks_before_weights,
    promote_fd,
    wait_for_promotion,
)
from vlaunch.cache.reference import faults
from vlaunch.cache.reference.http import EngineStopping, drain, parse_generate, start_http
from vlaunch.cache.reference.options import EX_CONFIG, ConfigError, EngineOptions, parse_args
from vlaunch.cache.reference.state import RankState
from vlaunch.cache.reference.workers import (
    broadcast_stop,
    device_for,
    gather_stats,
    group_barrier,
    open_store,
    reserve_store,
    run_generate,
    run_warmup,
    run_worker,
    start_rank,
)

__all__ = ["EX_CONFIG", "ConfigError", "Engine", "EngineOptions", "main", "parse_args",
           "parse_generate"]

log = logging.getLogger("vlaunch.engine")

WORKER_STOP_TIMEOUT = 10.0
SIGNAL_POLL_S = 0.1


def main(argv: Sequence[str] | None = None) -> int:
    """Run rank 0 (or, with --worker-rank, a worker) to completion; returns the exit status."""
    try:
        opts = parse_args(argv)
    except ConfigError as exc:
        _setup_logging(0, "INFO")
        log.error("%s", exc)
        return EX_CONFIG
    rank = 0 if opts.worker_rank is None else opts.worker_rank
    _setup_logging(rank, opts.log_level)
    try:
        if opts.worker_rank is None:
            return Engine(opts).run()
        return run_worker(opts)
    except Exception as exc:
        status = exit_status(exc)
        if status == EX_CONFIG:
            log.error("%s", exc)
        else:
            log.exception("engine failed: %s", exc)
        return status


def exit_status(exc: BaseException) -> int:
    """78 for an error a restart cannot fix, 1 for any other."""
    from vlaunch.cache.reference.config import ModelConfigError

    if isinstance(exc, (ConfigError, ModelConfigError)):
        return EX_CONFIG
    if isinstance(exc, VlaunchError) and int(exc.status) in CONFIG_ERROR_STATUSES:
        return EX_CONFIG
    return 1


def _setup_logging(rank: int, level: str) -> None:
    setup_logging("vlaunch-engine", level, rank)


@dataclass
class Job:
    """One request for the main thread: generate (tokens) or stop (None)."""

    tokens: list[int] | None
    max_new: int = 0
    result: Future[list[int]] = field(default_factory=Future)


STOP = Job(None)


class Engine:
    """Rank 0: HTTP in a thread, workers as children, every forward in the main thread."""

    def __init__(self, opts: EngineOptions) -> None:
        from vlaunch.cache.reference.config import ModelConfig

        self.opts = opts
        self.cfg = ModelConfig.from_dir(opts.model)
        self.cfg.check_tp(opts.tp_size)
        device_for(opts.device, 0, opts.tp_size)
        self.started_at = psutil.Process().create_time()
        self.stats: dict[str, Any] = {"weights_ms": None, "source": None, "layout": None,
                                      "tp_size": opts.tp_size, "bytes": None,
                                      "pid": os.getpid(), "started_at": self.started_at,
                                      "ready_at": None, "memory": None, "warmup": None}
        self.jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.accepting = False
        self.stopping = False
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self._accept_lock = threading.Lock()
        self._halt_lock = threading.Lock()
        # A stop while loading abandons the load by raising from the signal handler, but only
        # once torch is imported: an exception in the middle of a C extension's import leaves
        # it half-initialised ("cannot load module more than once per process").
        self._interruptible = False
        self._stop_requested = False
        self.http: ThreadingHTTPServer | None = None
        self.watchdog = Watchdog()  # --engine-watchdog: pings from the serving loop and park

    @property
    def ready(self) -> bool:
        """True while serving: weights loaded, not stopping."""
        return self.accepting and not self.stopping

    def run(self) -> int:
        """Load, serve until SIGTERM/SIGINT, stop; returns the exit status."""
        signal.signal(signal.SIGTERM, self.handle_signal)
        signal.signal(signal.SIGINT, self.handle_signal)
        standby = is_standby()
        try:
            fd = promote_fd() if standby else -1
            # on the launcher's socket, accept only once ready: until then connections wait
            # in its backlog (a 503 from a loading engine would fail them)
            late = standby or socket_passed()
            self.http = None if late else start_http(self)
            listener = self.start_workers() if self.opts.tp_size > 1 else None
            store = open_store(self.opts, listener) if listener is not None else None
            import torch  # noqa: F401  (before any interruptible wait: see __init__)

            self._interruptible = True
            if self._stop_requested:
                raise _StopRequested
            early = standby and parks_before_weights()  # an in-place swap's standby

            def park_early() -> None:  # the group is up, no weight mapped: park here
                self.park(fd)
                group_barrier()  # the workers wait for this, then every rank maps

            state = start_rank(self.opts, 0, self.cfg, store,
                               before_load=park_early if early else None)
            self.stats["layout"] = state.layout
            stats = gather_stats(state)
            self.record_memory(state, log_it=True)  # as loaded
            if early and state.scratch_warmup is not None and state.device != "cpu":
                # warmed up on scratch before it parked: the weights need no pass on CUDA
                self.stats["warmup"] = state.scratch_warmup.to_dict()
            else:  # an early standby is promoted already: what it warms up, it keeps
                self.warm_up(state,
                             free=standby and not early and not self.opts.standby_keep_memory)
            if standby and not early:  # weights mapped and warm on every rank: park until promoted
                self.park(fd)
            if late:  # what it accepts from now on is served: no 503 while it gets ready
                with self._accept_lock:
                    self.accepting = True
                self.http = start_http(self)
            self.became_ready(*stats)
            self.serve(state)
            return self.shutdown(state)
        except _StopRequested:
            log.info("stopped before serving (loading, or parked as a standby)")
            return 0
        except StandbyError as exc:
            log.info("%s", exc)
            return 0
        finally:
            self.stopping = True
            if self.http is not None:
                self.http.shutdown()
                self.http.server_close()
            self.reap_workers(kill=True)

    def handle_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT: stop; while loading, abandon the load at once."""
        log.info("received %s; stopping", signal.Signals(signum).name)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not self.accepting:
            self._stop_requested = True
            if self._interruptible:
                raise _StopRequested
            return
        if self.http is not None and getattr(self.http, "passed", False):
            # the launcher's socket: the next engine accepts from it while this one drains
            threading.Thread(target=self.drain_then_stop, name="vlaunch-drain",
                             daemon=True).start()
            return
        self.jobs.put(STOP)

    def drain_then_stop(self) -> None:
        """Stop accepting, answer every request this engine holds, then stop (SIGTERM on
        the launcher's socket)."""
        assert self.http is not None
        drain(self.http)
        self.jobs.put(STOP)

    def start_workers(self) -> socket.socket:
        """Start ranks 1..N-1 at once (before this process imports torch) and the thread that
        watches them; returns the store's listening socket."""
        listener = reserve_store()
        env = {k: v for k, v in os.environ.items()  # only rank 0 speaks for the engine
               if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        # started from the main thread: the parent-death signal fires when the forking thread
        # exits, not the process
        for rank in range(1, self.opts.tp_size):
            proc = subprocess.Popen(self.opts.worker_argv(rank, listener.getsockname()[1]),
                                    env=env, stdin=subprocess.DEVNULL)
            self.workers[rank] = proc
            log.info("started rank %d (pid %d)%s", rank, proc.pid,
                     "" if "torch" in sys.modules else " before importing torch")
        threading.Thread(target=self.watch_workers, name="vlaunch-workers", daemon=True).start()
        return listener

    def watch_workers(self) -> None:
        """Exit at once when a worker dies outside a shutdown."""
        while not self.stopping:
            for rank, proc in self.workers.items():
                status = proc.poll()
                if status is not None and not self.stopping:
                    self.halt(f"rank {rank} (pid {proc.pid}) exited with status {status}",
                              EX_CONFIG if status == EX_CONFIG else 1)
            time.sleep(0.1)

    def halt(self, reason: str, status: int) -> None:
        """Kill the workers and exit now: the main thread may be stuck in a collective."""
        with self._halt_lock:
            log.error("%s; stopping the engine (exit status %d)", reason, status)
            self.reap_workers(kill=True)
            logging.shutdown()
            os._exit(status)

    def park(self, fd: int) -> None:
        """Standby: report PARKED=1, then block until the launcher promotes this engine (every
        worker waits in its broadcast meanwhile, so the group is promoted together)."""
        log.info("parked as a standby (pid %d): waiting for the launcher's promotion", os.getpid())
        notify("PARKED=1\nSTATUS=parked (standby)")
        wait_for_promotion(fd, self.watchdog.ping, self.watchdog.every)
        self.stats["promoted_at"] = time.time()
        log.info("promoted: taking over")

    def warm_up(self, state: RankState, *, free: bool) -> None:
        """Every rank's warm-up (warmup.py), unless --warmup-tokens 0; `free`: give back what
        the allocator cached during it (a standby about to park)."""
        if self.opts.warmup_tokens == 0:
            return
        report = run_warmup(state, self.opts.warmup_tokens, free=free)
        self.stats["warmup"] = report.to_dict()
        self.record_memory(state)

    def became_ready(self, ms: float, source: str, nbytes: int) -> None:
        """Record the stats, accept requests, log and notify readiness."""
        self.stats = {**self.stats, "weights_ms": round(ms, 3), "source": source,
                      "bytes": nbytes, "ready_at": time.time()}
        with self._accept_lock:
            self.accepting = True
        log.info("weights ready in %.1f ms (source: %s)", ms, source)
        notify("READY=1\nSTATUS=serving")
        log.info("serving on http://%s:%d", *self.http_address())

    def record_memory(self, state: RankState, *, log_it: bool = False) -> None:
        """Every rank's memory into /stats (`memory`, one entry per rank; memory.py). Every
        rank gathers at the same points: once loaded (each logs its line), after the warm-up and
        after each request (a rank logs again when its figures moved)."""
        from vlaunch.cache.reference.memory import gather_memory

        self.stats["memory"] = [m.to_dict() for m in gather_memory(state, log_it=log_it)]

    def http_address(self) -> tuple[str, int]:
        """The host and port the HTTP server listens on."""
        assert self.http is not None
        address = self.http.server_address
        if isinstance(address, (str, bytes)):  # a Unix socket passed by the launcher
            return f"unix:{address!s}", 0
        host, port = address[:2]
        return str(host), int(port)

    def submit(self, tokens: list[int], max_new: int) -> Future[list[int]] | None:
        """Queue a generate request for the main thread; None while not serving."""
        with self._accept_lock:
            if not self.ready:
                return None
            job = Job(tokens, max_new)
            self.jobs.put(job)
            return job.result

    def serve(self, state: RankState) -> None:
        """Run queued requests in this (the main) thread until STOP."""
        while (job := self.next_job()) is not STOP:
            assert job.tokens is not None
            if faults.take(0) == "generate-stall":
                faults.stall()
            try:
                tokens = run_generate(state, job.tokens, job.max_new)
                self.record_memory(state)  # before the reply: /stats is current once it is in
                job.result.set_result(tokens)
            except Exception as exc:
                job.result.set_exception(exc)
                raise  # a failed collective leaves the group unusable: exit and be restarted

    def next_job(self) -> Job:
        """The next queued job; wakes up regularly so that signal handlers get to run."""
        while True:
            self.watchdog.ping()  # this loop runs every request: a stuck one stops the pings
            # a signal that the kernel delivers to another thread does not interrupt this
            # wait; Python runs the handler only once the main thread wakes up
            with contextlib.suppress(queue.Empty):
                return self.jobs.get(timeout=SIGNAL_POLL_S)

    def shutdown(self, state: RankState) -> int:
        """Refuse new requests, stop the workers through the group, wait for them."""
        import torch.distributed as dist

        notify("STOPPING=1")
        with self._accept_lock:
            self.stopping = True
        with contextlib.suppress(queue.Empty):
            while True:
                self.jobs.get_nowait().result.set_exception(EngineStopping())
        if state.tp_size > 1:
            broadcast_stop(state)
            dist.destroy_process_group()
        self.reap_workers(kill=False)
        log.info("stopped")
        return 0

    def reap_workers(self, *, kill: bool) -> None:
        """Wait for the workers to exit; SIGKILL them at once (kill) or after a grace period."""
        self.stopping = True
        deadline = time.monotonic() + WORKER_STOP_TIMEOUT
        for rank, proc in self.workers.items():
            if kill and proc.poll() is None:
                proc.kill()
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d (pid %d) did not stop in %.0f s; killing it", rank,
                            proc.pid, WORKER_STOP_TIMEOUT)
                proc.kill()
                proc.wait()


class _StopRequested(BaseException):
    """Raised by the signal handler to abandon a load."""


def notify(state: str) -> None:
    """Send `state` (KEY=value lines) to NOTIFY_SOCKET if set; never blocks, never raises."""
    out = SdNotify()
    out.send(parse_fields(state.encode()))
    out.close()


def leave(status: int) -> None:
    """Exit with `status` once the log is out, without the interpreter's teardown: torch's
    took 1-2 s of a 2-core machine after the engine had stopped, and while the process lives
    its port is not free for the engine that takes over (a swap's or a restart's downtime)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    leave(main())
