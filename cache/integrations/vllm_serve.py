"""`vllm serve` on the socket `vlaunch run --listen` passes (socket activation), with a drain.

`vlaunch run --listen HOST:PORT` binds the engine's listening socket once and hands it to each
engine and standby by the socket-activation protocol (`LISTEN_FDS=N`, `LISTEN_PID=<the
engine's pid>`, `LISTEN_FDNAMES`, fds from 3). vLLM's plugin (vllm_loader.register, loaded by
the API server process while it parses its arguments, before it binds) calls `install()` here.

The seam (vLLM 0.32, `vllm/entrypoints/launchers/launcher.py`): `setup_server` makes the HTTP
socket by calling the module's `create_server_socket(addr, reuse_port=...)` (or
`create_server_unix_socket(path)` with `--uds`), looked up in that module when it runs, and
`serve_http` hands that socket to uvicorn (`server.serve(sockets=[sock])`). Both `vllm serve`
and `python -m vllm.entrypoints.openai.api_server` reach it (`run_server`, and the parent of
several API servers in `run_multi_api_server`). In that process only (LISTEN_PID its pid, and
vLLM's launcher module imported: a front of one's own that builds `LLM` is left alone),
`install()` replaces those two module attributes, after checking the version and that
`setup_server` still calls them (else the start fails with an error naming the vLLM version),
with functions that take the passed socket when vLLM would bind (unsetting the LISTEN_*
variables before vLLM starts its children) and return it; without one they bind as vLLM does.
vLLM's other sockets (`--grpc`'s) are untouched.

The drain: on SIGTERM vLLM 0.32 first shuts its engine down (aborting what is in flight, unless
`--shutdown-timeout`), while uvicorn still accepts, and only then stops accepting. On a socket
the next engine accepts from too, that sends new connections to an engine on its way out. So,
only when it serves the inherited socket, `serve_http`'s server (the module's `NoSignalServer`,
replaced by a subclass) takes SIGTERM itself: it stops accepting at once (closes its copy of the
socket: a close, never a `shutdown()`, which would stop the socket listening for every process
that shares it), ends the keep-alive connections idle between two requests, answers the requests
it holds with `Connection: close`, and waits (at most NEW_REQUEST_WAIT) for the first request of
each connection it accepted that has none yet: uvicorn's own shutdown closes such a connection
unanswered, which fails a request its client has sent (on a busy host the request arrives after
the accept). Then it exits uvicorn's loop, whose shutdown lets every open request finish; vLLM
then shuts its engine down with nothing in flight. A second SIGTERM forces the exit; SIGINT is
vLLM's.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import signal
import socket
import sys
from collections.abc import MutableMapping
from typing import Any

from vlaunch.cache.contract import activation
from vlaunch.cache.contract.errors import UsageError

log = logging.getLogger("vllm.vlaunch")

SUPPORTED = ("0.32.",)  # vLLM versions whose launcher module this seam was read in
_LAUNCHER = "vllm.entrypoints.launchers.launcher"
NEW_REQUEST_WAIT = 2.0  # s a drain waits for the first request of a connection it accepted
_inherited: socket.socket | None = None  # the passed socket, once vLLM's setup_server took it


class VllmListenError(UsageError):
    """`vllm serve` cannot serve from the socket the launcher passed."""


def passed_socket(env: MutableMapping[str, str] | None = None) -> socket.socket | None:
    """The listening socket passed to this process (fd 3), or None when none is
    (activation.passed_socket: the variables unset, the fd close-on-exec)."""
    passed = activation.passed_socket(env, who="vllm serve")
    if passed is None:
        return None
    sock, count, names = passed
    if count > 1:
        log.warning("vlaunch: vllm serve serves one of the %d sockets passed (%s): fd %d (%s)",
                    count, ", ".join(n for n in names if n) or "unnamed", sock.fileno(),
                    names[0] or "-")
    return sock


def install(env: MutableMapping[str, str] | None = None) -> bool:
    """In vLLM's API server process, when the launcher passed it a socket, make the server
    serve from it and drain on SIGTERM; False (nothing changed) anywhere else: no socket for
    this pid, or a process that is not vLLM's API server (vLLM's children; a front of one's
    own that builds `LLM` keeps the variables for its own socket)."""
    env = os.environ if env is None else env
    if not env.get("LISTEN_FDS") or env.get("LISTEN_PID") != str(os.getpid()) or \
            _LAUNCHER not in sys.modules:  # vllm serve imports it before it loads plugins
        return False
    launcher = _launcher_module()
    if getattr(launcher.create_server_socket, "_vlaunch", False):
        return True
    bind_tcp, bind_unix = launcher.create_server_socket, launcher.create_server_unix_socket

    def take(what: object) -> socket.socket | None:
        global _inherited
        if _inherited is None:
            _inherited = passed_socket(env)
            if _inherited is not None:
                log.info("vlaunch: serving HTTP on the socket vlaunch run passed (fd %d, %s), "
                         "not binding %s", _inherited.fileno(), _where(_inherited), what)
        return _inherited

    def create_server_socket(addr: Any, *args: Any, **kwargs: Any) -> socket.socket:
        return take(addr) or bind_tcp(addr, *args, **kwargs)

    def create_server_unix_socket(path: Any, *args: Any, **kwargs: Any) -> socket.socket:
        return take(f"unix:{path}") or bind_unix(path, *args, **kwargs)

    for fn in (create_server_socket, create_server_unix_socket):
        fn._vlaunch = True  # type: ignore[attr-defined]
    launcher.create_server_socket = create_server_socket
    launcher.create_server_unix_socket = create_server_unix_socket
    launcher.NoSignalServer = _draining_server(launcher.NoSignalServer)
    return True


def _launcher_module() -> Any:
    """vLLM's launcher module, checked to be the one this seam was written against."""
    import vllm

    version = getattr(vllm, "__version__", "?")
    try:
        launcher = importlib.import_module(_LAUNCHER)
    except ImportError as exc:
        raise VllmListenError(f"vlaunch: vllm serve under vlaunch run --listen needs vLLM "
                              f"{'/'.join(v + 'x' for v in SUPPORTED)}; vLLM {version} has no "
                              f"vllm.entrypoints.launchers.launcher ({exc})") from None
    setup = getattr(launcher, "setup_server", None)
    called = set(getattr(getattr(inspect.unwrap(setup), "__code__", None), "co_names", ()))
    missing = [name for name in ("create_server_socket", "create_server_unix_socket")
               if name not in called or not callable(getattr(launcher, name, None))]
    server = getattr(launcher, "NoSignalServer", None)
    if not isinstance(server, type) or not hasattr(server, "startup") or missing:
        missing += [] if isinstance(server, type) else ["NoSignalServer"]
        raise VllmListenError(f"vlaunch: no --listen seam in vLLM {version}'s API server "
                              f"(setup_server calling {', '.join(missing)} in "
                              "vllm/entrypoints/launchers/launcher.py, read in vLLM 0.32): "
                              "serve vLLM on a port of its own, without --listen")
    if not version.startswith(SUPPORTED):
        log.warning("vlaunch: vLLM %s: the --listen seam was read in vLLM %s; it is present, "
                    "so it is used", version, "/".join(v + "x" for v in SUPPORTED))
    return launcher


