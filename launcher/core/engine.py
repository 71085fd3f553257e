"""The engine: spawn, readiness, an exit (config error, success, restart with backoff inside
the budget; after a hang, always a restart), and SIGHUP's restart outside the budget. Its
health and hangs are in hang.py."""

from __future__ import annotations

import math
import signal
from dataclasses import replace
from typing import Any

from vlaunch.cache.contract.exitcodes import ExitStatus

from .events import (
    Action,
    ChildExited,
    EngineReady,
    Log,
    Notify,
    SignalChild,
    SignalReceived,
    Spawned,
    SpawnEngine,
)
from .exits import describe_exit
from .model import ENGINE_ALIVE, ENGINE_NEXT, EngineState, EngineStatus, RankState, moved
from .state import SupervisorState, stale


class EngineDecisions(SupervisorState):
    """What the engine's spawn, ready, health and exit mean; SIGHUP; the backoff timers."""

    def _on_engine_ready(self, e: EngineReady) -> list[Action]:
        """The engine reported ready: READY=1 (again after a restart) and STATUS=serving."""
        return self._engine_became_ready(e.now)

    def _spawn_engine(self) -> list[Action]:
        """Start the engine's next attempt now (promote the standby, if one is parked)."""
        if self._standby_parked():
            return self._promote()
        attempt = self._engine_starts(None)
        return [Log("INFO", f"starting the engine (attempt {attempt})"),
                Notify({"STATUS": self._status_line()}), SpawnEngine(attempt)]

    def _engine_to(self, state: EngineState, **changes: Any) -> EngineStatus:
        """Move the engine to `state` (along ENGINE_NEXT), with `changes` to its record."""
        engine = self._require_engine()
        self._engine = replace(engine, state=moved(ENGINE_NEXT, engine.state, state, "engine"),
                               **changes)
        return self._engine

    def _engine_starts(self, pid: int | None) -> int:
        """The engine's next attempt begins (`pid`: a promoted standby's); its number."""
        engine = self._require_engine()
        attempt = engine.attempt + 1
        self._engine_to(EngineState.STARTING, pid=pid, attempt=attempt,
                        restarts=engine.restarts + (attempt > 1), healthy=True, failing=())
        self._engine_run.respawn_due = None
        self._reset_health(None)
        return attempt

    def _engine_spawned(self, e: Spawned) -> list[Action]:
        """Record the engine's pid; with readiness "none" it counts ready after the settle."""
        engine = self._engine = replace(self._require_engine(), pid=e.pid)
        actions: list[Action] = [Log("INFO", f"engine started (pid {e.pid}, attempt "
                                             f"{engine.attempt})")]
        return actions + self._settle_from(e.now)

    def _settle_from(self, now: float) -> list[Action]:
        """Readiness "none": the engine that started now counts ready engine_settle later."""
        if self.config.engine_readiness != "none":
            return []
        self._engine_run.settle_due = now + self.config.engine_settle
        return self._settle_if_due(now)

    def _engine_health(self, failing: tuple[str, ...]) -> None:
        """The ready engine's failing probes (hang.py decides which)."""
        self._engine = replace(self._require_engine(), healthy=not failing, failing=failing)

    def _engine_sigterm(self, reload_deadline: float | None = None, *, hung: bool = False,
                        sig: signal.Signals = signal.SIGTERM) -> list[Action]:
        """Stop the starting or ready engine with `sig` (`reload_deadline`: SIGKILL it then;
        `hung`: it is stopped as hung)."""
        engine = self._require_engine()
        self._engine_to(EngineState.STOPPING, hangs=engine.hangs + hung)
        self._engine_run.reload_deadline, self._engine_run.settle_due = reload_deadline, None
        planned = reload_deadline is not None and not hung  # it drains: its command alone
        return [SignalChild("engine", None, sig, command_only=planned)]

    def _cancel_restart(self) -> None:
        """No restart is due any more: an engine in backoff counts as exited."""
        self._engine_run.respawn_due = None
        engine = self._engine
        if engine is not None and engine.state is EngineState.BACKOFF:
            self._engine_to(EngineState.EXITED)

    def _forget_reload(self) -> None:
        """No planned stop's SIGKILL is due: its engine exited, or a stop takes over."""
        self._engine_run.reload_deadline = None

    def _engine_retired(self, now: float) -> None:
        """The engine steps aside to drain (drain.py): it is the engine no more."""
        self._reset_budget_if_stable(now)
        self._reset_health(None)
        self._engine_run.settle_due = None
        self._engine_to(EngineState.EXITED, pid=None, healthy=True, failing=())

    def _start_serving(self) -> list[Action]:
        """Start the engine, or READY=1 without one."""
        if self._engine is not None:
            return self._spawn_engine()
        self._engine_run.ready_sent = True
        return [Log("INFO", "every cache rank is ready (no engine)"),
                Notify({"READY": "1", "STATUS": self._status_line()})]

    def _settle_if_due(self, now: float) -> list[Action]:
        """Readiness "none": the engine is ready once it has stayed up engine_settle seconds."""
        if self._engine_run.settle_due is None or now < self._engine_run.settle_due:
            return []
        self._engine_run.settle_due = None
        return self._engine_became_ready(now)

    def _engine_became_ready(self, now: float) -> list[Action]:
        """Mark a starting engine ready: READY=1 every time (first start or after RELOADING)."""
        engine = self._engine
        if engine is None or engine.state is not EngineState.STARTING or self._stop is not None:
            return []
        self._engine_to(EngineState.READY, healthy=True, failing=())
        run = self._engine_run
        run.ready_since, run.ready_sent, run.reloading = now, True, False
        self._reset_health(now)
        swap = self._swap_engine_ready(now)  # a swap's new engine: the swap is done
        return [Log("INFO", f"engine ready (pid {engine.pid}, attempt {engine.attempt})"),
                *swap, Notify({"READY": "1", "STATUS": self._status_line()}),
                *self._spawn_standby(now)]

    def _on_engine_exited(self, e: ChildExited) -> list[Action]:
        """The engine is gone: finish a stop, respawn after SIGHUP, stop, or restart it."""
        engine = self._require_engine()
        if engine.state not in ENGINE_ALIVE or stale(engine.pid, e.pid):
            return []
        hung = self._hung_engine_gone()
        # a hung engine was stable only until its health began to fail
        self._reset_budget_if_stable(e.now if hung is None else
                                     (self._health.unhealthy_since or e.now))
        self._reset_health(None)
        self._engine_run.settle_due = None
        self._engine_to(EngineState.EXITED, pid=None, last_exit=e.status, healthy=True,
                        failing=())
        what = (f"engine (pid {e.pid}) exited: {describe_exit(e.status)}" if e.pid else
                f"engine could not be started: {describe_exit(e.status)}")
        if hung is not None:
            what = (f"hung engine (pid {e.pid}) stopped ({hung}): "
                    f"{describe_exit(e.status, hint=False)}")
        if self._stop is not None:
            return [Log("INFO", what), *self._stop_ranks(), *self._finish_if_done()]
        swap = self._swap_engine_exited(e, what)  # a swap that cuts over decides
        if swap is not None:
            return swap
        if self._engine_run.reload_deadline is not None:
            self._engine_run.reload_deadline = None
            return [Log("INFO", f"{what}; restarting it (SIGHUP)"), *self._spawn_engine()]
        if hung is not None:  # whatever its status: a hang is a failure, never a success
            return self._schedule_restart(what, e.now)
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
        run = self._engine_run
        if run.ready_since is not None and now - run.ready_since >= self.config.stable_after:
            run.budget.reset()
        run.ready_since = None

    def _schedule_restart(self, what: str, now: float) -> list[Action]:
        """Count the restart against the budget, then respawn after the backoff."""
        c = self.config
        count = self._engine_run.budget.count(now)
        if self._engine_run.budget.exhausted(count):
            why = (f"{what}; restart budget exhausted ({count} exits in {c.restart_window:g} s, "
                   f"at most {c.restart_max} restarts allowed)")
            return [Log("ERROR", why), *self._begin_stop(ExitStatus.ENGINE_BUDGET, why, now)]
        delay = self._engine_run.budget.next_delay()
        self._engine_to(EngineState.BACKOFF)
        if self._standby_parked():  # a promotion counts as a restart, but waits for nothing
            delay = 0.0
        self._engine_run.respawn_due = now + delay
        attempt = self._require_engine().attempt + 1
        status = f"restarting engine (attempt {attempt}, in {delay:g} s)"
        return [Log("WARNING", f"{what}; restarting it in {delay:g} s ({count} of at most "
                               f"{c.restart_max} restarts in {c.restart_window:g} s)"),
                Notify({**self._reloading_field(), "STATUS": status}), *self._respawn_if_due(now)]

    def _reloading_field(self) -> dict[str, str]:
        """RELOADING=1 once per restart, and only after READY=1 (systemd's reload state)."""
        if not self._engine_run.ready_sent or self._engine_run.reloading:
            return {}
        self._engine_run.reloading = True
        return {"RELOADING": "1"}

    def _respawn_if_due(self, now: float) -> list[Action]:
        """Respawn the engine once its backoff has passed and every cache rank serves (a new
        engine would find a respawning rank's socket missing; a parked standby has its
        weights mapped already and is promoted at once)."""
        if self._engine_run.respawn_due is None or now < self._engine_run.respawn_due:
            return []
        if not self._standby_parked() and any(
                r.state is RankState.RESPAWNING for r in self._ranks.values()):
            return []
        return self._spawn_engine()

    def _on_sighup(self, e: SignalReceived) -> list[Action]:
        """SIGHUP: restart the engine now, outside the restart budget."""
        engine = self._engine
        if engine is None or self._stop is not None or self._swap.state.value != "none":
            why = "no engine to restart (caches only)" if engine is None else "stopping" \
                if self._stop is not None else "a swap is in progress"
            return [Log("INFO", f"SIGHUP ignored: {why}")]
        if engine.state is EngineState.BACKOFF:  # RELOADING=1 went out with the crash
            return [Log("INFO", "SIGHUP: restarting the engine now, skipping its backoff"),
                    *self._spawn_engine()]
        if engine.state not in (EngineState.STARTING, EngineState.READY):
            return [Log("INFO", f"SIGHUP ignored: the engine is {engine.state.value}")]
        if self._can_overlap():
            return [Log("INFO", f"SIGHUP: restarting the engine (pid {engine.pid})"),
                    Notify({**self._reloading_field(), "STATUS": "restarting engine (SIGHUP)"}),
                    *self._promote_then_drain(e.now, "SIGHUP")]
        notify = Notify({**self._reloading_field(), "STATUS": "restarting engine (SIGHUP)"})
        return [Log("INFO", f"SIGHUP: restarting the engine (pid {engine.pid})"), notify,
                *self._engine_sigterm(e.now + self._drain_grace())]

    def _reload_timeout(self, now: float) -> list[Action]:
        """SIGKILL an engine that ignored a planned stop's SIGTERM (SIGHUP, a swap) for
        drain_timeout."""
        if self._engine_run.reload_deadline is None or now < self._engine_run.reload_deadline:
            return []
        self._engine_run.reload_deadline = math.inf  # still a reload, killed once
        pid = self._require_engine().pid
        return [Log("WARNING", f"the engine (pid {pid}) ignored SIGTERM for "
                               f"{self._drain_grace():g} s: killing it"),
                SignalChild("engine", None, signal.SIGKILL)]
