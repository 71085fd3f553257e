"""What an engine gets: `Weights`, named tensors and where they came from."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlaunch.cache.client.connection import CacheClient


class Weights(dict):  # type: ignore[type-arg]
    """Named tensors, plus where they came from and the bytes held outside the engine."""

    source: str = "disk"
    client: CacheClient | None = None
    bytes_outside: int = 0
    reason: str = ""
    layout: str = ""  # the engine layout's key when these are the engine's own tensors
    copied: frozenset[str] = frozenset()  # engine layout tensors that are private copies
    layout_miss: str = ""  # why load(layout=...) got the raw tensors instead
