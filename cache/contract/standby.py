"""The standby protocol: an engine started ahead, parked, and promoted when the serving one exits.

Any engine can implement it (docs/standby.md); three steps, all on channels the engine has:

1. The launcher starts the standby with `VLAUNCH_ENGINE_STANDBY=1` and `VLAUNCH_PROMOTE_FD=N`
   (the read end of a pipe) in its environment, and its own `NOTIFY_SOCKET`.
2. The standby does everything that can be shared (import, device set-up, distributed group,
   weights mapped in share mode), then sends `PARKED=1` on its NOTIFY_SOCKET and blocks on
   `wait_for_promotion` (pinging `WATCHDOG=1` meanwhile, when it was given `WATCHDOG_USEC`).
3. The launcher writes `PROMOTE` on the pipe when the serving engine has exited. Only then does
   the standby take what must be exclusive (its port, KV cache memory, compute), and report
   `READY=1` on the same NOTIFY_SOCKET as any engine does. An end of file on the pipe (the
   launcher is gone) means: exit without serving.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Mapping

from . import settings
from .errors import VlaunchError, exit_status

STANDBY_ENV = "VLAUNCH_ENGINE_STANDBY"
"""Set to 1 in a standby engine's environment (absent, or 0, for an ordinary engine)."""
PROMOTE_FD_ENV = "VLAUNCH_PROMOTE_FD"
"""The fd number, inherited by the standby, of the pipe the launcher promotes it on."""
PARKED_FIELD = "PARKED"
"""The sd_notify assignment (`PARKED=1`) a standby sends once it is parked."""
PROMOTE = b"PROMOTE\n"
"""The one message the launcher writes on the promote fd."""
PARK_ENV = "VLAUNCH_STANDBY_PARK"
"""`before-weights`: park before mapping any weight (an in-place swap overwrites the cache's
slabs before the promotion, docs/swap.md); unset: park with the weights mapped."""


class StandbyError(VlaunchError):
    """The standby environment is malformed, or the launcher went away before promoting."""

    status = exit_status("USAGE")


def standby_env(promote_fd: int) -> dict[str, str]:
    """The environment entries that make a started engine a standby, promoted on `promote_fd`."""
    return {STANDBY_ENV: "1", PROMOTE_FD_ENV: str(promote_fd)}


def is_standby(env: Mapping[str, str] | None = None) -> bool:
    """Whether this engine was started as a standby."""
    return settings.get(STANDBY_ENV, env) == "1"


def parks_before_weights(env: Mapping[str, str] | None = None) -> bool:
    """Whether this standby parks before it maps its weights (PARK_ENV)."""
    return is_standby(env) and settings.get(PARK_ENV, env) == "before-weights"


def promote_fd(env: Mapping[str, str] | None = None) -> int:
    """The promote fd a standby was given; StandbyError if it is missing or malformed."""
    raw = settings.get(PROMOTE_FD_ENV, env)
    if not raw.isdigit():
        raise StandbyError(f"{STANDBY_ENV}=1 but {PROMOTE_FD_ENV}={raw!r} is not an fd number; "
                           "start standbys with vlaunch run --standby, or unset "
                           f"{STANDBY_ENV}")
    return int(raw)


def wait_for_promotion(fd: int, ping: Callable[[], None] | None = None,
                       every: float | None = None) -> None:
    """Block until the launcher promotes this standby; StandbyError if it never will (EOF).
    `ping` runs every `every` seconds meanwhile (a parked standby's WATCHDOG=1)."""
    while ping is not None and every and not select.select([fd], [], [], every)[0]:
        ping()
    data = b""
    with os.fdopen(fd, "rb", buffering=0, closefd=True) as pipe:
        while len(data) < len(PROMOTE):
            chunk = pipe.read(len(PROMOTE) - len(data))  # bounded: never more than PROMOTE
            if not chunk:
                break
            data += chunk
    if data != PROMOTE:
        raise StandbyError("the launcher closed the promote fd without promoting this standby; "
                           "nothing to do: the launcher stopped or replaced it")
