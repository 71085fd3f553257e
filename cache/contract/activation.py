"""Socket activation, the engine's side (sd_listen_fds(3)): the listening socket a parent
(`vlaunch run --listen`, whose keeper places it, or systemd) passed to this process at fd 3.

`passed_socket` takes it once: LISTEN_FDS, LISTEN_PID and LISTEN_FDNAMES are unset (a child
must not take them for its own) and the fd is made close-on-exec. Engines built on it: the
reference engine (cache/reference/http.py) and `vllm serve` (integrations/vllm_serve.py).
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import MutableMapping
from typing import NamedTuple

from .errors import UsageError

SD_LISTEN_FDS_START = 3
ENV = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


class ActivationError(UsageError):
    """The passed socket cannot be served: the variables or fd 3 are not what they claim."""


class Passed(NamedTuple):
    """The first passed socket, how many were passed, and their names (LISTEN_FDNAMES)."""

    sock: socket.socket
    count: int
    names: list[str]


def socket_passed(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether a socket was passed to this process (LISTEN_FDS set, LISTEN_PID ours)."""
    env = os.environ if env is None else env
    return bool(env.get("LISTEN_FDS")) and env.get("LISTEN_PID") == str(os.getpid())


def passed_socket(env: MutableMapping[str, str] | None = None, *,
                  who: str = "the engine") -> Passed | None:
    """The listening socket passed to this process (fd 3), or None when none is (no
    LISTEN_FDS, or LISTEN_PID names another process: a child that inherited the
    environment); ActivationError naming `who` when fd 3 is not what the variables say."""
    env = os.environ if env is None else env
    raw_fds, raw_pid = env.get("LISTEN_FDS", ""), env.get("LISTEN_PID", "")
    if not raw_fds:
        return None
    try:
        count, pid = int(raw_fds), int(raw_pid)
    except ValueError:
        raise ActivationError(f"vlaunch: the socket-activation variables are not numbers "
                              f"(LISTEN_FDS={raw_fds!r}, LISTEN_PID={raw_pid!r}); {who} "
                              "cannot take the socket the launcher passed") from None
    if pid != os.getpid():
        return None
    names = env.get("LISTEN_FDNAMES", "").split(":")
    for name in ENV:
        env.pop(name, None)
    if count < 1:
        return None
    fd = SD_LISTEN_FDS_START
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or not stat.S_ISSOCK(st.st_mode):
        raise ActivationError(f"vlaunch: the passed socket is missing (LISTEN_FDS={count}, "
                              f"fd {fd} is not a socket): start {who} itself as the engine "
                              "command of vlaunch run --listen (a wrapper must exec it and "
                              "keep fd 3 open)")
    sock = socket.socket(fileno=fd)
    if sock.type != socket.SOCK_STREAM or \
            not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ActivationError(f"vlaunch: the passed fd is not a listening stream socket "
                              f"(fd {fd}); {who} serves HTTP on the first socket of "
                              "vlaunch run --listen, a TCP or unix: address")
    sock.set_inheritable(False)
    return Passed(sock, count, names)
