"""Share-mode leases, engine side: when one ends, and the thread that notices a cache leave.

A share-mode engine keeps its connection open while it holds mappings: the cache counts it as
a consumer. The lease ends when the engine has dropped the last tensor over the mapped slabs
(`Lease`), and one daemon thread per process (`WATCHER`) polls every lease's connection so
that a cache process that goes away is one warning, never a failure: the mappings stay valid.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import select
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Protocol

    import torch

    class Watched(Protocol):
        """A lease's connection, as the watcher sees it (client.connection.CacheClient)."""

        def fileno(self) -> int:
            """The connection's fd; -1 once closed."""

        def went_away(self) -> None:
            """Called once when the cache closed the connection."""

log = logging.getLogger("vlaunch.cache.client.leases")


class Lease:
    """The slabs one connection mapped in share mode; `end` runs once the engine has dropped
    the last tensor over them (any view keeps its slab)."""

    def __init__(self, slabs: list[torch.Tensor], end: Callable[[], None]) -> None:
        self._alive: list[None] = [None] * len(slabs)  # one entry per slab still referenced
        self._end = end
        for slab in slabs:
            # A storage's Python object lives exactly as long as its memory (torch keeps it
            # alive while any tensor uses the storage), so this fires when the mapping goes.
            weakref.finalize(slab.untyped_storage(), self._gone)

    def _gone(self) -> None:
        """A mapped slab was freed; after the last one, the lease ends (GC may call this)."""
        with contextlib.suppress(IndexError):
            self._alive.pop()  # atomic under the GIL: no lock a finalizer could block on
        if not self._alive:
            self._end()


class Watcher:
    """One daemon thread that polls every lease's connection for the cache hanging up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, Watched] = {}  # fd -> connection
        self._wake_r, self._wake_w = -1, -1
        self._thread = False

    def add(self, conn: Watched) -> None:
        """Watch `conn` until it is removed or hangs up."""
        with self._lock:
            self._watched[conn.fileno()] = conn
            self._start()
        self._wake()

    def remove(self, conn: Watched) -> None:
        """Stop watching (before the socket closes, so its fd number is never misread)."""
        with self._lock:
            fd = next((f for f, c in self._watched.items() if c is conn), None)
            if fd is not None:
                del self._watched[fd]
        if fd is not None:
            self._wake()

    def count(self) -> int:
        """Leases being watched."""
        return len(self._watched)

    def start(self) -> None:
        """Start the thread now, if it is not running (`add` starts it otherwise)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        """Start the thread once per process (lock held)."""
        if self._thread:
            return
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = True
        # _thread, not threading: Thread.start() waits until the new thread has run, a
        # scheduler wake-up inside the first handoff.
        _thread.start_new_thread(self._run, (self._wake_r,))

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self, wake: int) -> None:
        hangup = select.POLLRDHUP | select.POLLHUP
        while True:
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            with self._lock:
                watched = dict(self._watched)
            for fd in watched:
                poller.register(fd, hangup)
            for fd, event in poller.poll():
                if fd == wake:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake, 4096)
                elif event & (hangup | select.POLLERR | select.POLLNVAL):
                    self._hung_up(fd, watched[fd], warn=not event & select.POLLNVAL)

    def _hung_up(self, fd: int, conn: Watched, *, warn: bool) -> None:
        with self._lock:
            if self._watched.get(fd) is not conn:
                return  # removed (and maybe closed) while we polled
            del self._watched[fd]
        if warn and conn.fileno() >= 0:
            conn.went_away()

    def after_fork(self) -> None:
        """A forked child has no watcher thread and no leases of its own."""
        self._lock = threading.Lock()
        self._watched.clear()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r, self._wake_w, self._thread = -1, -1, False


WATCHER = Watcher()
os.register_at_fork(after_in_child=WATCHER.after_fork)
