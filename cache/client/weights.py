"""What an engine gets: `Weights`, named tensors, where they came from, and why."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import ClassVar

    from vlaunch.cache.client.connection import CacheClient


class Outcome(str):
    """What the rank answered when the engine asked for its weights: one of the constants
    below, each the error code the rank sends (contract/protocol.py `error`). A str with
    __slots__, not an Enum: every engine start defines it, and an Enum costs ten times more
    to define (82 against 9 us here; vlaunch.cache)."""

    __slots__ = ()
    SERVED: ClassVar[Outcome]  # from the cache: mapped (share) or copied
    RELEASED: ClassVar[Outcome]  # the rank dropped that layout (copy-release; raw after an
    # engine layout replaced it): a hand-back gives it an engine layout again
    CHANGED: ClassVar[Outcome]  # raw released, and the checkpoint changed on disk since
    BUSY: ClassVar[Outcome]  # at its connection bound, or copying a swap into its slabs
    MISMATCH: ClassVar[Outcome]  # it holds another configuration's weights
    UNAVAILABLE: ClassVar[Outcome]  # no cache answered
    BROKEN: ClassVar[Outcome]  # an error reply, or data that failed validation
    DISK: ClassVar[Outcome]  # read from the checkpoint without asking a cache

    @property
    def takes_hand_back(self) -> bool:
        """Whether the rank would take this engine's parameters as its engine layout."""
        return self in ("served", "released")


for _code in ("served", "released", "changed", "busy", "mismatch", "unavailable", "broken",
              "disk"):
    setattr(Outcome, _code.upper(), Outcome(_code))
del _code


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
