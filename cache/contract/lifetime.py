"""Process lifetime bits the launcher and the reference engine share (Linux prctl)."""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int, failure: str) -> None:
    """prctl(2) with one argument; OSError(`failure`) if it fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), failure)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """The kernel sends `sig` to this process when its parent dies, even by SIGKILL. (It
    fires when the thread that forked us exits: fork from the main thread.)"""
    prctl(PR_SET_PDEATHSIG, sig, "prctl(PR_SET_PDEATHSIG) failed")


def become_subreaper() -> None:
    """Orphaned descendants re-parent to us, so that a final sweep can find every one."""
    with contextlib.suppress(OSError):
        prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER) failed")
