"""Checks `vlaunch run` makes before it starts anything, and the socket directory it owns.

Everything here fails with a documented status and leaves nothing behind: a bad socket
directory (73), a second launcher on the same directory (75), a health port in use, an engine
command that cannot run or a /proc of another PID namespace (64) are found before a rank spends
minutes loading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.peers import proc_is_ours, proc_pid
from vlaunch.cache.contract.sockdir import LauncherLock, ensure_socket_dir, socket_path

from .health import check_port

log = logging.getLogger("vlaunch.launcher")


def check_command(argv: tuple[str, ...], what: str, option: str,
                  env: Mapping[str, str] | None = None) -> None:
    """Raise UsageError when argv[0] is neither an executable path nor found on PATH."""
    if not argv:
        return
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    if shutil.which(argv[0], path=path) is None:
        raise UsageError(f"{what} {argv[0]!r} is not an executable file and not found on "
                         f"PATH; fix {option} (a full path, or install the program)")


def check_proc() -> None:
    """Raise UsageError when /proc is not this PID namespace's: the launcher finds and kills
    its children's descendants there, and its pids would name other processes."""
    if proc_is_ours():
        return
    there = proc_pid()
    where = f"pid {there} there" if there is not None else "not visible there"
    raise UsageError(f"/proc is another PID namespace's than the launcher's: it is pid "
                     f"{os.getpid()} here, {where}; its final sweep would kill processes that "
                     "are not its own; mount a /proc for this PID namespace (unshare --pid "
                     "--fork --mount-proc; container runtimes do)")


@contextlib.contextmanager
def owned_socket_dir(directory: Path, ranks: tuple[int, ...], health_host: str,
                     health_port: int | None) -> Iterator[Path]:
    """Create/check the socket directory and hold its launcher lock while the body runs.

    The health port is checked before the directory is made; a directory this launcher
    created is removed again at the end if nothing is left in it.
    """
    check_proc()
    for rank in ranks:
        socket_path(directory, rank)  # too long for a Unix socket: SocketDirError (73) now
    if health_port:
        check_port(health_host, health_port)
    created = not os.path.lexists(directory)
    lock: LauncherLock | None = None
    try:
        directory = ensure_socket_dir(directory)
        lock = LauncherLock(directory)
        lock.acquire()
        yield directory
    finally:
        if lock is not None:
            lock.release()
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()
