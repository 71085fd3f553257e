"""What a rank's swap holds between its steps (docs/swap.md): the weights it serves and can
switch back to, the weights it has staged, and the errors a step refuses with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import VlaunchError, exit_status
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.store.manifest import Manifest

if TYPE_CHECKING:
    from vlaunch.cache.rank.copies import Copier
    from vlaunch.cache.rank.layouts import LayoutStore
    from vlaunch.cache.rank.openers import Openers
    from vlaunch.cache.store.identity import Record


class SwapError(VlaunchError):
    """A swap step the rank refuses; `status` says why (the launcher passes it on)."""

    def __init__(self, message: str, status: ExitStatus = ExitStatus.SWAP_UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = status


class StagingMemoryError(VlaunchError):
    """No room to stage the new weights (device or host)."""

    status = exit_status("OUT_OF_MEMORY")


@dataclass
class ServedShard:
    """One shard as the rank serves it: everything a cutover switches over."""

    version: int
    model: str
    label: str  # a published version's label; "" for a checkpoint's files
    fingerprint: dict[str, str]
    manifest: Manifest
    fds: list[int]
    release: Callable[[], None] | None
    buffers: list[Any] | None  # the rank's writable views of its raw slabs, where it has them
    layouts: LayoutStore
    raw_released: bool
    copier: Copier | None
    record: Record | None  # of the files; None for a published version
    digests: dict[str, str] | None = None  # a published version's, taken at its commit
    openers: Openers | None = None  # of these slabs (None: new, nobody opened them)


@dataclass
class Staged:
    """New weights beside the served ones, from prepare (or a publish) to finish."""

    version: int
    model: str
    label: str = ""
    mode: str = ""
    keep: bool = True  # in place: keep the served bytes on the host for a rollback
    margin: int = 0
    specs: list[Any] = field(default_factory=list)
    manifest: Manifest | None = None
    record: Record | None = None
    fingerprint: dict[str, str] = field(default_factory=dict)
    slabs: list[Any] = field(default_factory=list)  # allocated slabs (double, a publish's)
    buffers: list[Any] = field(default_factory=list)  # the staged bytes
    free: Callable[[], None] | None = None  # frees host buffers (in place)
    backup: list[Any] | None = None  # in place: the served bytes, for a rollback
    backup_free: Callable[[], None] | None = None
    previous: ServedShard | None = None  # what served before the commit
    committed: bool = False
    owner: int = 0  # a publish: id() of the trainer's lease
    reply: asyncio.Future[tuple[dict[str, Any], list[int]]] | None = None
    digests: dict[str, str] | None = None

    def release(self) -> None:
        """Free what was staged (never the served slabs)."""
        self.buffers = []
        if self.free is not None:
            self.free()
            self.free = None
        for slab in self.slabs:
            slab.release()
        self.slabs = []
        self.drop_backup()

    def drop_backup(self) -> None:
        """Free the host copy of the old weights."""
        self.backup = None
        if self.backup_free is not None:
            self.backup_free()
            self.backup_free = None



def discard(w: ServedShard) -> None:
    """Let go of weights no longer served (mapped clients keep the memory until they exit)."""
    if w.openers is not None:
        w.openers.close()
    wire.close_fds(w.fds)
    w.fds = []
    if w.release is not None:
        w.release()
    w.layouts.close()
    if w.copier is not None:
        w.copier.close()


def status_of(exc: BaseException) -> ExitStatus:
    """The exit status a failed step reports (as a rank's own failure would)."""
    from vlaunch.cache.rank.failures import out_of_memory

    if out_of_memory(exc):
        return ExitStatus.OUT_OF_MEMORY
    if isinstance(exc, OSError):
        return ExitStatus.IO_ERROR
    return ExitStatus.INTERNAL


def words(exc: BaseException) -> str:
    """An exception as one line of words."""
    return " ".join(str(exc).split()) or type(exc).__name__
