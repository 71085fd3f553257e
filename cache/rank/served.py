"""What a rank serves once it holds its slabs: `Served`, made by a load, a seed or an escrow."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlaunch.cache.contract.fingerprint import Fingerprint
    from vlaunch.cache.rank.layouts import EngineLayout
    from vlaunch.cache.store.manifest import Manifest


@dataclass(frozen=True)
class Served:
    """The slabs' manifest and fds, the rank's fingerprint and how to let the slabs go; and
    what an escrow adds: the engine layouts, whether the raw layout was released, and the
    version (with its label) that a swap had the rank serving (docs/swap.md)."""

    manifest: Manifest
    fds: list[int]
    fingerprint: Fingerprint
    release: Callable[[], None] | None = None
    layouts: list[EngineLayout] = field(default_factory=list)
    raw_released: bool = False
    version: int = 0
    label: str = ""
    # adopted slabs: who opened them (pid, start time), and whether that is everyone
    opened: tuple[tuple[int, float], ...] = ()
    incomplete: bool = False
