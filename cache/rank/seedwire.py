"""Seeding's byte streams over TCP: several authenticated connections per rank, each moving
ranges of the slabs, with the bytes never passing through Python objects.

A seeding rank opens `streams` connections to its source rank's port; each one sends the
token first (`seed_auth`, compared in constant time by the source), then asks for ranges
(`seed_range`: slab, offset, length, at most MAX_RANGE) taken in turn from one list, so a
slow connection takes fewer. The source answers each with a JSON header and then the raw
bytes: from a CPU slab by `os.sendfile` from its memfd (the kernel copies page cache to the
socket), from a CUDA slab through two pinned host buffers, one copied from the device while
the other is written to the socket. The seeding rank receives with `recv_into` straight into
its new slab's mapping (CPU) or into two pinned buffers per connection whose device copies
overlap the next receive (CUDA). Every read and write is bounded by the seed timeout; a
source that stalls, closes early or announces another length fails the whole seed.

Why this and not a transfer engine: measured on loopback for the same shard
(benchmarks/bench_seed_engines.py, benchmarks/results/seed_engines.md), NIXL's UCX backend
over TCP moved a tenth of what a plain 4-stream socket copy moved, and gloo's send/recv came
level with the plain copy but needs torch in every CPU rank (a rank imports none) and a
TCPStore and gloo listeners that take any peer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import SeedError
from vlaunch.cache.store.slabs import on_device

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.store.slabs import SlabBytes

RANGE = 64 << 20
"""Bytes a connection asks for at once (the last range of a slab may be shorter)."""
MAX_RANGE = 1 << 30
"""The most bytes one `seed_range` may ask for."""
STAGE = 16 << 20
"""Bytes of each pinned buffer that CUDA bytes pass through, on either side."""
DEFAULT_STREAMS = 4
MAX_STREAMS = 16
"""Connections a seeding rank opens at most (the source serves 4 x as many at once)."""

Range = tuple[int, int, int]  # (slab, offset, nbytes)


def ranges(sizes: tuple[int, ...], part: int = RANGE) -> list[Range]:
    """Every slab's bytes cut into ranges of at most `part` bytes, in order."""
    return [(slab, at, min(part, size - at)) for slab, size in enumerate(sizes)
            for at in range(0, size, part)]


def range_problem(sizes: tuple[int, ...], slab: int, offset: int, nbytes: int,
                  limit: int = MAX_RANGE) -> str:
    """Why a requested range is not one to serve, or "" (`limit`: the most bytes it may
    span; a whole slab that an earlier version's `seed_slab` asks for may be larger)."""
    if slab >= len(sizes):
        return f"no slab {slab}"
    if not 0 < nbytes <= limit or offset + nbytes > sizes[slab]:
        return (f"range {offset}+{nbytes} is outside slab {slab} ({sizes[slab]} bytes) or over "
                f"{limit} bytes")
    return ""


# --------------------------------------------------------------------- both ends


