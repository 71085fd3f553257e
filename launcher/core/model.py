"""The supervisor's model: the phase table, each child's states and the records it reports.

Plain enums and frozen dataclasses; the decisions that move between these states are in the
other modules of this package.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from vlaunch.cache.contract.exitcodes import ExitStatus

T = TypeVar("T", bound=enum.Enum)


class SupervisorProtocolError(RuntimeError):
    """The executor fed an event that cannot happen: a bug in the executor, not in a child."""


class Phase(enum.Enum):
    """Where the launcher stands as a whole; derived from the children, never stored.

    loading          Cache ranks load their shards; STATUS counts them and
                     EXTEND_TIMEOUT_USEC keeps systemd waiting.
                     -> starting_engine  the last rank is ready (with an engine)
                     -> serving          the last rank is ready (caches only): READY=1
                     -> stopping         a rank exits (its own status, else 68); SIGTERM/SIGINT
    starting_engine  Every rank was ready once; the engine runs, or waits out a backoff, but
                     has never been ready (no READY=1 yet, so no RELOADING=1 either).
                     -> serving          EngineReady: READY=1
                     -> stopping         budget (80), config error (81), success (0), a rank
                                         exits (69), SIGTERM/SIGINT (0)
    serving          READY=1 sent; the engine is ready, or there is none. A rank respawning
                     from escrow (on_rank_exit=respawn) stays here: the engine keeps serving
                     from its mappings.
                     -> restarting       the engine exits or SIGHUP: RELOADING=1
                     -> stopping         as from starting_engine
    restarting       RELOADING=1 sent; the engine is stopping (SIGHUP), in backoff, or
                     respawned and not ready yet.
                     -> serving          EngineReady: READY=1 again
                     -> stopping         as from starting_engine
    stopping         STOPPING=1 sent; the engine gets SIGTERM, then (once it is gone) the
                     ranks. The first cause fixes the exit status.
                     -> stopped          every child exited, or stop_timeout / a second
                                         SIGTERM/SIGINT: KillAll (82 unless a failure began it)
    stopped          Exit returned; every later event is ignored.
    """

    LOADING = "loading"
    STARTING_ENGINE = "starting_engine"
    SERVING = "serving"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"


class RankState(enum.Enum):
    """One cache rank: loading -> ready -> (respawning -> ready)* -> stopping -> exited."""

    LOADING = "loading"
    READY = "ready"
    RESPAWNING = "respawning"
    STOPPING = "stopping"
    EXITED = "exited"


class EngineState(enum.Enum):
    """The engine process, attempt after attempt (`ENGINE_NEXT` is this table as data).

    pending   Not started yet: the ranks load (and the preload runs).
              -> starting     every rank is ready
    starting  Spawned (or a standby promoted), not ready yet.
              -> ready        EngineReady (readiness "none": engine_settle after Spawned)
              -> stopping     SIGHUP, a swap, a stop: SIGTERM
              -> exited       it exited; or it steps aside to drain (drain.py)
    ready     Serving; its probes are watched (hang.py).
              -> stopping     hung, SIGHUP, a swap, a stop: SIGTERM (SIGKILL for a hang
                              with --engine-hang-kill-after 0)
              -> exited       it exited; or it steps aside to drain (drain.py)
    backoff   It exited; the next attempt waits out the backoff.
              -> starting     the backoff passed (at once with a parked standby, or SIGHUP)
              -> exited       a stop, or a swap's cutover: no restart is due any more
    stopping  Asked to stop; waits for its exit (SIGKILL past its deadline).
              -> exited       it exited
    exited    Gone, and no attempt is due.
              -> starting     a restart (SIGHUP, a swap, a promotion, the rollback)
              -> backoff      an unrequested exit inside the restart budget
    """

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    EXITED = "exited"


class StandbyState(enum.Enum):
    """The standby engine (`STANDBY_NEXT` is this table as data).

    none      No standby process (none yet, promoted, or given up).
              -> starting     the engine is ready and standbys are on
    starting  Spawned; loads and parks.
              -> parked       StandbyParked
              -> stopping     a stop, a swap retires it, it did not park in time
              -> none         it exited
    parked    Waits to be promoted (it pings, under a watchdog).
              -> none         promoted to the engine, or it exited (hung: killed)
              -> stopping     a stop, or a swap retires it
    stopping  Asked to stop; waits for its exit.
              -> none         it exited
    """

    NONE = "none"
    STARTING = "starting"
    PARKED = "parked"
    STOPPING = "stopping"


class SwapState(enum.Enum):
    """A swap of the weights (`vlaunch swap`, or a published version), step by step.

    none          No swap: the ranks serve `SwapStatus.version`.
                  -> preparing      SwapRequested
                  -> staging        a rank's trainer published a version
    preparing     The ranks check the new checkpoint: config and plan, headers, sampled
                  identity, memory. Nothing was touched; a refusal ends here.
                  -> staging        every rank prepared (the mode is chosen now)
                  -> none           a rank refused or exited (87)
    staging       The ranks read the new shard while the old one serves: into new slabs on
                  the device (double), or into pinned host memory (in-place). A published
                  version starts here: the trainer staged it.
                  -> committing     double: every rank staged
                  -> parking        in-place, with a standby: it parks before its weights
                  -> stopping       in-place, without one
                  -> none           a rank refused or exited, or a published version came
                                    late (87)
    committing    The ranks cut over: double: they serve the new slabs (the old engine keeps
                  its mappings of the old ones); in-place: the engine is gone, they copy the
                  new bytes into their slabs.
                  -> parking        double, with a standby: one parks on the new weights
                  -> stopping       double, without one
                  -> starting       in-place
                  -> rolling_back   a rank refused its commit
    parking       A standby for the new weights starts and parks; the old engine serves.
                  -> stopping       it parked (or standbys were given up)
                  -> starting       double on the launcher's sockets: it parked and is
                                    promoted while the old engine drains (drain.py)
    stopping      The serving engine gets SIGTERM (SIGKILL after stop_timeout).
                  -> starting       double: it exited
                  -> committing     in-place: it exited
    starting      The new engine starts (or the standby is promoted) on the new weights.
                  -> none           it is ready: the ranks drop the old weights (finish)
                  -> rolling_back   it exited `attempts` times, or ready_timeout passed
    rolling_back  The new engine is stopped, then the ranks restore the old weights; the
                  engine starts on them (status 85 to the requester).
                  -> none           every rank rolled back

    A cache rank that exits while preparing or staging abandons the swap (87); past that, it
    stops the launcher (69). A stop of the launcher ends any swap (86): every state but none
    also goes -> none (`SWAP_NEXT` is this table as data, with those arrows).
    """

    NONE = "none"
    PREPARING = "preparing"
    STAGING = "staging"
    COMMITTING = "committing"
    PARKING = "parking"
    STOPPING = "stopping"
    STARTING = "starting"
    ROLLING_BACK = "rolling_back"


P, E, SB, S = Phase, EngineState, StandbyState, SwapState
PHASE_NEXT: dict[Phase, frozenset[Phase]] = {
    P.LOADING: frozenset({P.STARTING_ENGINE, P.SERVING, P.STOPPING}),
    P.STARTING_ENGINE: frozenset({P.SERVING, P.STOPPING}),
    P.SERVING: frozenset({P.RESTARTING, P.STOPPING}),
    P.RESTARTING: frozenset({P.SERVING, P.STOPPING}),
    P.STOPPING: frozenset({P.STOPPED}),
    P.STOPPED: frozenset(),
}
"""Which phase may follow which: `Phase`'s table as data (a test holds the two equal)."""
ENGINE_NEXT: dict[EngineState, frozenset[EngineState]] = {
    E.PENDING: frozenset({E.STARTING}),
    E.STARTING: frozenset({E.READY, E.STOPPING, E.EXITED}),
    E.READY: frozenset({E.STOPPING, E.EXITED}),
    E.BACKOFF: frozenset({E.STARTING, E.EXITED}),
    E.STOPPING: frozenset({E.EXITED}),
    E.EXITED: frozenset({E.STARTING, E.BACKOFF}),
}
"""Which engine state may follow which: `EngineState`'s table; engine.py moves along it."""
STANDBY_NEXT: dict[StandbyState, frozenset[StandbyState]] = {
    SB.NONE: frozenset({SB.STARTING}),
    SB.STARTING: frozenset({SB.PARKED, SB.STOPPING, SB.NONE}),
    SB.PARKED: frozenset({SB.NONE, SB.STOPPING}),
    SB.STOPPING: frozenset({SB.NONE}),
}
"""Which standby state may follow which: `StandbyState`'s table; standby.py moves along it."""
SWAP_NEXT: dict[SwapState, frozenset[SwapState]] = {
    S.NONE: frozenset({S.PREPARING, S.STAGING}),
    S.PREPARING: frozenset({S.STAGING, S.NONE}),
    S.STAGING: frozenset({S.COMMITTING, S.PARKING, S.STOPPING, S.NONE}),
    S.COMMITTING: frozenset({S.PARKING, S.STOPPING, S.STARTING, S.ROLLING_BACK, S.NONE}),
    S.PARKING: frozenset({S.STOPPING, S.STARTING, S.NONE}),
    S.STOPPING: frozenset({S.STARTING, S.COMMITTING, S.NONE}),
    S.STARTING: frozenset({S.NONE, S.ROLLING_BACK}),
    S.ROLLING_BACK: frozenset({S.NONE}),
}
"""Which swap state may follow which: `SwapState`'s table, with -> none from every other
state (a stop or a rank's exit ends any swap); swap.py moves along it."""
del P, E, SB, S


