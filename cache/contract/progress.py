"""Load progress, one definition for both ends: the frame a loading rank sends the launcher on
its ready channel, and the text both show (bytes, GB/s, ETA)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.errors import ProtocolError

EVENT = "progress"
REPORT_EVERY = 1.0
"""Seconds between two progress frames of one rank (the last one is always sent)."""
ETA_AFTER = 2.0
"""No ETA before this many seconds: the first instants (a cold page cache, thread start-up)
say nothing about the rate."""
ETA_FRACTION = 0.02
"""... nor before this fraction of the bytes is in."""
MAX_BYTES = 1 << 50  # a bound for values read off the channel: 1 PiB per rank


def frame(rank: int, loaded: int, total: int) -> dict[str, Any]:
    """The progress frame a loading rank sends."""
    return protocol.event(EVENT, rank=rank, loaded=loaded, total=total)


def parse(message: dict[str, Any]) -> tuple[int, int] | None:
    """(loaded, total) of a progress frame; None for any other frame; ProtocolError if bad."""
    if message.get("event") != EVENT:
        return None
    loaded, total = message.get("loaded"), message.get("total")
    if not all(type(v) is int and 0 <= v <= MAX_BYTES for v in (loaded, total)):
        raise ProtocolError(f"bad progress frame {message!r}")
    return min(loaded, total), total  # type: ignore[type-var,return-value]


def eta(loaded: int, total: int, elapsed: float) -> float | None:
    """Seconds left at the average rate so far; None while too early to tell."""
    if total <= 0 or elapsed < ETA_AFTER or loaded < total * ETA_FRACTION or loaded <= 0:
        return None
    return (total - loaded) / (loaded / elapsed)


def describe(loaded: int, total: int, elapsed: float) -> str:
    """'3.20/17.40 GB (18%) 1.52 GB/s ETA 9s' (no ETA while too early to tell)."""
    rate = loaded / elapsed if elapsed > 0 else 0.0
    percent = 100 * loaded // total if total else 100
    left = eta(loaded, total, elapsed)
    when = "" if loaded >= total else " ETA --" if left is None else f" ETA {left:.0f}s"
    return (f"{loaded / 1e9:.2f}/{total / 1e9:.2f} GB ({percent}%) {rate / 1e9:.2f} GB/s"
            f"{when}")


def recv_ready(sock: socket.socket, on_progress: Callable[[int, int], None] | None = None
               ) -> tuple[dict[str, Any], list[int]]:
    """Read a rank's channel until its first frame that is not progress; hand each progress
    frame's (loaded, total) to `on_progress` (called in this thread)."""
    while True:
        message, fds = wire.recv_frame(sock)
        loaded_total = parse(message)
        if loaded_total is None:
            return message, fds
        wire.close_fds(fds)  # a progress frame carries none; never leak one that came anyway
        if on_progress is not None:
            on_progress(*loaded_total)
