"""CUDA slabs filled straight from the page cache: the file's mapping registered, then DMA.

The staging reader copies every byte twice on the host (page cache to pinned buffer, then the
copy engine reads the buffer), and allocating the pinned buffers is slow on VMs (1.9-2.8 GB/s
on the H200 VMs measured). Here each file is mapped read-only and registered with the driver
(`cudaHostRegister`, read-only) window by window, and every piece is one host-to-device copy
out of the page cache itself: no host copy, no staging buffers. Registering ran at 50 GB/s
and copying from the registered mapping at 55 GB/s on an H200 (GPU run 2, 2026-11-30); the
two overlap, since a window's copies are queued before the next window is registered.

Chosen by VLAUNCH_READER: `register` always, `auto` when every file the rank reads is at
least 90% in the page cache (registering a cold file reads it from disk on one thread, where
the staging reader's threads read in parallel), `staging` never. Any refusal to register
falls back to the staging reader.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.store.reader import Piece

log = logging.getLogger("vlaunch.cache.store.registered")
WINDOW = 32 << 20  # bytes registered at once; a multiple of the page size
CHUNK = 64 << 20  # the most bytes one copy spans (and the device scratch for split spans)
_READ_ONLY = 8  # cudaHostRegisterReadOnly
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


def resident(fd: int) -> float:
    """The fraction of a file's pages in the page cache (mincore over a fresh mapping); 0.0
    when it cannot be told. Registering a cold file reads it from disk on one thread, so the
    reader chooses this path only for a warm one."""
    import ctypes

    import numpy as np

    size = os.fstat(fd).st_size
    if size == 0:
        return 1.0
    pages = -(-size // mmap.PAGESIZE)
    try:
        mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        vec = ctypes.create_string_buffer(pages)
        view = np.frombuffer(mapping, dtype=np.uint8)  # a read-only mapping's address
        ok = libc.mincore(view.ctypes.data, size, vec) == 0
        del view
        if not ok:
            return 0.0
        return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8)[:pages] & 1)) / pages
    finally:
        mapping.close()


def segments(offset: int, length: int, window: int | None = None) -> list[tuple[int, int]]:
    """The byte range [offset, offset + length) cut at `window` boundaries: (lo, hi) pairs,
    each inside one registered window."""
    window = window or WINDOW  # read at call time: tests shrink WINDOW
    cuts = range((offset // window + 1) * window, offset + length, window)
    bounds = [offset, *cuts, offset + length]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def fill_registered(work: Sequence[tuple[str, Piece, torch.Tensor]], fds: dict[str, int],
                    device: torch.device, chunk: int, progress: Callable[[int], None],
                    split_copy: Callable[[torch.Tensor, torch.Tensor, Piece], None]) -> bool:
    """Copy every (file, piece, destination) out of the registered page cache (`split_copy`
    splits a span's rows on the device); False, with nothing registered left behind, when
    the driver refuses to register a mapping."""
    import numpy as np
    import torch

    cudart = torch.cuda.cudart()
    held: list[tuple[int, Any]] = []  # (registered address, the mapping it lies in)
    by_file: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for file, piece, dst in work:
        by_file.setdefault(file, []).append((piece, dst))
    stream = torch.cuda.Stream(device)
    scratch: torch.Tensor | None = None
    LAST.clear()
    try:
        # registrations belong to the current device's context: make it the rank's own
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for file, items in by_file.items():
                size = os.fstat(fds[file]).st_size
                mapping = mmap.mmap(fds[file], size, prot=mmap.PROT_READ)
                array = np.frombuffer(mapping, dtype=np.uint8)
                with warnings.catch_warnings():  # a read-only source is what we mean
                    warnings.simplefilter("ignore", UserWarning)
                    host = torch.from_numpy(array)
                base = array.ctypes.data
                for start, _, ready in windows([(p.offset, p.span) for p, _ in items], size):
                    # whole pages: the last window ends at the mapping's last page
                    length = min(WINDOW, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE - start)
                    err = cudart.cudaHostRegister(base + start, length, _READ_ONLY)
                    if int(getattr(err, "value", err)) != 0:
                        log.warning("cannot register %s with the CUDA driver (%s); reading "
                                    "it through pinned staging buffers instead", file, err)
                        LAST.update(refused=str(err), windows=len(held))
                        return False
                    held.append((base + start, mapping))
                    for i in ready:
                        piece, dst = items[i]
                        if not piece.contiguous and scratch is None:
                            scratch = torch.empty(chunk, dtype=torch.uint8, device=device)
                        into = dst if piece.contiguous else scratch
                        # one copy per registered window: the driver refuses a copy whose
                        # source spans two registrations ("invalid argument")
                        for lo, hi in segments(piece.offset, piece.span):
                            into[lo - piece.offset:hi - piece.offset].copy_(
                                host[lo:hi], non_blocking=True)
                        if not piece.contiguous:
                            split_copy(dst, scratch, piece)  # stream order reuses scratch
                        progress(piece.nbytes)
        stream.synchronize()
        LAST.update(windows=len(held))
        return True
    finally:
        stream.synchronize()
        _release_later(cudart, held)
        if scratch is not None:
            del scratch
            torch.cuda.empty_cache()  # the rank keeps no cached device memory of its own


def _release_later(cudart: Any, held: list[tuple[int, Any]]) -> None:
    """Unregister the windows (their copies are done) on a thread: the load is complete
    without waiting for it; the mappings are dropped after."""
    if not held:
        return

    def release() -> None:
        for address, _ in held:
            cudart.cudaHostUnregister(address)
        held.clear()

    threading.Thread(target=release, name="vlaunch-unregister", daemon=True).start()
