"""What a process can know about the peer of a Unix socket across PID namespaces.

`SO_PEERCRED` gives the peer's pid as the reader's PID namespace numbers it, and 0 when the
peer is not in that namespace or below it: an engine in a sibling container is pid 0 to its
cache. A pid read that way also names a process in /proc only when /proc was mounted for the
reader's own namespace (`unshare --pid --fork` without `--mount-proc` keeps the parent's).
`SO_PEERPIDFD` (Linux 6.5) hands out a pidfd instead, which follows the process whatever the
namespaces: it polls readable once the process has exited.
"""

from __future__ import annotations

import errno
import os
import select
import socket

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
UNKNOWN_PID = 0
"""The pid `SO_PEERCRED` reports for a peer outside the reader's PID namespace."""


class PeerGone(Exception):
    """The peer process of a socket has already exited."""


def proc_is_ours() -> bool:
    """Whether /proc shows this process's own PID namespace, so that /proc/<pid> is the
    process this one knows as <pid>."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def proc_pid() -> int | None:
    """This process's pid as /proc numbers it (its mount's PID namespace), None when this
    process is not visible there."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return None


def peer_pidfd(sock: socket.socket) -> int | None:
    """A pidfd (close-on-exec, ours to close) of the process that connected `sock`; None
    where the kernel has no SO_PEERPIDFD (before 6.5). PeerGone when that process exited."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ESRCH):  # no task left behind the peer's pid
            raise PeerGone from None
        return None  # ENOPROTOOPT: an older kernel; ENODATA: no peer credentials at all


def peer_pidfds() -> bool:
    """Whether this kernel hands out a socket peer's pidfd (SO_PEERPIDFD, Linux 6.5)."""
    a, b = socket.socketpair()
    with a, b:
        try:
            fd = peer_pidfd(a)
        except PeerGone:
            return True
    if fd is not None:
        os.close(fd)
    return fd is not None


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (the pidfd polls readable then)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def describe(pid: int, client: str = "") -> str:
    """A peer as log lines name it: its pid, or what it calls itself when its pid is unknown."""
    if pid != UNKNOWN_PID:
        return f"pid {pid}"
    return f"{client or 'a process'} in another PID namespace"