def moved(table: Mapping[T, frozenset[T]], old: T, new: T, what: str) -> T:
    """`new`, once `table` allows `old` -> `new` (else the core itself is wrong: a bug)."""
    if new is not old and new not in table[old]:
        raise AssertionError(f"{what}: {old.value} -> {new.value} is not in its table")
    return new


ENGINE_ALIVE = (EngineState.STARTING, EngineState.READY, EngineState.STOPPING)
"""Engine states in which its process may still exist."""
RANK_RUNNING = (RankState.LOADING, RankState.READY, RankState.RESPAWNING)
"""Rank states in which the rank runs and has not been asked to stop."""


@dataclass(frozen=True)
class RankStatus:
    """One cache rank as the status surface shows it."""

    rank: int
    state: RankState = RankState.LOADING
    pid: int | None = None
    last_exit: int | None = None
    respawns: int = 0
    loaded_bytes: int = 0  # while loading: from its progress reports; once ready: total_bytes
    total_bytes: int = 0


@dataclass(frozen=True)
class EngineStatus:
    """The engine as the status surface shows it; `restarts` counts every respawn."""

    state: EngineState = EngineState.PENDING
    pid: int | None = None
    attempt: int = 0
    restarts: int = 0
    last_exit: int | None = None
    healthy: bool = True
    failing: tuple[str, ...] = ()  # the probes failing now: health, liveness, watchdog
    hangs: int = 0  # engines found hung (--engine-unhealthy-after) and stopped


