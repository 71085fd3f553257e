"""Read each rank's slices straight into its slabs: several reader threads, bounded staging.

CPU slabs are read into directly (`preadv` into the mapping). CUDA slabs go through pinned
staging buffers, one pair per reader thread, so that one buffer is being read from disk while
the other is copied to the device on the thread's own stream. A slice that is not contiguous
in the file (a split along dimension 1) is read span by span, never as a whole-tensor copy.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from vlaunch.cache.contract.errors import CheckpointError, VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.store.manifest import Manifest
    from vlaunch.cache.store.plan import SliceSpec

log = logging.getLogger("vlaunch.cache.store.reader")
CHUNK = 64 << 20
CUDA_CHUNK = 16 << 20  # pinned staging is costly to allocate: 2 buffers x threads x this


class ReadError(VlaunchError):
    """Reading the checkpoint failed."""

    status = ExitStatus.IO_ERROR


class Progress:
    """Bytes done, GB/s and ETA: a live line on a TTY, a log line every few seconds otherwise."""

    def __init__(self, total: int, label: str, every: float = 5.0) -> None:
        self.total, self.label, self.every = total, label, every
        self.done = 0
        self.start = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._tty = sys.stderr.isatty()

    def add(self, n: int) -> None:
        """Count n more bytes and report if due."""
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last >= (0.2 if self._tty else self.every) or self.done >= self.total:
                self._last = now
                self._report(now)

    def _report(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0.0
        line = (f"{self.label}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                f"{rate / 1e9:.2f} GB/s ETA {eta:.0f}s")
        if self._tty:
            print(f"\r{line}", end="\n" if self.done >= self.total else "", file=sys.stderr,
                  flush=True)
        else:
            log.info(line)


def _host_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a CPU tensor's bytes (the tensor must outlive it)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else \
        memoryview(bytearray())


def _pread_into(fd: int, view: memoryview, offset: int, file: str) -> None:
    got = 0
    while got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            raise ReadError(f"reading {file} failed: {exc.strerror}; check the disk") from None
        if n == 0:
            raise CheckpointError(file, f"file ended at byte {offset + got} while reading "
                                  "tensor data (truncated file)")
        got += n


def fill(specs: list[SliceSpec], manifest: Manifest, slabs: list[torch.Tensor], *,
         threads: int = 8, chunk: int = CHUNK, label: str = "loading") -> None:
    """Read every slice into its place in the slabs."""
    records = {t.name: t for t in manifest.tensors}
    fds = {str(f): os.open(f, os.O_RDONLY | os.O_CLOEXEC)
           for f in {str(s.source.file) for s in specs}}
    progress = Progress(sum(s.nbytes for s in specs), label)
    cuda = bool(slabs) and slabs[0].is_cuda
    if cuda:
        chunk = min(chunk, CUDA_CHUNK)
    work = [(s, block) for s in specs for block in s.blocks(chunk)]
    local = threading.local()

    def one(item: tuple[SliceSpec, tuple[int, int, list[tuple[int, int, int]]]]) -> None:
        spec, (span_off, span_len, runs) = item
        rec = records[spec.name]
        dst = slabs[rec.slab][rec.offset:rec.offset + rec.nbytes]
        file = str(spec.source.file)
        if cuda:
            _copy_cuda(local, fds[file], file, dst, span_off, span_len, runs, chunk)
        elif len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == span_len:
            _pread_into(fds[file], _host_view(dst)[runs[0][2]:runs[0][2] + span_len], span_off,
                        file)
        else:
            staging = _staging(local, chunk)
            _pread_into(fds[file], staging[:span_len], span_off, file)
            view = _host_view(dst)
            for src, n, at in runs:
                view[at:at + n] = staging[src:src + n]
        progress.add(sum(n for _, n, _ in runs))

    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="vlaunch-read") as pool:
            for _ in pool.map(one, work):
                pass
        if cuda:
            import torch

            torch.cuda.synchronize(slabs[0].device)
    finally:
        for fd in fds.values():
            os.close(fd)


def _staging(local: threading.local, chunk: int) -> memoryview:
    if not hasattr(local, "host"):
        local.host = memoryview(bytearray(chunk))
    return local.host


def _copy_cuda(local: threading.local, fd: int, file: str, dst: torch.Tensor, span_off: int,
               span_len: int, runs: list[tuple[int, int, int]], chunk: int) -> None:
    """Read a span into a pinned buffer and copy its runs to the device asynchronously."""
    import torch

    if not hasattr(local, "pinned"):
        local.pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        local.events = [None, None]
        local.turn = 0
        local.stream = torch.cuda.Stream(dst.device)
    i = local.turn = 1 - local.turn
    if local.events[i] is not None:
        local.events[i].synchronize()  # the copy that last used this buffer has finished
    buf = local.pinned[i]
    _pread_into(fd, _host_view(buf)[:span_len], span_off, file)
    with torch.cuda.stream(local.stream):
        for src, n, at in runs:
            dst[at:at + n].copy_(buf[src:src + n], non_blocking=True)
        event = torch.cuda.Event()
        event.record(local.stream)
    local.events[i] = event


def checksums(manifest: Manifest, slabs: list[torch.Tensor], threads: int = 8) -> dict[str, int]:
    """crc32 of every tensor's bytes (CPU slabs; CUDA slabs are copied to host in chunks)."""
    def one(rec: object) -> tuple[str, int]:
        crc = 0
        for part in _chunks(slabs[rec.slab][rec.offset:rec.offset + rec.nbytes]):  # type: ignore[attr-defined]
            crc = zlib.crc32(part, crc)
        return rec.name, crc  # type: ignore[attr-defined]

    with ThreadPoolExecutor(max(1, threads)) as pool:
        return dict(pool.map(one, manifest.tensors))


def _chunks(t: torch.Tensor) -> Iterator[memoryview]:
    for start in range(0, t.numel(), CHUNK):
        part = t[start:start + CHUNK]
        if part.is_cuda:
            part = part.cpu()
        yield _host_view(part)
