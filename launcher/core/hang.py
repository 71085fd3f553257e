"""Hang detection (--engine-unhealthy-after): a ready engine whose probes fail continuously
that long is failed (SIGTERM, SIGKILL after hang_kill_after, by default stop_timeout; with 0,
SIGKILL at once; then a restart inside the budget), and a parked standby whose watchdog pings
stopped is killed and replaced.

The probes: the health URL and the liveness request (`EngineHealth`, from the executor), and
the engine's own `WATCHDOG=1` (`EngineWatchdog`), overdue `engine_watchdog` seconds after the
last one. Checks start when the engine is ready; an engine that never gets there is the start
timeout's business.
"""

from __future__ import annotations

import signal

from .events import Action, EngineHealth, EngineWatchdog, Log, Notify, SignalChild
from .model import EngineState, StandbyState
from .state import SupervisorState

PROBE_WORDS = {"health": "health check", "liveness": "liveness request", "watchdog": "watchdog"}
"""How the log lines and STATUS= name each probe."""


class HangDecisions(SupervisorState):
    """Which probes of the ready engine fail and since when; when that makes it hung."""

    def _on_engine_health(self, e: EngineHealth) -> list[Action]:
        """One probe of the ready engine answered or failed: track it; log a change."""
        engine = self._engine
        if engine is None or engine.state is not EngineState.READY:
            return []
        failing = {k: v for k, v in self._health.failing.items() if k != e.probe}
        if not e.ok:
            failing[e.probe] = self._health.failing.get(e.probe, e.detail)
        return self._set_failing(failing, e.now)

    def _on_engine_watchdog(self, e: EngineWatchdog) -> list[Action]:
        """WATCHDOG=1 from the ready engine or the parked standby: its watchdog passes."""
        if e.role == "standby":
            if self._standby is not None and self._standby.state is StandbyState.PARKED:
                self._health.standby_ping = e.now
            return []
        engine = self._engine
        if engine is None or engine.state is not EngineState.READY:
            return []
        self._health.last_ping = e.now
        if "watchdog" not in self._health.failing:
            return []
        return self._set_failing({k: v for k, v in self._health.failing.items() if k != "watchdog"},
                                 e.now)

    def _hang_checks(self, now: float) -> list[Action]:
        """On a tick: overdue watchdogs, a hung engine, its SIGKILL, a hung parked standby."""
        return [*self._watchdog_overdue(now), *self._hung_if_due(now),
                *self._hang_kill_if_due(now), *self._standby_hung_if_due(now)]

    def _reset_health(self, now: float | None) -> None:
        """Forget every probe result: a new engine attempt (`now`: it is ready, its watchdog
        runs from here) or none (None)."""
        self._health.failing, self._health.unhealthy_since, self._health.last_ping = {}, None, now

    def _set_failing(self, failing: dict[str, str], since: float) -> list[Action]:
        """Record the failing probes (`since`: when a failure that begins now began)."""
        engine, before = self._require_engine(), self._health.failing
        self._health.failing = failing
        if not failing:
            self._health.unhealthy_since = None
        elif self._health.unhealthy_since is None:
            self._health.unhealthy_since = since
        self._engine_health(tuple(sorted(failing)))
        limit = self.config.unhealthy_after
        then = (f"; hung after {limit:g} s of failing (--engine-unhealthy-after)" if limit
                else "")
        actions: list[Action] = [
            Log("WARNING", f"engine (pid {engine.pid}) {fails(p, failing[p])}: not ready{then}")
            for p in sorted(failing.keys() - before.keys())]
        actions += [Log("INFO", f"engine (pid {engine.pid}) {PROBE_WORDS[p]} passes again")
                    for p in sorted(before.keys() - failing.keys())]
        if engine.healthy != (not failing):
            actions.append(Notify({"STATUS": self._status_line()}))
        return actions

    def _watchdog_overdue(self, now: float) -> list[Action]:
        """The ready engine sent no WATCHDOG=1 for engine_watchdog seconds: failing since."""
        limit, engine = self.config.engine_watchdog, self._engine
        if limit is None or engine is None or engine.state is not EngineState.READY or \
                self._health.last_ping is None or "watchdog" in self._health.failing:
            return []
        due = self._health.last_ping + limit
        if now < due:
            return []
        return self._set_failing({**self._health.failing,
                                  "watchdog": f"no WATCHDOG=1 for {limit:g} s"}, due)

    def _hung_if_due(self, now: float) -> list[Action]:
        """Failing for unhealthy_after seconds: the engine is hung; SIGTERM its group."""
        limit, engine = self.config.unhealthy_after, self._engine
        since = self._health.unhealthy_since
        if limit is None or since is None or engine is None or self._stop is not None or \
                engine.state is not EngineState.READY or now - since < limit:
            return []
        why = "; ".join(fails(p, d) for p, d in sorted(self._health.failing.items()))
        grace = self._hang_grace()
        self._health.hang, self._health.kill_due = why, (now + grace if grace else None)
        sigterm = self._engine_sigterm(hung=True, sig=signal.SIGTERM if grace else
                                       signal.SIGKILL)
        failing = f"{why}, failing for {now - since:.1f} s (--engine-unhealthy-after {limit:g})"
        line = (f"engine (pid {engine.pid}) hung, stopping it (SIGTERM, SIGKILL after "
                f"{grace:g} s): {failing}" if grace else
                f"engine (pid {engine.pid}) hung, killing it (SIGKILL at once, "
                f"--engine-hang-kill-after 0): {failing}")
        return [Log("ERROR", line),
                Notify({**self._reloading_field(), "STATUS": "restarting engine (hung)"}),
                *sigterm]

    def _hang_grace(self) -> float:
        """Seconds a hung engine gets between its SIGTERM and its SIGKILL (0: SIGKILL at
        once): hang_kill_after, else stop_timeout."""
        c = self.config
        return c.stop_timeout if c.hang_kill_after is None else c.hang_kill_after

    def _hang_kill_if_due(self, now: float) -> list[Action]:
        """SIGKILL a hung engine that outlived its SIGTERM by its grace (_hang_grace)."""
        if self._health.kill_due is None or now < self._health.kill_due or self._stop is not None:
            return []
        self._health.kill_due = None
        return [Log("WARNING", f"the hung engine (pid {self._require_engine().pid}) ignored "
                               f"SIGTERM for {self._hang_grace():g} s: killing it"),
                SignalChild("engine", None, signal.SIGKILL)]

    def _hung_engine_gone(self) -> str | None:
        """Why the engine that just exited was found hung (None: it exited on its own)."""
        hung, self._health.hang, self._health.kill_due = self._health.hang, None, None
        return hung

    def _standby_responsive(self) -> bool:
        """Whether the parked standby pings as its watchdog asks (always, without one)."""
        limit = self.config.engine_watchdog
        if self._health.standby_hung:
            return False
        return limit is None or self._health.standby_ping is None or \
            self._now - self._health.standby_ping <= limit

    def _standby_hung_if_due(self, now: float) -> list[Action]:
        """A parked standby silent for engine_watchdog + unhealthy_after: SIGKILL it (its exit
        starts the next one); nothing of it serves, so there is nothing to stop gracefully."""
        sb, watchdog, limit = self._standby, self.config.engine_watchdog, \
            self.config.unhealthy_after
        if sb is None or watchdog is None or limit is None or self._stop is not None or \
                sb.state is not StandbyState.PARKED or self._health.standby_hung or \
                self._health.standby_ping is None or \
                now - self._health.standby_ping < watchdog + limit:
            return []
        self._health.standby_hung = True
        self._count_standby_hang()
        return [Log("WARNING", f"standby engine {sb.number} (pid {sb.pid}) hung while parked: "
                               f"no WATCHDOG=1 for {now - self._health.standby_ping:.1f} s "
                               f"(--engine-watchdog {watchdog:g} + --engine-unhealthy-after "
                               f"{limit:g}): killing it and starting another"),
                SignalChild("standby", None, signal.SIGKILL)]

    def _watch_standby(self, since: float | None, *, promoted: bool = False) -> None:
        """The parked standby's watchdog runs from `since` (None: no standby is parked; a
        `promoted` one ends the streak of hung standbys)."""
        self._health.standby_ping = since
        if promoted:
            self._health.standby_streak = 0

    def _hung_standby_gone(self) -> bool:
        """Whether the standby that just exited was killed as hung (counted in a streak that
        a promotion ends)."""
        hung, self._health.standby_hung = self._health.standby_hung, False
        self._health.standby_streak = self._health.standby_streak + 1 if hung else 0
        return hung


def fails(probe: str, detail: str) -> str:
    """"health check fails (HTTP 503)": a failing probe and how, in words."""
    return f"{PROBE_WORDS[probe]} fails" + (f" ({detail})" if detail else "")
