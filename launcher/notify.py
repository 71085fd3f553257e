"""sd_notify out to systemd, and a notify socket of our own for the engine."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("vlaunch.launcher")


class Notifier:
    """Sends sd_notify messages when NOTIFY_SOCKET is set; failures are logged, not hidden."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        self._notifier = None
        self._failed = False
        if self.enabled:
            import sdnotify

            self._notifier = sdnotify.SystemdNotifier(debug=True)  # debug: raise, not swallow

    def send(self, fields: Mapping[str, str]) -> None:
        """Send one message made of these assignments."""
        if self._notifier is None:
            return
        items = dict(fields)
        if "RELOADING" in items:  # systemd needs the time the reload began
            items["MONOTONIC_USEC"] = str(time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)
        try:
            self._notifier.notify("\n".join(f"{k}={v}" for k, v in items.items()))
        except OSError as exc:
            if not self._failed:
                log.warning("sd_notify to %s failed: %s; systemd will not see our state",
                            os.environ.get("NOTIFY_SOCKET"), exc)
            self._failed = True


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

    def __init__(self, directory: Path) -> None:
        self.path = directory / "engine-notify.sock"
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
            fields = {}
            for line in data.decode("utf-8", "replace").splitlines():
                key, sep, value = line.partition("=")
                if sep:
                    fields[key] = value
            out.append(fields)

    def close(self) -> None:
        """Close and remove the socket."""
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
