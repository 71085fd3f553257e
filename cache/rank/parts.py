"""How a rank's server and its parts see each other, in both directions.

The server (rank/daemon.py) is built once, with its parts (rank/process.py): a part that calls
back into the server, the integrity (rank/integrity.py) or the swap (rank/swap.py), is made by
a factory that the server calls with itself, seen as the narrow host the part needs
(`IntegrityHost`, `SwapHost`); the server holds the part as what it needs of it
(`IntegrityPart`, `SwapPart`). A copier only answers: `copies.Copier`. The seed source
(rank/seedsource.py), started beside the server, reads it as a `SeedHost`.

Only Protocols here, so that neither side imports the other's module (nor this one the
server's: the server's clients are in rank/leases.py).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vlaunch.cache.contract.fingerprint import Fingerprint
    from vlaunch.cache.rank.copies import Copier
    from vlaunch.cache.rank.layouts import LayoutStore
    from vlaunch.cache.rank.leases import Lease
    from vlaunch.cache.rank.openers import Openers
    from vlaunch.cache.rank.swapstate import ServedShard
    from vlaunch.cache.store.artifacts import ArtifactStore
    from vlaunch.cache.store.identity import Record
    from vlaunch.cache.store.manifest import Manifest
    from vlaunch.cache.store.slabs import SlabBytes

Reply = tuple[dict[str, Any], list[int]]
"""A request's reply frame and the fds that go with it."""


class IntegrityHost(Protocol):
    """What the integrity needs of the server: the slabs it digests and the fingerprint it
    marks when the files change."""

    @property
    def rank(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def fds(self) -> list[int]: ...
    @property
    def fingerprint(self) -> Fingerprint: ...
    @property
    def manifest(self) -> Manifest: ...
    @property
    def handing_over(self) -> bool: ...

    def reading_raw(self) -> AbstractContextManager[None]: ...
    def change_fingerprint(self, **fields: str) -> None: ...


class IntegrityPart(Protocol):
    """What the server (and the swap, through it) needs of the rank's integrity
    (rank.integrity.Integrity): the files its slabs came from, their watch, the digests."""

    changed: list[str]
    record: Record | None
    slabs: list[SlabBytes] | None

    def status(self) -> dict[str, Any]: ...
    def digest_reply(self, f: dict[str, Any]) -> Coroutine[Any, Any, Reply]: ...
    def rebase(self, model: str, record: Record | None, slabs: list[SlabBytes] | None,
               published: str = "") -> None: ...


class Publishing(Protocol):
    """What the server needs of the trainers' side of the swap (rank.publishing.Publisher)."""

    def request(self, op: str, lease: Lease, f: dict[str, Any]) -> Any: ...


class SwapPart(Protocol):
    """What the server (and its ready report) needs of the rank's swap (rank.swap.RankSwap):
    the served version, the launcher's channel, the trainers' requests, and what it holds."""

    version: int
    model: str
    label: str
    publisher: Publishing

    def listen(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None: ...
    def raw_closed(self) -> None: ...
    def held(self) -> dict[str, int]: ...
    def status(self) -> dict[str, Any]: ...


class SwapHost(Protocol):
    """What the swap (and publishing) needs of the server: what it serves, who holds it, the
    launcher's channel, and the cutover's steps; the swap writes none of its fields itself."""

    @property
    def rank(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def fingerprint(self) -> Fingerprint: ...
    @property
    def manifest(self) -> Manifest: ...
    @property
    def fds(self) -> list[int]: ...
    @property
    def layouts(self) -> LayoutStore: ...
    @property
    def copier(self) -> Copier | None: ...
    @property
    def openers(self) -> Openers: ...
    @property
    def leases(self) -> dict[int, Lease]: ...
    @property
    def raw_readers(self) -> int: ...
    @property
    def raw_released(self) -> bool: ...
    @property
    def escrow(self) -> socket.socket | None: ...
    @property
    def integrity(self) -> IntegrityPart | None: ...
    @property
    def handing_over(self) -> bool: ...
    @property
    def release_hook(self) -> Callable[[], None] | None: ...

    def send_escrow(self, frame: dict[str, Any], fds: list[int]) -> None: ...
    def tell_openers(self, everything: bool = False) -> None: ...
    def swapping(self) -> AbstractContextManager[None]: ...
    def replace_layouts(self, layouts: LayoutStore) -> LayoutStore: ...
    def free_raw(self) -> None: ...
    def install(self, weights: ServedShard) -> None: ...


class SeedHost(Protocol):
    """What the seed source needs of the server: what it serves, to stream to a new replica."""

    @property
    def rank(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def fingerprint(self) -> Fingerprint: ...
    @property
    def manifest(self) -> Manifest: ...
    @property
    def fds(self) -> list[int]: ...
    @property
    def artifacts(self) -> ArtifactStore: ...
    @property
    def handing_over(self) -> bool: ...

    def reading_raw(self) -> AbstractContextManager[None]: ...
    def artifact_reply(self, kind: str, key: str) -> dict[str, Any]: ...
