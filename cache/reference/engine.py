"""The reference engine: greedy generation of a Llama checkpoint over HTTP, a process per rank.

    python -m vlaunch.cache.reference.engine --model DIR [--tensor-parallel-size N]
        [--device cpu|cuda]
        [--mode share|copy|copy-release] [--no-fallback] [--timeout S] [--host H] [--port P]
        [--port-file FILE] [--socket-dir DIR]

Rank 0 is the process started by hand or by `vlaunch run`; it starts ranks 1..N-1 as its own
children (`--worker-rank r`), and the ranks form a torch.distributed group (gloo on CPU, nccl on
CUDA). Each rank takes its shard with `vlaunch.cache.load`. Rank 0 serves HTTP:

    GET  /health    200 {"status": "ok"} once the weights are loaded; 503 before and while
                    stopping
    GET  /stats     {weights_ms, source, tp_size, bytes, pid, started_at, ready_at}
    POST /generate  {"tokens": [int, ...], "max_new_tokens": int} -> {"tokens": [int, ...]}

Rank 0 runs every request in its main thread, one at a time, and first broadcasts it to the
workers: a header [op, n_tokens, max_new_tokens] (op 0: stop, 1: generate), then the tokens.

Exit statuses: 0 after SIGTERM/SIGINT; 78 (EX_CONFIG) for a configuration error that a restart
cannot fix (config.json, model path, tensor-parallel size, options, devices); 1 otherwise,
including a worker's death.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import psutil

from vlaunch.cache.contract.errors import UsageError, VlaunchError
from vlaunch.cache.contract.exitcodes import CONFIG_ERROR_STATUSES
from vlaunch.cache.contract.launch import EngineEnv
from vlaunch.cache.contract.protocol import MODES

if TYPE_CHECKING:
    from vlaunch.cache.reference.refmodel import ModelConfig, TPLlama

log = logging.getLogger("vlaunch.engine")

EX_CONFIG = 78
MAX_PROMPT_TOKENS = 256
MAX_NEW_TOKENS = 64
MAX_BODY_BYTES = 64 << 10
OP_STOP, OP_GENERATE = 0, 1
WORKER_STOP_TIMEOUT = 10.0
SIGNAL_POLL_S = 0.1
STORE_TIMEOUT = datetime.timedelta(seconds=300)
# Workers wait in a broadcast for the next request, however long the engine idles; a dead
# peer is caught by process monitoring (parent-death signal, rank 0's watcher), not by this.
GROUP_TIMEOUT = datetime.timedelta(days=3650)
PR_SET_PDEATHSIG = 1


class ConfigError(Exception):
    """A bad option or environment variable: exit status 78."""


@dataclass(frozen=True)
class EngineOptions:
    """The engine's command line."""

    model: str
    tp_size: int = 1
    device: str = "cpu"
    mode: str = "share"
    fallback: bool = True
    timeout: float = 60.0
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str = ""
    socket_dir: str = ""
    log_level: str = "INFO"
    worker_rank: int | None = None
    store_port: int = 0
    parent_pid: int = 0

    def worker_argv(self, rank: int, store_port: int) -> list[str]:
        """The command line that starts worker `rank`."""
        argv = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--model", self.model,
                "--tensor-parallel-size", str(self.tp_size), "--device", self.device,
                "--mode", self.mode, "--timeout", str(self.timeout),
                "--log-level", self.log_level, "--worker-rank", str(rank),
                "--store-port", str(store_port), "--parent-pid", str(os.getpid())]
        if not self.fallback:
            argv.append("--no-fallback")
        if self.socket_dir:
            argv += ["--socket-dir", self.socket_dir]
        return argv


def _launcher_env() -> EngineEnv:
    """What vlaunch run told this engine (contract.launch); a malformed variable is 78."""
    try:
        return EngineEnv.from_env()
    except UsageError as exc:
        raise ConfigError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse's own exit status, 2, would tell the launcher that a restart may help
        raise ConfigError(f"{message}; see --help")


