"""One log-line format for every vlaunch process: time, who (with rank and pid), level, text."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(program: str, level: str | int = "INFO", rank: int | None = None, *,
                  force: bool = True) -> None:
    """Log to stderr as `<time> <program>[rank R pid P] LEVEL message`, or `<program>[P]`
    without a rank; `force=False` leaves a configuration already made alone."""
    who = f"rank {rank} pid {os.getpid()}" if rank is not None else "%(process)d"
    logging.basicConfig(level=level, stream=sys.stderr, force=force,
                        format=f"%(asctime)s {program}[{who}] %(levelname)s %(message)s")
