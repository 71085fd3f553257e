"""Read each rank's slices straight into its slabs: several reader threads, bounded staging.

CPU slabs are read into directly (`preadv` into the mapping). CUDA slabs go through one pool
of pinned staging buffers that all reader threads share: while one buffer is read from disk,
others are being copied to the device on the threads' streams (VLAUNCH_READER=register reads
from the registered page cache instead: registered.py). A slice that is not contiguous in the
file (a split along dimension 1) has its rows' parts gathered from the file's mapping, one
strided copy per span (VLAUNCH_SPLIT_READ=span: whole spans read and split after the read, on
the device for CUDA slabs); never row by row. On the host every copy is numpy's or the
kernel's: reading into CPU slabs imports no torch (`slabs.SlabBytes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import settings
from vlaunch.cache.contract.errors import CheckpointError, VlaunchError, exit_status
from vlaunch.cache.store.pieces import Piece, pieces
from vlaunch.cache.store.progress import Progress
from vlaunch.cache.store.slabs import host_array, on_device

if TYPE_CHECKING:
    import numpy as np
    import torch

    from vlaunch.cache.store.manifest import Manifest
    from vlaunch.cache.store.plan import SliceSpec
    from vlaunch.cache.store.slabs import SlabBytes

log = logging.getLogger("vlaunch.cache.store.reader")
CHUNK = 64 << 20
CUDA_CHUNK = 16 << 20  # pinned staging is costly to allocate: up to 2 buffers x threads x this
SPARE_BUFFERS = 2  # pinned staging buffers beyond one per reader thread
STAGING: dict[str, Any] = {}  # the last CUDA load's staging: buffers, chunk, pinned_s


class ReadError(VlaunchError):
    """Reading the checkpoint failed."""

    status = exit_status("IO_ERROR")


def host_view(t: SlabBytes) -> memoryview:
    """A memoryview over host bytes: a numpy array's (writable where it is), or a CPU
    tensor's (writable; the tensor must outlive it)."""
    if not hasattr(t, "data_ptr"):
        return memoryview(t).cast("B")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else \
        memoryview(bytearray())


def pread_into(fd: int, view: memoryview, offset: int, file: str) -> None:
    """Fill `view` from the file's bytes at `offset` (preadv_all with one view)."""
    preadv_all(fd, [view], offset, file)


def fill(specs: list[SliceSpec], manifest: Manifest, slabs: list[SlabBytes], *,
         threads: int, chunk: int | None = None, label: str = "loading") -> None:
    """Read every slice into its place in the slabs (`chunk`: the most bytes one read
    spans; default CHUNK, or CUDA_CHUNK for CUDA slabs, whose staging it sizes). Host slabs
    may be numpy arrays or CPU tensors (the disk fallback's)."""
    records = {t.name: t for t in manifest.tensors}
    cuda = bool(slabs) and on_device(slabs[0])
    if not cuda:
        slabs = [host_array(s) for s in slabs]
    fds = {str(f): os.open(f, os.O_RDONLY | os.O_CLOEXEC)
           for f in {str(s.source.file) for s in specs}}
    progress = Progress(sum(s.nbytes for s in specs), label)
    try:
        if cuda and reader_mode() == "register" and _fill_registered(specs, records, slabs, fds,
                                                                      progress):
            return
        _fill_staged(specs, records, slabs, fds, threads, chunk, progress)
    finally:
        for fd in fds.values():
            os.close(fd)


def reader_mode() -> str:
    """The CUDA reader (VLAUNCH_READER): `staging` (the default: reader threads read into
    pinned buffers, the copy engine moves them) or `register` (DMA out of the registered page
    cache, no host copy: registered.py). Staging is the default: on two H200s it was faster
    or level in every layout but PP 2, where the two traded places
    (benchmarks/results/gpu_2026-12-01.md).
    """
    return str(settings.get("VLAUNCH_READER"))


