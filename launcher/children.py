"""Child processes: their environment, their own process groups, and the final sweep."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

from vlaunch.cache.contract import lifetime

from .keeper import COMMAND_SIGTERM

log = logging.getLogger("vlaunch.launcher")

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in every child: it can take a shared host's GPUs down."""


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL if the launcher dies, even by SIGKILL, and joins
    the launcher's child cgroup when there is one (contain_children)."""
    lifetime.die_with_parent()
    if _CGROUP is not None:
        _CGROUP.join()


class ChildCgroup:
    """A cgroup v2 directory for every child of one launcher: `cgroup.kill` ends all of them,
    daemonized descendants included, which neither process groups nor the parent-death
    signal reach."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, parent: Path, name: str) -> ChildCgroup | None:
        """Make `parent/name`; None unless it is a cgroup we may fill and kill."""
        path = parent / name
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            log.debug("no child cgroup under %s: %s", parent, exc)
            return None
        if not (os.access(path / "cgroup.procs", os.W_OK) and (path / "cgroup.kill").exists()):
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return cls(path)

    def join(self) -> None:
        """Move the calling process here (in a preexec_fn: before the child runs anything)."""
        with contextlib.suppress(OSError), open(self.path / "cgroup.procs", "w") as f:
            f.write("0")

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the cgroup, wait until it is empty, remove it."""
        with contextlib.suppress(OSError), open(self.path / "cgroup.kill", "w") as f:
            f.write("1")
        deadline = time.monotonic() + timeout
        while self.populated() and time.monotonic() < deadline:
            time.sleep(0.02)
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def populated(self) -> bool:
        """Whether a process is still in the cgroup (or below it)."""
        try:
            return "populated 1" in (self.path / "cgroup.events").read_text()
        except OSError:
            return False


_CGROUP: ChildCgroup | None = None


def own_cgroup(mountinfo: str = "/proc/self/mountinfo",
               cgroup: str = "/proc/self/cgroup") -> Path | None:
    """The directory of this process's cgroup v2, or None (no unified hierarchy, or we sit
    at its root, which is the host's and not ours to fill)."""
    try:
        mounts, groups = Path(mountinfo).read_text(), Path(cgroup).read_text()
    except OSError:
        return None
    mount = next((line.split()[4] for line in mounts.splitlines() if " - cgroup2 " in line),
                 None)
    rel = next((line[3:] for line in groups.splitlines() if line.startswith("0::")), None)
    if mount is None or rel is None or rel in ("", "/"):
        return None
    return Path(mount) / rel.lstrip("/")


def contain_children(base: Path | None = None) -> ChildCgroup | None:
    """Put every child of this launcher into a child cgroup of our own when our cgroup is a
    delegated one (systemd Delegate=yes, a container's private cgroup namespace); first
    kill what launchers killed with SIGKILL left in theirs. None: not available here."""
    global _CGROUP
    base = base or own_cgroup()
    if base is None or not os.access(base, os.W_OK):
        log.info("no delegated cgroup v2 here: children are tracked by process group and "
                 "the parent-death signal only (see the lifecycle page)")
        return None
    for stale in base.glob("vlaunch-*"):
        pid = stale.name.removeprefix("vlaunch-")
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            log.warning("killing what a launcher (pid %s) killed with SIGKILL left behind in "
                        "%s", pid, stale)
            ChildCgroup(stale).kill()
    _CGROUP = ChildCgroup.create(base, f"vlaunch-{os.getpid()}")
    if _CGROUP is not None:
        log.info("children run in cgroup %s", _CGROUP.path)
    return _CGROUP


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


def signal_command(pid: int, sig: int) -> None:
    """SIGTERM the command the keeper `pid` runs, alone (keeper.COMMAND_SIGTERM); any other
    signal goes to the group. A vanished keeper is fine."""
    if sig != signal.SIGTERM:
        signal_group(pid, sig)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, COMMAND_SIGTERM)


def group_running(pgid: int) -> list[int]:
    """Processes of process group `pgid` that still run (a zombie holds no socket, no memory).

    A keeper killed with its group can be reaped before its child has finished exiting: the
    child still holds the engine's port and device memory for a moment."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # the usual end: nothing of the group exists, not even a zombie
    except PermissionError:
        pass
    running = []
    for proc in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc.pid)
    return running


def sweep(pids: Iterable[int]) -> list[str]:
    """SIGKILL the given children's groups, our child cgroup, and every descendant of ours;
    returns the killed."""
    for pid in pids:
        signal_group(pid, signal.SIGKILL)
    if _CGROUP is not None:
        _CGROUP.kill()
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
