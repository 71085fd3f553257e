"""One standby engine's channels: the pipe it is promoted on and its own notify socket.

The protocol itself (environment, PARKED=1, PROMOTE) is in cache/contract/standby.py; the
decisions (when to start, promote, replace or give up a standby) are in core/standby.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from vlaunch.cache.contract.standby import PARKED_FIELD, PROMOTE, standby_env

from .notify import EngineNotifySocket

log = logging.getLogger("vlaunch.launcher")


class StandbyChannel:
    """The promote pipe (its read end goes to the standby) and the standby's notify socket."""

    def __init__(self, directory: Path, number: int) -> None:
        self.number = number
        self.notify = EngineNotifySocket(directory, f"standby-{number}-notify.sock")
        self.read_fd, self.write_fd = os.pipe()  # both close-on-exec; pass_fds hands one on

    def env(self) -> dict[str, str]:
        """The environment entries that make the engine command a standby."""
        return standby_env(self.read_fd)

    def spawned(self) -> None:
        """The child holds the read end now (or failed to start): drop ours."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def read(self) -> tuple[bool, bool, bool]:
        """Drain the notify socket: (PARKED=1 seen, READY=1 seen, WATCHDOG=1 seen)."""
        parked = ready = watchdog = False
        for fields in self.notify.read():
            parked = parked or fields.get(PARKED_FIELD) == "1"
            ready = ready or fields.get("READY") == "1"
            watchdog = watchdog or fields.get("WATCHDOG") == "1"
        return parked, ready, watchdog

    def promote(self) -> bool:
        """Write PROMOTE and close the pipe; False if the standby is already gone."""
        try:
            os.write(self.write_fd, PROMOTE)
        except BrokenPipeError:
            log.warning("standby engine %d exited before its promotion arrived; its exit is "
                        "handled as the engine's", self.number)
            return False
        finally:
            self._close_write()
        return True

    def close(self) -> None:
        """Close both ends and remove the socket."""
        self.spawned()
        self._close_write()
        self.notify.close()

    def _close_write(self) -> None:
        if self.write_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.write_fd)
            self.write_fd = -1