def parse_args(argv: Sequence[str] | None) -> EngineOptions:
    """Parse the command line; ConfigError on a bad one."""
    env = _launcher_env()  # under vlaunch run, no flag needs repeating
    p = _Parser(prog="python -m vlaunch.cache.reference.engine",
                description="The vlaunch reference engine: greedy generation over HTTP.")
    p.add_argument("--model", required=not env.model, default=env.model,
                   help="checkpoint directory (config.json + safetensors) [default: "
                   "$VLAUNCH_MODEL]")
    p.add_argument("--tensor-parallel-size", type=int, dest="tp_size",
                   default=env.tensor_parallel_size or 1)
    p.add_argument("--device", choices=("cpu", "cuda"), default=env.device or "cpu")
    p.add_argument("--mode", choices=MODES, default="share")
    p.add_argument("--no-fallback", action="store_false", dest="fallback",
                   help="fail instead of reading the disk when the cache is missing or wrong")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the cache "
                   "with --no-fallback")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port; 0 picks a free one")
    p.add_argument("--port-file", default="", help="write the HTTP port to this file")
    p.add_argument("--socket-dir", default=env.socket_dir, help="cache sockets (default: "
                   "$VLAUNCH_SOCKET_DIR)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    opts = EngineOptions(**vars(p.parse_args(argv)))
    if opts.tp_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {opts.tp_size}")
    if not 0 <= opts.port < 65536:
        raise ConfigError(f"--port must be in 0..65535, got {opts.port}")
    if not opts.timeout >= 0:
        raise ConfigError(f"--timeout must be >= 0, got {opts.timeout}")
    return opts


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
    from vlaunch.cache.reference.refmodel import ModelConfigError

    if isinstance(exc, (ConfigError, ModelConfigError)):
        return EX_CONFIG
    if isinstance(exc, VlaunchError) and int(exc.status) in CONFIG_ERROR_STATUSES:
        return EX_CONFIG
    return 1


def _setup_logging(rank: int, level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, force=True,
                        format=f"%(asctime)s vlaunch-engine[rank {rank} pid {os.getpid()}] "
                               "%(levelname)s %(message)s")


@dataclass
class RankState:
    """One rank's model and its process group."""

    rank: int
    tp_size: int
    device: str
    comm_device: str
    model: TPLlama
    weights_ms: float
    source: str
    nbytes: int


def device_for(kind: str, rank: int, tp_size: int) -> str:
    """The torch device of `rank`: cpu, or the GPU that $VLAUNCH_ENGINE_DEVICES names.

    The launcher lists each rank's cache GPU by UUID (cuda:GPU-...), so an engine whose
    CUDA_VISIBLE_DEVICES orders the GPUs differently still maps each shard on its own GPU.
    """
    if kind == "cpu":
        return "cpu"
    from vlaunch.cache.contract.errors import DeviceError
    from vlaunch.cache.store.slabs import cuda_index

    raw = os.environ.get("VLAUNCH_ENGINE_DEVICES", "")
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items:
        return f"cuda:{rank}"
    if len(items) < tp_size:
        raise ConfigError(f"VLAUNCH_ENGINE_DEVICES={raw!r} lists {len(items)} device(s) for "
                          f"{tp_size} rank(s); list one per rank")
    item = items[rank] if items[rank].startswith("cuda") else f"cuda:{items[rank]}"
    try:
        return f"cuda:{cuda_index(item)}"
    except DeviceError as exc:
        raise ConfigError(f"VLAUNCH_ENGINE_DEVICES entry {item!r}: {exc}") from None


def start_rank(opts: EngineOptions, rank: int, cfg: ModelConfig, store: Any) -> RankState:
    """Join the process group (tp > 1), load the rank's weights and build its model."""
    import torch
    import torch.distributed as dist

    from vlaunch.cache import load
    from vlaunch.cache.reference.refmodel import SingleRank, TorchDistributed, TPLlama

    device = device_for(opts.device, rank, opts.tp_size)
    if device.startswith("cuda"):
        count = torch.cuda.device_count()
        if torch.device(device).index >= count:
            raise ConfigError(f"rank {rank} needs {device}, but torch sees {count} CUDA "
                              "device(s); set VLAUNCH_ENGINE_DEVICES or CUDA_VISIBLE_DEVICES, "
                              "or use --device cpu")
        torch.cuda.set_device(torch.device(device))
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.tp_size))
    if opts.tp_size > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store,
                                rank=rank, world_size=opts.tp_size, timeout=GROUP_TIMEOUT)
    start = time.perf_counter()
    weights = load(opts.model, rank=rank, tensor_parallel_size=opts.tp_size, device=device,
                   mode=opts.mode, fallback=opts.fallback, timeout=opts.timeout,
                   socket_dir=opts.socket_dir or None)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1000
    nbytes = sum(t.nbytes for t in weights.values())
    log.info("rank %d: weights from %s in %.1f ms (%.2f GB)", rank, weights.source, ms,
             nbytes / 1e9)
    comm = TorchDistributed() if opts.tp_size > 1 else SingleRank()
    model = TPLlama(weights, cfg, comm)
    return RankState(rank=rank, tp_size=opts.tp_size, device=device,
                     comm_device=device if device.startswith("cuda") else "cpu", model=model,
                     weights_ms=ms, source=weights.source, nbytes=nbytes)


