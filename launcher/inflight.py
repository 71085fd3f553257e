"""Connections an engine holds on the launcher's sockets: what it loses if it dies now.

Accepted connections are the engine's: when it dies they are reset, and the request on each
(or an idle keep-alive connection) is lost. Connections not yet accepted wait in the kernel's
backlog of the launcher's socket and are the next engine's. The launcher counts the first kind
by looking at the engine's process tree (psutil), TCP sockets only: a Unix socket's accepted
end is not told apart from its listening one there.
"""

from __future__ import annotations

import contextlib
import socket

import psutil

from .listen import Listeners

WILDCARD = ("0.0.0.0", "::")


def tcp_ports(listeners: Listeners) -> dict[int, str]:
    """Port -> host of each TCP socket the launcher holds."""
    out = {}
    for sock in listeners.sockets:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host, port = sock.getsockname()[:2]
            out[int(port)] = str(host)
    return out


def held_connections(root: int, ports: dict[int, str]) -> int:
    """Connections accepted from those sockets and still open in process `root` or below."""
    if not ports:
        return 0
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return 0
    seen = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for c in proc.net_connections(kind="tcp"):
                if c.status != psutil.CONN_ESTABLISHED or not c.laddr or not c.raddr:
                    continue
                host = ports.get(c.laddr.port)
                if host is not None and (host in WILDCARD or host == c.laddr.ip):
                    seen.add((c.laddr, c.raddr))  # a socket shared by a fork counts once
    return len(seen)
