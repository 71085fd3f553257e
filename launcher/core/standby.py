"""The standby engine (--standby): start one once the engine is ready, promote it instead of
spawning, replace one that dies, give standbys up after repeated failures or a park timeout."""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import Any

from .events import (
    Action,
    ChildExited,
    Log,
    Notify,
    PromoteStandby,
    SignalChild,
    Spawned,
    SpawnStandby,
    StandbyParked,
)
from .exits import describe_exit
from .model import (
    STANDBY_NEXT,
    EngineState,
    StandbyState,
    StandbyStatus,
    SupervisorProtocolError,
    moved,
)
from .state import SupervisorState

STANDBY_MAX_FAILS = 3
"""Standbys in a row that die before parking; then the launcher gives standbys up."""


class StandbyDecisions(SupervisorState):
    """When to start, promote, replace, stop or give up the standby engine."""

    def _standby_parked(self) -> bool:
        """Whether a parked standby waits for its promotion (and pings, under a watchdog:
        hang.py)."""
        return self._standby is not None and self._standby.state is StandbyState.PARKED and \
            self._standby_responsive()

    def _is_promoted(self, pid: int) -> bool:
        """Whether `pid` is the engine now: a standby promoted before its exit was reaped."""
        engine = self._engine
        return engine is not None and engine.pid is not None and engine.pid == pid

    def _spawn_standby(self, now: float) -> list[Action]:
        """Start a standby, when standbys are on, the engine is ready and there is none."""
        sb, engine = self._standby, self._engine
        if sb is None or sb.given_up or sb.state is not StandbyState.NONE or \
                self._stop is not None or engine is None or \
                engine.state is not EngineState.READY or self._standby_run.paused:
            return []
        self._standby = self._standby_at(sb, StandbyState.STARTING, pid=None, number=sb.number + 1)
        self._standby_run.park_due = now + self.config.standby_park_timeout
        before = " (to park before its weights)" if self._standby_run.next_weights else ""
        return [Log("INFO", f"starting standby engine {sb.number + 1}{before}"),
                SpawnStandby(sb.number + 1, next_weights=self._standby_run.next_weights)]

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
        self._standby = self._standby_at(sb, StandbyState.PARKED, failures=0)
        self._standby_run.park_due = None
        self._watch_standby(e.now)  # its watchdog runs from here (hang.py)
        actions: list[Action] = [Log("INFO", f"standby engine {sb.number} (pid {sb.pid}) parked")]
        if self._engine_run.respawn_due is not None and self._stop is None:  # engine in backoff
            actions += self._spawn_engine()
        return [*actions, *self._swap_standby_parked(e.now)]

    def _promote(self) -> list[Action]:
        """Make the parked standby the engine's next attempt; a new standby follows once it is
        ready."""
        sb = self._standby
        assert sb is not None
        self._standby = self._standby_at(sb, StandbyState.NONE, pid=None,
                                         promotions=sb.promotions + 1)
        self._watch_standby(None, promoted=True)
        attempt = self._engine_starts(sb.pid)
        return [Log("INFO", f"promoting standby engine {sb.number} (pid {sb.pid}) to engine "
                            f"attempt {attempt}"),
                Notify({"STATUS": self._status_line()}), PromoteStandby(),
                *self._settle_from(self._now)]

    def _on_standby_exited(self, e: ChildExited) -> list[Action]:
        """A standby died or stopped: replace it, or give standbys up after repeated failures."""
        sb = self._standby
        if sb is None or sb.state is StandbyState.NONE or (sb.pid is not None and sb.pid != e.pid):
            return []
        parked = sb.state is StandbyState.PARKED
        hung = self._hung_standby_gone()
        retired = self._standby_run.retired == sb.number  # stopped for a swap: no failure
        self._standby = sb = self._standby_at(
            sb, StandbyState.NONE, pid=None, failures=sb.failures + (not parked and not retired))
        self._standby_run.park_due = None
        self._watch_standby(None)
        how = "hung while parked, killed" if hung else "exited"
        what = f"standby engine {sb.number} (pid {e.pid}) {how}: " \
               f"{describe_exit(e.status, hint=not hung)}"
        if self._stop is not None:
            return [Log("INFO", what), *self._finish_if_done()]
        if retired:
            return [Log("INFO", what), *self._spawn_standby(e.now)]
        if sb.given_up:
            return [Log("INFO", what)]
        if sb.failures >= STANDBY_MAX_FAILS or self._health.standby_streak >= STANDBY_MAX_FAILS:
            self._standby = replace(sb, given_up=True)
            streak = (f"{sb.failures} standbys in a row died before parking" if not hung else
                      f"{self._health.standby_streak} parked standbys in a row hung")
            return [Log("WARNING", f"{what}; {streak}: giving standbys up, engine restarts are "
                                   "ordinary restarts from now on")]
        return [Log("WARNING", f"{what}; replacing it"), *self._spawn_standby(e.now)]

    def _park_timeout(self, now: float) -> list[Action]:
        """Give standbys up when one has not parked within standby_park_timeout."""
        sb = self._standby
        if sb is None or self._standby_run.park_due is None or now < self._standby_run.park_due or \
                sb.state is not StandbyState.STARTING:
            return []
        self._standby_run.park_due = None
        self._standby = self._standby_at(sb, StandbyState.STOPPING, given_up=True)
        limit = self.config.standby_park_timeout
        return [Log("WARNING", f"standby engine {sb.number} (pid {sb.pid}) did not park within "
                               f"{limit:g} s (--standby-park-timeout): killing it and giving "
                               "standbys up; engine restarts are ordinary restarts from now on"),
                SignalChild("standby", None, signal.SIGKILL)]

    def _standby_at(self, sb: StandbyStatus, state: StandbyState, **changes: Any
                    ) -> StandbyStatus:
        """`sb` moved to `state` (along STANDBY_NEXT), with `changes` to its record."""
        return replace(sb, state=moved(STANDBY_NEXT, sb.state, state, "standby"), **changes)

    def _retire_standby(self) -> list[Action]:
        """Stop a starting or parked standby for a swap: its exit is no failure."""
        sb = self._standby
        if sb is None or sb.state not in (StandbyState.STARTING, StandbyState.PARKED):
            return []
        self._standby_run.retired = sb.number
        self._standby = self._standby_at(sb, StandbyState.STOPPING)
        self._standby_run.park_due = None
        return [SignalChild("standby", None, signal.SIGTERM)]

    def _hold_standbys(self, *, next_weights: bool, paused: bool | None = None) -> None:
        """How a swap wants the next standbys: parked before their weights, or none at all
        (`paused` None: as it was)."""
        run = self._standby_run
        run.next_weights = next_weights
        run.paused = run.paused if paused is None else paused

    def _count_standby_hang(self) -> None:
        """The parked standby was found hung (hang.py): count it."""
        sb = self._standby
        assert sb is not None
        self._standby = replace(sb, hangs=sb.hangs + 1)

    def _stop_standby(self) -> list[Action]:
        """SIGTERM a live standby as part of the stop."""
        sb = self._standby
        self._standby_run.park_due = None
        if sb is None or sb.state in (StandbyState.NONE, StandbyState.STOPPING):
            return []
        self._standby = self._standby_at(sb, StandbyState.STOPPING)
        return [SignalChild("standby", None, signal.SIGTERM)]
