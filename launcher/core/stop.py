"""The one way out: SIGTERM/SIGINT/SIGQUIT, the stop (engine first, then the ranks), the stop
timeout, and the exit status that the first cause fixes."""

from __future__ import annotations

from dataclasses import replace

from vlaunch.cache.contract.exitcodes import ExitStatus

from .events import Action, Exit, KillAll, Log, Notify, SignalReceived
from .exits import signal_name
from .model import EngineState, RankState, Stop
from .state import SupervisorState


class StopDecisions(SupervisorState):
    """Begin a stop, carry it through, and halt with its status."""

    def _on_stop_signal(self, e: SignalReceived) -> list[Action]:
        """SIGTERM/SIGINT: stop gracefully; a second one during a stop kills everything."""
        name = signal_name(e.sig)
        if self._stop is None:
            return [Log("INFO", f"{name} received: stopping"),
                    *self._begin_stop(ExitStatus.OK, f"{name} received", e.now, signals=1)]
        stop = self._stop = replace(self._stop, signals=self._stop.signals + 1)
        if stop.signals < 2:
            return [Log("WARNING", f"{name} received while stopping ({stop.reason}); "
                                   "send it again to kill every child now")]
        return self._kill_all(f"second {name} received")

    def _on_quit(self, e: SignalReceived) -> list[Action]:
        """SIGQUIT: stop at once: SIGKILL every child and exit QUIT (or the status of a
        failure whose stop was under way)."""
        cause = self._stop.cause if self._stop is not None else ExitStatus.OK
        notify = [] if self._stop is not None else [
            Notify({"STOPPING": "1", "STATUS": "stopping: SIGQUIT received"})]
        self._stop = self._stop or Stop(ExitStatus.OK, "SIGQUIT received", e.now, 1)
        left = ", ".join(self._live_children()) or "no child"
        status = ExitStatus.QUIT if cause is ExitStatus.OK else cause
        return [Log("WARNING", f"SIGQUIT received: killing {left} with SIGKILL now"), *notify,
                KillAll(), *self._halt(status, "SIGQUIT received: children killed")]

    def _begin_stop(self, cause: ExitStatus, reason: str, now: float,
                    signals: int = 0) -> list[Action]:
        """Start the one stop path: STOPPING=1, SIGTERM the engine, then the ranks."""
        self._stop = Stop(cause, reason, now + self.config.stop_timeout, signals)
        self._cancel_restart()
        self._forget_reload()
        actions: list[Action] = [*self._swap_stopped(reason),
                                 Notify({"STOPPING": "1", "STATUS": f"stopping: {reason}"})]
        engine = self._engine
        actions += self._stop_standby()
        if engine is not None and engine.state in (EngineState.STARTING, EngineState.READY):
            return [*actions, *self._engine_sigterm()]
        if self._engine_alive():  # a SIGHUP restart already sent it SIGTERM
            return actions
        return [*actions, *self._stop_ranks(), *self._finish_if_done()]

    def _finish_if_done(self) -> list[Action]:
        """Exit with the stop's cause once no child is left."""
        if self._stop is None or self._engine_alive() or self._standby_alive() or \
                self._draining or any(
                r.state is not RankState.EXITED for r in self._ranks.values()):
            return []
        return self._halt(self._stop.cause, self._stop.reason)

    def _stop_timeout(self, now: float) -> list[Action]:
        """Kill everything once a stop has run past stop_timeout."""
        if self._stop is None or now < self._stop.deadline:
            return []
        return self._kill_all(f"stop timed out after {self.config.stop_timeout:g} s")

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
