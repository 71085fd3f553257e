"""The supervisor's decisions: a pure state machine that takes events and returns actions.

Nothing here touches a process, a clock, a socket or a logger (the h11 shape). The asyncio
executor feeds `Supervisor.handle` one event at a time (a child exited, a signal arrived, a
tick) and executes the actions it returns, in order: spawn, signal, notify, log, exit. Time
arrives inside the events (`now`, monotonic seconds), so a test replays a whole history in
microseconds.

Contract with the executor:

- `Started` comes first, exactly once; any other event before it, or a second `Started`, or a
  rank that is not in `SupervisorConfig.ranks`, raises `SupervisorProtocolError` (a bug).
- Every `SpawnCache`/`SpawnEngine` is answered by `Spawned` (with the pid) and later by one
  `ChildExited`. A spawn that fails outright (exec error) is reported as a `ChildExited` with
  the status the executor chose (127 for a missing program, like a shell), no `Spawned` needed.
- `SignalChild` and `KillAll` address a child's process group: children run in their own.
- `Tick` arrives often (every 0.1-0.25 s is plenty): backoff, stop timeout, the SIGHUP kill
  deadline, `WATCHDOG=1` and `EXTEND_TIMEOUT_USEC` all fire on the first tick at or after
  their time.
- Engine readiness, by `SupervisorConfig.engine_readiness`: "notify": the executor relays the
  engine's own sd_notify `READY=1` as `EngineReady`; "http": it polls the health URL and sends
  `EngineReady` when it first answers, then `EngineHealth` for each later probe; "none": the
  engine counts as ready once it has stayed up `engine_settle` seconds after its `Spawned`
  (at once when 0; an `EngineReady` sent anyway is ignored), so an engine that exits at once
  is never reported ready.
- `RunPreload` (only with `SupervisorConfig.preload`, once, when every rank is first ready) is
  answered by exactly one `PreloadDone`, after the command ended, timed out or failed to
  start; the engine is spawned (or READY=1 sent) only then. The executor kills a preload
  still running at shutdown.
- `Exit` is the last action ever returned; later events return nothing. The executor exits
  with `Exit.status` after its sweep (psutil) of anything left.
- `Notify` fields are sd_notify assignments in order; the executor adds `MONOTONIC_USEC` to
  a message that carries `RELOADING=1`.
- `Log.level` is a `logging` level name ("INFO", "WARNING", "ERROR").
"""

from __future__ import annotations

import enum
import math
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from vlaunch.cache.contract.exitcodes import EXIT_TABLE, ExitStatus

from .events import (
    Action,
    CacheProgress,
    CacheReady,
    ChildExited,
    EngineHealth,
    EngineReady,
    Event,
    Exit,
    KillAll,
    Log,
    Notify,
    PreloadDone,
    PromoteStandby,
    RunPreload,
    SignalChild,
    SignalReceived,
    SpawnCache,
    Spawned,
    SpawnEngine,
    SpawnStandby,
    StandbyParked,
    Started,
    SupervisorConfig,
    Tick,
)

EXTEND_EVERY = 10.0
"""Seconds between two `EXTEND_TIMEOUT_USEC` messages until the first `READY=1`."""
EXTEND_BY = 3 * EXTEND_EVERY
"""Seconds each `EXTEND_TIMEOUT_USEC` grants: three missed ticks before systemd gives up."""
STANDBY_MAX_FAILS = 3
"""Standbys in a row that die before parking; then the launcher gives standbys up."""

CACHE_STATUSES: frozenset[int] = frozenset(
    int(row.status) for row in EXIT_TABLE if "cache" in row.who and row.status != ExitStatus.OK)
"""Documented statuses a cache rank exits with; the launcher passes them on unchanged."""

_SIGNAL_HINTS: dict[int, str] = {
    # Nobody sends SIGKILL to a cache rank by accident; the kernel's OOM killer (or a cgroup's
    # memory limit) does, and it leaves no trace in the rank's own log.
    signal.SIGKILL: "the OOM killer?",
    # SIGBUS on an mmap'd checkpoint means the file shrank or its disk failed under the reader.
    signal.SIGBUS: "a checkpoint file truncated or unreadable while mapped?",
}


class SupervisorProtocolError(RuntimeError):
    """The executor fed an event that cannot happen: a bug in the executor, not in a child."""


