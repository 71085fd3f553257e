"""One reference-engine rank's state: its model, its process group, its figures (`RankState`).

Apart from workers.py, which builds it, so that the warm-up and the memory figures that read
it (warmup.py, memory.py) do not import the module that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlaunch.cache.reference.refmodel import TPLlama


@dataclass
class RankState:
    """One rank's model and its process group."""

    rank: int
    tp_size: int
    device: str
    comm_device: str
    model: TPLlama
    weights_ms: float
    source: str
    nbytes: int
    layout: str = "own"
    draft: TPLlama | None = None  # speculative decoding's draft model (replicated: no comm)
    speculative_tokens: int = 4
    weights_split: tuple[int, int] | None = None  # bytes (shared, own): memory.py
    memory_logged: Any = None  # the RankMemory this rank last logged (memory.py)
    scratch_warmup: Any = None  # the WarmupReport of a warm-up on scratch weights (warmup.py)
