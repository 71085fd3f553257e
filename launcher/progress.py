"""Loading ranks' progress in the launcher: read their progress frames, draw them on a TTY.

A rank under `vlaunch run` sends progress frames on its ready channel before its ready frame
(`vlaunch.cache.contract.progress`); they become `CacheProgress` events, so `/status`,
`/metrics` and sd_notify's STATUS= show loaded bytes per rank and in total. On a terminal the
launcher draws one line per rank plus a total, redrawn in place (the ranks draw nothing then);
otherwise the ranks log their own lines and nothing is drawn.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from vlaunch.cache.contract import progress
from vlaunch.cache.contract.progress import recv_ready

__all__ = ["LoadDisplay", "recv_ready"]

REDRAW_EVERY = 0.25


class LoadDisplay:
    """Every loading rank's line and a total, redrawn in place on a TTY; inert otherwise."""

    def __init__(self, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.clock = clock
        self._drawn = 0  # lines of the block on screen right above the cursor
        self._started: dict[int, float] = {}
        self._finished: set[int] = set()
        self._last = -math.inf
        self._over = False
        if self.enabled:
            for handler in logging.getLogger().handlers:
                handler.addFilter(self._before_log)

    def show(self, snapshot: dict[str, Any]) -> None:
        """Redraw from the supervisor's snapshot (at most every REDRAW_EVERY seconds)."""
        if not self.enabled or self._over:
            return
        ranks = [r for r in snapshot.get("ranks", []) if r.get("total_bytes")]
        if not ranks:
            return
        now = self.clock()
        for r in ranks:
            self._started.setdefault(r["rank"], now)
        finished = {r["rank"] for r in ranks if r["loaded_bytes"] >= r["total_bytes"]}
        complete = snapshot.get("phase") != "loading" or len(finished) == len(
            snapshot.get("ranks", []))
        news = finished - self._finished
        if not news and not complete and now - self._last < REDRAW_EVERY:
            return
        self._last, self._finished, self._over = now, finished, complete
        lines = self.lines(ranks, now)
        erase = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        self.stream.write(erase + "\n".join(lines) + "\n")
        self.stream.flush()
        # A rank that just finished logs its own lines below the block: leave this block as
        # it is and draw the next one under them, so that nothing of theirs is overwritten.
        self._drawn = 0 if news or complete else len(lines)

    def lines(self, ranks: list[dict[str, Any]], now: float) -> list[str]:
        """The block's text: one line per rank, then the total."""
        out = []
        for r in ranks:
            elapsed = now - self._started[r["rank"]]
            out.append(f"rank {r['rank']:>3} "
                       f"{progress.describe(r['loaded_bytes'], r['total_bytes'], elapsed)}")
        if len(ranks) > 1:
            loaded = sum(r["loaded_bytes"] for r in ranks)
            total = sum(r["total_bytes"] for r in ranks)
            elapsed = now - min(self._started.values())
            out.append(f"total    {progress.describe(loaded, total, elapsed)}")
        return out

    def _before_log(self, record: logging.LogRecord) -> bool:
        """A launcher log line is about to be written: erase the block first."""
        if self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0
        return True
