"""The supervisor's state, by concern, and the lookups every decision uses.

`Supervisor` (supervisor.py) is this state plus one mixin per concern (ranks, engine, hang,
standby, swap, drain, stop, timers, status view). Each concern's fields are one record here,
written by its own module only (the comment or docstring names it): the status records the
status surface shows (`EngineStatus`, `StandbyStatus`, `SwapStatus`, `RankStatus`, model.py)
and, beside them, the bookkeeping it keeps (`EngineRun`, `Health`, `StandbyRun`, `SwapRun`,
`Clocks`, `Startup`). A mixin that changes another concern's state calls a step of the
module that owns it (`_engine_sigterm`, `_retire_standby`, `_watch_standby`...). The engine,
standby and swap states move along their tables (`ENGINE_NEXT`...); `phase` is derived.
`python benchmarks/structure.py --state` lists the fields and who writes each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .budget import RestartBudget
from .events import Exit, SupervisorConfig, SwapPolicy
from .model import (
    ENGINE_ALIVE,
    DrainStatus,
    EngineState,
    EngineStatus,
    Failure,
    Phase,
    RankState,
    RankStatus,
    StandbyState,
    StandbyStatus,
    Stop,
    SupervisorProtocolError,
    SwapStatus,
)


@dataclass(slots=True)
class EngineRun:
    """The engine's restart accounting and timers beside its status (engine.py writes them)."""

    budget: RestartBudget
    respawn_due: float | None = None  # the backoff ends then
    ready_since: float | None = None  # ready since then (stable_after)
    reload_deadline: float | None = None  # a planned stop (SIGHUP, a swap): SIGKILL then
    settle_due: float | None = None  # readiness "none": when the engine counts ready
    ready_sent: bool = False  # READY=1 went out once
    reloading: bool = False  # RELOADING=1 sent, READY=1 not yet again


@dataclass(slots=True)
class Health:
    """The ready engine's probes and the parked standby's watchdog (hang.py writes them)."""

    failing: dict[str, str] = field(default_factory=dict)  # failing probe -> how it fails
    unhealthy_since: float | None = None  # failing continuously since then
    last_ping: float | None = None  # the ready engine's last WATCHDOG=1 (or ready)
    hang: str | None = None  # why the engine now being stopped was found hung
    kill_due: float | None = None  # SIGKILL the hung engine then
    standby_ping: float | None = None  # the parked standby's last WATCHDOG=1 (or park)
    standby_hung: bool = False  # the standby being killed hung while parked
    standby_streak: int = 0  # parked standbys in a row that hung


@dataclass(slots=True)
class StandbyRun:
    """The standby's deadline and what a swap asked of the next ones (standby.py writes
    them)."""

    park_due: float | None = None  # the standby must park by then
    paused: bool = False  # no standby starts while a swap cuts over without one
    next_weights: bool = False  # standbys started now park before their weights
    retired: int = 0  # the standby number retired for a swap (not a failure)


@dataclass(slots=True)
class SwapRun:
    """The pending swap's bookkeeping beside its status (swap.py writes it)."""

    policy: SwapPolicy = field(default_factory=SwapPolicy)
    request: int = 0  # the control connection that asked (0: a publish)
    waiting: set[int] = field(default_factory=set)  # ranks whose answer to the step is due
    answered: set[int] = field(default_factory=set)  # committed ranks (a refusal rolls back)
    fits: bool = True  # every prepared rank has room for both shards
    no_in_place: dict[int, str] = field(default_factory=dict)  # rank -> why not in place
    refusal: tuple[int, str] | None = None  # the commit's (status, why)
    deadline: float | None = None
    engine_gone: bool = False  # the old engine exited during the commit
    rollback_sent: bool = False
    new_engine: bool = False  # the engine started on the new weights
    ready_at: float | None = None  # when the new engine was ready (its hellos are due)
    # engine or standby pid -> rank -> why that rank refused its weights ("": it maps them)
    weights_seen: dict[int, dict[int, str]] = field(default_factory=dict)