@dataclass(frozen=True)
class StandbyStatus:
    """The standby engine (--standby) as the status surface shows it."""

    state: StandbyState = StandbyState.NONE
    pid: int | None = None
    number: int = 0  # standbys started so far
    promotions: int = 0
    failures: int = 0  # standbys in a row that died before parking
    given_up: bool = False
    hangs: int = 0  # parked standbys whose watchdog pings stopped, killed and replaced


@dataclass(frozen=True)
class DrainStatus:
    """Engines replaced on purpose (drain.py): how many drained and exited on their own, how
    many were killed past --drain-timeout, and how many drain now."""

    drained: int = 0
    killed: int = 0
    draining: int = 0


@dataclass(frozen=True)
class SwapStatus:
    """The weights the ranks serve (`version`, `model`, a published `label`), and the swap in
    progress (`state`, `target_*`, `mode`), as the status surface shows them."""

    state: SwapState = SwapState.NONE
    version: int = 0  # 0: what the ranks loaded at start; + 1 with each completed swap
    model: str = ""
    label: str = ""  # the trainer's label of a published version ("" for a checkpoint)
    target_version: int = 0
    target_model: str = ""
    target_label: str = ""
    mode: str = ""  # double or in-place (the pending swap's, then the last one's)
    swaps: int = 0
    rollbacks: int = 0
    failures: int = 0  # exits of the pending swap's new engine before it was ready
    last: str = ""  # how the last swap ended, in words


@dataclass(frozen=True)
class Failure:
    """The first cache rank that failed, as logged and reported."""

    rank: int
    pid: int
    status: int


@dataclass(frozen=True)
class Stop:
    """A stop in progress: its first cause (the exit status) and its deadline."""

    cause: ExitStatus
    reason: str
    deadline: float
    signals: int
