"""Copy-mode handoffs from a GPU rank: the rank makes the engine's copy.

An engine that asks for memory of its own (mode copy or copy-release) would otherwise map the
slabs, allocate its destination and copy into it, one step after the other, all on its start's
critical path. A GPU rank instead allocates fresh slabs and queues the device-to-device copy
into them as soon as the `open` request arrives, then sends their fds. The engine maps them
read-write while the copy runs (they are its memory from then on: the rank lets go of its own
handles), and the rank answers the engine's `copied` request once the copy is done.

On an H200 this brought a copy-mode `load()` in a fresh engine process from about two thirds
of a plain device-to-device copy_ of the same bytes to about four fifths (each slab in four
pieces, the reply sent by the copy's thread: benchmarks/results/gpu_2026-12-01.md, calls
32-34, with what the rest is made of).
Where the rank cannot take the copy on (no room for it on the device, or MAX_IN_FLIGHT copies
already running), `start` returns None and the rank sends its own slabs: the engine copies
them itself, as on a CPU rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from ctypes import c_void_p
from typing import TYPE_CHECKING, Protocol

from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import DeviceError
from vlaunch.cache.store import cudadrv as cu

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.store.slabs import Slab
    from vlaunch.cache.store.slabs_cuda import CudaBackend

log = logging.getLogger("vlaunch.cache")

MAX_IN_FLIGHT = 2
"""Copies a rank makes at once; past that, engines copy for themselves (their memory, their
failure): every copy in flight is a second shard's worth of device memory."""
PIECES = 4
"""Allocations a slab's copy is made of, at most: the first piece's copy starts once it alone
is allocated."""
MIN_PIECE = 64 << 20
"""No piece is cut smaller: a small slab is one allocation (it allocates fast anyway)."""


