"""A rank that makes the engine's copy (rank/copies.py), without a GPU.

The rank's side of a copy-mode handoff on a GPU is a protocol and a lifecycle: the `open`
reply with the new slabs' fds and "copying", `copied` answered once the copy's event is
done, the rank's fds and handles let go afterwards, a bound on copies in flight, and a copy
the device failed refused. Here the real CacheServer serves on a real Unix socket in its own
event loop, the real `Copy` carries each copy, and the engine is the real client. Only the
device is stood in for: a copy is a memfd that a timer fills (the engine must not see its bytes
before `copied`), its event a threading one, its slab handle an object that records release.
The GPU test (test_gpu_cache.py) runs the same paths on CUDA.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import CacheBrokenError
from vlaunch.cache.rank import copies
from vlaunch.cache.rank.daemon import CacheServer
from vlaunch.cache.rank.served import Served
from vlaunch.cache.store.manifest import pack

from .conftest import eventually

MANIFEST = pack([("w", "U8", (4096,))], backend="cpu", alignment=256, max_slab=1 << 20)
SIZE = MANIFEST.slab_sizes[0]
FINGERPRINT = {"checkpoint": "a"}
COPY_SECONDS = 0.05


class _Event:
    """A copy's event: done when the timer has written the bytes (or failed); with a gate,
    not before the gate is opened."""

    def __init__(self, fill: Any, fail: bool, gate: threading.Event | None) -> None:
        self._done, self._fail = threading.Event(), fail
        threading.Timer(COPY_SECONDS, self._finish, (fill, gate)).start()

    def _finish(self, fill: Any, gate: threading.Event | None) -> None:
        if gate is not None:
            gate.wait(30)
        fill()
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class _Handle:
    """The rank's own handle on the engine's copy (the copy writes through it), apart from
    the fd it exported."""

    def __init__(self, fd: int, released: list[str]) -> None:
        self.fd, self._released = os.dup(fd), released

    def release(self) -> None:
        os.close(self.fd)
        self._released.append("handle")


class MemfdCopier:
    """RankCopier's part, with memfds for device memory."""

    def __init__(self, source: int) -> None:
        self.source, self.fail = source, False
        self.gate: threading.Event | None = None  # set: copies finish once it is
        self.made: list[copies.Copy] = []
        self.released: list[str] = []
        self.slots = copies.Slots()

    def start(self, who: str) -> copies.Copy | None:
        if not self.slots.acquire():
            return None
        fd = os.memfd_create("test-rank-copy")
        os.ftruncate(fd, SIZE)
        handle = _Handle(fd, self.released)
        source = os.pread(self.source, SIZE, 0)
        event = _Event(lambda: os.pwrite(handle.fd, source, 0), self.fail, self.gate)
        now = time.perf_counter()
        copy = copies.Copy([handle], [fd], event, self.slots, f"{who}'s copy", (now, now, now))
        self.made.append(copy)
        return copy

    def status(self) -> dict[str, int]:
        return {"in_flight": self.slots.taken, "bytes": self.slots.taken * SIZE}

    def close(self) -> None:
        pass


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[tuple[Path, MemfdCopier, asyncio.AbstractEventLoop]]:
    """A CacheServer with a MemfdCopier, serving in a thread of its own."""
    sockdir = tmp_path / "s"
    sockdir.mkdir(mode=0o700)
    slab = os.memfd_create("test-rank-slab")
    os.pwrite(slab, bytes(range(256)) * (SIZE // 256), 0)
    copier = MemfdCopier(slab)
    server = CacheServer(0, Served(MANIFEST, [slab], FINGERPRINT), device="cpu",
                         copier=copier)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    path = sockdir / "rank-0.sock"
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(path, stop),),
                              daemon=True)
    thread.start()
    eventually(lambda: path.exists() or None, 10)
    yield path, copier, loop
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    loop.close()


