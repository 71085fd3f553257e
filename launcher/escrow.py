"""The launcher's escrow: duplicates of each ready rank's slab fds, held with no CUDA context.

While the launcher holds them, the slabs outlive their rank: a rank respawned after a crash
adopts them instead of reading the disk. What a rank holds, the escrow holds: its checkpoint
("raw") slabs from its ready report, each engine layout it adopts, and nothing of a layout it
released (copy-release, or an engine layout that replaced the raw one): held fds would keep
that memory allocated forever. Its artifacts (autotune tables) are held too, as the rank sent
them, bounded by count and bytes (the oldest go first), so that a respawned rank gets them
back without an artifact directory.
"""

from __future__ import annotations

import logging
import socket
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vlaunch.cache.contract import protocol, wire

log = logging.getLogger("vlaunch.launcher.escrow")
MAX_OPENED = 256
"""Live openers of a rank's slabs held for its respawn (rank/openers.py MAX_OPENERS)."""
MAX_ARTIFACTS = 64
"""Artifacts held per rank (a rank holds as many)."""
MAX_ARTIFACT_BYTES = 4 * protocol.MAX_ARTIFACT_DATA
"""Base64 bytes of artifacts held per rank (four at the size limit, about 85 MiB); the oldest go
first beyond it."""


@dataclass
class Held:
    """One rank's escrow: its ready report, raw slab fds, and its engine layouts' frames."""

    ready: dict[str, Any]
    fds: list[int]
    released: bool = False
    incomplete: bool = False  # not every process that opened the raw slabs can be named
    opened: dict[int, float] = field(default_factory=dict)  # pid -> start time, of openers
    layouts: list[tuple[dict[str, Any], list[int]]] = field(default_factory=list)
    artifacts: OrderedDict[tuple[str, str], dict[str, Any]] = field(
        default_factory=OrderedDict)


def _close(fds: list[int]) -> int:
    wire.close_fds(fds)
    return len(fds)


class Escrow:
    """Slab fds by rank; every fd is closed exactly once (replaced, released or closed)."""

    def __init__(self) -> None:
        self._held: dict[int, Held] = {}

    def __contains__(self, rank: object) -> bool:
        """Whether a respawn of `rank` has anything to adopt."""
        return rank in self._held

    def keep(self, rank: int, ready: dict[str, Any], fds: list[int]) -> None:
        """Hold a rank's ready report and raw fds (closing what an earlier life left)."""
        self.drop(rank)
        self._held[rank] = Held(ready, fds)

    def keep_layout(self, rank: int, frame: dict[str, Any], fds: list[int]) -> None:
        """Hold an engine layout the rank adopted (fds closed if the rank is not held)."""
        held = self._held.get(rank)
        if held is None:
            _close(fds)
            return
        held.layouts.append((frame, fds))

    def keep_artifact(self, rank: int, frame: dict[str, Any]) -> None:
        """Hold an artifact frame of a held rank (replacing one of the same name), bounded."""
        held = self._held.get(rank)
        if held is None:
            return
        if len(frame["data"]) > protocol.MAX_ARTIFACT_DATA or max(
                len(frame["kind"]), len(frame["key"])) > protocol.MAX_STRING:
            log.warning("cache rank %d sent an oversized artifact frame: not escrowed", rank)
            return
        held.artifacts.pop((frame["kind"], frame["key"]), None)
        held.artifacts[(frame["kind"], frame["key"])] = frame
        while len(held.artifacts) > MAX_ARTIFACTS or (len(held.artifacts) > 1 and sum(
                len(f["data"]) for f in held.artifacts.values()) > MAX_ARTIFACT_BYTES):
            held.artifacts.popitem(last=False)

    def keep_opener(self, rank: int, msg: dict[str, Any]) -> None:
        """A process opened the rank's raw slabs (pid, start time), or not every opener can
        be named: a respawn that adopts them is told (it follows them); bounded."""
        held = self._held.get(rank)
        if held is None:
            return
        if len(held.opened) >= MAX_OPENED:  # forget the ones that exited
            held.opened = {p: t for p, t in held.opened.items() if _runs(p, t)}
        if msg.get("incomplete") is True or len(held.opened) >= MAX_OPENED:
            held.incomplete, held.opened = True, {}
        elif not held.incomplete and isinstance(msg.get("pid"), int) and "started" in msg:
            held.opened[msg["pid"]] = float(msg["started"])

    def release_raw(self, rank: int) -> int:
        """The rank dropped its raw slabs: close ours; returns how many fds were closed. With
        no engine layout left either, nothing is held: a respawn reads the disk."""
        held = self._held.get(rank)
        if held is None:
            return 0
        closed = _close(held.fds)
        held.fds, held.released = [], True
        if not held.layouts:
            del self._held[rank]
        return closed

    def drop(self, rank: int) -> int:
        """Close everything held for `rank`; returns how many fds were closed."""
        held = self._held.pop(rank, None)
        if held is None:
            return 0
        return _close(held.fds) + sum(_close(fds) for _, fds in held.layouts)

    def hand_over(self, rank: int, sock: socket.socket) -> None:
        """Send a respawned rank its escrow on its adopt channel (we keep our duplicates)."""
        held = self._held[rank]
        extra: dict[str, Any] = {k: held.ready[k] for k in ("version", "model", "label")
                                 if k in held.ready}  # what a swap made the rank serve
        if held.released:
            extra["released"] = True
        if held.incomplete:
            extra["incomplete"] = True
        elif held.opened:
            extra["opened"] = [[pid, started] for pid, started in held.opened.items()]
        wire.send_frame(sock, protocol.event("escrow", manifest=held.ready["manifest"],
                                             fingerprint=held.ready["fingerprint"], **extra),
                        held.fds)
        for frame, fds in held.layouts:
            wire.send_frame(sock, frame, fds)
        for frame in held.artifacts.values():
            wire.send_frame(sock, frame)

    def fd_count(self) -> int:
        """Fds held, over every rank."""
        return sum(len(h.fds) + sum(len(f) for _, f in h.layouts) for h in self._held.values())

    def close(self) -> None:
        """Close everything (the launcher is exiting)."""
        for rank in list(self._held):
            self.drop(rank)


def _runs(pid: int, started: float) -> bool:
    """Whether process `pid`, started at `started`, still runs (a pid and its start time name
    one process)."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time()) == started
    except psutil.Error:
        return False
