"""Draining: an engine replaced on purpose finishes what it holds while the next one serves.

With the engine's listening sockets held by the launcher (`listening`: --listen, or systemd's
sockets), an engine replaced on purpose whose successor is a parked standby (a double swap, a
SIGHUP restart) is retired first, then drained: the standby is promoted at once and accepts
from the shared sockets, while the old engine gets SIGTERM, stops accepting, finishes the
requests it holds and exits; SIGKILL after `drain_timeout` (default `stop_timeout`). The two
overlap: nothing is refused and nothing fails. Without a parked standby (an in-place swap,
which cannot map two copies; a SIGHUP without --standby) the old engine drains the same way
before its successor starts, and the connections that arrive meanwhile wait in the kernel's
backlog.

A draining engine is no longer the engine: its exit (role "draining") restarts nothing and
counts against no budget; a stop waits for it like for any child.
"""

from __future__ import annotations

import math
import signal
from dataclasses import replace

from .events import Action, ChildExited, Log, RetireEngine, SignalDraining
from .exits import describe_exit
from .model import EngineState
from .state import SupervisorState


class DrainDecisions(SupervisorState):
    """Retire the engine for its standby, time its drain, and account for its exit."""

    def _drain_grace(self) -> float:
        """Seconds an engine replaced on purpose has between its SIGTERM and its SIGKILL."""
        c = self.config
        return c.stop_timeout if c.drain_timeout is None else c.drain_timeout

    def _can_overlap(self) -> bool:
        """Whether the serving engine can give way to a parked standby before it exits: the
        launcher holds the sockets both accept from."""
        engine = self._engine
        return self.config.listening and self._standby_parked() and engine is not None and \
            engine.pid is not None and engine.state in (EngineState.STARTING, EngineState.READY)

    def _promote_then_drain(self, now: float, why: str) -> list[Action]:
        """Promote the parked standby, then SIGTERM the old engine to drain (`why`: what
        replaces it, for the log)."""
        engine = self._require_engine()
        pid = engine.pid
        assert pid is not None
        grace = self._drain_grace()
        self._draining[pid] = now + grace
        self._engine_retired(now)
        return [Log("INFO", f"{why}: the standby takes over first; engine (pid {pid}) drains "
                            f"what it holds (SIGTERM, SIGKILL after {grace:g} s)"),
                RetireEngine(pid), *self._spawn_engine(),
                SignalDraining(pid, signal.SIGTERM)]

    def _on_drained(self, e: ChildExited) -> list[Action]:
        """A draining engine exited."""
        due = self._draining.pop(e.pid, None)
        if due is None:
            return []
        self._drains = replace(self._drains, drained=self._drains.drained + (due != math.inf),
                               killed=self._drains.killed + (due == math.inf))
        how = "killed after its drain timeout" if due == math.inf else "drained"
        actions: list[Action] = [Log("INFO" if due != math.inf else "WARNING",
                                     f"engine (pid {e.pid}) {how}: "
                                     f"{describe_exit(e.status, hint=False)}")]
        return [*actions, *self._finish_if_done()] if self._stop is not None else actions

    def _drain_timeouts(self, now: float) -> list[Action]:
        """SIGKILL a draining engine past its drain_timeout (what it still held is lost)."""
        actions: list[Action] = []
        for pid, due in list(self._draining.items()):
            if now < due:
                continue
            self._draining[pid] = math.inf  # killed once
            actions += [Log("WARNING", f"engine (pid {pid}) did not finish its requests within "
                                       f"{self._drain_grace():g} s (--drain-timeout): killing "
                                       "it; what it still held is lost"),
                        SignalDraining(pid, signal.SIGKILL)]
        return actions