def _fill_staged(specs: list[SliceSpec], records: dict[str, Any], slabs: list[SlabBytes],
                 fds: dict[str, int], threads: int, chunk: int | None,
                 progress: Progress) -> None:
    """The pinned-staging reader (CUDA slabs) or direct reads (host slabs: numpy arrays), on
    `threads`."""
    cuda = on_device(slabs[0]) if slabs else False
    chunk = chunk or (CUDA_CHUNK if cuda else CHUNK)
    gather = settings.get("VLAUNCH_SPLIT_READ") == "gather"
    if not cuda:  # whole tensors that follow each other in a file: one preadv for many
        specs, batches = _batched(specs, records, slabs, chunk)
    work = [(s, p) for s in specs for p in pieces(s, chunk, packed=gather)]
    maps = {f: _file_bytes(fd) for f, fd in fds.items()} if gather else {}
    mover = (_CudaMover(slabs[0].device, chunk, max(1, threads) + SPARE_BUFFERS) if cuda
             else _HostMover(chunk))

    def one(item: tuple[SliceSpec, Piece]) -> None:
        spec, piece = item
        rec = records[spec.name]
        at = rec.offset + piece.at
        file = str(spec.source.file)
        mover.move(fds[file], file, piece, slabs[rec.slab][at:at + piece.nbytes],
                   maps.get(file))
        progress.add(piece.nbytes)

    def many(items: list[tuple[SliceSpec, Piece]]) -> None:
        for item in items:
            one(item)

    def batch(b: _Batch) -> None:
        preadv_all(fds[b.file], b.views, b.offset, b.file)
        progress.add(b.nbytes)

    groups = [work[i:i + _PER_TASK] for i in range(0, len(work), _PER_TASK)]
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="vlaunch-read") as pool:
            for _ in pool.map(many, groups):
                pass
            if not cuda:
                for _ in pool.map(batch, batches):
                    pass
        mover.finish()
    except BaseException:
        mover.close()
        raise
    release_later(mover)


_PER_TASK = 16  # pieces one reader task moves: fewer hand-offs for many small tensors
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


@dataclass
class _Batch:
    """Whole tensors that follow each other in one file, read with one preadv into their
    places in the slabs."""

    file: str
    offset: int
    nbytes: int
    views: list[memoryview]


def _batched(specs: list[SliceSpec], records: dict[str, Any], slabs: list[np.ndarray],
             chunk: int) -> tuple[list[SliceSpec], list[_Batch]]:
    """Split host-slab reads into batches of whole tensors (at most `chunk` bytes and
    IOV_MAX tensors each, back to back in their file) and the specs left to read piece by
    piece (split slices, larger tensors)."""
    rest: list[SliceSpec] = []
    batches: list[_Batch] = []
    bytes_of = [memoryview(s).cast("B") if len(s) else memoryview(b"") for s in slabs]
    last: _Batch | None = None
    for spec in specs:
        n = spec.nbytes
        if n == 0:
            continue
        if (spec.dim is not None and spec.parts > 1) or n > chunk:
            rest.append(spec)
            continue
        rec = records[spec.name]
        view = bytes_of[rec.slab][rec.offset:rec.offset + n]
        file, begin = str(spec.source.file), spec.source.begin
        if last is not None and last.file == file and last.offset + last.nbytes == begin \
                and last.nbytes + n <= chunk and len(last.views) < _IOV_MAX:
            last.views.append(view)
            last.nbytes += n
            continue
        last = _Batch(file, begin, n, [view])
        batches.append(last)
    return rest, batches


def preadv_all(fd: int, views: list[memoryview], offset: int, file: str) -> None:
    """Fill `views`, in order, from the file's bytes at `offset` (short reads continued)."""
    at = 0
    while views:
        try:
            n = os.preadv(fd, views, offset + at)
        except OSError as exc:
            raise ReadError(f"reading {file} failed: {exc.strerror}; check the disk") from None
        if n == 0:
            raise CheckpointError(file, f"file ended at byte {offset + at} while reading "
                                  "tensor data (truncated file)")
        at += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]


def release_later(mover: _CudaMover | _HostMover) -> None:
    """Free a finished load's staging pool on a thread of its own: unpinning host memory
    costs about what pinning it did, and every byte is in the slabs already."""
    if isinstance(mover, _HostMover):
        mover.close()
        return
    threading.Thread(target=mover.close, name="vlaunch-unpin", daemon=True).start()


def _fill_registered(specs: list[SliceSpec], records: dict[str, Any], slabs: list[torch.Tensor],
                     fds: dict[str, int], progress: Progress) -> bool:
    """The registered-page-cache reader (registered.py); False when the driver refused to
    register (nothing is left registered, and the staging reader reads it all)."""
    from vlaunch.cache.store import registered

    work = []
    for spec in specs:
        rec = records[spec.name]
        for piece in pieces(spec, registered.CHUNK):
            at = rec.offset + piece.at
            work.append((str(spec.source.file), piece, slabs[rec.slab][at:at + piece.nbytes]))
    return registered.fill_registered(work, fds, slabs[0].device, progress.add)