def connect(host: str, port: int, token: str, timeout: float) -> socket.socket:
    """A connection to a seed source, the token accepted; reads and writes bounded by
    `timeout` (SO_RCVTIMEO / SO_SNDTIMEO on a blocking socket: one system call may receive a
    whole range)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise SeedError(f"seed source {host}:{port} unreachable: {exc}; start the source with "
                        "--seed-listen-port and check the firewall") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        limit = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        ask(sock, {"op": "seed_auth", "token": token})
    except BaseException:
        sock.close()
        raise
    return sock


def ask(sock: socket.socket, message: dict[str, Any], *, miss: bool = False) -> dict[str, Any]:
    """One request and its reply; a refusal raises SeedError (`miss`: an artifact miss is a
    reply)."""
    try:
        wire.send_frame(sock, message)
        reply, fds = wire.recv_frame(sock)
    except BlockingIOError:
        raise TimeoutError("stalled: no reply in time") from None
    wire.close_fds(fds)
    if reply.get("ok") is not True and not (miss and reply.get("error") == "miss"):
        raise SeedError(f"seed source refused {message['op']}: {reply.get('error')}: "
                        f"{reply.get('message')}")
    return reply


# ------------------------------------------------------------------- the receiver


def receive(socks: list[socket.socket], work: list[Range], slabs: list[SlabBytes], *,
            op: str = "seed_range") -> None:
    """Fill `slabs` with the ranges of `work`, each connection of `socks` on a thread of its
    own taking the next range; the first failure closes every connection and is raised
    (`op` seed_slab: an older source's whole-slab request, ranges of whole slabs)."""
    items: Iterator[Range] = iter(work)
    lock = threading.Lock()
    failures: list[BaseException] = []

    def run(sock: socket.socket) -> None:
        staging = _Staging(slabs)
        try:
            while not failures:
                with lock:
                    item = next(items, None)
                if item is None:
                    break
                slab, offset, nbytes = item
                request = {"op": op, "slab": slab}
                if op == "seed_range":
                    request.update(offset=offset, nbytes=nbytes)
                head = ask(sock, request)
                if head.get("nbytes") != nbytes:
                    raise SeedError(f"seed source announced {head.get('nbytes')!r} bytes for "
                                    f"slab {slab} at {offset}, expected {nbytes}")
                staging.receive(sock, slabs[slab], offset, nbytes)
            staging.finish()
        except BaseException as exc:
            with lock:
                failures.append(exc)
            for other in socks:  # wakes the other threads out of their reads
                with contextlib.suppress(OSError):
                    other.shutdown(socket.SHUT_RDWR)
        finally:
            staging.close()

    threads = [threading.Thread(target=run, args=(s,), name=f"vlaunch-seed-{i}", daemon=True)
               for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


class _Staging:
    """One connection's receiving side: straight into CPU slabs; into CUDA slabs through two
    pinned buffers, one filling from the socket while the other is copied to the device on
    this connection's own CUDA stream."""

    def __init__(self, slabs: list[SlabBytes]) -> None:
        self.buffers: list[Any] = []
        self.events: list[Any] = []
        self.stream: Any = None
        self.turn = 0
        if slabs and on_device(slabs[0]):
            import torch

            self.stream = torch.cuda.Stream(slabs[0].device)
            self.buffers = [torch.empty(STAGE, dtype=torch.uint8, pin_memory=True)
                            for _ in range(2)]
            self.events = [None, None]

    def receive(self, sock: socket.socket, slab: SlabBytes, offset: int, n: int) -> None:
        """Read exactly n bytes from `sock` into `slab` at `offset`."""
        from vlaunch.cache.store.reader import host_view

        if not self.buffers:
            recv_exact(sock, host_view(slab[offset:offset + n]), offset, n)
            return
        import torch

        for at in range(offset, offset + n, STAGE):
            want, i = min(STAGE, offset + n - at), self.turn % 2
            self.turn += 1
            if self.events[i] is not None:
                self.events[i].synchronize()  # its last copy to the device has finished
            recv_exact(sock, host_view(self.buffers[i][:want]), at, offset + n)
            with torch.cuda.stream(self.stream):
                slab[at:at + want].copy_(self.buffers[i][:want], non_blocking=True)
                self.events[i] = torch.cuda.Event()
                self.events[i].record(self.stream)

    def finish(self) -> None:
        """Wait for this connection's device copies."""
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        """Drop the pinned buffers (after any copy from them finished)."""
        if self.stream is not None:
            self.stream.synchronize()
        self.buffers.clear()


def recv_exact(sock: socket.socket, view: memoryview, at: int, end: int) -> None:
    """Fill `view` from the socket (`at`, `end`: where in the slab, for the error)."""
    got, want = 0, len(view)
    while got < want:
        try:
            k = sock.recv_into(view[got:], want - got, socket.MSG_WAITALL)
        except BlockingIOError:
            raise TimeoutError(f"stalled: no byte in time at byte {at + got} of "
                               f"{end}") from None
        if not k:
            raise EOFError(f"stream ended at byte {at + got} of {end} (truncated)")
        got += k


# --------------------------------------------------------------------- the source


def send_fd(sock: int, fd: int, offset: int, nbytes: int, timeout: float) -> None:
    """Write bytes [offset, offset + nbytes) of file `fd` (a CPU slab) to the non-blocking
    socket `sock` with sendfile; TimeoutError when the peer takes no byte for `timeout`."""
    end = offset + nbytes
    while offset < end:
        _writable(sock, timeout)
        try:
            sent = os.sendfile(sock, fd, offset, end - offset)
        except BlockingIOError:
            continue
        if sent == 0:
            raise EOFError(f"slab file ended at byte {offset}")
        offset += sent


class DeviceSender:
    """One connection's sending side for CUDA slabs: two pinned buffers (made at its first
    range, freed with it); the device copy of the next part runs while one is written."""

    def __init__(self) -> None:
        self.stream: Any = None
        self.buffers: list[Any] = []

    def send(self, sock: int, slab: torch.Tensor, offset: int, nbytes: int, timeout: float
             ) -> None:
        """Write bytes [offset, offset + nbytes) of a CUDA slab to the non-blocking `sock`."""
        import torch

        from vlaunch.cache.store.reader import host_view

        if self.stream is None:
            self.stream = torch.cuda.Stream(slab.device)
            self.buffers = [torch.empty(STAGE, dtype=torch.uint8, pin_memory=True)
                            for _ in range(2)]
        parts = [(at, min(STAGE, offset + nbytes - at))
                 for at in range(offset, offset + nbytes, STAGE)]
        events: list[Any] = [None, None]

        def fetch(k: int) -> None:
            at, n = parts[k]
            with torch.cuda.stream(self.stream):
                self.buffers[k % 2][:n].copy_(slab[at:at + n], non_blocking=True)
                events[k % 2] = torch.cuda.Event()
                events[k % 2].record(self.stream)

        try:
            fetch(0)
            for k, (_, n) in enumerate(parts):
                events[k % 2].synchronize()
                if k + 1 < len(parts):
                    fetch(k + 1)  # into the buffer written out at the last turn
                view = host_view(self.buffers[k % 2][:n])
                done = 0
                while done < n:
                    _writable(sock, timeout)
                    with contextlib.suppress(BlockingIOError):
                        done += os.write(sock, view[done:])
        finally:
            self.stream.synchronize()

    def close(self) -> None:
        """Free the pinned buffers."""
        if self.stream is not None:
            self.stream.synchronize()
        self.buffers.clear()


def _writable(sock: int, timeout: float) -> None:
    """Wait until the socket takes bytes; TimeoutError after `timeout`, OSError when the peer
    has gone."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    deadline = time.monotonic() + timeout
    while True:
        events = poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
        if events:
            if events[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                raise ConnectionResetError(errno.ECONNRESET, "the seeding peer closed the "
                                           "connection")
            return
        if time.monotonic() >= deadline:
            raise TimeoutError("stalled: the peer read nothing in time")