def gather_stats(state: RankState) -> tuple[float, str, int]:
    """(slowest rank's load ms, source over all ranks, bytes over all ranks)."""
    import torch
    import torch.distributed as dist

    flags = torch.tensor([state.weights_ms, state.source == "disk", state.source == "cache"],
                         dtype=torch.float64, device=state.comm_device)
    nbytes = torch.tensor([state.nbytes], dtype=torch.float64, device=state.comm_device)
    if state.tp_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        dist.all_reduce(nbytes)
    ms, disk, cache = flags.tolist()
    source = "mixed" if disk and cache else "disk" if disk else "cache"
    return ms, source, int(nbytes.item())


def run_generate(state: RankState, tokens: list[int], max_new: int) -> list[int]:
    """Send the request to the workers (tp > 1), then decode it on this rank."""
    import torch
    import torch.distributed as dist

    from vlaunch.cache.reference.refmodel import greedy

    if state.tp_size > 1:
        dist.broadcast(torch.tensor([OP_GENERATE, len(tokens), max_new], dtype=torch.int64,
                                    device=state.comm_device), src=0)
        dist.broadcast(torch.tensor(tokens, dtype=torch.int64, device=state.comm_device), src=0)
    return greedy(state.model, tokens, max_new)


def broadcast_stop(state: RankState) -> None:
    """Tell the workers to leave their loop."""
    import torch
    import torch.distributed as dist

    dist.broadcast(torch.tensor([OP_STOP, 0, 0], dtype=torch.int64, device=state.comm_device),
                   src=0)


