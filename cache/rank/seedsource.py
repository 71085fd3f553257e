"""The seed source: serves one rank's slabs to seeding replicas on a TCP port; needs a token.

Every connection must send the token first (`seed_auth`, compared in constant time); until
then it can ask for nothing, and a wrong one ends it. An authenticated connection asks for the
fingerprint and manifest (`seed_manifest`, whose reply says that ranges and several streams
are served), artifacts, and byte ranges of the slabs (`seed_range`; `seed_slab`, a whole slab,
for seeding ranks of earlier versions). The bytes of a range are written by a thread from a
descriptor of the slab duplicated for it (`seedwire.send_fd`, `send_device`), so the event
loop keeps serving the rank's engines meanwhile. Requests are bounded as on the Unix socket;
a peer that stalls longer than the timeout, or sends a malformed or oversized frame, loses its
connection and nothing else. At most MAX_CONNECTIONS connections are served at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.errors import ProtocolError, SeedError
from vlaunch.cache.rank import seedwire

if TYPE_CHECKING:
    from vlaunch.cache.rank.parts import SeedHost

log = logging.getLogger("vlaunch.cache.rank.seed")
MAX_CONNECTIONS = 4 * seedwire.MAX_STREAMS


@dataclass
class _Peer:
    """One seeding connection: bytes sent since when, and its CUDA slabs' pinned buffers."""

    bytes: int = 0
    since: float = field(default_factory=time.perf_counter)
    device: seedwire.DeviceSender = field(default_factory=seedwire.DeviceSender)


