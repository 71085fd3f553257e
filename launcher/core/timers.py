"""What systemd is told on a clock (WATCHDOG=1, EXTEND_TIMEOUT_USEC) and the start-up
deadline (--start-timeout) with what keeps the launcher from serving."""

from __future__ import annotations

from vlaunch.cache.contract.exitcodes import ExitStatus

from .events import Action, Log, Notify
from .model import Phase, RankState
from .state import SupervisorState

EXTEND_EVERY = 10.0
"""Seconds between two `EXTEND_TIMEOUT_USEC` messages until the first `READY=1`, and while a
restart after it is reported as a reload (`RELOADING=1` until `READY=1` again: systemd times
that state with TimeoutStartSec too)."""
EXTEND_BY = 3 * EXTEND_EVERY
"""Seconds each `EXTEND_TIMEOUT_USEC` grants: three missed ticks before systemd gives up."""


class Timers(SupervisorState):
    """The keep-alives and the start-up deadline, fired by ticks."""

    def _watchdog(self, now: float) -> list[Action]:
        """WATCHDOG=1 at most every half interval, while not stopping."""
        interval = self.config.watchdog_interval
        if interval is None or self._stop is not None or now < self._clocks.next_watchdog:
            return []
        self._clocks.next_watchdog = now + interval / 2
        return [Notify({"WATCHDOG": "1"})]

    def _extend(self, now: float) -> list[Action]:
        """EXTEND_TIMEOUT_USEC every EXTEND_EVERY seconds until the first READY=1, and from a
        RELOADING=1 until the READY=1 that ends it."""
        waiting = not self._engine_run.ready_sent or self._engine_run.reloading
        if not waiting or self._stop is not None or now < self._clocks.next_extend:
            return []
        self._clocks.next_extend = now + EXTEND_EVERY
        return [Notify({"EXTEND_TIMEOUT_USEC": usec(EXTEND_BY)})]

    def _extend_from(self, now: float) -> None:
        """The first EXTEND_TIMEOUT_USEC went out now (Started); the next is due EXTEND_EVERY
        later."""
        self._clocks.next_extend = now + EXTEND_EVERY

    def _note_pending(self, now: float) -> None:
        """After each event: the start-up deadline runs from the first one that left the
        launcher not serving."""
        if self.config.start_timeout is not None and self._clocks.pending_since is None \
                and self._exit is None and self._stop is None and self._pending():
            self._clocks.pending_since = now

    def _start_timeout(self, now: float) -> list[Action]:
        """Stop with START_TIMEOUT once the launcher has not been serving for start_timeout:
        since Started, since an engine restart began, or since a rank began to respawn."""
        limit = self.config.start_timeout
        if limit is None or self._stop is not None:
            return []
        pending = self._pending()
        if not pending:
            self._clocks.pending_since = None
            return []
        if self._clocks.pending_since is None:
            self._clocks.pending_since = now
        if now - self._clocks.pending_since < limit:
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
        if self._startup.preloading:
            return "the preload command still runs"
        engine = self._require_engine()
        again = " again after a restart" if self._engine_run.ready_sent else ""
        return f"the engine (attempt {engine.attempt}) did not become ready{again}"


def usec(seconds: float) -> str:
    """Seconds as the integer microseconds sd_notify expects."""
    return str(round(seconds * 1_000_000))
