"""Slab fds into tensors, engine side: what an `open` reply hands over, mapped or copied.

An `open` reply carries one fd per slab (or per piece of a slab the rank allocated for our
copy) and says how to take them (`Opened`); `import_slabs` maps them with the slab backend
and, in the copy modes, queues one copy per slab into memory of the engine's own.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import CacheBrokenError
from vlaunch.cache.contract.protocol import MAX_FDS
from vlaunch.cache.store.manifest import checked_int

if TYPE_CHECKING:
    import torch

MAX_SLABS = 4096


class Opened:
    """How to take the fds of an `open` reply: the slabs' `sizes`; per slab, the sizes of the
    allocations it is made of, an fd each (`pieces`, or None); whether they are our own copy,
    which the rank is still making (`copying`: mapped writable), or the rank's own slabs,
    ours now (`handed_over`: copy-release, nobody else's). A plain class, as
    contract/settings.py's `Setting`: defined at every engine start."""

    __slots__ = ("copying", "handed_over", "pieces", "sizes")

    def __init__(self, sizes: tuple[int, ...],
                 pieces: tuple[tuple[int, ...], ...] | None = None, copying: bool = False,
                 handed_over: bool = False) -> None:
        self.sizes, self.pieces, self.copying, self.handed_over = (sizes, pieces, copying,
                                                                   handed_over)

    @classmethod
    def of(cls, reply: dict[str, Any], mode: str,
           sizes: tuple[int, ...] | None = None) -> Opened:
        """An ok `open` reply's, checked (`sizes`: known already, from the manifest);
        CacheBrokenError when it is malformed (e.g. a cache of another version)."""
        try:
            if sizes is None:
                raw = reply.get("sizes")
                if not isinstance(raw, list) or len(raw) > MAX_SLABS:
                    raise ValueError("no list of at most 4096 slab sizes")
                sizes = tuple(checked_int(s, "slab size") for s in raw)
            pieces = _pieces(reply.get("pieces"), sizes)
        except (TypeError, ValueError) as exc:
            raise CacheBrokenError(f"invalid open reply from cache: {exc}") from exc
        copying = reply.get("copying") is True and mode != "share"
        handed_over = reply.get("handover") is True and mode == "copy-release" and not copying
        return cls(sizes, pieces if copying else None, copying, handed_over)


def _pieces(pieces: Any, sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    """Per slab, the sizes of the allocations it is made of, checked; None where each slab is
    one fd."""
    if pieces is None:
        return None
    if not isinstance(pieces, list) or len(pieces) != len(sizes):
        raise ValueError("no list of pieces per slab")
    out = tuple(tuple(checked_int(k, "piece size") for k in cut) for cut in pieces
                if isinstance(cut, list))
    if len(out) != len(sizes) or sum(map(len, out)) > MAX_FDS or not all(
            cut and min(cut) > 0 and sum(cut) >= n for cut, n in zip(out, sizes, strict=True)):
        raise ValueError("pieces that do not cover their slabs")
    return out


def import_slabs(fds: list[int], opened: Opened, device: str,
                 copies: list[torch.Tensor] | None = None, *,
                 writable: bool = False) -> list[torch.Tensor]:
    """Map each slab fd (read-only unless the slabs are our own copy, or `writable`); closes
    every fd. With `copies`, also copy each slab into memory of our own (appended to `copies`
    in order): every slab is mapped first, then each destination allocated, then one copy per
    slab queued on the current stream.

    In that order, not overlapped: the driver serialises imports and allocations, so threads
    do not shorten them, and mapping a slab while earlier copies ran stalled on them
    (benchmarks/results/gpu_2026-12-01.md).
    """
    from vlaunch.cache.store.slabs import backend_for

    sizes, pieces = opened.sizes, opened.pieces
    try:
        if len(fds) != (sum(map(len, pieces)) if pieces else len(sizes)):
            raise CacheBrokenError(f"cache sent {len(fds)} fds for {len(sizes)} slabs")
        backend = backend_for(device)
        readonly = not (writable or opened.copying)
        if opened.handed_over:
            mapped = [backend.import_handed_over(fd, size)
                      for fd, size in zip(fds, sizes, strict=True)]
        elif pieces is None:
            mapped = [backend.import_fd(fd, size, readonly=readonly)
                      for fd, size in zip(fds, sizes, strict=True)]
        else:
            mapped, at = [], 0
            for size, cut in zip(sizes, pieces, strict=True):
                mapped.append(backend.import_pieces(fds[at:at + len(cut)], cut, size,
                                                    readonly=readonly))
                at += len(cut)
        if copies is not None:
            from vlaunch.cache.store.slabs import empty_for_copy

            copies.extend(empty_for_copy(n, device) for n in sizes)
            for destination, slab in zip(copies, mapped, strict=True):
                destination.copy_(slab, non_blocking=True)
        return mapped
    finally:
        wire.close_fds(fds)


def release_after_copies(mapped: list[torch.Tensor], device: str) -> None:
    """Drop the slab mappings once the copies queued on this stream are done: the copies are
    waited for here, the unmapping (a driver call per slab, after a device synchronisation)
    runs on a thread the engine does not wait for."""
    if not mapped or not device.startswith("cuda"):
        mapped.clear()
        return
    import torch

    torch.cuda.current_stream(device).synchronize()
    held = list(mapped)
    mapped.clear()
    threading.Thread(target=held.clear, name="vlaunch-unmap", daemon=True).start()


def spin_until_readable(sock: socket.socket, seconds: float) -> None:
    """Poll `sock` without sleeping until it is readable, for at most `seconds`.

    For the one reply a copy-mode handoff waits milliseconds for (the rank's copy into our
    slabs): a thread asleep in recv() was woken up late by a sizeable share of that. The
    engine burns one core for as long as the copy runs, once per start, as CUDA's own
    spin-wait does; past `seconds` it sleeps in recv() as for any reply."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP)
    deadline = time.perf_counter() + seconds
    while not poller.poll(0) and time.perf_counter() < deadline:
        pass
