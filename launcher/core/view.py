"""The status surface: probes, the JSON snapshot and the STATUS= line, read from the state."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from vlaunch.cache.contract.exitcodes import ExitStatus

from .exits import describe_exit
from .hang import PROBE_WORDS
from .model import (
    DrainStatus,
    EngineState,
    EngineStatus,
    Failure,
    Phase,
    RankState,
    RankStatus,
    StandbyStatus,
    SwapState,
    SwapStatus,
)
from .state import SupervisorState


class StatusView(SupervisorState):
    """What /livez, /startupz, /readyz, /status and STATUS= show."""

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
        return self._startup.first_failure

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
            return self._startup.caches_loaded and self.caches_ready
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
            "ranks": [jsonable(r) for r in self._ranks.values()],
            "loaded_bytes": sum(r.loaded_bytes for r in self._ranks.values()),
            "total_bytes": sum(r.total_bytes for r in self._ranks.values()),
            "engine": None if self._engine is None else {
                **jsonable(self._engine), "recent_restarts": len(self._engine_run.budget),
                "weights": self._engine_weights(),
                "unhealthy_for": (0.0 if self._health.unhealthy_since is None
                                  else round(self._now - self._health.unhealthy_since, 3))},
            "first_failure": None if self._startup.first_failure is None else {
                **jsonable(self._startup.first_failure),
                "description": describe_exit(self._startup.first_failure.status)},
            **({} if self._standby is None else {"standby": jsonable(self._standby)}),
            "swap": jsonable(self._swap),
            **({"drain": {**jsonable(self._drains), "draining": len(self._draining)}}
               if self.config.listening else {}),
            "stop": None if stop is None else {"cause": int(stop.cause), "reason": stop.reason},
            "exit_status": self.exit_status,
        }

    def _engine_weights(self) -> dict[str, str]:
        """Where the engine's processes took each rank's weights from, as far as the ranks
        saw: "cache", or why the rank refused them (`/status` engine.weights)."""
        engine = self._engine
        seen = self._swap_run.weights_seen.get(engine.pid or 0, {}) if engine is not None else {}
        return {str(r): f"not the cache: {why}" if why else "cache"
                for r, why in sorted(seen.items())}

    def _status_line(self) -> str:
        """The STATUS= text for the current phase, naming respawning ranks."""
        respawning = [r.rank for r in self._ranks.values() if r.state is RankState.RESPAWNING]
        sw = self._swap
        swap = "" if sw.state is SwapState.NONE else \
            f"; swapping to version {sw.target_version} ({sw.state.value.replace('_', ' ')})"
        return self._phase_line() + "".join(f"; cache rank {r} respawning"
                                            for r in respawning) + swap

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
            failing = ", ".join(PROBE_WORDS[p] for p in engine.failing) if engine else ""
            return "serving" + (f" (engine {failing} failing)" if failing else "")
        verb = "starting" if phase is Phase.STARTING_ENGINE else "restarting"
        return f"{verb} engine (attempt {engine.attempt})"


def jsonable(record: RankStatus | EngineStatus | StandbyStatus | SwapStatus | Failure
             | DrainStatus) -> dict[str, Any]:
    """A status record as a flat JSON-able dict (enums by value)."""
    return {k: v.value if isinstance(v, enum.Enum) else list(v) if isinstance(v, tuple) else v
            for k, v in vars(record).items()}