@dataclass(slots=True)
class Clocks:
    """When systemd hears next, and since when the launcher is not serving (timers.py writes
    them)."""

    next_extend: float = -math.inf
    next_watchdog: float = -math.inf
    pending_since: float | None = None  # not serving since then (start_timeout)


@dataclass(slots=True)
class Startup:
    """The ranks' startup: loaded once, the preload, the first failure (ranks.py writes it)."""

    caches_loaded: bool = False  # every rank was ready once: startup is past loading
    preloading: bool = False  # the preload command runs (PreloadDone not yet)
    first_failure: Failure | None = None


class SupervisorState:
    """The state the decisions read: the status records the status surface shows, and one
    record per concern for the rest, each written by its own module (the `*Run` records
    above, `Health`, `Clocks`, `Startup`); `phase` is derived from them."""

    def __init__(self, config: SupervisorConfig) -> None:
        """Loading, nothing spawned, no stop, no exit."""
        self.config = config
        self._now = 0.0  # the time of the event being handled (supervisor.py)
        self._started = False  # supervisor.py
        self._stop: Stop | None = None  # stop.py
        self._exit: Exit | None = None  # stop.py
        self._ranks = {r: RankStatus(r) for r in config.ranks}  # ranks.py
        self._startup = Startup()
        self._engine = EngineStatus() if config.has_engine else None  # engine.py
        self._engine_run = EngineRun(RestartBudget(config))
        self._health = Health()
        self._standby = StandbyStatus() if config.standby else None  # standby.py
        self._standby_run = StandbyRun()
        self._swap = SwapStatus(model=config.model)  # swap.py
        self._swap_run = SwapRun()
        self._draining: dict[int, float] = {}  # drain.py: retired engines' pids: SIGKILL then
        self._drains = DrainStatus()  # drain.py
        self._clocks = Clocks()

    @property
    def phase(self) -> Phase:
        """The launcher's phase (see `Phase` for the table)."""
        if self._exit is not None:
            return Phase.STOPPED
        if self._stop is not None:
            return Phase.STOPPING
        if not self._startup.caches_loaded:
            return Phase.LOADING
        if self._engine is None or self._engine.state is EngineState.READY:
            return Phase.SERVING
        return Phase.RESTARTING if self._engine_run.ready_sent else Phase.STARTING_ENGINE

    def _rank(self, rank: int | None) -> RankStatus:
        """The status of `rank`; an unknown rank is an executor bug."""
        if rank not in self._ranks:
            raise SupervisorProtocolError(f"cache rank {rank!r} is not one of "
                                          f"{self.config.ranks}")
        return self._ranks[rank]

    def _require_engine(self) -> EngineStatus:
        """The engine's status; an engine event in the caches-only layout is a bug."""
        if self._engine is None:
            raise SupervisorProtocolError("engine event, but this launcher runs no engine")
        return self._engine

    def _engine_alive(self) -> bool:
        """Whether an engine process may still exist."""
        return self._engine is not None and self._engine.state in ENGINE_ALIVE

    def _standby_alive(self) -> bool:
        """Whether a standby process may still exist (not yet promoted)."""
        return self._standby is not None and self._standby.state is not StandbyState.NONE

    def _swap_ranks(self) -> tuple[int, ...]:
        """The ranks a swap changes: the target group."""
        return self.config.swap_ranks or self.config.ranks

    def _live_children(self) -> list[str]:
        """Names of the children not yet reaped, for log lines."""
        names = ["the engine"] if self._engine_alive() else []
        names += ["the standby engine"] if self._standby_alive() else []
        names += [f"the draining engine (pid {pid})" for pid in self._draining]
        return names + [f"cache rank {r.rank}" for r in self._ranks.values()
                        if r.state is not RankState.EXITED]


def stale(known_pid: int | None, pid: int) -> bool:
    """Whether an exit reports a pid other than the child's current one."""
    return known_pid is not None and known_pid != pid
