"""The core's state tables: each enum's docstring draws the table its `*_NEXT` holds as data
(the docstring is what a reader sees; the data is what the core moves along), and each
concern's state is written by its own module only."""

from __future__ import annotations

import enum
import importlib.util
import sys
from pathlib import Path

import pytest

from vlaunch.launcher.core import EngineState, Phase, StandbyState, SwapState
from vlaunch.launcher.core.model import (
    ENGINE_NEXT,
    PHASE_NEXT,
    STANDBY_NEXT,
    SWAP_NEXT,
    moved,
)

ROOT = Path(__file__).resolve().parents[1]


def drawn(states: type[enum.Enum]) -> dict[enum.Enum, frozenset[enum.Enum]]:
    """The arrows of a state table docstring: a line that starts with a state's value opens
    its block; each `-> value` line in the block is one transition."""
    values = {s.value for s in states}
    table: dict[enum.Enum, set[enum.Enum]] = {}
    state = None
    for line in (states.__doc__ or "").splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "->" and state is not None:
            table[state].add(states(words[1]))
        elif words and words[0] in values and line.startswith(" " * 4 + words[0] + " "):
            state = states(words[0])
            table[state] = set()
    return {k: frozenset(v) for k, v in table.items()}


@pytest.mark.parametrize(("states", "data", "implied"), [
    (Phase, PHASE_NEXT, None), (EngineState, ENGINE_NEXT, None),
    (StandbyState, STANDBY_NEXT, None), (SwapState, SWAP_NEXT, SwapState.NONE)])
def test_each_docstring_draws_its_table(states: type[enum.Enum],
                                        data: dict[enum.Enum, frozenset[enum.Enum]],
                                        implied: enum.Enum | None) -> None:
    table = drawn(states)
    assert set(table) == set(states) == set(data)
    for state, arrows in table.items():  # the swap's "-> none" from anywhere is its footnote
        extra = {implied} if implied is not None and state is not implied else set()
        assert data[state] == arrows | extra, state


def test_a_move_off_the_table_is_a_bug() -> None:
    assert moved(ENGINE_NEXT, EngineState.READY, EngineState.STOPPING, "engine") \
        is EngineState.STOPPING
    assert moved(ENGINE_NEXT, EngineState.READY, EngineState.READY, "engine") is EngineState.READY
    with pytest.raises(AssertionError, match="engine: pending -> ready is not in its table"):
        moved(ENGINE_NEXT, EngineState.PENDING, EngineState.READY, "engine")


def test_each_field_of_the_state_has_one_writer() -> None:
    spec = importlib.util.spec_from_file_location("structure", ROOT / "benchmarks/structure.py")
    assert spec is not None and spec.loader is not None
    structure = importlib.util.module_from_spec(spec)
    sys.modules["structure"] = structure
    spec.loader.exec_module(structure)
    writers = structure.state_writers(ROOT)
    fields = set(structure.state_fields(ROOT))
    shared = {p: sorted(w) for p, w in writers.items() if p.split(".")[0] in fields
              and len(w) > 1}
    assert shared == {}
    assert writers["_engine"] == {"engine"} and writers["_swap_run.waiting"] == {"swap"}
