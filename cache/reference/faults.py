"""Test-only faults of the reference engine: the hangs the fault suite injects (tests/faults).

Off unless `VLAUNCH_REFERENCE_FAULT_FILE` names a file. Before each request, rank 0 and every
worker read that file; the rank a fault names removes the file (so that the one engine hangs,
not the next) and hangs:

    generate-stall    rank 0's main thread stops before the request: HTTP and /health keep
                      answering, generation never does (nor do the watchdog pings)
    worker-stall R    worker R waits in a receive that rank 0 never sends, while rank 0 waits
                      for it in the request's first collective

Nothing else reads the variable; never set it in production.
"""

from __future__ import annotations

import logging
import os
import time

from vlaunch.cache.contract import settings

log = logging.getLogger("vlaunch.engine")

FAULT_ENV = "VLAUNCH_REFERENCE_FAULT_FILE"


def take(rank: int) -> str:
    """The fault for `rank`, once ("" if none): the file is removed by whoever takes it."""
    path = settings.get(FAULT_ENV)
    if not path:
        return ""
    try:
        with open(path) as f:
            words = f.read(64).split()
    except OSError:
        return ""
    fault = _for_rank(words, rank)
    if not fault:
        return ""
    try:
        os.unlink(path)
    except FileNotFoundError:  # another rank took it first
        return ""
    log.warning("rank %d: test fault %s (%s): hanging now", rank, fault, FAULT_ENV)
    return fault


def _for_rank(words: list[str], rank: int) -> str:
    """Which of the file's faults applies to `rank`."""
    if words == ["generate-stall"] and rank == 0:
        return "generate-stall"
    if len(words) == 2 and words[0] == "worker-stall" and words[1] == str(rank) and rank > 0:
        return "worker-stall"
    return ""


def stall() -> None:
    """Hang for good (signal handlers still run between the sleeps, to no effect)."""
    while True:
        time.sleep(3600)


def stall_in_collective() -> None:
    """Hang in a receive from rank 0 that never comes (a worker stuck in a collective)."""
    import torch
    import torch.distributed as dist

    dist.recv(torch.empty(1), src=0)
    stall()