def run_worker(opts: EngineOptions) -> int:
    """A worker rank: load, then decode what rank 0 broadcasts until op 0."""
    import torch
    import torch.distributed as dist

    from vlaunch.cache.reference.refmodel import ModelConfig, greedy

    _die_with_parent(opts.parent_pid)
    # the launcher signals the whole process group; rank 0 alone decides when workers stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = opts.worker_rank or 0
    cfg = ModelConfig.from_dir(opts.model)
    store = dist.TCPStore("127.0.0.1", opts.store_port, opts.tp_size, False,
                          timeout=STORE_TIMEOUT)
    state = start_rank(opts, rank, cfg, store)
    gather_stats(state)
    header = torch.empty(3, dtype=torch.int64, device=state.comm_device)
    while True:
        dist.broadcast(header, src=0)
        op, n_tokens, max_new = header.tolist()
        if op == OP_STOP:
            break
        tokens = torch.empty(n_tokens, dtype=torch.int64, device=state.comm_device)
        dist.broadcast(tokens, src=0)
        greedy(state.model, tokens.tolist(), max_new)
    dist.destroy_process_group()
    log.info("stopped")
    return 0


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when rank 0 dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid and os.getppid() != parent_pid:  # rank 0 died before prctl took effect
        raise RuntimeError(f"rank 0 (pid {parent_pid}) is gone; exiting")


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
        from vlaunch.cache.reference.refmodel import ModelConfig

        self.opts = opts
        self.cfg = ModelConfig.from_dir(opts.model)
        self.cfg.check_tp(opts.tp_size)
        device_for(opts.device, 0, opts.tp_size)
        self.started_at = psutil.Process().create_time()
        self.stats: dict[str, Any] = {"weights_ms": None, "source": None,
                                      "tp_size": opts.tp_size, "bytes": None,
                                      "pid": os.getpid(), "started_at": self.started_at,
                                      "ready_at": None}
        self.jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.accepting = False
        self.stopping = False
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self._accept_lock = threading.Lock()
        self._halt_lock = threading.Lock()
        self.http: ThreadingHTTPServer | None = None

    @property
    def ready(self) -> bool:
        """True while serving: weights loaded, not stopping."""
        return self.accepting and not self.stopping

    def run(self) -> int:
        """Load, serve until SIGTERM/SIGINT, stop; returns the exit status."""
        signal.signal(signal.SIGTERM, self.handle_signal)
        signal.signal(signal.SIGINT, self.handle_signal)
        try:
            self.http = start_http(self)
            store = self.start_workers() if self.opts.tp_size > 1 else None
            state = start_rank(self.opts, 0, self.cfg, store)
            self.became_ready(*gather_stats(state))
            self.serve(state)
            return self.shutdown(state)
        except _StopRequested:
            log.info("stopped before the weights were ready")
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
            raise _StopRequested
        self.jobs.put(STOP)

    def start_workers(self) -> Any:
        """Start ranks 1..N-1 and the thread that watches them; returns the TCPStore."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, self.opts.tp_size, True, timeout=STORE_TIMEOUT,
                              wait_for_workers=False)
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # only rank 0 speaks for the engine
        # started from the main thread: the parent-death signal fires when the forking thread
        # exits, not the process
        for rank in range(1, self.opts.tp_size):
            proc = subprocess.Popen(self.opts.worker_argv(rank, store.port), env=env,
                                    stdin=subprocess.DEVNULL)
            self.workers[rank] = proc
            log.info("started rank %d (pid %d)", rank, proc.pid)
        threading.Thread(target=self.watch_workers, name="vlaunch-workers", daemon=True).start()
        return store

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

    def became_ready(self, ms: float, source: str, nbytes: int) -> None:
        """Record the stats, accept requests, log and notify readiness."""
        self.stats = {**self.stats, "weights_ms": round(ms, 3), "source": source,
                      "bytes": nbytes, "ready_at": time.time()}
        with self._accept_lock:
            self.accepting = True
        log.info("weights ready in %.1f ms (source: %s)", ms, source)
        notify("READY=1\nSTATUS=serving")
        log.info("serving on http://%s:%d", *self.http_address())

    def http_address(self) -> tuple[str, int]:
        """The host and port the HTTP server listens on."""
        assert self.http is not None
        host, port = self.http.server_address[:2]
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
            try:
                job.result.set_result(run_generate(state, job.tokens, job.max_new))
            except Exception as exc:
                job.result.set_exception(exc)
                raise  # a failed collective leaves the group unusable: exit and be restarted

    def next_job(self) -> Job:
        """The next queued job; wakes up regularly so that signal handlers get to run."""
        while True:
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


class EngineStopping(Exception):
    """A queued request that the engine will not run because it stops."""

    def __init__(self) -> None:
        super().__init__("the engine is stopping")


class _StopRequested(BaseException):
    """Raised by the signal handler to abandon a load."""


def notify(state: str) -> None:
    """Send `state` to systemd when NOTIFY_SOCKET is set; failures are logged."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    import sdnotify

    try:
        sdnotify.SystemdNotifier(debug=True).notify(state)
    except OSError as exc:
        log.warning("sd_notify %r to %s failed: %s", state.replace("\n", " "),
                    os.environ["NOTIFY_SOCKET"], exc)