class SeedSource:
    """Serves one rank's slabs to seeding replicas on a TCP port; needs a token."""

    def __init__(self, server: SeedHost, token: str, *, timeout: float = 30.0) -> None:
        if len(token) < 16:
            raise SeedError("the seed token is shorter than 16 characters; use a long random "
                            "one (openssl rand -hex 32)")
        self.server, self.token, self.timeout = server, token.encode(), timeout
        self.listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pool = ThreadPoolExecutor(MAX_CONNECTIONS, thread_name_prefix="vlaunch-seed-send")

    async def start(self, host: str, port: int) -> SeedSource:
        """Listen on host:port (the caller closes this source)."""
        try:
            listener = socket.create_server((host, port), backlog=MAX_CONNECTIONS)
        except OSError as exc:
            raise SeedError(f"cannot listen for seeding on {host}:{port}: {exc.strerror}; "
                            "pick another --seed-listen-port or --seed-listen-host") from None
        listener.setblocking(False)
        self.listener = listener
        self._accepting = asyncio.ensure_future(self._accept(asyncio.get_running_loop()))
        log.info("rank %d: seed source listening on %s:%d", self.server.rank, host, port)
        return self

    def close(self) -> None:
        """Stop listening and drop every connection."""
        for task in [self._accepting, *self._tasks]:
            if task is not None:
                task.cancel()
        if self.listener is not None:
            self.listener.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _accept(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.listener is not None
        while True:
            conn, peer = await loop.sock_accept(self.listener)
            conn.setblocking(False)
            if len(self._tasks) >= MAX_CONNECTIONS:
                log.warning("rank %d: refusing seed client %s: %d connections already",
                            self.server.rank, peer, MAX_CONNECTIONS)
                with contextlib.suppress(OSError):
                    conn.send(protocol.encode(protocol.error(
                        "busy", f"the seed source serves {MAX_CONNECTIONS} connections at "
                        "most")))
                conn.close()
                continue
            task = asyncio.ensure_future(self._client(loop, conn, peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _client(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      peer: tuple[str, int]) -> None:
        sent = _Peer()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            op, f = await self._read(loop, conn)
            if op != "seed_auth" or not hmac.compare_digest(f.get("token", "").encode(),
                                                            self.token):
                raise ProtocolError("wrong or missing seed token")
            await self._send(loop, conn, {"ok": True})
            while True:
                op, f = await self._read(loop, conn)
                await self._dispatch(loop, conn, op, f, sent)
        except (EOFError, ConnectionError, asyncio.CancelledError):
            pass
        except (ProtocolError, TimeoutError, asyncio.TimeoutError) as exc:
            reason = str(exc) or "stalled: no complete request in time"
            log.warning("rank %d: dropping seed client %s: %s", self.server.rank, peer, reason)
            with contextlib.suppress(Exception):
                await self._send(loop, conn, protocol.error("forbidden", reason), timeout=1.0)
        finally:
            conn.close()
            sent.device.close()
            if sent.bytes:
                log.info("rank %d: seed client %s: sent %.2f GB in %.2fs", self.server.rank,
                         peer, sent.bytes / 1e9, time.perf_counter() - sent.since)

    async def _read(self, loop: asyncio.AbstractEventLoop, conn: socket.socket
                    ) -> tuple[str, dict[str, Any]]:
        """One request: no large frames, no fds; idle or stalled past the timeout fails."""
        body = await wire.read_frame(loop, conn, max_body=protocol.MAX_REQUEST_BODY,
                                     frame_timeout=self.timeout, idle_timeout=self.timeout)
        return protocol.validate_request(body)

    async def _send(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                    msg: dict[str, Any], *, timeout: float | None = None) -> None:
        await wire.write_frame(loop, conn, msg, timeout=timeout or self.timeout)

    async def _dispatch(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, op: str,
                        f: dict[str, Any], sent: _Peer) -> None:
        server = self.server
        if server.state != "serving":
            raise ProtocolError("this cache released its copy; it cannot seed")
        if server.handing_over:
            raise ProtocolError("this cache is handing its slabs over to a copy-release "
                                "engine; it cannot seed")
        if op == "seed_manifest":
            await self._send(loop, conn, {"ok": True, "fingerprint": server.fingerprint,
                                          "manifest": server.manifest.to_wire(),
                                          "artifacts": server.artifacts.listing(),
                                          "ranges": True, "streams": seedwire.MAX_STREAMS})
        elif op == "seed_range":
            sent.bytes += await self._range(loop, conn, f["slab"], f["offset"], f["nbytes"],
                                            sent.device)
        elif op == "seed_slab":
            sizes = server.manifest.slab_sizes
            if f["slab"] >= len(sizes):
                raise ProtocolError(f"no slab {f['slab']}")
            sent.bytes += await self._range(loop, conn, f["slab"], 0, sizes[f["slab"]],
                                            sent.device, limit=sizes[f["slab"]])
        elif op == "artifact_get":
            await self._send(loop, conn, server.artifact_reply(f["kind"], f["key"]))
        else:
            raise ProtocolError(f"{op} is not a seeding request")

    async def _range(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, slab: int,
                     offset: int, nbytes: int, device: seedwire.DeviceSender,
                     limit: int = seedwire.MAX_RANGE) -> int:
        """Announce and write one range. It is read from a descriptor of the slab duplicated
        for it (a copy-release may close the rank's own meanwhile), and while it is written
        the rank hands no slab over (`CacheServer.reading_raw`)."""
        server = self.server
        problem = seedwire.range_problem(server.manifest.slab_sizes, slab, offset, nbytes,
                                         limit)
        if problem:
            raise ProtocolError(problem)
        with server.reading_raw():
            fd = os.dup(server.fds[slab])
            try:
                await self._send(loop, conn, {"ok": True, "slab": slab, "offset": offset,
                                              "nbytes": nbytes})
                await loop.run_in_executor(self._pool, self._write, conn.fileno(), fd,
                                           server.manifest.slab_sizes[slab], offset, nbytes,
                                           device)
            finally:
                os.close(fd)
        return nbytes

    def _write(self, sock: int, fd: int, size: int, offset: int, nbytes: int,
               device: seedwire.DeviceSender) -> None:
        """On a sending thread: the range's bytes, from the slab's memfd or its device."""
        if self.server.manifest.backend == "cpu":
            seedwire.send_fd(sock, fd, offset, nbytes, self.timeout)
            return
        from vlaunch.cache.store.slabs import backend_for

        slab = backend_for(self.server.device).map_fd(fd, size, readonly=True)
        try:
            device.send(sock, slab, offset, nbytes, self.timeout)
        finally:
            del slab  # unmapped here, not whenever the thread next runs


def source_port(base: int, rank: int) -> int:
    """The TCP port of `rank`: base + rank."""
    port = base + rank
    if not 0 < port < 65536:
        raise SeedError(f"seed port {base} + rank {rank} is not a valid port; pick a lower "
                        "--seed-listen-port")
    return port
