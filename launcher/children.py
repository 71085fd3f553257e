"""Child processes: their environment, their own process groups, and the final sweep."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
from collections.abc import Iterable, Mapping

import psutil

log = logging.getLogger("vlaunch.launcher")

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in every child: it can take a shared host's GPUs down."""


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def become_subreaper() -> None:
    """Orphaned descendants re-parent to us, so the final sweep can find every one of them."""
    with contextlib.suppress(OSError):
        _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL if the launcher dies, even by SIGKILL."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def child_env(base: Mapping[str, str], extra: Mapping[str, str],
              notify_socket: str | None) -> dict[str, str]:
    """The launcher's environment, minus systemd's NOTIFY_SOCKET, plus ours."""
    env = {k: v for k, v in base.items()
           if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
                        "LISTEN_PID", "LISTEN_FDNAMES")}
    env.update(NO_MULTICAST)
    env.update(extra)
    if notify_socket:
        env["NOTIFY_SOCKET"] = notify_socket
    return env


def reap_orphans(ours: Iterable[int]) -> list[int]:
    """Collect exited descendants that re-parented to us (we are their subreaper)."""
    known = set(ours)
    reaped = []
    for proc in psutil.Process().children():
        if proc.pid in known:
            continue  # asyncio waits for its own children
        with contextlib.suppress(ChildProcessError, psutil.Error):
            if proc.status() == psutil.STATUS_ZOMBIE and os.waitpid(proc.pid, os.WNOHANG)[0]:
                reaped.append(proc.pid)
    return reaped


def signal_group(pid: int, sig: int) -> None:
    """Signal a child's process group (it leads its own); a vanished group is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def sweep(pids: Iterable[int]) -> list[str]:
    """SIGKILL the given children's groups and every descendant of ours; returns the killed."""
    for pid in pids:
        signal_group(pid, signal.SIGKILL)
    me = psutil.Process()
    left = me.children(recursive=True)
    names = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            names.append(f"{proc.pid} ({' '.join(proc.cmdline()[:4])[:80]})")
            proc.kill()
    gone, alive = psutil.wait_procs(left, timeout=5)
    for proc in alive:
        log.error("process %d survived SIGKILL (uninterruptible sleep in a driver call?)",
                  proc.pid)
    return names if gone else []
