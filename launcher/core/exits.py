"""How a child ended, in words: raw exit statuses and signals as the log lines name them."""

from __future__ import annotations

import signal

from vlaunch.cache.contract.exitcodes import EXIT_TABLE, ExitStatus

CACHE_STATUSES: frozenset[int] = frozenset(
    int(row.status) for row in EXIT_TABLE if "cache" in row.who and row.status != ExitStatus.OK)
"""Documented statuses a cache rank exits with; the launcher passes them on unchanged."""

_SIGNAL_HINTS: dict[int, str] = {
    # Nobody sends SIGKILL to a cache rank by accident; the kernel's OOM killer (or a cgroup's
    # memory limit) does, and it leaves no trace in the rank's own log.
    signal.SIGKILL: "the OOM killer?",
    # SIGBUS on an mmap'd checkpoint means the file shrank or its disk failed under the reader.
    signal.SIGBUS: "a checkpoint file truncated or unreadable while mapped?",
}


def describe_exit(status: int, *, hint: bool = True) -> str:
    """Say how a child ended, from its raw status (negative: killed by signal -status);
    `hint`: guess who sent the signal (not when the launcher did)."""
    if status < 0:
        if not known_signal(-status):
            return f"killed by signal {-status}"
        hint = _SIGNAL_HINTS.get(-status) if hint else None
        return f"killed by signal {-status} ({signal_name(-status)}{': ' + hint if hint else ''})"
    # A shell between the launcher and the program reports a signal death as 128+N.
    shell = 128 < status < 256 and known_signal(status - 128)
    return f"status {status}" + (f" (128+{signal_name(status - 128)}?)" if shell else "")


def rank_exit(status: int) -> str:
    """`describe_exit`, naming a documented vlaunch status of a cache rank."""
    if status in CACHE_STATUSES:
        return f"status {status} ({ExitStatus(status).name})"
    return describe_exit(status)


def signal_name(sig: int) -> str:
    """SIGTERM for 15; "signal 99" for a number the platform does not name."""
    return signal.Signals(sig).name if known_signal(sig) else f"signal {sig}"


def known_signal(sig: int) -> bool:
    """Whether the platform names signal number `sig`."""
    try:
        signal.Signals(sig)
    except ValueError:
        return False
    return True
