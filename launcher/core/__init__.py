"""The supervisor's decisions: a pure state machine that takes events and returns actions.

One concern a module: `events` (the vocabulary: the configuration, the events the core takes
and the actions it returns), `supervisor` (the entry, `Supervisor.handle`, and the contract
with the executor), `model` (phases, states, records), `state` (the shared state), `ranks`,
`engine`, `budget`, `hang` (health probes, the engine watchdog, hung engines and standbys),
`standby`, `swap` (new weights), `stop`, `timers`, `view` (the status surface) and `exits` (how
a child ended, in words). None of them does I/O or reads a clock (tests/test_layout.py checks
it).
"""

from .exits import CACHE_STATUSES, describe_exit
from .model import (
    EngineState,
    EngineStatus,
    Failure,
    Phase,
    RankState,
    RankStatus,
    StandbyState,
    StandbyStatus,
    SupervisorProtocolError,
    SwapState,
    SwapStatus,
)
from .standby import STANDBY_MAX_FAILS
from .supervisor import Supervisor
from .timers import EXTEND_BY, EXTEND_EVERY

__all__ = [
    "CACHE_STATUSES", "EXTEND_BY", "EXTEND_EVERY", "STANDBY_MAX_FAILS", "EngineState",
    "EngineStatus", "Failure", "Phase", "RankState", "RankStatus", "StandbyState",
    "StandbyStatus", "Supervisor", "SupervisorProtocolError", "SwapState", "SwapStatus",
    "describe_exit",
]
