"""What an engine gets: `Weights`, named tensors, where they came from, and why."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlaunch.cache.client.connection import CacheClient


class Outcome(enum.Enum):
    """What the rank answered when the engine asked for its weights; the values are the
    error codes it sends (contract/protocol.py `error`)."""

    SERVED = "served"  # from the cache: mapped (share) or copied
    RELEASED = "released"  # the rank dropped that layout (copy-release; raw after an engine
    # layout replaced it): a hand-back gives it an engine layout again
    CHANGED = "changed"  # raw released, and the checkpoint changed on disk since it was read
    BUSY = "busy"  # at its connection bound, or copying a swap into its slabs
    MISMATCH = "mismatch"  # it holds another configuration's weights
    UNAVAILABLE = "unavailable"  # no cache answered
    BROKEN = "broken"  # an error reply, or data that failed validation
    DISK = "disk"  # read from the checkpoint without asking a cache (load_from_disk)

    @property
    def takes_hand_back(self) -> bool:
        """Whether the rank would take this engine's parameters as its engine layout."""
        return self in (Outcome.SERVED, Outcome.RELEASED)


class Weights(dict):  # type: ignore[type-arg]
    """Named tensors, plus where they came from and the bytes held outside the engine."""

    source: str = "disk"
    outcome: Outcome = Outcome.DISK
    client: CacheClient | None = None
    bytes_outside: int = 0
    reason: str = ""  # the outcome in words, for the log; decide on `outcome`
    layout: str = ""  # the engine layout's key when these are the engine's own tensors
    copied: frozenset[str] = frozenset()  # engine layout tensors that are private copies
    layout_miss: str = ""  # why load(layout=...) got the raw tensors instead