def _copy_fds() -> int:
    """Open fds of the stand-in copies in this process: the rank's, its handles', and the one
    each of the engine's mappings keeps."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd
            n += "memfd:test-rank-copy" in os.readlink(f"/proc/self/fd/{fd}")
    return n


def _copy_mapped() -> bool:
    with open("/proc/self/maps") as maps:
        return "memfd:test-rank-copy" in maps.read()


def test_the_engine_gets_the_copy_once_it_is_made_and_the_rank_lets_go_of_it(rank) -> None:
    path, copier, _ = rank
    client = CacheClient(path)
    try:
        tensors = client.handoff(lambda: FINGERPRINT, mode="copy", device="cpu")
    finally:
        client.close()
    w = tensors["w"]
    assert torch.equal(w, torch.arange(256, dtype=torch.uint8).repeat(SIZE // 256)[:4096])
    assert _copy_mapped()  # the engine's weights are the pages the rank made
    w[0] = 9  # and its own: written in place
    assert eventually(lambda: copier.released == ["handle"] or None, 10)
    # the rank closed its fds: what is left is our mapping's own (Python's mmap keeps one)
    assert eventually(lambda: _copy_fds() == 1 or None, 10)
    del tensors, w
    assert not _copy_mapped() and _copy_fds() == 0


def test_an_engine_that_walks_away_frees_its_slot(rank) -> None:
    path, copier, _ = rank
    for _ in range(copies.MAX_IN_FLIGHT + 1):  # more than the bound, one after another
        client = CacheClient(path)
        reply, fds = client.request({"op": "open", "mode": "copy"})
        assert reply["copying"] is True
        wire.close_fds(fds)
        client.close()  # never asks `copied`
        assert eventually(lambda: _copy_fds() == 0 or None, 10)
    assert eventually(lambda: len(copier.released) == copies.MAX_IN_FLIGHT + 1 or None, 10)


def test_past_the_bound_the_engine_copies_for_itself(rank) -> None:
    path, copier, _ = rank
    holders = [CacheClient(path) for _ in range(copies.MAX_IN_FLIGHT)]
    try:
        for holder in holders:
            reply, fds = holder.request({"op": "open", "mode": "copy"})
            assert reply["copying"] is True
            wire.close_fds(fds)
        time.sleep(COPY_SECONDS * 2)  # their copies are done: the fds still hold the slots
        assert holders[0].status()["copies"] == {"in_flight": copies.MAX_IN_FLIGHT,
                                                 "bytes": copies.MAX_IN_FLIGHT * SIZE}
        client = CacheClient(path)
        try:
            tensors = client.handoff(lambda: FINGERPRINT, mode="copy", device="cpu")
        finally:
            client.close()
        assert int(tensors["w"][255]) == 255
        assert not _copy_mapped()  # the cache's slab, copied by the engine
    finally:
        for holder in holders:
            holder.close()
    assert eventually(lambda: len(copier.released) == copies.MAX_IN_FLIGHT or None, 10)
    assert copier.slots.acquire()  # free again
    copier.slots.release()
    client = CacheClient(path)
    try:
        assert client.status()["copies"] == {"in_flight": 0, "bytes": 0}
    finally:
        client.close()


def test_a_copy_the_device_failed_is_refused_and_let_go(rank) -> None:
    path, copier, _ = rank
    copier.fail = True
    client = CacheClient(path)
    try:
        with pytest.raises(CacheBrokenError, match="copy_failed: the rank's copy for the engine "
                                                   "failed: CUDA error"):
            client.handoff(lambda: FINGERPRINT, mode="copy", device="cpu")
        assert client.status()["rank"] == 0  # the connection still serves
    finally:
        client.close()
    assert not _copy_mapped()
    assert eventually(lambda: copier.released == ["handle"] or None, 10)


def test_the_copied_reply_does_not_wait_for_the_ranks_event_loop(rank) -> None:
    """The copy's thread answers `copied` itself: a rank whose event loop is busy (another
    engine's requests) does not hold up an engine whose copy is done."""
    path, copier, loop = rank
    copier.gate = threading.Event()
    client = CacheClient(path)
    busy = threading.Event()
    try:
        reply, fds = client.request({"op": "open", "mode": "copy"})
        assert reply["copying"] is True
        wire.close_fds(fds)
        wire.send_frame(client._sock, {"op": "copied"})
        # the rank has taken the request in: the thread is to answer it
        assert eventually(lambda: copier.made[-1]._answer is not None or None, 10)
        loop.call_soon_threadsafe(busy.wait, 30)  # the rank's event loop is held up
        copier.gate.set()  # the device finishes the copy
        client._sock.settimeout(5)
        assert wire.recv_frame(client._sock) == ({"ok": True}, [])
        busy.set()
        client._sock.settimeout(client.io_timeout)
        assert client.status()["rank"] == 0  # answered once: the next reply is the status
    finally:
        busy.set()
        copier.gate.set()
        client.close()
    assert eventually(lambda: copier.released == ["handle"] or None, 10)


def test_copied_asked_after_the_copy_is_done_is_answered_by_the_rank(rank) -> None:
    path, copier, _ = rank
    client = CacheClient(path)
    try:
        reply, fds = client.request({"op": "open", "mode": "copy"})
        wire.close_fds(fds)
        assert reply["copying"] is True
        assert eventually(lambda: copier.made[-1]._device_done or None, 10)
        assert client.request({"op": "copied"})[0] == {"ok": True}
        assert client.status()["rank"] == 0  # and the connection goes on serving
    finally:
        client.close()
    assert eventually(lambda: copier.released == ["handle"] or None, 10)


@pytest.mark.parametrize("n", [1, 2 << 20, copies.MIN_PIECE * 2 - 1, copies.MIN_PIECE * 4,
                               (17 << 30) + 12345, 1 << 40])
def test_a_slab_is_cut_into_pieces_of_whole_granules(n: int) -> None:
    """The allocations a slab's copy is made of: whole granules that cover it, at most PIECES,
    none under MIN_PIECE (a smaller slab is one piece)."""
    granule = 2 << 20
    cut = copies.piece_sizes(n, granule)
    total = -(-n // granule) * granule
    assert sum(cut) == total and all(k > 0 and k % granule == 0 for k in cut)
    assert 1 <= len(cut) <= copies.PIECES
    assert len(cut) == 1 or min(cut) >= copies.MIN_PIECE - granule
    if n >= copies.PIECES * copies.MIN_PIECE:
        assert len(cut) == copies.PIECES


def test_a_copy_longer_than_the_engines_spin_is_waited_for(rank, monkeypatch) -> None:
    """The engine polls for `copied` for SPIN_FOR_COPY, then sleeps on it as on any reply."""
    from vlaunch.cache.client import connection

    path, copier, _ = rank
    monkeypatch.setattr(connection, "SPIN_FOR_COPY", 0.01)
    copier.gate = threading.Event()
    client = CacheClient(path)
    try:
        t0 = time.perf_counter()
        threading.Timer(0.3, copier.gate.set).start()
        tensors = client.handoff(lambda: FINGERPRINT, mode="copy", device="cpu")
        assert time.perf_counter() - t0 >= 0.29  # it did wait for the copy
    finally:
        copier.gate.set()
        client.close()
    assert int(tensors["w"][255]) == 255