def start_http(engine: Engine) -> ThreadingHTTPServer:
    """Bind the HTTP server, serve it from a daemon thread, log and publish its port."""
    server = _Server((engine.opts.host, engine.opts.port), _Handler)
    server.engine = engine
    threading.Thread(target=server.serve_forever, name="vlaunch-http", daemon=True).start()
    port = int(server.server_address[1])
    log.info("listening on http://%s:%d", engine.opts.host, port)
    if engine.opts.port_file:
        write_port_file(Path(engine.opts.port_file), port)
    return server


def write_port_file(path: Path, port: int) -> None:
    """Write the port atomically: a reader sees no file or the whole number."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    engine: Engine

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Log a failed request (socketserver would print the traceback to stderr)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):  # the client hung up: nothing to fix here
            log.debug("http %s: %s", client_address[0], exc)
        else:
            log.error("http %s: request failed", client_address[0], exc_info=True)


class BadRequest(Exception):
    """A request the engine refuses, with the status and message to answer."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 30  # a client that stalls mid-request loses its connection, not a thread forever
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        engine = self.server.engine
        if self.path == "/health":
            if engine.ready:
                self._reply(HTTPStatus.OK, {"status": "ok"})
            else:
                state = "stopping" if engine.stopping else "loading"
                self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"status": state})
        elif self.path == "/stats":
            self._reply(HTTPStatus.OK, engine.stats)
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/generate":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})
            return
        engine = self.server.engine
        try:
            tokens, max_new = parse_generate(self._body(), engine.cfg)
        except BadRequest as exc:
            self._reply(exc.status, {"error": str(exc)})
            return
        result = engine.submit(tokens, max_new)
        if result is None:
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "not serving: weights are "
                                                                  "loading or the engine stops"})
            return
        try:
            tokens = result.result()
        except EngineStopping as exc:
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)})
        except Exception as exc:
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"generation failed: {exc}"})
        else:
            self._reply(HTTPStatus.OK, {"tokens": tokens})

    def _body(self) -> bytes:
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.isdigit():
            raise BadRequest(HTTPStatus.LENGTH_REQUIRED, "send a Content-Length header")
        length = int(raw)
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body would be taken for the next request
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
        return self.rfile.read(length)

    def _reply(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s: " + format, self.client_address[0], *args)


def parse_generate(body: bytes, cfg: ModelConfig) -> tuple[list[int], int]:
    """Validate a /generate body; returns (tokens, max_new_tokens) or raises BadRequest."""
    bad = HTTPStatus.BAD_REQUEST
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(bad, f"body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(bad, 'body must be an object {"tokens": [...], "max_new_tokens": n}')
    unknown = set(obj) - {"tokens", "max_new_tokens"}
    if unknown:
        raise BadRequest(bad, f"unknown field(s) {', '.join(sorted(unknown))}")
    tokens, max_new = obj.get("tokens"), obj.get("max_new_tokens", 16)
    vocab = cfg.vocab_size
    if (not isinstance(tokens, list) or not 1 <= len(tokens) <= MAX_PROMPT_TOKENS
            or not all(type(t) is int and 0 <= t < vocab for t in tokens)):
        raise BadRequest(bad, f"tokens must be a list of 1..{MAX_PROMPT_TOKENS} integers in "
                         f"0..{vocab - 1}")
    if type(max_new) is not int or not 0 <= max_new <= MAX_NEW_TOKENS:
        raise BadRequest(bad, f"max_new_tokens must be an integer in 0..{MAX_NEW_TOKENS}")
    if len(tokens) + max_new > cfg.max_position_embeddings:
        raise BadRequest(bad, f"tokens + max_new_tokens exceed max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    return tokens, max_new


if __name__ == "__main__":
    sys.exit(main())
