"""The one poll-until of the project (tests, benchmarks and the demo use it too)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(check: Callable[[], T | None], timeout: float, *,
          what: str | Callable[[], str] = "", interval: float = 0.02) -> T:
    """Call `check` until it returns something truthy, and return that; TimeoutError naming
    `what` (or what it returns, called then) once `timeout` seconds have passed (`timeout=0`:
    exactly one call). An exception from `check` propagates: raise to stop waiting early."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise TimeoutError(f"not within {timeout:g} s: {said or check}; last: {got!r}")
        time.sleep(interval)
