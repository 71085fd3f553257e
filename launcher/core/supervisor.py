"""The supervisor's entry: `Supervisor.handle` takes one event, dispatches it to the decisions
of its concern (ranks, engine, standby, stop, timers) and returns the actions.

Nothing in this package touches a process, a clock, a socket or a logger (the h11 shape). The
asyncio executor feeds `Supervisor.handle` one event at a time (a child exited, a signal arrived,
a tick) and executes the actions it returns, in order: spawn, signal, notify, log, exit. Time
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
- Engine health, once the engine is ready: `EngineHealth(probe="health")` for each probe of the
  health URL, `EngineHealth(probe="liveness")` for each liveness request (a timeout is a
  failure), `EngineWatchdog` for each `WATCHDOG=1` of the engine (role "engine") or of the
  parked standby (role "standby"). With `unhealthy_after`, failing that long makes the engine
  hung (hang.py): `SignalChild` SIGTERM, SIGKILL after `hang_kill_after` (default
  `stop_timeout`; 0: SIGKILL at once, no SIGTERM), and its exit is a restart whatever its
  status.
- `RunPreload` (only with `SupervisorConfig.preload`, once, when every rank is first ready) is
  answered by exactly one `PreloadDone`, after the command ended, timed out or failed to
  start; the engine is spawned (or READY=1 sent) only then. The executor kills a preload
  still running at shutdown.
- `Exit` is the last action ever returned; later events return nothing. The executor exits
  with `Exit.status` after its sweep (psutil) of anything left.
- `Notify` fields are sd_notify assignments in order; the executor adds `MONOTONIC_USEC` to
  a message that carries `RELOADING=1`.
- `Log.level` is a `logging` level name ("INFO", "WARNING", "ERROR").
- A swap (core/swap.py): `SwapRanks` goes to every rank of `SupervisorConfig.swap_ranks`
  (or `ranks`: the target group), each of which answers with one `SwapStep` (finish and
  abort are not answered); a rank's ready channel carries both. `SwapReply` answers the
  control connection the `SwapRequested` came from. Between a `SwapRanks` commit and the
  rank's answer the executor switches what it gives new engines (model, escrow).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from .drain import DrainDecisions
from .engine import EngineDecisions
from .events import (
    Action,
    CacheProgress,
    CacheReady,
    ChildExited,
    EngineHealth,
    EngineReady,
    EngineWatchdog,
    EngineWeights,
    Event,
    Log,
    Notify,
    PreloadDone,
    SignalReceived,
    SpawnCache,
    Spawned,
    StandbyParked,
    Started,
    SupervisorConfig,
    SwapRequested,
    SwapStep,
    Tick,
)
from .exits import signal_name
from .hang import HangDecisions
from .model import SupervisorProtocolError
from .ranks import RankDecisions
from .standby import StandbyDecisions
from .stop import StopDecisions
from .swap import SwapDecisions
from .timers import EXTEND_BY, Timers, usec
from .view import StatusView


class Supervisor(RankDecisions, EngineDecisions, HangDecisions, StandbyDecisions, SwapDecisions,
                 DrainDecisions, StopDecisions, Timers, StatusView):
    """The launcher's decisions: `handle(event)` returns the actions to execute, in order."""

    def __init__(self, config: SupervisorConfig) -> None:
        """Start in phase loading with nothing spawned; `Started` spawns the ranks."""
        super().__init__(config)
        self._handlers: dict[type, Callable[[Any], list[Action]]] = {
            Started: self._on_started, CacheReady: self._on_cache_ready,
            ChildExited: self._on_child_exited, EngineReady: self._on_engine_ready,
            EngineHealth: self._on_engine_health, SignalReceived: self._on_signal,
            Tick: self._on_tick, Spawned: self._on_spawned, PreloadDone: self._on_preload_done,
            CacheProgress: self._on_cache_progress, StandbyParked: self._on_standby_parked,
            EngineWatchdog: self._on_engine_watchdog,
            SwapRequested: self._on_swap_requested, SwapStep: self._on_swap_step,
            EngineWeights: self._on_engine_weights,
        }

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
        self._note_pending(event.now)
        return actions

    def _on_started(self, e: Started) -> list[Action]:
        """Spawn every cache rank from disk and report loading."""
        self._started = True
        self._extend_from(e.now)
        ranks = ", ".join(map(str, self.config.ranks))
        return [Log("INFO", f"starting cache ranks {ranks}"),
                *(SpawnCache(r, adopt=False) for r in self.config.ranks),
                Notify({"STATUS": self._status_line(), "EXTEND_TIMEOUT_USEC": usec(EXTEND_BY)})]

    def _on_spawned(self, e: Spawned) -> list[Action]:
        """Record a child's pid; with readiness "none" a spawned engine is ready."""
        if e.role == "cache":
            return self._rank_spawned(e)
        if e.role == "standby":
            return self._standby_spawned(e)
        return self._engine_spawned(e)

    def _on_signal(self, e: SignalReceived) -> list[Action]:
        """Dispatch a signal: SIGTERM/SIGINT stop, SIGQUIT quits now, SIGHUP restarts the
        engine."""
        if e.sig in (signal.SIGTERM, signal.SIGINT):
            return self._on_stop_signal(e)
        if e.sig == signal.SIGQUIT:
            return self._on_quit(e)
        if e.sig == signal.SIGHUP:
            return self._on_sighup(e)
        return [Log("WARNING", f"{signal_name(e.sig)} ignored")]

    def _on_tick(self, e: Tick) -> list[Action]:
        """Fire whatever is due: watchdog, timeout extension, backoff, kill deadlines, hangs."""
        return [*self._watchdog(e.now), *self._extend(e.now), *self._settle_if_due(e.now),
                *self._respawn_if_due(e.now),
                *self._reload_timeout(e.now), *self._stop_timeout(e.now),
                *self._start_timeout(e.now), *self._park_timeout(e.now),
                *self._hang_checks(e.now), *self._swap_tick(e.now),
                *self._drain_timeouts(e.now)]

    def _on_child_exited(self, e: ChildExited) -> list[Action]:
        """Dispatch a reaped child to the engine, the standby, a draining engine or the rank
        handler."""
        if e.role == "draining" or e.pid in self._draining:  # it may exit before its retiral
            return self._on_drained(e)
        if e.role == "standby" and not self._is_promoted(e.pid):
            return self._on_standby_exited(e)
        if e.role in ("engine", "standby"):
            return self._on_engine_exited(e)
        return self._on_rank_exited(e)
