"""Cache ranks: readiness, load progress, a rank's exit (start failure, failure, respawn;
during a swap's cutover always a failure), and the startup that follows the last rank's
first ready (preload, then the engine)."""

from __future__ import annotations

import signal
from dataclasses import replace

from vlaunch.cache.contract.exitcodes import ExitStatus

from .events import (
    Action,
    CacheProgress,
    CacheReady,
    ChildExited,
    Log,
    Notify,
    PreloadDone,
    RunPreload,
    SignalChild,
    SpawnCache,
    Spawned,
)
from .exits import CACHE_STATUSES, rank_exit
from .model import RANK_RUNNING, Failure, Phase, RankState, RankStatus
from .state import SupervisorState, stale


class RankDecisions(SupervisorState):
    """What a rank's ready, progress or exit means, and how startup proceeds."""

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
        if not self._startup.caches_loaded and self.caches_ready:
            return actions + self._caches_loaded_now()
        # an engine restart that waited for this rank's respawn goes ahead now
        return [*actions, Notify({"STATUS": self._status_line()}), *self._respawn_if_due(e.now)]

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

    def _on_rank_exited(self, e: ChildExited) -> list[Action]:
        """A cache rank is gone: finish a stop, fail the start, respawn, or shut down."""
        rank = self._rank(e.rank)
        if rank.state is RankState.EXITED or stale(rank.pid, e.pid):
            return []
        self._ranks[rank.rank] = replace(rank, state=RankState.EXITED, pid=None,
                                         last_exit=e.status)
        if self._stop is not None:
            return self._rank_gone_while_stopping(rank, e)
        swap, past_cutover = self._swap_rank_exited(rank.rank, e)
        if rank.state is RankState.LOADING:
            return self._rank_start_failed(e)
        if rank.state is RankState.READY and self.config.on_rank_exit == "respawn" and \
                not past_cutover:
            return [*swap, *self._respawn_rank(rank, e)]
        return [*swap, *self._rank_failed(rank, e)]

    def _rank_gone_while_stopping(self, rank: RankStatus, e: ChildExited) -> list[Action]:
        """Note a rank's exit during a stop (the first cause stands) and maybe finish."""
        asked = rank.state is RankState.STOPPING
        level, when = ("INFO", "") if asked else ("WARNING", " during the stop, unasked")
        return [Log(level, f"cache rank {e.rank} (pid {e.pid}) exited{when}: "
                           f"{rank_exit(e.status)}"), *self._finish_if_done()]

    def _rank_start_failed(self, e: ChildExited) -> list[Action]:
        """A rank died before its first ready: pass its documented status on, else 68."""
        status = (ExitStatus(e.status) if e.status in CACHE_STATUSES
                  else ExitStatus.RANK_START_FAILED)
        what = f"cache rank {e.rank} (pid {e.pid}) exited before ready: {rank_exit(e.status)}"
        return self._fail(e, status, what)

    def _rank_failed(self, rank: RankStatus, e: ChildExited) -> list[Action]:
        """A serving (or respawning) rank died: shut everything down with RANK_EXITED."""
        when = " before it was ready again" if rank.state is RankState.RESPAWNING else ""
        what = f"cache rank {e.rank} (pid {e.pid}) exited{when}: {rank_exit(e.status)}"
        return self._fail(e, ExitStatus.RANK_EXITED, what)

    def _fail(self, e: ChildExited, status: ExitStatus, what: str) -> list[Action]:
        """Record the first failing rank and begin the stop it causes."""
        assert e.rank is not None
        self._startup.first_failure = Failure(e.rank, e.pid, e.status)
        return [Log("ERROR", what), *self._begin_stop(status, what, e.now)]

    def _respawn_rank(self, rank: RankStatus, e: ChildExited) -> list[Action]:
        """Respawn a serving rank from the escrowed slabs; the engine keeps serving."""
        self._ranks[rank.rank] = replace(self._ranks[rank.rank], state=RankState.RESPAWNING,
                                         respawns=rank.respawns + 1)
        return [Log("WARNING", f"cache rank {e.rank} (pid {e.pid}) exited: "
                               f"{rank_exit(e.status)}; respawning it from the escrowed slabs"),
                SpawnCache(rank.rank, adopt=True), Notify({"STATUS": self._status_line()})]

    def _caches_loaded_now(self) -> list[Action]:
        """Every rank is ready for the first time: preload, then start the engine (or READY=1
        without one)."""
        self._startup.caches_loaded = True
        if self.config.preload:
            self._startup.preloading = True
            return [Log("INFO", "every cache rank is ready: running the preload command"),
                    Notify({"STATUS": "running the preload command"}), RunPreload()]
        return self._start_serving()

    def _on_preload_done(self, e: PreloadDone) -> list[Action]:
        """The preload command ended: start the engine either way (a failure is a warning)."""
        if not self._startup.preloading:
            return []
        self._startup.preloading = False
        if self._stop is not None:
            return []
        if e.ok:
            return [Log("INFO", "preload command finished"), *self._start_serving()]
        return [Log("WARNING", f"preload command {e.detail}; starting the engine anyway (it "
                               "tunes on its own)"), *self._start_serving()]

    def _rank_spawned(self, e: Spawned) -> list[Action]:
        """Record a rank's pid."""
        rank = self._rank(e.rank)
        self._ranks[rank.rank] = replace(rank, pid=e.pid)
        return []

    def _stop_ranks(self) -> list[Action]:
        """SIGTERM every rank still running (the engine is gone)."""
        running = [r for r in self._ranks.values() if r.state in RANK_RUNNING]
        for r in running:
            self._ranks[r.rank] = replace(r, state=RankState.STOPPING)
        return [SignalChild("cache", r.rank, signal.SIGTERM) for r in running]
