"""sd_notify: datagrams to $NOTIFY_SOCKET that never block and never end the sender.

One implementation for the launcher, the cache ranks and the reference engine (whose
`Watchdog` pings are the launcher's --engine-watchdog). The socket is
non-blocking: a reader that does not keep up (its queue is full) costs a dropped message, not
a stalled event loop. A variable naming a socket that is gone (a stale NOTIFY_SOCKET left in
a shell, a systemd that restarted) costs one warning, then the process carries on.

Not the `sdnotify` package (0.3.2, unchanged since 2019): its socket blocks when the reader's
queue is full (a stalled systemd would stall the launcher's event loop), it connects once at
construction from `os.environ` only (no explicit address for an engine's own notify socket, and
a socket that appears later is never reached), and it encodes latin-1 (a STATUS= with a character
outside latin-1, in a path say, is silently dropped).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("vlaunch.notify")
MAX_DATAGRAM = 4096


def format_fields(fields: Mapping[str, str]) -> bytes:
    """`KEY=value` lines, in order, as sd_notify wants them."""
    return "\n".join(f"{k}={v}" for k, v in fields.items()).encode()


def parse_fields(data: bytes) -> dict[str, str]:
    """The assignments of one received message (lines without `=` are ignored)."""
    fields = {}
    for line in data.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


class SdNotify:
    """Sends sd_notify messages when NOTIFY_SOCKET is set; a no-op otherwise."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        raw = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
        self.target = raw
        self._address = "\0" + raw[1:] if raw.startswith("@") else raw  # @: abstract namespace
        self._sock: socket.socket | None = None
        self._failing = ""  # the failure already logged; cleared by a send that gets through
        if raw:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                                       | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        """Whether NOTIFY_SOCKET was set."""
        return self._sock is not None

    def send(self, fields: Mapping[str, str]) -> bool:
        """Send one message made of these assignments; False if it was dropped."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto(format_fields(fields)[:MAX_DATAGRAM], self._address)
        except BlockingIOError:
            self._failed("full", "its reader is not keeping up; dropping messages until it "
                                 "does")
            return False
        except OSError as exc:
            self._failed(exc.__class__.__name__, f"{exc.strerror or exc}; is NOTIFY_SOCKET "
                         "stale? unset it outside systemd")
            return False
        self._failing = ""
        return True

    def _failed(self, kind: str, why: str) -> None:
        """Log a failure once, until a send gets through again."""
        if self._failing != kind:
            log.warning("sd_notify to %s failed: %s; systemd will not see our state",
                        self.target, why)
        self._failing = kind

    def close(self) -> None:
        """Close the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Watchdog:
    """`WATCHDOG=1` on NOTIFY_SOCKET at most every quarter of `WATCHDOG_USEC`, when it is set
    (and `WATCHDOG_PID`, if set, names this process): sd_watchdog_enabled(3)'s rule. Call
    `ping` from the loop whose progress it vouches for: a stuck loop stops the pings."""

    def __init__(self, env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ if env is None else env
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        on = usec.isdigit() and int(usec) > 0 and pid in ("", str(os.getpid()))
        self.every: float | None = int(usec) / 4e6 if on else None
        self._out = SdNotify(env) if on else None
        self._clock = clock
        self._next = -math.inf

    @property
    def enabled(self) -> bool:
        """Whether pings are asked for (and there is a socket to send them to)."""
        return self._out is not None and self._out.enabled

    def ping(self) -> None:
        """Send WATCHDOG=1 unless one went out less than a quarter interval ago."""
        if self._out is None or self.every is None:
            return
        now = self._clock()
        if now >= self._next:
            self._next = now + self.every
            self._out.send({"WATCHDOG": "1"})