# --------------------------------------------------------------------------------- states


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
    """The engine: pending -> starting -> ready, then backoff/stopping -> starting, or exited."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    EXITED = "exited"


class StandbyState(enum.Enum):
    """The standby engine: none -> starting -> parked -> (promoted: none) | stopping -> none."""

    NONE = "none"
    STARTING = "starting"
    PARKED = "parked"
    STOPPING = "stopping"


_ENGINE_ALIVE = (EngineState.STARTING, EngineState.READY, EngineState.STOPPING)
_RANK_RUNNING = (RankState.LOADING, RankState.READY, RankState.RESPAWNING)


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


@dataclass(frozen=True)
class StandbyStatus:
    """The standby engine (--standby) as the status surface shows it."""

    state: StandbyState = StandbyState.NONE
    pid: int | None = None
    number: int = 0  # standbys started so far
    promotions: int = 0
    failures: int = 0  # standbys in a row that died before parking
    given_up: bool = False


@dataclass(frozen=True)
class Failure:
    """The first cache rank that failed, as logged and reported."""

    rank: int
    pid: int
    status: int


@dataclass(frozen=True)
class _Stop:
    """A stop in progress: its first cause (the exit status) and its deadline."""

    cause: ExitStatus
    reason: str
    deadline: float
    signals: int


# ----------------------------------------------------------------------------- supervisor


class Supervisor:
    """The launcher's decisions: `handle(event)` returns the actions to execute, in order."""

    def __init__(self, config: SupervisorConfig) -> None:
        """Start in phase loading with nothing spawned; `Started` spawns the ranks."""
        self.config = config
        self._ranks = {r: RankStatus(r) for r in config.ranks}
        self._engine = EngineStatus() if config.has_engine else None
        self._started = False
        self._caches_loaded = False  # every rank was ready once: startup is past loading
        self._ready_sent = False
        self._reloading = False  # RELOADING=1 sent, READY=1 not yet again
        self._first_failure: Failure | None = None
        self._stop: _Stop | None = None
        self._exit: Exit | None = None
        self._restart_times: list[float] = []
        self._next_backoff = config.backoff_initial
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
        self._handlers: dict[type, Callable[[Any], list[Action]]] = {
            Started: self._on_started, CacheReady: self._on_cache_ready,
            ChildExited: self._on_child_exited, EngineReady: self._on_engine_ready,
            EngineHealth: self._on_engine_health, SignalReceived: self._on_signal,
            Tick: self._on_tick, Spawned: self._on_spawned, PreloadDone: self._on_preload_done,
            CacheProgress: self._on_cache_progress, StandbyParked: self._on_standby_parked,
        }
        self._preloading = False

    def handle(self, event: Event) -> list[Action]:
        """Consume one event; return the actions to execute, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a supervisor event: {event!r}")
        if self._exit is not None:
            return []
        if isinstance(event, Started) == self._started:
            raise SupervisorProtocolError(f"{event!r}: Started must come first, exactly once")
        self._now = event.now
        actions = handler(event)
        if self.config.start_timeout is not None and self._pending_since is None \
                and self._exit is None and self._stop is None and self._pending():
            self._pending_since = event.now  # the start-up deadline runs from here
        return actions

    # ------------------------------------------------------------------ status surface

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

    @property
    def ranks(self) -> Mapping[int, RankStatus]:
        """Every cache rank's status, by rank number."""
        return MappingProxyType(self._ranks)

    @property
    def engine(self) -> EngineStatus | None:
        """The engine's status; None in the caches-only layout."""
        return self._engine

    @property
    def first_failure(self) -> Failure | None:
        """The first cache rank that exited unasked (start failure or while serving)."""
        return self._first_failure

    @property
    def started_ok(self) -> bool:
        """Liveness: started, and not on its way out with a failure status."""
        return self._started and (self._stop is None or self._stop.cause is ExitStatus.OK)

    @property
    def caches_ready(self) -> bool:
        """Startup probe: every cache rank is ready now."""
        return all(r.state is RankState.READY for r in self._ranks.values())

    @property
    def engine_ready(self) -> bool:
        """Readiness probe: engine ready, healthy, not restarting (caches-only: caches ready)."""
        if self._stop is not None or self._exit is not None:
            return False
        if self._engine is None:
            return self._caches_loaded and self.caches_ready
        return self._engine.state is EngineState.READY and self._engine.healthy

    @property
    def exit_status(self) -> int | None:
        """The status of the returned `Exit`, or None while running."""
        return None if self._exit is None else self._exit.status

    def snapshot(self) -> dict[str, Any]:
        """Everything above as JSON-able data, for the HTTP status endpoint."""
        stop = self._stop
        return {
            "phase": self.phase.value,
            "started_ok": self.started_ok,
            "caches_ready": self.caches_ready,
            "engine_ready": self.engine_ready,
            "ranks": [_jsonable(r) for r in self._ranks.values()],
            "loaded_bytes": sum(r.loaded_bytes for r in self._ranks.values()),
            "total_bytes": sum(r.total_bytes for r in self._ranks.values()),
            "engine": None if self._engine is None else {
                **_jsonable(self._engine), "recent_restarts": len(self._restart_times)},
            "first_failure": None if self._first_failure is None else {
                **_jsonable(self._first_failure),
                "description": describe_exit(self._first_failure.status)},
            **({} if self._standby is None else {"standby": _jsonable(self._standby)}),
            "stop": None if stop is None else {"cause": int(stop.cause), "reason": stop.reason},
            "exit_status": self.exit_status,
        }

    # ------------------------------------------------------------------------- events

    def _on_started(self, e: Started) -> list[Action]:
        """Spawn every cache rank from disk and report loading."""
        self._started = True
        self._next_extend = e.now + EXTEND_EVERY
        ranks = ", ".join(map(str, self.config.ranks))
        return [Log("INFO", f"starting cache ranks {ranks}"),
                *(SpawnCache(r, adopt=False) for r in self.config.ranks),
                Notify({"STATUS": self._status_line(), "EXTEND_TIMEOUT_USEC": _usec(EXTEND_BY)})]

    def _on_spawned(self, e: Spawned) -> list[Action]:
        """Record a child's pid; with readiness "none" a spawned engine is ready."""
        if e.role == "cache":
            rank = self._rank(e.rank)
            self._ranks[rank.rank] = replace(rank, pid=e.pid)
            return []
        if e.role == "standby":
            return self._standby_spawned(e)
        engine = self._engine = replace(self._require_engine(), pid=e.pid)
        actions: list[Action] = [Log("INFO", f"engine started (pid {e.pid}, attempt "
                                             f"{engine.attempt})")]
        if self.config.engine_readiness == "none":
            self._settle_due = e.now + self.config.engine_settle
            actions += self._settle_if_due(e.now)
        return actions

    def _settle_if_due(self, now: float) -> list[Action]:
        """Readiness "none": the engine is ready once it has stayed up engine_settle seconds."""
        if self._settle_due is None or now < self._settle_due:
            return []
        self._settle_due = None
        return self._engine_became_ready(now)

    def _on_cache_ready(self, e: CacheReady) -> list[Action]:
        """Mark a rank ready; the last one of the startup starts the engine (or READY=1)."""
        rank = self._rank(e.rank)
        if rank.state not in (RankState.LOADING, RankState.RESPAWNING):
            return []
        self._ranks[rank.rank] = replace(rank, state=RankState.READY,
                                         loaded_bytes=rank.total_bytes)
        again = " again, from the escrowed slabs" if rank.state is RankState.RESPAWNING else ""
        actions: list[Action] = [Log("INFO", f"cache rank {rank.rank} (pid {rank.pid}) "
                                             f"ready{again}")]
        if self._stop is not None:
            return actions
        if not self._caches_loaded and self.caches_ready:
            return actions + self._caches_loaded_now()
        return [*actions, Notify({"STATUS": self._status_line()})]

    def _on_cache_progress(self, e: CacheProgress) -> list[Action]:
        """Record a loading rank's bytes; while loading, STATUS= shows the bytes so far."""
        rank = self._rank(e.rank)
        if rank.state not in (RankState.LOADING, RankState.RESPAWNING):
            return []
        self._ranks[rank.rank] = replace(rank, loaded_bytes=min(e.loaded, e.total),
                                         total_bytes=e.total)
        if self.phase is not Phase.LOADING:
            return []
        return [Notify({"STATUS": self._status_line()})]

    def _on_engine_ready(self, e: EngineReady) -> list[Action]:
        """The engine reported ready: READY=1 (again after a restart) and STATUS=serving."""
        return self._engine_became_ready(e.now)

    def _on_engine_health(self, e: EngineHealth) -> list[Action]:
        """Track a ready engine's health; log and update STATUS when it changes."""
        engine = self._engine
        if engine is None or engine.state is not EngineState.READY or engine.healthy == e.ok:
            return []
        self._engine = replace(engine, healthy=e.ok)
        level, word = ("INFO", "passes again") if e.ok else ("WARNING", "fails: not ready")
        return [Log(level, f"engine (pid {engine.pid}) health check {word}"),
                Notify({"STATUS": self._status_line()})]

    def _on_signal(self, e: SignalReceived) -> list[Action]:
        """Dispatch a signal: SIGTERM/SIGINT stop, SIGQUIT quits now, SIGHUP restarts the
        engine."""
        if e.sig in (signal.SIGTERM, signal.SIGINT):
            return self._on_stop_signal(e)
        if e.sig == signal.SIGQUIT:
            return self._on_quit(e)
        if e.sig == signal.SIGHUP:
            return self._on_sighup(e)
        return [Log("WARNING", f"{_signal_name(e.sig)} ignored")]

    def _on_tick(self, e: Tick) -> list[Action]:
        """Fire whatever is due: watchdog, timeout extension, backoff, kill deadlines."""
        return [*self._watchdog(e.now), *self._extend(e.now), *self._settle_if_due(e.now),
                *self._respawn_if_due(e.now),
                *self._reload_timeout(e.now), *self._stop_timeout(e.now),
                *self._start_timeout(e.now), *self._park_timeout(e.now)]

    def _on_child_exited(self, e: ChildExited) -> list[Action]:
        """Dispatch a reaped child to the engine, the standby or the rank handler."""
        if e.role == "standby" and not self._is_promoted(e.pid):
            return self._on_standby_exited(e)
        if e.role in ("engine", "standby"):
            return self._on_engine_exited(e)
        return self._on_rank_exited(e)

    # -------------------------------------------------------------------------- ranks

    def _on_rank_exited(self, e: ChildExited) -> list[Action]:
        """A cache rank is gone: finish a stop, fail the start, respawn, or shut down."""
        rank = self._rank(e.rank)
        if rank.state is RankState.EXITED or _stale(rank.pid, e.pid):
            return []
        self._ranks[rank.rank] = replace(rank, state=RankState.EXITED, pid=None,
                                         last_exit=e.status)
        if self._stop is not None:
            return self._rank_gone_while_stopping(rank, e)
        if rank.state is RankState.LOADING:
            return self._rank_start_failed(e)
        if rank.state is RankState.READY and self.config.on_rank_exit == "respawn":
            return self._respawn_rank(rank, e)
        return self._rank_failed(rank, e)

    def _rank_gone_while_stopping(self, rank: RankStatus, e: ChildExited) -> list[Action]:
        """Note a rank's exit during a stop (the first cause stands) and maybe finish."""
        asked = rank.state is RankState.STOPPING
        level, when = ("INFO", "") if asked else ("WARNING", " during the stop, unasked")
        return [Log(level, f"cache rank {e.rank} (pid {e.pid}) exited{when}: "
                           f"{_rank_exit(e.status)}"), *self._finish_if_done()]

    def _rank_start_failed(self, e: ChildExited) -> list[Action]:
        """A rank died before its first ready: pass its documented status on, else 68."""
        status = (ExitStatus(e.status) if e.status in CACHE_STATUSES
                  else ExitStatus.RANK_START_FAILED)
        what = f"cache rank {e.rank} (pid {e.pid}) exited before ready: {_rank_exit(e.status)}"
        return self._fail(e, status, what)

    def _rank_failed(self, rank: RankStatus, e: ChildExited) -> list[Action]:
        """A serving (or respawning) rank died: shut everything down with RANK_EXITED."""
        when = " before it was ready again" if rank.state is RankState.RESPAWNING else ""
        what = f"cache rank {e.rank} (pid {e.pid}) exited{when}: {_rank_exit(e.status)}"
        return self._fail(e, ExitStatus.RANK_EXITED, what)

    def _fail(self, e: ChildExited, status: ExitStatus, what: str) -> list[Action]:
        """Record the first failing rank and begin the stop it causes."""
        assert e.rank is not None
        self._first_failure = Failure(e.rank, e.pid, e.status)
        return [Log("ERROR", what), *self._begin_stop(status, what, e.now)]

    def _respawn_rank(self, rank: RankStatus, e: ChildExited) -> list[Action]:
        """Respawn a serving rank from the escrowed slabs; the engine keeps serving."""
        self._ranks[rank.rank] = replace(self._ranks[rank.rank], state=RankState.RESPAWNING,
                                         respawns=rank.respawns + 1)
        return [Log("WARNING", f"cache rank {e.rank} (pid {e.pid}) exited: "
                               f"{_rank_exit(e.status)}; respawning it from the escrowed slabs"),
                SpawnCache(rank.rank, adopt=True), Notify({"STATUS": self._status_line()})]

    def _caches_loaded_now(self) -> list[Action]:
        """Every rank is ready for the first time: preload, then start the engine (or READY=1
        without one)."""
        self._caches_loaded = True
        if self.config.preload:
            self._preloading = True
            return [Log("INFO", "every cache rank is ready: running the preload command"),
                    Notify({"STATUS": "running the preload command"}), RunPreload()]
        return self._start_serving()

    def _on_preload_done(self, e: PreloadDone) -> list[Action]:
        """The preload command ended: start the engine either way (a failure is a warning)."""
        if not self._preloading:
            return []
        self._preloading = False
        if self._stop is not None:
            return []
        if e.ok:
            return [Log("INFO", "preload command finished"), *self._start_serving()]
        return [Log("WARNING", f"preload command {e.detail}; starting the engine anyway (it "
                               "tunes on its own)"), *self._start_serving()]

    def _start_serving(self) -> list[Action]:
        """Start the engine, or READY=1 without one."""
        if self._engine is not None:
            return self._spawn_engine()
        self._ready_sent = True
        return [Log("INFO", "every cache rank is ready (no engine)"),
                Notify({"READY": "1", "STATUS": self._status_line()})]

    # ------------------------------------------------------------------------- engine

    def _spawn_engine(self) -> list[Action]:
        """Start the engine's next attempt now (promote the standby, if one is parked)."""
        if self._standby_parked():
            return self._promote()
        engine = self._require_engine()
        attempt = engine.attempt + 1
        self._engine = replace(engine, state=EngineState.STARTING, pid=None, attempt=attempt,
                               restarts=engine.restarts + (attempt > 1), healthy=True)
        self._respawn_due = None
        return [Log("INFO", f"starting the engine (attempt {attempt})"),
                Notify({"STATUS": self._status_line()}), SpawnEngine(attempt)]

    def _engine_became_ready(self, now: float) -> list[Action]:
        """Mark a starting engine ready: READY=1 every time (first start or after RELOADING)."""
        engine = self._engine
        if engine is None or engine.state is not EngineState.STARTING or self._stop is not None:
            return []
        self._engine = replace(engine, state=EngineState.READY, healthy=True)
        self._ready_since, self._ready_sent, self._reloading = now, True, False
        return [Log("INFO", f"engine ready (pid {engine.pid}, attempt {engine.attempt})"),
                Notify({"READY": "1", "STATUS": self._status_line()}), *self._spawn_standby(now)]

    def _on_engine_exited(self, e: ChildExited) -> list[Action]:
        """The engine is gone: finish a stop, respawn after SIGHUP, stop, or restart it."""
        engine = self._require_engine()
        if engine.state not in _ENGINE_ALIVE or _stale(engine.pid, e.pid):
            return []
        self._reset_budget_if_stable(e.now)
        self._settle_due = None
        self._engine = replace(engine, state=EngineState.EXITED, pid=None, last_exit=e.status)
        what = (f"engine (pid {e.pid}) exited: {describe_exit(e.status)}" if e.pid else
                f"engine could not be started: {describe_exit(e.status)}")
        if self._stop is not None:
            return [Log("INFO", what), *self._stop_ranks(), *self._finish_if_done()]
        if self._reload_deadline is not None:
            self._reload_deadline = None
            return [Log("INFO", f"{what}; restarting it (SIGHUP)"), *self._spawn_engine()]
        return self._engine_crashed(e, what)

    def _engine_crashed(self, e: ChildExited, what: str) -> list[Action]:
        """Decide an unrequested engine exit: config error, success, or a restart."""
        if e.status in self.config.engine_config_error_statuses:
            why = f"{what}, a configuration error (engine_config_error_statuses): not restarting"
            return [Log("ERROR", why), *self._begin_stop(ExitStatus.ENGINE_CONFIG, why, e.now)]
        if e.status == 0 and self.config.stop_on_engine_success:
            why = f"{what}: finished (stop_on_engine_success)"
            return [Log("INFO", why), *self._begin_stop(ExitStatus.OK, why, e.now)]
        return self._schedule_restart(what, e.now)

    def _reset_budget_if_stable(self, now: float) -> None:
        """Forget restarts and backoff if the exiting engine stayed ready `stable_after`."""
        if self._ready_since is not None and now - self._ready_since >= self.config.stable_after:
            self._restart_times.clear()
            self._next_backoff = self.config.backoff_initial
        self._ready_since = None

    def _schedule_restart(self, what: str, now: float) -> list[Action]:
        """Count the restart against the budget, then respawn after the backoff."""
        c = self.config
        self._restart_times = [t for t in self._restart_times if t > now - c.restart_window]
        self._restart_times.append(now)
        count = len(self._restart_times)
        if count > c.restart_max:
            why = (f"{what}; restart budget exhausted ({count} exits in {c.restart_window:g} s, "
                   f"at most {c.restart_max} restarts allowed)")
            return [Log("ERROR", why), *self._begin_stop(ExitStatus.ENGINE_BUDGET, why, now)]
        delay, self._next_backoff = self._next_backoff, min(self._next_backoff * c.backoff_factor,
                                                            c.backoff_max)
        self._engine = replace(self._require_engine(), state=EngineState.BACKOFF)
        if self._standby_parked():  # a promotion counts as a restart, but waits for nothing
            delay = 0.0
        self._respawn_due = now + delay
        attempt = self._require_engine().attempt + 1
        status = f"restarting engine (attempt {attempt}, in {delay:g} s)"
        return [Log("WARNING", f"{what}; restarting it in {delay:g} s ({count} of at most "
                               f"{c.restart_max} restarts in {c.restart_window:g} s)"),
                Notify({**self._reloading_field(), "STATUS": status}), *self._respawn_if_due(now)]

    def _reloading_field(self) -> dict[str, str]:
        """RELOADING=1 once per restart, and only after READY=1 (systemd's reload state)."""
        if not self._ready_sent or self._reloading:
            return {}
        self._reloading = True
        return {"RELOADING": "1"}

    def _on_sighup(self, e: SignalReceived) -> list[Action]:
        """SIGHUP: restart the engine now, outside the restart budget."""
        engine = self._engine
        if engine is None or self._stop is not None:
            why = "no engine to restart (caches only)" if engine is None else "stopping"
            return [Log("INFO", f"SIGHUP ignored: {why}")]
        if engine.state is EngineState.BACKOFF:  # RELOADING=1 went out with the crash
            return [Log("INFO", "SIGHUP: restarting the engine now, skipping its backoff"),
                    *self._spawn_engine()]
        if engine.state not in (EngineState.STARTING, EngineState.READY):
            return [Log("INFO", f"SIGHUP ignored: the engine is {engine.state.value}")]
        self._engine = replace(engine, state=EngineState.STOPPING)
        self._reload_deadline = e.now + self.config.stop_timeout
        return [Log("INFO", f"SIGHUP: restarting the engine (pid {engine.pid})"),
                Notify({**self._reloading_field(), "STATUS": "restarting engine (SIGHUP)"}),
                SignalChild("engine", None, signal.SIGTERM)]

    # --------------------------------------------------------------------------- stop

    def _on_quit(self, e: SignalReceived) -> list[Action]:
        """SIGQUIT: stop at once: SIGKILL every child and exit QUIT (or the status of a
        failure whose stop was under way)."""
        cause = self._stop.cause if self._stop is not None else ExitStatus.OK
        notify = [] if self._stop is not None else [
            Notify({"STOPPING": "1", "STATUS": "stopping: SIGQUIT received"})]
        self._stop = self._stop or _Stop(ExitStatus.OK, "SIGQUIT received", e.now, 1)
        left = ", ".join(self._live_children()) or "no child"
        status = ExitStatus.QUIT if cause is ExitStatus.OK else cause
        return [Log("WARNING", f"SIGQUIT received: killing {left} with SIGKILL now"), *notify,
                KillAll(), *self._halt(status, "SIGQUIT received: children killed")]

    def _on_stop_signal(self, e: SignalReceived) -> list[Action]:
        """SIGTERM/SIGINT: stop gracefully; a second one during a stop kills everything."""
        name = _signal_name(e.sig)
        if self._stop is None:
            return [Log("INFO", f"{name} received: stopping"),
                    *self._begin_stop(ExitStatus.OK, f"{name} received", e.now, signals=1)]
        stop = self._stop = replace(self._stop, signals=self._stop.signals + 1)
        if stop.signals < 2:
            return [Log("WARNING", f"{name} received while stopping ({stop.reason}); "
                                   "send it again to kill every child now")]
        return self._kill_all(f"second {name} received")

    def _begin_stop(self, cause: ExitStatus, reason: str, now: float,
                    signals: int = 0) -> list[Action]:
        """Start the one stop path: STOPPING=1, SIGTERM the engine, then the ranks."""
        self._stop = _Stop(cause, reason, now + self.config.stop_timeout, signals)
        self._respawn_due = self._reload_deadline = None
        actions: list[Action] = [Notify({"STOPPING": "1", "STATUS": f"stopping: {reason}"})]
        engine = self._engine
        if engine is not None and engine.state is EngineState.BACKOFF:
            self._engine = replace(engine, state=EngineState.EXITED)
        actions += self._stop_standby()
        if engine is not None and engine.state in (EngineState.STARTING, EngineState.READY):
            self._engine = replace(engine, state=EngineState.STOPPING)
            return [*actions, SignalChild("engine", None, signal.SIGTERM)]
        if self._engine_alive():  # a SIGHUP restart already sent it SIGTERM
            return actions
        return [*actions, *self._stop_ranks(), *self._finish_if_done()]

    def _stop_ranks(self) -> list[Action]:
        """SIGTERM every rank still running (the engine is gone)."""
        running = [r for r in self._ranks.values() if r.state in _RANK_RUNNING]
        for r in running:
            self._ranks[r.rank] = replace(r, state=RankState.STOPPING)
        return [SignalChild("cache", r.rank, signal.SIGTERM) for r in running]

    def _finish_if_done(self) -> list[Action]:
        """Exit with the stop's cause once no child is left."""
        if self._stop is None or self._engine_alive() or self._standby_alive() or any(
                r.state is not RankState.EXITED for r in self._ranks.values()):
            return []
        return self._halt(self._stop.cause, self._stop.reason)

    def _kill_all(self, why: str) -> list[Action]:
        """SIGKILL what is left and exit: the first failure's status, else STOP_TIMEOUT."""
        assert self._stop is not None
        left = ", ".join(self._live_children())
        cause = self._stop.cause
        status = ExitStatus.STOP_TIMEOUT if cause is ExitStatus.OK else cause
        return [Log("ERROR", f"{why}: killing {left} with SIGKILL"), KillAll(),
                *self._halt(status, f"{self._stop.reason}; {why}: children killed")]

    def _halt(self, status: ExitStatus, reason: str) -> list[Action]:
        """The single way out: log and return the final Exit."""
        self._exit = Exit(int(status), reason)
        level = "INFO" if status is ExitStatus.OK else "ERROR"
        return [Log(level, f"exiting with status {int(status)} ({status.name}): {reason}"),
                self._exit]

    # -------------------------------------------------------------------------- timers

    def _watchdog(self, now: float) -> list[Action]:
        """WATCHDOG=1 at most every half interval, while not stopping."""
        interval = self.config.watchdog_interval
        if interval is None or self._stop is not None or now < self._next_watchdog:
            return []
        self._next_watchdog = now + interval / 2
        return [Notify({"WATCHDOG": "1"})]

    def _extend(self, now: float) -> list[Action]:
        """EXTEND_TIMEOUT_USEC every EXTEND_EVERY seconds until the first READY=1."""
        if self._ready_sent or self._stop is not None or now < self._next_extend:
            return []
        self._next_extend = now + EXTEND_EVERY
        return [Notify({"EXTEND_TIMEOUT_USEC": _usec(EXTEND_BY)})]

    def _respawn_if_due(self, now: float) -> list[Action]:
        """Respawn the engine once its backoff has passed."""
        if self._respawn_due is None or now < self._respawn_due:
            return []
        return self._spawn_engine()

    def _reload_timeout(self, now: float) -> list[Action]:
        """SIGKILL an engine that ignored a SIGHUP restart's SIGTERM for stop_timeout."""
        if self._reload_deadline is None or now < self._reload_deadline:
            return []
        self._reload_deadline = math.inf  # still a reload, killed once
        pid = self._require_engine().pid
        return [Log("WARNING", f"the engine (pid {pid}) ignored SIGTERM for "
                               f"{self.config.stop_timeout:g} s: killing it"),
                SignalChild("engine", None, signal.SIGKILL)]

    def _start_timeout(self, now: float) -> list[Action]:
        """Stop with START_TIMEOUT once the launcher has not been serving for start_timeout:
        since Started, since an engine restart began, or since a rank began to respawn."""
        limit = self.config.start_timeout
        if limit is None or self._stop is not None:
            return []
        pending = self._pending()
        if not pending:
            self._pending_since = None
            return []
        if self._pending_since is None:
            self._pending_since = now
        if now - self._pending_since < limit:
            return []
        why = f"not serving within --start-timeout ({limit:g} s): {pending}"
        return [Log("ERROR", why), *self._begin_stop(ExitStatus.START_TIMEOUT, why, now)]

    def _pending(self) -> str:
        """What keeps the launcher from serving (empty when it serves)."""
        loading = [str(r.rank) for r in self._ranks.values()
                   if r.state in (RankState.LOADING, RankState.RESPAWNING)]
        if loading:
            verb = "still loading" if self.phase is Phase.LOADING else "not ready again"
            return f"cache rank(s) {', '.join(loading)} {verb}"
        if self.phase is Phase.SERVING:
            return ""
        if self._preloading:
            return "the preload command still runs"
        engine = self._require_engine()
        again = " again after a restart" if self._ready_sent else ""
        return f"the engine (attempt {engine.attempt}) did not become ready{again}"

    def _stop_timeout(self, now: float) -> list[Action]:
        """Kill everything once a stop has run past stop_timeout."""
        if self._stop is None or now < self._stop.deadline:
            return []
        return self._kill_all(f"stop timed out after {self.config.stop_timeout:g} s")

    # ------------------------------------------------------------------------ standby

    def _standby_alive(self) -> bool:
        """Whether a standby process may still exist (not yet promoted)."""
        return self._standby is not None and self._standby.state is not StandbyState.NONE

    def _standby_parked(self) -> bool:
        """Whether a parked standby waits for its promotion."""
        return self._standby is not None and self._standby.state is StandbyState.PARKED

    def _is_promoted(self, pid: int) -> bool:
        """Whether `pid` is the engine now: a standby promoted before its exit was reaped."""
        engine = self._engine
        return engine is not None and engine.pid is not None and engine.pid == pid

    def _spawn_standby(self, now: float) -> list[Action]:
        """Start a standby, when standbys are on, the engine is ready and there is none."""
        sb, engine = self._standby, self._engine
        if sb is None or sb.given_up or sb.state is not StandbyState.NONE or \
                self._stop is not None or engine is None or engine.state is not EngineState.READY:
            return []
        self._standby = replace(sb, state=StandbyState.STARTING, pid=None, number=sb.number + 1)
        self._park_due = now + self.config.standby_park_timeout
        return [Log("INFO", f"starting standby engine {sb.number + 1}"),
                SpawnStandby(sb.number + 1)]

    def _standby_spawned(self, e: Spawned) -> list[Action]:
        """Record the standby's pid."""
        sb = self._standby
        if sb is None or sb.state is StandbyState.NONE:
            raise SupervisorProtocolError(f"{e!r}: no standby was asked for")
        self._standby = replace(sb, pid=e.pid)
        return [Log("INFO", f"standby engine {sb.number} started (pid {e.pid})")]

    def _on_standby_parked(self, e: StandbyParked) -> list[Action]:
        """The standby is parked: promote it at once if the engine is already down."""
        sb = self._standby
        if sb is None or sb.state is not StandbyState.STARTING:
            return []
        self._standby = replace(sb, state=StandbyState.PARKED, failures=0)
        self._park_due = None
        actions: list[Action] = [Log("INFO", f"standby engine {sb.number} (pid {sb.pid}) parked")]
        if self._respawn_due is not None and self._stop is None:  # the engine is in backoff
            actions += self._spawn_engine()
        return actions

    def _promote(self) -> list[Action]:
        """Make the parked standby the engine's next attempt; a new standby follows once it is
        ready."""
        sb, engine = self._standby, self._require_engine()
        assert sb is not None
        attempt = engine.attempt + 1
        self._standby = replace(sb, state=StandbyState.NONE, pid=None,
                                promotions=sb.promotions + 1)
        self._engine = replace(engine, state=EngineState.STARTING, pid=sb.pid, attempt=attempt,
                               restarts=engine.restarts + (attempt > 1), healthy=True)
        self._respawn_due = None
        actions: list[Action] = [
            Log("INFO", f"promoting standby engine {sb.number} (pid {sb.pid}) to engine "
                        f"attempt {attempt}"),
            Notify({"STATUS": self._status_line()}), PromoteStandby()]
        if self.config.engine_readiness == "none":
            self._settle_due = self._now + self.config.engine_settle
            actions += self._settle_if_due(self._now)
        return actions

    def _on_standby_exited(self, e: ChildExited) -> list[Action]:
        """A standby died or stopped: replace it, or give standbys up after repeated failures."""
        sb = self._standby
        if sb is None or sb.state is StandbyState.NONE or (sb.pid is not None and sb.pid != e.pid):
            return []
        parked = sb.state is StandbyState.PARKED
        self._standby = sb = replace(sb, state=StandbyState.NONE, pid=None,
                                     failures=sb.failures + (not parked))
        self._park_due = None
        what = f"standby engine {sb.number} (pid {e.pid}) exited: {describe_exit(e.status)}"
        if self._stop is not None:
            return [Log("INFO", what), *self._finish_if_done()]
        if sb.given_up:
            return [Log("INFO", what)]
        if sb.failures >= STANDBY_MAX_FAILS:
            self._standby = replace(sb, given_up=True)
            return [Log("WARNING", f"{what}; {sb.failures} standbys in a row died before "
                                   "parking: giving standbys up, engine restarts are ordinary "
                                   "restarts from now on")]
        return [Log("WARNING", f"{what}; replacing it"), *self._spawn_standby(e.now)]

    def _park_timeout(self, now: float) -> list[Action]:
        """Give standbys up when one has not parked within standby_park_timeout."""
        sb = self._standby
        if sb is None or self._park_due is None or now < self._park_due or \
                sb.state is not StandbyState.STARTING:
            return []
        self._park_due = None
        self._standby = replace(sb, state=StandbyState.STOPPING, given_up=True)
        limit = self.config.standby_park_timeout
        return [Log("WARNING", f"standby engine {sb.number} (pid {sb.pid}) did not park within "
                               f"{limit:g} s (--standby-park-timeout): killing it and giving "
                               "standbys up; engine restarts are ordinary restarts from now on"),
                SignalChild("standby", None, signal.SIGKILL)]

    def _stop_standby(self) -> list[Action]:
        """SIGTERM a live standby as part of the stop."""
        sb = self._standby
        self._park_due = None
        if sb is None or sb.state in (StandbyState.NONE, StandbyState.STOPPING):
            return []
        self._standby = replace(sb, state=StandbyState.STOPPING)
        return [SignalChild("standby", None, signal.SIGTERM)]

    # ------------------------------------------------------------------------- helpers

    def _status_line(self) -> str:
        """The STATUS= text for the current phase, naming respawning ranks."""
        respawning = [r.rank for r in self._ranks.values() if r.state is RankState.RESPAWNING]
        return self._phase_line() + "".join(f"; cache rank {r} respawning" for r in respawning)

    def _phase_line(self) -> str:
        """The phase part of STATUS= (a stop sets its own STATUS once, and no other)."""
        phase, engine = self.phase, self._engine
        if phase is Phase.LOADING:
            ready = sum(r.state is RankState.READY for r in self._ranks.values())
            total = sum(r.total_bytes for r in self._ranks.values())
            loaded = sum(r.loaded_bytes for r in self._ranks.values())
            of = f", {loaded / 1e9:.2f}/{total / 1e9:.2f} GB loaded" if total else ""
            return f"loading: {ready}/{len(self._ranks)} cache ranks ready{of}"
        if engine is None or phase is Phase.SERVING:
            sick = engine is not None and not engine.healthy
            return "serving" + (" (engine health check failing)" if sick else "")
        verb = "starting" if phase is Phase.STARTING_ENGINE else "restarting"
        return f"{verb} engine (attempt {engine.attempt})"

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
        return self._engine is not None and self._engine.state in _ENGINE_ALIVE

    def _live_children(self) -> list[str]:
        """Names of the children not yet reaped, for log lines."""
        names = ["the engine"] if self._engine_alive() else []
        names += ["the standby engine"] if self._standby_alive() else []
        return names + [f"cache rank {r.rank}" for r in self._ranks.values()
                        if r.state is not RankState.EXITED]


