"""The reference engine's HTTP surface (rank 0): /health, /stats and /generate.

    GET  /health    200 {"status": "ok"} once the weights are loaded; 503 before and while
                    stopping
    GET  /stats     {weights_ms, source, layout, tp_size, bytes, pid, started_at, ready_at,
                    memory} (memory: each rank's bytes, docs/memory.md)
    POST /generate  {"tokens": [int, ...], "max_new_tokens": int} -> {"tokens": [int, ...]}

Requests are served from threads; each generation is queued for the engine's main thread.

Under `vlaunch run --listen` the engine serves the socket the launcher passed (socket
activation: `LISTEN_FDS` with `LISTEN_PID` this process, fd 3) instead of binding --port, and
accepts only once it is ready (connections wait in the launcher's backlog meanwhile, where a
loading engine's 503 would fail them); it drains on SIGTERM (`drain`): it stops accepting and
closes its copy of the socket (never `shutdown()`, which would end the launcher's socket for
every engine), closes idle keep-alive connections, finishes the requests it holds, then stops;
the next engine accepts meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.activation import passed_socket
from vlaunch.cache.contract.http import reply_json

if TYPE_CHECKING:
    from concurrent.futures import Future
    from typing import Protocol

    from vlaunch.cache.reference.config import ModelConfig
    from vlaunch.cache.reference.options import EngineOptions

    class Engine(Protocol):
        """What the HTTP server needs of its engine (engine.Engine), so that this module
        names no engine module: its options and config, its figures, whether it is ready
        or stopping, and a way to queue a request."""

        opts: EngineOptions
        cfg: ModelConfig
        stats: dict[str, Any]
        stopping: bool

        @property
        def ready(self) -> bool:
            """Weights loaded, warmed up, accepting requests."""

        def submit(self, tokens: list[int], max_new: int) -> Future[list[int]] | None:
            """Queue a generation; None when the engine no longer accepts requests."""

log = logging.getLogger("vlaunch.engine")

MAX_PROMPT_TOKENS = 256
MAX_NEW_TOKENS = 64
MAX_BODY_BYTES = 64 << 10
BIND_PATIENCE = 5.0
DRAIN_LIMIT = 300.0
"""Seconds a drain waits for the connections it holds (the launcher's --drain-timeout kills
sooner)."""


class EngineStopping(Exception):
    """A queued request that the engine will not run because it stops."""

    def __init__(self) -> None:
        super().__init__("the engine is stopping")


def start_http(engine: Engine) -> ThreadingHTTPServer:
    """Bind the HTTP server, serve it from a daemon thread, log and publish its port."""
    taken = passed_socket(who="the reference engine")
    passed = taken.sock if taken is not None else None
    server = _bind((engine.opts.host, engine.opts.port)) if passed is None else \
        EngineServer.on_socket(passed)
    server.engine = engine
    server.passed = passed is not None
    # polled every 50 ms: the stop's shutdown() waits for the next poll (0.5 s by default)
    threading.Thread(target=server.serve_forever, args=(0.05,), name="vlaunch-http",
                     daemon=True).start()
    port = int(server.server_address[1]) if passed is None or \
        passed.family != socket.AF_UNIX else 0
    if passed is not None:
        log.info("serving on the socket vlaunch run passed (fd %d, %s), not binding port %d",
                 passed.fileno(), passed.getsockname(), engine.opts.port)
    else:
        log.info("listening on http://%s:%d", engine.opts.host, port)
    if engine.opts.port_file:
        write_port_file(Path(engine.opts.port_file), port)
    return server


def _bind(address: tuple[str, int], patience: float = BIND_PATIENCE) -> EngineServer:
    """The server bound to `address`, retrying while the port is in use for `patience` s.

    The engine this one replaces (a promoted standby starts serving the moment it is gone)
    may still hold the port for a moment after its death: the kernel can close a killed
    process's sockets after it has been reaped (the last reference dropped late, on a
    workqueue), most often a listener with a connection in its queue."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return EngineServer(address, _Handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or not address[1] or time.monotonic() > deadline:
                raise
            log.debug("port %d still in use (the engine before this one closing?); retrying",
                      address[1])
            time.sleep(0.05)