def _words(piece: Piece, *addresses: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that the piece's offsets and the addresses allow."""
    return next(u for u in (8, 4, 2, 1)
                if not (piece.row | piece.lo | piece.width | sum(a % u for a in addresses)) % u)


def split_copy(dst: torch.Tensor, span: torch.Tensor, piece: Piece) -> None:
    """Each row's part of a span's bytes into `dst`, packed: one strided device copy."""
    import torch

    unit = _words(piece, span.data_ptr(), dst.data_ptr())
    word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[unit]
    rows = span[:piece.span].view(word).view(piece.rows, piece.row // unit)
    dst.view(word).view(piece.rows, piece.width // unit).copy_(
        rows[:, piece.lo // unit:(piece.lo + piece.width) // unit])


def _gather(dst: np.ndarray, span: np.ndarray, piece: Piece) -> None:
    """The same on the host, through numpy: one strided copy without the GIL on this thread
    (torch's CPU copy would start its own thread team from every reader thread)."""
    import numpy as np

    unit = _words(piece, span.ctypes.data, dst.ctypes.data)
    word = np.dtype(f"u{unit}")
    rows = span[:piece.span].view(word).reshape(piece.rows, piece.row // unit)
    np.copyto(dst[:piece.nbytes].view(word).reshape(piece.rows, piece.width // unit),
              rows[:, piece.lo // unit:(piece.lo + piece.width) // unit])


def _file_bytes(fd: int) -> np.ndarray:
    """A read-only uint8 array over a whole file's mapping (the array keeps it mapped)."""
    import mmap

    import numpy as np

    return np.frombuffer(mmap.mmap(fd, 0, prot=mmap.PROT_READ), dtype=np.uint8)


class _HostMover:
    """CPU slabs: contiguous pieces are read straight into the slab; split spans through a
    per-thread staging buffer and one strided copy, or gathered from the file's mapping."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._local = threading.local()

    def move(self, fd: int, file: str, piece: Piece, dst: np.ndarray,
             mapped: np.ndarray | None = None) -> None:
        """Read one piece into `dst` (`mapped`: the file's bytes, to gather split rows from)."""
        if piece.contiguous:
            pread_into(fd, host_view(dst), piece.offset, file)
            return
        if mapped is not None:
            _gather(dst, mapped[piece.offset:piece.offset + piece.span], piece)
            return
        stage = getattr(self._local, "stage", None)
        if stage is None:
            import numpy as np

            stage = self._local.stage = np.empty(self.chunk, dtype=np.uint8)
        pread_into(fd, memoryview(stage)[:piece.span], piece.offset, file)
        _gather(dst, stage, piece)

    def finish(self) -> None:
        """Nothing is in flight on the CPU."""

    def close(self) -> None:
        """Nothing to free: the staging buffers go with their threads."""


class _CudaMover:
    """CUDA slabs through one pool of pinned staging buffers that every reader thread shares.

    A thread takes a free buffer (waiting for the copy that last used it), reads a piece into
    it without the GIL (preadv), and queues the host-to-device copy on its own stream: straight
    into the slab, or for a split span into the thread's device scratch, then one strided
    device copy into the slab. The pool grows to `limit` buffers as threads need them, so
    allocating pinned memory (slow, proportional to size) overlaps the first reads; it is
    allocated once per load and freed at the end.

    Why hand-written: fastsafetensors, kvikio and cuFile readers were weighed. Without the
    nvidia-fs kernel module (absent in containers and VMs), cuFile and kvikio fall back to
    POSIX reads into pinned bounce buffers, which is this pipeline, at the cost of a large
    native dependency each; fastsafetensors reads whole files per rank and measured within
    this reader's range on the same H200 (benchmarks/results/figures.md). None splits a
    tensor per rank on the device. The pipeline is some 60 lines over torch and os.preadv.
    """

    def __init__(self, device: torch.device, chunk: int, limit: int) -> None:
        import torch

        self.device, self.chunk, self.limit = device, chunk, limit
        # Pinned memory made by malloc + cudaHostRegister on 8 threads instead of
        # cudaHostAlloc: 1 GiB in 113 ms against 354 ms, and TP 1 warm at 44 GB/s against 33
        # (H200 VM, GPU run 2). A torch allocator setting, made only where the process has no
        # PYTORCH_CUDA_ALLOC_CONF of its own (an engine's settings are never touched).
        settings = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                    or getattr(torch.cuda.memory, "_set_allocator_settings", None))
        if settings is not None and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                settings("pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
        self._free: queue.SimpleQueue[tuple[torch.Tensor, Any]] = queue.SimpleQueue()
        self._made = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._scratch: list[torch.Tensor] = []
        self._pinned_s = 0.0
        self._torch = torch

    def _take(self) -> tuple[torch.Tensor, Any]:
        """A free pinned buffer and the event of its last copy (None: new)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            grow = self._made < self.limit
            self._made += grow
        if not grow:
            return self._free.get()
        start = time.perf_counter()
        buf = self._torch.empty(self.chunk, dtype=self._torch.uint8, pin_memory=True)
        with self._lock:
            self._pinned_s += time.perf_counter() - start
        return buf, None

    def _thread(self) -> tuple[Any, torch.Tensor | None]:
        """This thread's stream, made current on it once, and its device scratch (made on
        first use)."""
        local = self._local
        if not hasattr(local, "stream"):
            local.stream = self._torch.cuda.Stream(self.device)
            self._torch.cuda.set_stream(local.stream)  # reader threads end with the load
            local.scratch = None
        return local.stream, local.scratch

    def move(self, fd: int, file: str, piece: Piece, dst: torch.Tensor,
             mapped: np.ndarray | None = None) -> None:
        """Read one piece and queue its copies to `dst` (`mapped`: the file's bytes, to gather
        split rows from on the host instead of reading whole spans)."""
        torch = self._torch
        buf, event = self._take()
        try:
            if event is not None:
                event.synchronize()  # the copy that last used this buffer has finished
            if mapped is not None and not piece.contiguous:
                _gather(buf.numpy(), mapped[piece.offset:piece.offset + piece.span], piece)
            else:
                pread_into(fd, host_view(buf)[:piece.span], piece.offset, file)
            stream, scratch = self._thread()
            if piece.contiguous or mapped is not None:
                dst.copy_(buf[:piece.nbytes], non_blocking=True)
            else:
                if scratch is None:
                    scratch = self._local.scratch = torch.empty(
                        self.chunk, dtype=torch.uint8, device=self.device)
                    with self._lock:
                        self._scratch.append(scratch)
                scratch[:piece.span].copy_(buf[:piece.span], non_blocking=True)
                split_copy(dst, scratch, piece)  # in stream order: scratch is reused
            if event is None:
                event = torch.cuda.Event()
            event.record(stream)  # each buffer has one event, recorded anew at each use
        finally:
            self._free.put((buf, event))

    def finish(self) -> None:
        """Wait for every queued copy."""
        self._torch.cuda.synchronize(self.device)
        STAGING.update(buffers=self._made, chunk=self.chunk, pinned_s=self._pinned_s)
        log.debug("staging: %d pinned buffers of %d MiB, %.0f ms allocating them", self._made,
                  self.chunk >> 20, self._pinned_s * 1e3)

    def close(self) -> None:
        """Free the pool and the scratch buffers (after finish, or on an error)."""
        torch = self._torch
        torch.cuda.synchronize(self.device)
        while True:
            try:
                self._free.get_nowait()
            except queue.Empty:
                break
        self._scratch.clear()
        self._local = threading.local()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:  # torch keeps freed pinned blocks cached otherwise
            empty_host()


def checksums(manifest: Manifest, slabs: list[SlabBytes], threads: int = 8) -> dict[str, int]:
    """crc32 of every tensor's bytes (CPU slabs; CUDA slabs are copied to host in chunks)."""
    def one(rec: Any) -> tuple[str, int]:
        crc = 0
        for part in chunks(slabs[rec.slab][rec.offset:rec.offset + rec.nbytes]):
            crc = zlib.crc32(part, crc)
        return rec.name, crc

    def small(recs: tuple[Any, ...]) -> list[tuple[str, int]]:
        """Tensors of host slabs smaller than CHUNK, through one memoryview per slab."""
        views = [memoryview(host_array(s)).cast("B") if len(s) else memoryview(b"")
                 for s in slabs]
        crc32 = zlib.crc32
        return [(r.name, crc32(views[r.slab][r.offset:r.offset + r.nbytes])) for r in recs]

    tensors = manifest.tensors
    with ThreadPoolExecutor(max(1, threads)) as pool:
        if slabs and on_device(slabs[0]):
            return dict(pool.map(one, tensors))
        large = [t for t in tensors if t.nbytes > CHUNK]
        little = [t for t in tensors if t.nbytes <= CHUNK]
        step = max(256, -(-len(little) // max(1, threads)))
        out = dict(pool.map(one, large))
        for part in pool.map(small, [tuple(little[i:i + step])
                                     for i in range(0, len(little), step)]):
            out.update(part)
        return out


def chunks(t: SlabBytes) -> Iterator[memoryview]:
    """A 1-D slab range's bytes as host memoryviews of at most CHUNK bytes (device bytes are
    copied to the host a chunk at a time)."""
    for start in range(0, len(t), CHUNK):
        part = t[start:start + CHUNK]
        if on_device(part):
            part = part.cpu()
        yield host_view(part)