# ---------------------------------------------------------------------------- functions


def describe_exit(status: int) -> str:
    """Say how a child ended, from its raw status (negative: killed by signal -status)."""
    if status < 0:
        if not _known_signal(-status):
            return f"killed by signal {-status}"
        hint = _SIGNAL_HINTS.get(-status)
        return f"killed by signal {-status} ({_signal_name(-status)}{': ' + hint if hint else ''})"
    # A shell between the launcher and the program reports a signal death as 128+N.
    shell = 128 < status < 256 and _known_signal(status - 128)
    return f"status {status}" + (f" (128+{_signal_name(status - 128)}?)" if shell else "")


def _rank_exit(status: int) -> str:
    """`describe_exit`, naming a documented vlaunch status of a cache rank."""
    if status in CACHE_STATUSES:
        return f"status {status} ({ExitStatus(status).name})"
    return describe_exit(status)


def _signal_name(sig: int) -> str:
    """SIGTERM for 15; "signal 99" for a number the platform does not name."""
    return signal.Signals(sig).name if _known_signal(sig) else f"signal {sig}"


def _known_signal(sig: int) -> bool:
    """Whether the platform names signal number `sig`."""
    try:
        signal.Signals(sig)
    except ValueError:
        return False
    return True


def _stale(known_pid: int | None, pid: int) -> bool:
    """Whether an exit reports a pid other than the child's current one."""
    return known_pid is not None and known_pid != pid


def _usec(seconds: float) -> str:
    """Seconds as the integer microseconds sd_notify expects."""
    return str(round(seconds * 1_000_000))


def _jsonable(record: RankStatus | EngineStatus | StandbyStatus | Failure) -> dict[str, Any]:
    """A status record as a flat JSON-able dict (enums by value)."""
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in vars(record).items()}
