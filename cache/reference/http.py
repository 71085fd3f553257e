"""The reference engine's HTTP surface (rank 0): /health, /stats and /generate.

    GET  /health    200 {"status": "ok"} once the weights are loaded; 503 before and while
                    stopping
    GET  /stats     {weights_ms, source, layout, tp_size, bytes, pid, started_at, ready_at,
                    memory} (memory: each rank's bytes, docs/memory.md)
    POST /generate  {"tokens": [int, ...], "max_new_tokens": int} -> {"tokens": [int, ...]}

Requests are served from threads; each generation is queued for the engine's main thread.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


class EngineStopping(Exception):
    """A queued request that the engine will not run because it stops."""

    def __init__(self) -> None:
        super().__init__("the engine is stopping")


def start_http(engine: Engine) -> ThreadingHTTPServer:
    """Bind the HTTP server, serve it from a daemon thread, log and publish its port."""
    server = _bind((engine.opts.host, engine.opts.port))
    server.engine = engine
    # polled every 50 ms: the stop's shutdown() waits for the next poll (0.5 s by default)
    threading.Thread(target=server.serve_forever, args=(0.05,), name="vlaunch-http",
                     daemon=True).start()
    port = int(server.server_address[1])
    log.info("listening on http://%s:%d", engine.opts.host, port)
    if engine.opts.port_file:
        write_port_file(Path(engine.opts.port_file), port)
    return server


def _bind(address: tuple[str, int], patience: float = BIND_PATIENCE) -> _Server:
    """The server bound to `address`, retrying while the port is in use for `patience` s.

    The engine this one replaces (a promoted standby starts serving the moment it is gone)
    may still hold the port for a moment after its death: the kernel can close a killed
    process's sockets after it has been reaped (the last reference dropped late, on a
    workqueue), most often a listener with a connection in its queue."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return _Server(address, _Handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or not address[1] or time.monotonic() > deadline:
                raise
            log.debug("port %d still in use (the engine before this one closing?); retrying",
                      address[1])
            time.sleep(0.05)


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
