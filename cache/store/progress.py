"""Progress of one load: log lines, a live line on a TTY, or frames to the launcher."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

from vlaunch.cache.contract import progress as contract
from vlaunch.cache.contract import wire

log = logging.getLogger("vlaunch.cache.store.progress")

Reporter = Callable[[int, int], None]
_reporter: Reporter | None = None  # set while a rank under a launcher loads


class Progress:
    """Bytes done, GB/s and ETA of one load.

    Alone, it draws a live line on a TTY and logs a line every `every` seconds otherwise.
    While `reported_on` is active (a rank under `vlaunch run`), it sends the launcher a frame
    every REPORT_EVERY seconds instead of drawing: the launcher draws every rank on a TTY, and
    log lines still go out when stderr is not a terminal.
    """

    def __init__(self, total: int, label: str, every: float = 5.0) -> None:
        self.total, self.label, self.every = total, label, every
        self.done = 0
        self.start = time.monotonic()
        self._last_line = self._last_report = self.start
        self._lock = threading.Lock()
        self._reporter = _reporter
        self._tty = sys.stderr.isatty()
        if self._reporter is not None:
            self._reporter(0, total)

    def add(self, n: int) -> None:
        """Count n more bytes and report if due."""
        with self._lock:
            self.done += n
            now = time.monotonic()
            final = self.done >= self.total
            if self._reporter is not None and (
                    final or now - self._last_report >= contract.REPORT_EVERY):
                self._last_report = now
                self._reporter(self.done, self.total)
            if self._reporter is not None and self._tty:
                return  # the launcher draws this rank's line
            if final or now - self._last_line >= (0.2 if self._tty else self.every):
                self._last_line = now
                self._show(now, final)

    def _show(self, now: float, final: bool) -> None:
        line = f"{self.label}: {contract.describe(self.done, self.total, now - self.start)}"
        if self._tty:
            print(f"\r\x1b[K{line}", end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            log.info(line)


@contextlib.contextmanager
def reported_on(fd: int, rank: int) -> Iterator[None]:
    """Loads in the body send progress frames on the launcher's ready channel `fd` (a
    duplicate of it: the ready frame still goes on the original). No-op when fd < 0."""
    global _reporter
    if fd < 0:
        yield
        return
    sock = socket.socket(fileno=os.dup(fd))
    send_lock = threading.Lock()

    def report(loaded: int, total: int) -> None:
        with send_lock, contextlib.suppress(OSError):
            wire.send_frame(sock, contract.frame(rank, loaded, total))

    _reporter = report
    try:
        yield
    finally:
        _reporter = None
        sock.close()
