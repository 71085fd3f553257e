"""The engine's restart budget: exits counted in a sliding window, and the growing backoff."""

from __future__ import annotations

from .events import SupervisorConfig


class RestartBudget:
    """At most `restart_max` restarts in `restart_window` seconds; each waits a backoff that
    grows by `backoff_factor` up to `backoff_max`, and `reset` forgets both."""

    def __init__(self, config: SupervisorConfig) -> None:
        """A whole budget: no exit counted, the first backoff `backoff_initial`."""
        self.config = config
        self._times: list[float] = []
        self._next_backoff = config.backoff_initial

    def __len__(self) -> int:
        """Exits counted in the window, as of the last `count`."""
        return len(self._times)

    def count(self, now: float) -> int:
        """Count an exit at `now`; return the exits inside the window, this one included."""
        self._times = [t for t in self._times if t > now - self.config.restart_window]
        self._times.append(now)
        return len(self._times)

    def exhausted(self, count: int) -> bool:
        """Whether `count` exits in the window leave no restart."""
        return count > self.config.restart_max

    def next_delay(self) -> float:
        """The backoff before this restart; the next one grows by backoff_factor."""
        c = self.config
        delay = self._next_backoff
        self._next_backoff = min(delay * c.backoff_factor, c.backoff_max)
        return delay

    def reset(self) -> None:
        """Forget every counted exit and start the backoff again (the engine was stable)."""
        self._times.clear()
        self._next_backoff = self.config.backoff_initial
