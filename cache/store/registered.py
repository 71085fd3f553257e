"""CUDA slabs filled straight from the page cache: the file's mapping registered, then DMA.

The staging reader copies every byte twice on the host (page cache to pinned buffer, then the
copy engine reads the buffer): when several ranks load at once, the host's memory bandwidth
may be the limit (TP 2 ranks at 52-56% of a lone TP 1 rank, H200 x2). Here each file is
mapped read-only and registered with the driver (`cuMemHostRegister`, read-only) window by
window, and every piece moves by DMA out of the page cache itself: no host copy, no staging
buffers. A split along dimension 1 is a 2-D copy (each row's part, the row
pitch apart), so a rank moves only its own bytes. A copy may not span two registrations (the
driver answers "invalid argument"), so copies are cut at window boundaries.

Opt-in (VLAUNCH_READER=register, reader.reader_mode): on two H200s it was not faster than the
staging reader (registering and copying do not overlap; 8 registering threads were slower
than 1; a 2-D DMA of rows a few KiB long crawls: benchmarks/results/gpu_2026-12-01.md).
Registering a cold file reads it from disk on one thread. Any refusal to register falls back
to the staging reader.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from ctypes import byref, c_void_p
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.store.pieces import Piece

log = logging.getLogger("vlaunch.cache.store.registered")
WINDOW = 32 << 20  # bytes registered at once; a multiple of the page size
CHUNK = 64 << 20  # the most file bytes one piece spans
LAST: dict[str, Any] = {}  # the last fill's outcome: windows registered, refused (benchmarks)


def windows(spans: Sequence[tuple[int, int]], size: int, window: int = WINDOW
            ) -> list[tuple[int, int, list[int]]]:
    """The windows of a file to register, in file order: (start, length, pieces ready).

    `spans` are the pieces' byte ranges (offset, length) in a file of `size` bytes. Windows
    are `window`-aligned, never overlap, and only those that hold a needed byte are listed;
    a piece is ready (listed with a window) once the window holding its last byte is, and
    every window it touches comes no later.
    """
    needed: dict[int, list[int]] = {}
    for i, (offset, length) in enumerate(spans):
        if length <= 0:
            continue
        first, last = offset // window, (offset + length - 1) // window
        for k in range(first, last + 1):
            needed.setdefault(k, [])
        needed[last].append(i)
    return [(k * window, min(window, size - k * window), sorted(needed[k]))
            for k in sorted(needed)]


@dataclass(frozen=True)
class Copy:
    """One DMA out of a registered window: `height` rows of `width` bytes, `pitch` bytes apart
    in the file from file offset `src`, packed (`width` apart) from byte `dst` of the piece."""

    src: int
    dst: int
    width: int
    height: int
    pitch: int


def window_copies(piece: Piece, start: int, end: int) -> list[Copy]:
    """The copies that move a piece's kept bytes lying in file window [start, end).

    Each row keeps bytes [lo, lo + width) of its `row` bytes. Rows wholly inside the window
    are one 2-D copy; a row cut by the window's first or last byte is a 1-D copy of its part
    inside. Every copy's source lies in the window; over all windows, each kept byte once.
    """
    base, row, width = piece.offset + piece.lo, piece.row, piece.width
    if width <= 0 or piece.rows <= 0:
        return []
    first = max(0, (start - width - base) // row + 1)  # the first row ending after `start`
    stop = min(piece.rows, -(-(end - base) // row))  # past the last row beginning before `end`
    out = []
    if first < stop and base + first * row < start:  # cut by the window's start
        at = base + first * row
        hi = min(at + width, end)
        out.append(Copy(start, first * width + start - at, hi - start, 1, hi - start))
        first += 1
    tail = []
    if first < stop and base + (stop - 1) * row + width > end:  # cut by the window's end
        at = base + (stop - 1) * row
        tail.append(Copy(at, (stop - 1) * width, end - at, 1, end - at))
        stop -= 1
    if first < stop:
        out.append(Copy(base + first * row, first * width, width, stop - first, row))
    return out + tail


@dataclass
class _Job:
    """One window of `file`: its host address and length, and its copies (copy, the file's
    base address, the destination's address)."""

    file: str
    address: int
    length: int
    copies: list[tuple[Copy, int, int]] = field(default_factory=list)


def fill_registered(work: Sequence[tuple[str, Piece, torch.Tensor]], fds: dict[str, int],
                    device: torch.device, progress: Callable[[int], None]) -> bool:
    """Copy every (file, piece, destination) out of the registered page cache; False, with
    nothing registered left behind and no copy in flight, when the driver refuses to register.

    Each window is registered in file order and its copies queued on one stream as soon as it
    is, so the copy engine drains the queue while the next window is registered (one thread:
    eight were slower, benchmarks/results/figures.md). Split rows go by 2-D copies
    straight from the page cache: only the rank's own bytes cross the bus.
    """
    import numpy as np

    by_file: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for file, piece, dst in work:
        by_file.setdefault(file, []).append((piece, dst))
    jobs: list[_Job] = []
    keep: list[Any] = []  # the mappings, until every registration in them is released
    for file, items in by_file.items():
        size = os.fstat(fds[file]).st_size
        array = np.frombuffer(mmap.mmap(fds[file], size, prot=mmap.PROT_READ), dtype=np.uint8)
        keep.append(array)
        base = array.ctypes.data
        pages = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        for start, _, _ in windows([(p.offset, p.span) for p, _ in items], size, WINDOW):
            length = min(WINDOW, pages - start)
            job = _Job(file, base + start, length)
            for piece, dst in items:
                job.copies.extend((c, base, dst.data_ptr())
                                  for c in window_copies(piece, start, start + length))
            jobs.append(job)
    LAST.clear()
    held: list[int] = []
    try:
        refused = _register_and_copy(jobs, device, held, progress)
    finally:
        _release_later(device, held, keep)
        LAST.update(windows=len(held))
    if refused is not None:
        file, error = refused
        log.warning("cannot register %s with the CUDA driver (%s); reading it through pinned "
                    "staging buffers instead", file, error)
        LAST.update(refused=str(error))
        return False
    return True


def _register_and_copy(jobs: list[_Job], device: torch.device, held: list[int],
                       progress: Callable[[int], None]) -> tuple[str, Exception] | None:
    """Register each job's window (its address appended to `held`) and queue its copies on
    one stream, then wait for them; (file, error) when the driver refuses a registration."""
    import torch

    from vlaunch.cache.store import cudadrv as cu

    stream = torch.cuda.Stream(device)
    try:
        with torch.cuda.device(device):  # the driver calls act in its primary context
            handle = c_void_p(stream.cuda_stream)
            for job in jobs:
                try:
                    cu.call("cuMemHostRegister_v2", c_void_p(job.address), job.length,
                            cu.MEMHOSTREGISTER_READ_ONLY)
                except cu.DriverError as e:
                    return job.file, e
                held.append(job.address)
                for c, base, dst in job.copies:
                    cu.call("cuMemcpy2DAsync_v2", byref(_desc(c, base, dst)), handle)
                    progress(c.width * c.height)
        return None
    finally:
        stream.synchronize()


def _desc(c: Copy, base: int, dst: int) -> Any:
    """The driver's description of copy `c` from the file mapped at `base` to address `dst`."""
    from vlaunch.cache.store import cudadrv as cu

    d = cu.Memcpy2D()
    d.srcMemoryType, d.srcHost, d.srcPitch = cu.MEMORYTYPE_HOST, base + c.src, c.pitch
    d.dstMemoryType, d.dstDevice, d.dstPitch = cu.MEMORYTYPE_DEVICE, dst + c.dst, c.width
    d.WidthInBytes, d.Height = c.width, c.height
    return d


def _release_later(device: torch.device, held: list[int], keep: list[Any]) -> None:
    """Unregister the windows (their copies are done) on a thread: the load is complete
    without waiting for it; the mappings are dropped after."""
    if not held:
        return

    def release() -> None:
        import torch

        from vlaunch.cache.store import cudadrv as cu

        torch.cuda.set_device(device)
        for address in held:
            with contextlib.suppress(cu.DriverError):
                cu.call("cuMemHostUnregister", c_void_p(address))
        held.clear()
        keep.clear()

    threading.Thread(target=release, name="vlaunch-unregister", daemon=True).start()
