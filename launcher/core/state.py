"""The supervisor's state, shared by the decision mixins, and the lookups they all use.

`Supervisor` (supervisor.py) is this state plus one mixin per concern (ranks, engine, standby,
stop, timers, status view). The mixins call each other's steps through `self`; none keeps
state of its own.
"""

from __future__ import annotations

import math

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


class SupervisorState:
    """Every field the decisions read and write; `phase` is derived from them."""

    def __init__(self, config: SupervisorConfig) -> None:
        """Loading, nothing spawned, no stop, no exit."""
        self.config = config
        self._ranks = {r: RankStatus(r) for r in config.ranks}
        self._engine = EngineStatus() if config.has_engine else None
        self._started = False
        self._caches_loaded = False  # every rank was ready once: startup is past loading
        self._ready_sent = False
        self._reloading = False  # RELOADING=1 sent, READY=1 not yet again
        self._first_failure: Failure | None = None
        self._stop: Stop | None = None
        self._exit: Exit | None = None
        self._budget = RestartBudget(config)
        self._respawn_due: float | None = None
        self._ready_since: float | None = None
        self._reload_deadline: float | None = None  # SIGHUP asked the engine to stop
        self._next_extend = -math.inf
        self._next_watchdog = -math.inf
        self._pending_since: float | None = None  # not serving since then (start_timeout)
        self._settle_due: float | None = None  # readiness "none": when the engine counts ready
        self._standby = StandbyStatus() if config.standby else None
        self._park_due: float | None = None  # the standby must park by then
        self._now = 0.0  # the time of the event being handled
        self._preloading = False  # the preload command runs (PreloadDone not yet)
        self._failing: dict[str, str] = {}  # the ready engine's failing probes: how each fails
        self._unhealthy_since: float | None = None  # failing continuously since then
        self._last_ping: float | None = None  # the ready engine's last WATCHDOG=1 (or ready)
        self._hang: str | None = None  # why the engine now being stopped was found hung
        self._hang_kill_due: float | None = None  # SIGKILL the hung engine then
        self._standby_ping: float | None = None  # the parked standby's last WATCHDOG=1 (or park)
        self._standby_hung = False  # the standby being killed hung while parked
        self._standby_hang_streak = 0  # parked standbys in a row that hung
        self._swap = SwapStatus(model=config.model)
        self._swap_policy = SwapPolicy()
        self._swap_request = 0  # the control connection that asked (0: a publish)
        self._swap_waiting: set[int] = set()  # ranks whose answer to the last step is due
        self._swap_answered: set[int] = set()  # committed ranks (a refusal rolls them back)
        self._swap_fits = True  # every prepared rank has room for both shards
        self._swap_no_in_place: dict[int, str] = {}  # rank -> why it cannot cut over in place
        # engine or standby pid -> rank -> why that rank refused its weights ("": it maps them)
        self._weights_seen: dict[int, dict[int, str]] = {}
        self._swap_refusal: tuple[int, str] | None = None  # the commit's (status, why)
        self._swap_deadline: float | None = None
        self._swap_engine_gone = False  # the old engine exited during the commit
        self._swap_rollback_sent = False
        self._swap_new_engine = False  # the engine started on the new weights
        self._standby_paused = False  # no standby starts while a swap cuts over without one
        self._standby_next_weights = False  # standbys started now park before their weights
        self._standby_retired = 0  # the standby number retired for a swap (not a failure)
        self._draining: dict[int, float] = {}  # retired engines' pids: their SIGKILL is due then
        self._drains = DrainStatus()

    @property
    def phase(self) -> Phase:
        """The launcher's phase (see `Phase` for the table)."""
        if self._exit is not None:
            return Phase.STOPPED
        if self._stop is not None:
            return Phase.STOPPING
        if not self._caches_loaded:
            return Phase.LOADING
        if self._engine is None or self._engine.state is EngineState.READY:
            return Phase.SERVING
        return Phase.RESTARTING if self._ready_sent else Phase.STARTING_ENGINE

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
