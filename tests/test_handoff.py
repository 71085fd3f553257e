"""The engine's handoff against a cache that answers wrongly: a real Unix socket, real memfds.

The client maps the slabs at the sizes the open reply gives, before it reads the manifest, so
a cache whose two replies disagree (or whose open reply has no sizes) must be refused before
any tensor is returned, with every fd it sent closed.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import CacheBrokenError, FingerprintMismatchError
from vlaunch.cache.store.manifest import pack

MANIFEST = pack([("w", "F32", (64, 64))], backend="cpu", alignment=256, max_slab=1 << 20)
SLAB = MANIFEST.slab_sizes[0]
FINGERPRINT = {"checkpoint": "a"}

Answer = Callable[[dict[str, Any], int], tuple[dict[str, Any], list[int]]]


def honest(req: dict[str, Any], slab_fd: int) -> tuple[dict[str, Any], list[int]]:
    """What a rank answers (the sizes from the manifest, the slab's fd with open)."""
    if req["op"] == "open":
        return {"ok": True, "slabs": 1, "sizes": list(MANIFEST.slab_sizes)}, [slab_fd]
    if req["op"] == "manifest":
        return {"ok": True, "manifest": MANIFEST.to_wire()}, []
    if req["op"] == "hello":
        return {"ok": True, "fingerprint": FINGERPRINT, "rank": 0}, []
    return {"ok": True}, []


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Callable[[Answer], Path]]:
    """Start a scripted cache on a real socket in a 0700 directory; yields its starter."""
    sockdir = tmp_path / "s"
    sockdir.mkdir(mode=0o700)
    slab_fd = os.memfd_create("test-slab")
    os.ftruncate(slab_fd, MANIFEST.slab_sizes[0])
    threads: list[threading.Thread] = []
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def start(answer: Answer) -> Path:
        path = sockdir / "rank-0.sock"
        listener.bind(str(path))
        listener.listen(1)

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                while True:
                    try:
                        req, _ = wire.recv_frame(conn)
                        wire.send_frame(conn, *answer(req, slab_fd))
                    except (EOFError, OSError):  # the client hung up
                        return

        thread = threading.Thread(target=serve, name="fake-cache", daemon=True)
        thread.start()
        threads.append(thread)
        return path

    yield start
    listener.close()
    for thread in threads:
        thread.join(5)
    os.close(slab_fd)


def _cache_hung_up() -> None:
    """Wait for the scripted cache to see the client hang up (it closes its end then)."""
    for thread in threading.enumerate():
        if thread.name == "fake-cache":
            thread.join(5)


