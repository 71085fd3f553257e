"""How a rank's failures are told apart: what means it could not get memory."""

from __future__ import annotations

import errno


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` means the process could not get memory or a thread."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    if isinstance(exc, ImportError):  # the loader could not map a shared library
        return "failed to map segment" in str(exc) or "Cannot allocate memory" in str(exc)
    return isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)