def _where(sock: socket.socket) -> str:
    try:
        name = sock.getsockname()
    except OSError:
        return "?"
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return f"unix:{name}"


def _draining_server(base: type) -> type:
    """serve_http's uvicorn server, which on SIGTERM stops accepting before anything else when
    it serves the inherited socket."""

    class DrainingServer(base):  # type: ignore[misc, valid-type]
        """Stops accepting on SIGTERM, answers what it accepted, then lets uvicorn finish."""

        _vlaunch_draining = False
        _vlaunch_ended: set[Any]  # connections given uvicorn's shutdown() (the drain's)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if _inherited is None or not any(s is _inherited for s in sockets or ()):
                return
            import asyncio

            # serve_http installed vLLM's handler before this task ran: this one replaces it
            # for SIGTERM (SIGINT keeps vLLM's).
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._vlaunch_drain)

        def _vlaunch_drain(self) -> None:
            if self._vlaunch_draining:
                self.force_exit = True
                return
            self._vlaunch_draining, self._vlaunch_ended = True, set()
            for server in getattr(self, "servers", ()):
                server.close()  # this process's copy only; the launcher's stays listening
            log.info("vlaunch: SIGTERM: stopped accepting on the launcher's socket; finishing "
                     "%d open connection(s), then vLLM shuts down",
                     len(self.server_state.connections))
            self._vlaunch_end_started()
            self.should_exit = True

        def _vlaunch_end_started(self) -> list[Any]:
            """uvicorn's graceful end (`shutdown()` of a protocol: an idle connection closed,
            a busy one closed once answered) for each connection that has had a request;
            those that have not (a protocol's `cycle` is None until a request's headers are
            read) are returned."""
            ended = self._vlaunch_ended
            fresh = []
            for conn in list(self.server_state.connections):
                if getattr(conn, "cycle", True) is None:
                    fresh.append(conn)
                elif conn not in ended:  # once: a second shutdown() of a closed h11 one raises
                    ended.add(conn)
                    conn.shutdown()
            return fresh

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if self._vlaunch_draining:
                import asyncio

                loop = asyncio.get_running_loop()
                end = loop.time() + NEW_REQUEST_WAIT
                while self._vlaunch_end_started() and loop.time() < end and \
                        not self.force_exit:
                    await asyncio.sleep(0.01)
            await super().shutdown(sockets)

    return DrainingServer