def open_fds() -> set[int]:
    """This process's open fds, less pipes (the lease watcher's wake pipe, opened by the
    process's first share handoff, is not a leak)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                fds.add(int(fd))
        except FileNotFoundError:  # the listing's own fd
            pass
    return fds


@pytest.mark.parametrize("mode", ["share", "copy"])
def test_an_honest_cache_hands_over_its_tensors(cache: Callable[[Answer], Path],
                                                mode: str) -> None:
    client = CacheClient(cache(honest))
    try:
        tensors = client.handoff(lambda: FINGERPRINT, mode=mode, device="cpu")
        assert list(tensors) == ["w"] and tuple(tensors["w"].shape) == (64, 64)
    finally:
        client.close()


@pytest.mark.parametrize(("lie", "words"), [
    ({"sizes": [SLAB // 2]}, "sent slabs of"),
    ({"sizes": [SLAB * 2]}, "slab fd holds"),
    ({"sizes": [SLAB, SLAB]}, "fds for 2 slabs"),
    ({"sizes": None}, "invalid open reply"),
    ({"sizes": ["x"]}, "invalid open reply"),
    ({"sizes": [-1]}, "invalid open reply"),
])
@pytest.mark.parametrize("mode", ["share", "copy"])
def test_an_open_reply_that_disagrees_with_the_manifest_is_refused(
        cache: Callable[[Answer], Path], lie: dict[str, Any], words: str, mode: str) -> None:
    def answer(req: dict[str, Any], slab_fd: int) -> tuple[dict[str, Any], list[int]]:
        reply, fds = honest(req, slab_fd)
        if req["op"] == "open":
            reply = {**reply, **lie}
            if reply["sizes"] is None:
                del reply["sizes"]
        return reply, fds

    before = open_fds()
    client = CacheClient(cache(answer))
    try:
        with pytest.raises(CacheBrokenError, match=words):
            client.handoff(lambda: FINGERPRINT, mode=mode, device="cpu")
    finally:
        client.close()
    _cache_hung_up()  # the cache's end of the connection is closed too
    assert open_fds() <= before  # the slab fd it was sent is closed, nothing is mapped


@pytest.mark.parametrize("opened", [
    ({"ok": False, "error": "released", "message": "gone"}, False),
    ({"ok": True, "slabs": 1}, True),  # a cache of an older version: no sizes
])
@pytest.mark.parametrize("mode", ["share", "copy"])
def test_a_mismatch_is_reported_before_a_broken_open_reply(
        cache: Callable[[Answer], Path], opened: tuple[dict[str, Any], bool], mode: str) -> None:
    """The hello's answer comes first: an engine of another checkpoint or vlaunch version is
    told so, not that the cache is broken."""
    reply, with_fd = opened

    def answer(req: dict[str, Any], slab_fd: int) -> tuple[dict[str, Any], list[int]]:
        if req["op"] == "open":
            return reply, [slab_fd] if with_fd else []
        if req["op"] == "hello":
            return {"ok": False, "error": "mismatch", "message": "fingerprint mismatch",
                    "mismatch": [["vlaunch", "0.0.9", "0.1.0"]]}, []
        return honest(req, slab_fd)

    before = open_fds()
    client = CacheClient(cache(answer))
    try:
        with pytest.raises(FingerprintMismatchError, match="vlaunch"):
            client.handoff(lambda: {"vlaunch": "0.1.0"}, mode=mode, device="cpu")
    finally:
        client.close()
    _cache_hung_up()
    assert open_fds() <= before


@pytest.mark.parametrize("mode", ["copy", "copy-release"])
@pytest.mark.parametrize("via", ["handoff", "map"])
def test_a_copy_the_cache_makes_is_waited_for_and_becomes_the_engines(
        cache: Callable[[Answer], Path], mode: str, via: str) -> None:
    """A GPU rank copies for the copy modes (rank/copies.py): its open reply sends a fresh
    allocation, still being written, with "copying"; the engine maps it read-write as its own
    memory and returns nothing before the cache has answered `copied`. Here the cache writes
    the bytes only when `copied` arrives, so an engine that did not wait would see zeros."""
    copy_fd = os.memfd_create("test-copy")
    os.ftruncate(copy_fd, SLAB)
    seen: list[str] = []

    def answer(req: dict[str, Any], slab_fd: int) -> tuple[dict[str, Any], list[int]]:
        seen.append(req["op"])
        if req["op"] == "open":
            return {"ok": True, "slabs": 1, "sizes": [SLAB], "copying": True}, [copy_fd]
        if req["op"] == "copied":
            os.pwrite(copy_fd, b"\x01" * SLAB, 0)
        return honest(req, slab_fd)

    client = CacheClient(cache(answer))
    drop = ["drop"] if mode == "copy-release" else []
    try:
        if via == "handoff":
            tensors = client.handoff(lambda: FINGERPRINT, mode=mode, device="cpu")
            # the hello goes out once the manifest arrived (the copy modes), then `copied`;
            # no `mapped` report (nothing of the cache's is held), a drop after copy-release
            assert seen == ["open", "manifest", "hello", "copied", *drop]
        else:
            tensors = client.map(client.manifest(), mode=mode, device="cpu")
            assert seen == ["manifest", "open", "copied", *drop]
        w = tensors["w"].view(-1).view(dtype=__import__("torch").uint8)
        assert bool((w == 1).all())
        w[:4] = 7  # the engine's own memory: the very pages the cache made, no second copy
        assert os.pread(copy_fd, 4, 0) == b"\x07" * 4
    finally:
        client.close()
        os.close(copy_fd)


@pytest.mark.parametrize("mode", ["share", "copy", "copy-release"])
@pytest.mark.parametrize("via", ["handoff", "map"])
def test_slabs_handed_over_are_taken_as_our_own_in_copy_release_only(
        cache: Callable[[Answer], Path], mode: str, via: str) -> None:
    """A rank that hands its slabs over (copy-release, nobody else mapping them) sends them
    with "handover": the engine maps them writable, privately (the memfd is sealed against
    shared writes), copies nothing and says `drop`. In any other mode the word is ignored:
    share maps read-only, copy copies into memory of its own."""
    import torch

    seen: list[str] = []

    def answer(req: dict[str, Any], slab_fd: int) -> tuple[dict[str, Any], list[int]]:
        seen.append(req["op"])
        if req["op"] == "open":
            os.pwrite(slab_fd, b"\x02" * SLAB, 0)
            return {"ok": True, "slabs": 1, "sizes": [SLAB], "handover": True}, [slab_fd]
        return honest(req, slab_fd)

    client = CacheClient(cache(answer))
    try:
        if via == "handoff":
            tensors = client.handoff(lambda: FINGERPRINT, mode=mode, device="cpu")
        else:
            tensors = client.map(client.manifest(), mode=mode, device="cpu")
        w = tensors["w"].view(-1).view(dtype=torch.uint8)
        assert bool((w == 2).all())
        where = next(line for line in Path("/proc/self/maps").read_text().splitlines()
                     if int(line.split("-")[0], 16) <= w.data_ptr() < int(
                         line.split()[0].split("-")[1], 16))
        perms = where.split()[1]
        want = {"share": "r--s", "copy": "rw-p", "copy-release": "rw-p"}[mode]
        assert perms == want and (("test-slab" in where) == (mode != "copy")), where
        assert ("drop" in seen) == (mode == "copy-release")
    finally:
        client.close()


@pytest.mark.parametrize("wrong", ["copied", "hello"])
def test_a_copy_that_failed_or_does_not_match_returns_nothing(
        cache: Callable[[Answer], Path], wrong: str) -> None:
    copy_fd = os.memfd_create("test-copy")
    os.ftruncate(copy_fd, SLAB)

    def answer(req: dict[str, Any], slab_fd: int) -> tuple[dict[str, Any], list[int]]:
        if req["op"] == "open":
            return {"ok": True, "slabs": 1, "sizes": [SLAB], "copying": True}, [copy_fd]
        if req["op"] == wrong == "copied":
            return {"ok": False, "error": "internal", "message": "the copy failed"}, []
        if req["op"] == wrong == "hello":
            return {"ok": False, "error": "mismatch", "message": "fingerprint mismatch",
                    "mismatch": [["checkpoint", "b", "a"]]}, []
        return honest(req, slab_fd)

    before = open_fds()
    client = CacheClient(cache(answer))
    try:
        error = CacheBrokenError if wrong == "copied" else FingerprintMismatchError
        with pytest.raises(error, match="the copy failed" if wrong == "copied" else "checkpoint"):
            client.handoff(lambda: FINGERPRINT, mode="copy", device="cpu")
    finally:
        client.close()
    _cache_hung_up()
    os.close(copy_fd)
    assert open_fds() <= before  # the copy's fd is closed and its mapping is gone
    with open("/proc/self/maps") as maps:
        assert "memfd:test-copy" not in maps.read()


@pytest.mark.parametrize("via", ["handoff", "map"])
@pytest.mark.parametrize("pieces", [[[SLAB // 2, SLAB // 2]], [[SLAB // 2]], [[0, SLAB]],
                                    [["x"]], "x", [[SLAB], [SLAB]]])
def test_a_copy_in_pieces_is_refused_where_they_cannot_be(
        cache: Callable[[Answer], Path], pieces: Any, via: str) -> None:
    """A slab of a rank's copy may come as several allocations ("pieces", an fd each); that
    is a GPU rank's, so a CPU engine refuses it, as it refuses pieces that do not cover their
    slab or are not sizes, with every fd closed and nothing mapped."""
    fds = [os.memfd_create("test-copy") for _ in range(2)]
    for fd in fds:
        os.ftruncate(fd, SLAB)

    def answer(req: dict[str, Any], slab_fd: int) -> tuple[dict[str, Any], list[int]]:
        if req["op"] == "open":
            return {"ok": True, "slabs": 1, "sizes": [SLAB], "copying": True,
                    "pieces": pieces}, fds
        return honest(req, slab_fd)

    before = open_fds()
    client = CacheClient(cache(answer))
    try:
        # not "sent 2 fds for 1 slabs": the pieces were read, and refused
        with pytest.raises(CacheBrokenError, match=r"pieces|piece size"):
            if via == "handoff":
                client.handoff(lambda: FINGERPRINT, mode="copy", device="cpu")
            else:
                client.map(client.manifest(), mode="copy", device="cpu")
    finally:
        client.close()
    _cache_hung_up()
    for fd in fds:
        os.close(fd)
    assert open_fds() <= before
    with open("/proc/self/maps") as maps:
        assert "memfd:test-copy" not in maps.read()
