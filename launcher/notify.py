"""sd_notify out to systemd, and a notify socket of our own for the engine."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from vlaunch.cache.contract.notify import SdNotify, parse_fields


class Notifier:
    """The launcher's sd_notify: adds MONOTONIC_USEC to RELOADING=1; never blocks the loop."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._out = SdNotify(env)
        self.enabled = self._out.enabled

    def send(self, fields: Mapping[str, str]) -> None:
        """Send one message made of these assignments (dropped, logged once, on failure)."""
        items = dict(fields)
        if "RELOADING" in items:  # systemd needs the time the reload began
            items["MONOTONIC_USEC"] = str(time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)
        self._out.send(items)

    def close(self) -> None:
        """Close the socket."""
        self._out.close()


def watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), if systemd asked for them."""
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    with contextlib.suppress(ValueError):
        return int(usec) / 1e6 / 2
    return None


class EngineNotifySocket:
    """A datagram socket the engine gets as NOTIFY_SOCKET; its READY=1 means engine ready."""

    def __init__(self, directory: Path, name: str = "engine-notify.sock") -> None:
        self.path = directory / name
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self.sock.setblocking(False)

    def read(self) -> list[dict[str, str]]:
        """Every pending message, parsed into assignments."""
        out = []
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return out
            out.append(parse_fields(data))

    def close(self) -> None:
        """Close and remove the socket."""
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