def piece_sizes(n: int, granularity: int, most: int = PIECES) -> list[int]:
    """The sizes of the allocations a slab of n bytes is copied into: whole granules, at
    most `most` of them, none under MIN_PIECE (but a slab that small is one piece)."""
    total = -(-max(n, 1) // granularity) * granularity
    count = max(1, min(most, total // MIN_PIECE, total // granularity))
    piece = -(-(total // count) // granularity) * granularity
    return [piece] * (count - 1) + [total - piece * (count - 1)]


class Copy:
    """One handoff's copy: fresh slabs, their fds, and a thread that waits for the copy.

    The thread starts with the copy. Where the engine's `copied` request came first
    (`answer_on`), the thread sends the reply itself the moment the device is done: through
    the rank's event loop the reply took some tenths of a millisecond longer, on the critical
    path of every copy-mode start. Then `done()` returns (how much of the reply was sent), and
    `close()` closes our fds, and the thread drops the rank's handles and mappings: not before,
    because unmapping takes the GIL (and the device) for milliseconds, and the replies the
    engine waits for come first. The fds sent to the engine keep the memory alive until the
    engine has mapped it; it is freed when the engine drops it. The rank's slot is free again
    once the handles are gone.
    """

    def __init__(self, slabs: list[Slab], fds: list[int], event: torch.cuda.Event,
                 slot: Slots, what: str, steps: tuple[float, ...],
                 pieces: list[list[int]] | None = None) -> None:
        self.fds = fds
        self.pieces = pieces  # per slab, the sizes of the allocations it is made of
        self._slabs, self._event, self._slot = slabs, event, slot
        self._what, self._steps = what, steps  # for the log: perf_counter at request, ...
        self._closed = threading.Event()
        # guards the reply the thread may send: the connection is not closed under it
        self._lock = threading.Lock()
        self._answer: tuple[socket.socket, bytes] | None = None
        self._device_done = False
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[int] = self._loop.create_future()
        threading.Thread(target=self._wait, name="vlaunch-copy", daemon=True).start()

    def answer_on(self, sock: socket.socket, frame: bytes) -> None:
        """Have the thread send `frame` (the `copied` reply) on `sock` once the device is done,
        unless it is done already. The connection's task sends nothing on `sock` meanwhile:
        it awaits `done()`."""
        with self._lock:
            if not self._device_done and not self._closed.is_set():
                self._answer = (sock, frame)

    async def done(self) -> int:
        """Wait until the copy is done, without holding up the rank's other clients, and
        return how many bytes of the `answer_on` frame the thread sent (0: none, it is the
        task's to send). A copy the device failed raises DeviceError."""
        return await self._done

    def close(self) -> None:
        """Close our fds (the frame that carried them was sent, or never will be) and let the
        thread drop our handles once the copy is done. Past this the thread sends nothing:
        the connection may be closed next."""
        with self._lock:  # a send in progress finishes first
            self._answer = None
            wire.close_fds(self.fds)
            self.fds = []
            self._closed.set()

    def _wait(self) -> None:
        error: Exception | None = None
        try:
            self._event.synchronize()
        except RuntimeError as exc:  # a CUDA error: the copy is not to be used
            error = DeviceError(f"the rank's copy for the engine failed: {exc}")
        done = time.perf_counter()
        with self._lock:
            self._device_done, answer, self._answer = True, self._answer, None
            sent = _send_now(*answer) if answer and error is None else 0
        with contextlib.suppress(RuntimeError):  # the loop is gone: the rank is stopping
            self._loop.call_soon_threadsafe(self._finished, error, sent)
        self._closed.wait()
        try:
            for slab in self._slabs:
                slab.release()
        except (DeviceError, RuntimeError) as exc:  # a thread must not die loudly
            log.warning("could not release a copy-mode handoff's slabs: %s", exc)
        finally:
            self._slabs = []
            self._slot.release()
        asked, first, allocated = self._steps
        if error is None:
            log.info("made %s in %.1f ms after the request (copying from %.1f, allocated in "
                     "%.1f)", self._what, (done - asked) * 1e3, (first - asked) * 1e3,
                     (allocated - asked) * 1e3)

    def _finished(self, error: Exception | None, sent: int) -> None:
        if self._done.done():
            return
        if error is None:
            self._done.set_result(sent)
        else:
            self._done.set_exception(error)


def _send_now(sock: socket.socket, frame: bytes) -> int:
    """Bytes of `frame` the (non-blocking) socket took at once; 0 on any error, which the
    connection's task then meets itself."""
    try:
        return max(sock.send(frame), 0)
    except OSError:  # full (a peer that stopped reading), or gone
        return 0


class Slots:
    """At most MAX_IN_FLIGHT copies at once, and how many are taken (the rank's status)."""

    def __init__(self, count: int = MAX_IN_FLIGHT) -> None:
        self._free = threading.Semaphore(count)
        self._lock = threading.Lock()
        self.taken = 0

    def acquire(self) -> bool:
        """Take a slot if one is free."""
        if not self._free.acquire(blocking=False):
            return False
        with self._lock:
            self.taken += 1
        return True

    def release(self) -> None:
        """Give a slot back (a copy's handles and fds are gone)."""
        with self._lock:
            self.taken -= 1
        self._free.release()


class Copier(Protocol):
    """What the rank's server needs of a copier (RankCopier; a test's stand-in)."""

    def start(self, who: str) -> Copy | None: ...
    def status(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class RankCopier:
    """Makes engines' copies of this rank's slabs on its GPU, on a stream of its own."""

    def __init__(self, backend: CudaBackend, fds: list[int], sizes: tuple[int, ...]) -> None:
        import torch

        self._backend, self._sizes = backend, sizes
        # the rank's own read-only view of every slab, whether it loaded or adopted them
        self._sources = [backend.map_fd(fd, n, readonly=True) for fd, n in zip(fds, sizes,
                                                                               strict=True)]
        self._stream = torch.cuda.Stream(device=backend.device)
        self._slots = Slots()
        if self._sources:  # the first copy's one-time costs (the copy path's first use) now
            scratch = torch.empty(256, dtype=torch.uint8, device=backend.device)
            self._queue([(scratch.data_ptr(), self._sources[0].data_ptr(),
                          min(256, self._sources[0].numel()))])
            self._stream.synchronize()
            del scratch
            torch.cuda.empty_cache()  # the warm-up's block: the rank holds slabs, not a cache

    def start(self, who: str) -> Copy | None:
        """Allocate the engine's slabs and queue the copy into them; None where the rank
        cannot (every slot busy, or no room on the device: the engine then copies).

        Each slab is made of `piece_sizes()` allocations, and each piece's copy is queued as
        soon as that piece is mapped: the device copies the first piece while the rank
        allocates the next ones, so the copy starts sooner than with one allocation
        (benchmarks/results/gpu_2026-12-01.md)."""
        asked = time.perf_counter()
        if not self._sources or not self._slots.acquire():
            return None
        slabs: list[Slab] = []
        fds: list[int] = []
        cuts: list[list[int]] = []
        first = 0.0
        try:
            for source, n in zip(self._sources, self._sizes, strict=True):
                cuts.append(piece_sizes(n, self._backend.granularity))
                offset = 0
                for k in cuts[-1]:
                    slabs.append(self._backend.allocate(k))
                    self._queue([(slabs[-1].ptr, source.data_ptr() + offset,
                                  min(k, n - offset))])
                    first = first or time.perf_counter()
                    offset += k
            allocated = time.perf_counter()
            event = self._record()
            fds.extend(slab.export_fd() for slab in slabs)
        except DeviceError as exc:
            log.info("the engine copies its slabs itself: the rank cannot make its copy (%s)",
                     exc)
            wire.close_fds(fds)
            self._stream.synchronize()
            for slab in slabs:
                slab.release()
            self._slots.release()
            return None
        what = f"{who}'s copy ({sum(self._sizes) / 1e9:.2f} GB)"
        return Copy(slabs, fds, event, self._slots, what, (asked, first, allocated), cuts)

    def status(self) -> dict[str, int]:
        """Copies for engines the rank holds device memory for (from `open` until the rank let
        go of them: milliseconds each, unless an engine never asks `copied`), and their bytes."""
        taken = self._slots.taken
        granule = self._backend.granularity
        each = sum(-(-max(n, 1) // granule) * granule for n in self._sizes)
        return {"in_flight": taken, "bytes": taken * each}

    def _record(self) -> torch.cuda.Event:
        """An event on the rank's stream after every copy queued so far."""
        import torch

        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _queue(self, copies: list[tuple[int, int, int]]) -> None:
        """Queue (destination, source, bytes) device copies on the rank's stream: the driver's
        copy, not torch's copy_, which needs a tensor over the new slab first (torch.as_tensor
        of a mapping: a few tenths of a millisecond)."""
        import torch

        stream = c_void_p(self._stream.cuda_stream)
        with torch.cuda.device(self._backend.device):  # its primary context
            for destination, source, nbytes in copies:
                cu.call("cuMemcpyDtoDAsync_v2", destination, source, nbytes, stream)

    def close(self) -> None:
        """Drop the rank's views of its slabs (the raw layout was dropped or released), on a
        thread: unmapping synchronises the device, which may be running an engine's copy."""
        sources, self._sources = self._sources, []
        threading.Thread(target=sources.clear, name="vlaunch-unmap", daemon=True).start()
