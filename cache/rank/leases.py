"""A cache rank's clients: `Lease`, one connection and what it has mapped."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

from vlaunch.cache.contract import peers


@dataclass
class Lease:
    """One connected client and what it has mapped."""

    pid: int
    conn: socket.socket = field(repr=False, compare=False)
    client: str = ""
    mode: str = ""
    bytes: int = 0
    since: float = field(default_factory=time.time)

    @property
    def who(self) -> str:
        """The client as log lines name it (pid 0: a process in another PID namespace)."""
        return peers.describe(self.pid, self.client)

    def to_status(self) -> dict[str, Any]:
        """The lease as `status` shows it (its connection is the rank's own business)."""
        return {"pid": self.pid, "client": self.client, "mode": self.mode, "bytes": self.bytes,
                "since": self.since}
