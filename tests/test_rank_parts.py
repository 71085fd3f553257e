"""The rank's server built once with its parts (rank/parts.py), without a socket or a load.

The parts are stood in for by fakes that record what the server asks of them; the server is
the real one. The Protocols both ways name only what the real classes have.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vlaunch.cache.rank import copies, parts, publishing
from vlaunch.cache.rank.daemon import CacheServer
from vlaunch.cache.rank.integrity import Integrity
from vlaunch.cache.rank.layouts import LayoutStore
from vlaunch.cache.rank.openers import Openers
from vlaunch.cache.rank.publishing import Publisher
from vlaunch.cache.rank.served import Served
from vlaunch.cache.rank.swap import RankSwap
from vlaunch.cache.rank.swapstate import ServedShard
from vlaunch.cache.store.manifest import pack

MANIFEST = pack([("w", "U8", (4096,))], backend="cpu", alignment=256, max_slab=1 << 20)


class FakeIntegrity:
    """An IntegrityPart that records the host it was built with."""

    def __init__(self, host: parts.IntegrityHost) -> None:
        self.host, self.changed, self.record, self.slabs = host, [], None, None
        self.rebased: list[str] = []

    def status(self) -> dict[str, Any]:
        return {}

    async def digest_reply(self, f: dict[str, Any]) -> parts.Reply:
        return {"ok": True}, []

    def rebase(self, model: str, record: Any, slabs: Any, published: str = "") -> None:
        self.rebased.append(model)


class FakeSwap:
    """A SwapPart that records the host it was built with and what the server told it."""

    def __init__(self, host: parts.SwapHost) -> None:
        self.host, self.integrity_seen = host, host.integrity
        self.version, self.model, self.label = 0, "", ""
        self.publisher = SimpleNamespace(request=lambda op, lease, f: ({"ok": True}, []))
        self.raw_closes = 0

    def listen(self, sock: Any, loop: Any) -> None: ...

    def raw_closed(self) -> None:
        self.raw_closes += 1

    def held(self) -> dict[str, int]:
        return {}

    def status(self) -> dict[str, Any]:
        return {"version": self.version}


def _server(released: list[str]) -> CacheServer:
    fd = os.memfd_create("test-rank-parts")
    os.ftruncate(fd, MANIFEST.slab_sizes[0])
    served = Served(MANIFEST, [fd], {"checkpoint": "a"}, lambda: released.append("raw"))
    return CacheServer(0, served, device="cpu", openers=Openers(0), integrity=FakeIntegrity,
                       swap=FakeSwap)


def test_the_server_builds_its_parts_with_itself_integrity_first() -> None:
    server = _server([])
    assert isinstance(server.integrity, FakeIntegrity) and server.integrity.host is server
    assert isinstance(server.swap, FakeSwap) and server.swap.host is server
    assert server.swap.integrity_seen is server.integrity  # the swap reads its files' record
    assert server.status()["weights"] == {"version": 0}


def test_free_raw_closes_the_raw_layout_and_frees_it_once() -> None:
    released: list[str] = []
    server = _server(released)
    fd = server.fds[0]
    server.free_raw()
    assert server.fds == [] and released == ["raw"] and server.release_hook is None
    assert server.swap.raw_closes == 1  # type: ignore[union-attr]
    with pytest.raises(OSError):
        os.fstat(fd)
    server.free_raw()
    assert released == ["raw"]


def test_swapping_refuses_handoffs_until_the_block_ends_even_on_a_failure() -> None:
    server = _server([])
    with pytest.raises(RuntimeError), server.swapping():
        assert server.state == "swapping"
        assert server._dispatch(0, "hello", {})[0]["error"] == "busy"
        raise RuntimeError("the copy failed")
    assert server.state == "serving"


def test_install_switches_every_served_field_at_once() -> None:
    server = _server([])
    before = server.manifest_frame
    layouts, fingerprint = LayoutStore(None, 0), {"checkpoint": "b"}
    server.install(ServedShard(1, "/m", "", fingerprint, MANIFEST, [], None, None, layouts, True,
                           None, None))
    assert (server.fingerprint, server.fds, server.layouts, server.raw_released) == (
        fingerprint, [], layouts, True)
    assert server.release_hook is None and server.copier is None
    assert server.manifest_frame is not before  # encoded again for the new manifest
    assert len(server.openers) == 0  # new slabs: nobody opened them yet
    old = server.replace_layouts(LayoutStore(None, 0))
    assert old is layouts and server.layouts is not layouts


def test_change_fingerprint_gives_a_new_dict() -> None:
    server = _server([])
    old = server.fingerprint
    server.change_fingerprint(checkpoint_data="changed")
    assert old == {"checkpoint": "a"}
    assert server.fingerprint == {"checkpoint": "a", "checkpoint_data": "changed"}


def _members(protocol: type) -> set[str]:
    names = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {n for n in names if not n.startswith("_")}


def test_each_protocol_names_only_what_the_real_class_has(tmp_path: Path) -> None:
    server = _server([])
    swap = RankSwap(server, SimpleNamespace(plan="p", position=None, quantization="",
                                            model=str(tmp_path)),  # type: ignore[arg-type]
                    backend=SimpleNamespace(name="cpu"), threads=1)  # type: ignore[arg-type]
    integrity = Integrity(server, str(tmp_path), "p", tmp_path / "rank-0.sock")
    for protocol, real in ((parts.IntegrityHost, server), (parts.SwapHost, server),
                           (parts.SeedHost, server), (parts.IntegrityPart, integrity),
                           (parts.SwapPart, swap), (parts.Publishing, Publisher),
                           (publishing.Swapper, swap), (copies.Copier, copies.RankCopier)):
        missing = sorted(n for n in _members(protocol) if not hasattr(real, n))
        assert not missing, (protocol.__name__, missing)
