"""Where a rank sits: `Position`, its tensor-, pipeline- and data-parallel sizes and ranks.

(An "engine layout" is something else: the tensors as an engine post-processed them,
docs/engine-layout.md.) Apart from the shard plans (plan.py) because an engine's share
handoff needs the position and nothing else of them. Light: nothing beyond the contract's errors.
"""

from __future__ import annotations

from typing import NamedTuple

from vlaunch.cache.contract.errors import UsageError


class _PositionFields(NamedTuple):
    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0


class Position(_PositionFields):
    """Where a rank sits: its tensor-, pipeline- and data-parallel sizes and ranks.

    Global ranks are ordered data, then pipeline, then tensor (tensor varies fastest):
    global_rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank.

    Immutable, compared and hashed by its fields, validated when made (a NamedTuple: see
    vlaunch.cache).
    """

    __slots__ = ()

    def __new__(cls, tp_size: int, tp_rank: int, pp_size: int = 1, pp_rank: int = 0,
                dp_size: int = 1, dp_rank: int = 0) -> Position:
        for kind, size, rank in (("tp", tp_size, tp_rank), ("pp", pp_size, pp_rank),
                                 ("dp", dp_size, dp_rank)):
            if type(size) is not int or size < 1:
                raise UsageError(f"{kind}_size must be an integer >= 1, got {size!r}")
            if type(rank) is not int or not 0 <= rank < size:
                raise UsageError(f"{kind}_rank must be an integer in 0..{size - 1} for "
                                 f"{kind}_size {size}, got {rank!r}")
        return super().__new__(cls, tp_size, tp_rank, pp_size, pp_rank, dp_size, dp_rank)

    @property
    def world_size(self) -> int:
        """Number of ranks in all: tp_size * pp_size * dp_size."""
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def global_rank(self) -> int:
        """This rank's index in data, pipeline, tensor order."""
        return (self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.tp_rank

    @classmethod
    def from_global(cls, rank: int, tp_size: int, pp_size: int = 1, dp_size: int = 1) -> Position:
        """The position of global rank `rank` in a world of the given sizes."""
        world = tp_size * pp_size * dp_size
        if type(rank) is not int or not 0 <= rank < world:
            raise UsageError(f"rank must be an integer in 0..{world - 1} for tp_size "
                             f"{tp_size}, pp_size {pp_size}, dp_size {dp_size}, got {rank!r}")
        return cls(tp_size=tp_size, tp_rank=rank % tp_size,
                   pp_size=pp_size, pp_rank=rank // tp_size % pp_size,
                   dp_size=dp_size, dp_rank=rank // (tp_size * pp_size))

    def as_dict(self) -> dict[str, int]:
        """Return the six sizes and ranks by field name."""
        return {"tp_size": self.tp_size, "tp_rank": self.tp_rank, "pp_size": self.pp_size,
                "pp_rank": self.pp_rank, "dp_size": self.dp_size, "dp_rank": self.dp_rank}