def drain(server: ThreadingHTTPServer, limit: float = DRAIN_LIMIT) -> int:
    """Stop accepting, close this process's copy of the listening socket, close idle
    keep-alive connections and wait (at most `limit` s) until every connection held has had
    its reply; returns how many were still open after the limit."""
    assert isinstance(server, EngineServer)
    server.draining = True
    server.shutdown()  # the accept loop ends (socketserver's shutdown: no socket shutdown())
    server.socket.close()  # our copy only: the launcher's socket keeps listening
    server.close_idle()
    deadline = time.monotonic() + limit
    while server.open_connections() and time.monotonic() < deadline:
        time.sleep(0.01)
    left = server.open_connections()
    log.info("drained: stopped accepting, %s", f"{left} connection(s) still open after "
             f"{limit:g} s" if left else "every request it held answered")
    return left


NEW, BUSY, IDLE = "new", "busy", "idle"  # no request read yet; one in hand; between two


def write_port_file(path: Path, port: int) -> None:
    """Write the port atomically: a reader sees no file or the whole number."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


class EngineServer(ThreadingHTTPServer):
    """The reference engine's HTTP server: counts its connections, so that a drain waits for
    what it holds (and answers what it accepted)."""

    daemon_threads = True
    engine: Engine
    draining = False
    passed = False  # serves the launcher's socket: drains on SIGTERM

    @classmethod
    def on_socket(cls, sock: socket.socket) -> EngineServer:
        """A server on an already listening socket (passed by the launcher)."""
        server = cls(sock.getsockname() if sock.family != socket.AF_UNIX else ("", 0),
                     _Handler, bind_and_activate=False)
        server.socket.close()
        server.socket, server.address_family = sock, sock.family
        server.server_address = sock.getsockname()
        return server

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._table: dict[socket.socket, str] = {}  # open connections: NEW, BUSY or IDLE
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _conns(self) -> dict[socket.socket, str]:
        """Each open connection and its state."""
        return self._table

    def mark(self, conn: socket.socket, state: str | None) -> None:
        """Record a connection's state (NEW, BUSY, IDLE); None: it closed."""
        table = self._conns()
        with self._lock:
            if state is None:
                table.pop(conn, None)
            else:
                table[conn] = state

    def open_connections(self) -> int:
        """Connections not yet closed."""
        return len(self._conns())

    def close_idle(self) -> None:
        """End keep-alive connections that wait for a next request (their reads see EOF). A
        connection accepted whose first request has not been read yet is not idle: its
        client has sent, or is sending, a request this engine took from the queue, and
        answers it (closing it would fail that request on a busy host)."""
        table = self._conns()
        with self._lock:
            idle = [c for c, state in table.items() if state == IDLE]
        for conn in idle:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)

    def get_request(self) -> tuple[socket.socket, Any]:
        """Accept; a Unix socket's peer is named "unix" (its address is an empty string)."""
        conn, address = self.socket.accept()
        return conn, address if self.socket.family != socket.AF_UNIX else ("unix", 0)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Count the connection from its accept, then serve it in a thread."""
        self.mark(request, NEW)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        """The connection is done."""
        self.mark(request, None)
        super().shutdown_request(request)

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
    server: EngineServer
    timeout = 30  # a client that stalls mid-request loses its connection, not a thread forever
    protocol_version = "HTTP/1.1"

    def parse_request(self) -> bool:
        self.server.mark(self.connection, BUSY)  # a request arrived: a drain waits for it
        return super().parse_request()

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        finally:
            if self.server.draining:
                self.close_connection = True  # replied: the next request goes to the next engine
            if not self.close_connection:
                self.server.mark(self.connection, IDLE)

    def do_GET(self) -> None:
        engine = self.server.engine
        if self.path == "/health":
            if engine.ready and not self.server.draining:
                self._reply(HTTPStatus.OK, {"status": "ok"})
            else:  # draining: a probe of the engine that replaces it must not read this one
                state = "stopping" if engine.stopping or self.server.draining else "loading"
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
        reply_json(self, status, body)

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
