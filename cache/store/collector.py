"""The cyclic garbage collector held off while a handoff builds the engine's tensors.

A handoff makes thousands of small objects (manifest records, tensors, the replies' lists)
that live as long as the weights. With the collector on, they set off collections in the
middle of the handoff, and one more the moment it is re-enabled. `paused()` keeps it off
for the handoff and then moves the young objects into the oldest generation, as a
collection that found them all alive would, without examining them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

INTERPRETER_FROZEN = 1000
"""At most this many frozen objects are the interpreter's, not an engine's (375 in 3.12)."""


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block (where it was on), then on again with nothing due."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        age_young_objects()
        gc.enable()


def age_young_objects() -> None:
    """Move the objects of the young GC generations into the oldest one, without collecting.

    They are the handoff's and what the engine made just before it (vlaunch's modules,
    imported for the call), and they live as long as the weights. Otherwise re-enabling the
    collector set off a collection of them at once, a fifth of a first share load() on a CPU
    (benchmarks/results/figures.md). gc.freeze() then gc.unfreeze() is that move (two list
    splices, and the young counts reset); it is skipped where the engine has frozen a heap of
    its own, which unfreeze() would thaw. Python 3.12 starts with a few hundred objects frozen
    (tuples of its deep-frozen modules): thawing those into the oldest generation is free.
    """
    if gc.get_freeze_count() <= INTERPRETER_FROZEN:
        gc.freeze()
        gc.unfreeze()
