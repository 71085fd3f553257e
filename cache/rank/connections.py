"""A rank's client connections: a documented bound, idle shedding, and an accept loop that
survives running out of file descriptors.

Every connection costs the rank one file descriptor. A lease (a share-mode mapping) keeps its
connection open for as long as the engine holds the tensors; anything else (a status query, a
client between requests) is idle and may be shed when the rank nears its bound. A rank that
cannot accept for `STARVED_AFTER` seconds, even after shedding, can no longer serve: it exits
with RANK_STARVED so that the launcher acts (shutdown, or respawn from escrow).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from vlaunch.cache.contract import protocol, settings, wire
from vlaunch.cache.contract.errors import RankStarvedError

log = logging.getLogger("vlaunch.cache")

MAX_CONNECTIONS = 4096
"""Default bound on a rank's open client connections ($VLAUNCH_MAX_CONNECTIONS overrides)."""
FD_RESERVE = 64
"""File descriptors kept free for everything else a rank opens (slabs, logs, the checkpoint)."""
IDLE_GRACE = 1.0
"""Seconds a connection must have been quiet before it may be shed (not mid-handoff)."""
COPY_GRACE = 30.0
"""Seconds a copy-mode connection must have been quiet before it may be shed."""
STARVED_AFTER = settings.STARVED_AFTER
"""Seconds without a successful accept, shedding included, before the rank gives up
($VLAUNCH_STARVED_AFTER overrides)."""
_SHORT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (systemd's soft default is 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft, hard


def connection_bound(env: Mapping[str, str], reserved_fds: int) -> int:
    """The most client connections this rank keeps open: $VLAUNCH_MAX_CONNECTIONS as given,
    else MAX_CONNECTIONS capped by the file-descriptor limit less a reserve."""
    given = settings.get("VLAUNCH_MAX_CONNECTIONS", env)
    if given is not None:
        return int(given)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft - FD_RESERVE - reserved_fds))


def starved_after(env: Mapping[str, str]) -> float:
    """$VLAUNCH_STARVED_AFTER (seconds), else STARVED_AFTER."""
    return float(settings.get("VLAUNCH_STARVED_AFTER", env))


class Leased(Protocol):
    """What the shedding policy reads of a connection's lease (daemon.Lease)."""

    mode: str  # "" before any open; share, copy or copy-release after


class Connections:
    """Open client connections by id, when each last spoke, and how many may be open."""

    def __init__(self, rank: int, bound: int, starved: float = STARVED_AFTER) -> None:
        self.rank, self.bound, self.starved_after = rank, bound, starved
        self._socks: dict[int, socket.socket] = {}
        self._active: dict[int, float] = {}
        self._refused = 0
        self._short_logged = False
        self._shed, self._shed_logged = 0, -1e9

    def __len__(self) -> int:
        return len(self._socks)

    def add(self, cid: int, conn: socket.socket) -> None:
        """Count a new connection."""
        self._socks[cid] = conn
        self._active[cid] = time.monotonic()

    def touch(self, cid: int) -> None:
        """The connection just made a request."""
        self._active[cid] = time.monotonic()

    def remove(self, cid: int) -> None:
        """The connection is closed."""
        self._socks.pop(cid, None)
        self._active.pop(cid, None)

    def shed_idle(self, leases: Mapping[int, Leased], count: int) -> int:
        """Cut up to `count` idle connections that hold no mapping, quietest first."""
        now = time.monotonic()
        idle = sorted((t, cid) for cid, t in self._active.items()
                      if now - t >= _grace(leases.get(cid)))
        for _, cid in idle[:count]:
            with contextlib.suppress(OSError):
                self._socks[cid].shutdown(socket.SHUT_RDWR)  # its task sees EOF and closes it
        self._shed += len(idle[:count])
        if self._shed and now - self._shed_logged >= 5.0:  # a flood logs every 5 s, not per cut
            log.warning("rank %d: shed %d idle connection(s) (%d open, bound %d)", self.rank,
                        self._shed, len(self), self.bound)
            self._shed, self._shed_logged = 0, now
        return len(idle[:count])

    async def accept_loop(self, loop: asyncio.AbstractEventLoop, listener: socket.socket,
                          leases: Mapping[int, Leased], serve: Callable[[socket.socket], None]
                          ) -> None:
        """Accept clients forever; hand each to `serve`. Refuses past the bound (after
        shedding), and survives EMFILE; raises RankStarvedError when it can accept no more."""
        short_since: float | None = None
        backoff = 0.01
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno not in _SHORT_OF:
                    raise
                short_since = short_since or time.monotonic()
                self._short_of_fds(exc, short_since, leases)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            if short_since is not None:
                log.info("rank %d: accepting clients again (%d open)", self.rank, len(self))
                short_since, backoff, self._short_logged = None, 0.01, False
            conn.setblocking(False)
            if len(self) >= self.bound and not self.shed_idle(leases, 1):
                await self._refuse(loop, conn)
                continue
            serve(conn)

    def _short_of_fds(self, exc: OSError, since: float, leases: Mapping[int, Leased]) -> None:
        """Log once, shed, and give up once the shortage has lasted `starved_after`."""
        if not self._short_logged:
            self._short_logged = True
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            log.error("rank %d: cannot accept clients: %s (%d connections open, "
                      "RLIMIT_NOFILE %d); shedding idle connections and retrying", self.rank,
                      os.strerror(exc.errno or 0), len(self), soft)
        self.shed_idle(leases, max(1, len(self) // 8))
        if time.monotonic() - since >= self.starved_after:
            raise RankStarvedError(
                f"rank {self.rank} could accept no client for {self.starved_after:g} s "
                f"({os.strerror(exc.errno or 0)}, {len(self)} connections open): raise "
                "LimitNOFILE (ulimit -n) or lower VLAUNCH_MAX_CONNECTIONS, and look for an "
                "engine that leaks cache connections")

    async def _refuse(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        """Answer a connection over the bound with a busy error, then close it."""
        self._refused += 1
        if self._refused == 1 or self._refused % 1000 == 0:
            log.warning("rank %d: refusing a client: %d connections open, all holding "
                        "mappings (bound %d; refused %d so far)", self.rank, len(self),
                        self.bound, self._refused)
        try:
            await wire.write_frame(loop, conn, protocol.error(
                "busy", f"the cache serves at most {self.bound} connections and all of them "
                "hold mappings; close unused clients or raise VLAUNCH_MAX_CONNECTIONS"),
                timeout=1.0)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            conn.close()


def _grace(lease: Leased | None) -> float:
    """Seconds of quiet after which a connection may be shed: IDLE_GRACE if it never opened
    the slabs; longer after a copy (its copies may still run); never while it maps them."""
    if lease is None or not lease.mode:
        return IDLE_GRACE
    return COPY_GRACE if lease.mode != "share" else float("inf")
