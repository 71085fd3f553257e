"""The engine's listening sockets (`vlaunch run --listen`): bound once by the launcher, before
any rank starts, or taken from systemd's socket activation, and handed to every engine and
standby by the same protocol (`LISTEN_FDS`, `LISTEN_PID`, `LISTEN_FDNAMES`, fds from 3;
keeper.py places them). The launcher never accepts on them: it only holds them, so that a
client's connection waits in the kernel's backlog while one engine gives way to the next.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import stat
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

from vlaunch.cache.contract.errors import UsageError

log = logging.getLogger("vlaunch.launcher")

MAX_LISTEN = 16
"""--listen may be given this many times."""
UNIX_PATH_MAX = 107
"""Bytes of a Unix socket path: sun_path holds 108, the last one the terminating NUL."""
SD_LISTEN_FDS_START = 3
DEFAULT_NAME = "http"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # LISTEN_FDNAMES: ':'-separated, no ':' inside
_ENV = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


@dataclass(frozen=True)
class ListenAddress:
    """One --listen value: a name (LISTEN_FDNAMES) and a TCP host and port, or a Unix path."""

    name: str
    host: str = ""
    port: int = 0
    path: str = ""  # a Unix socket's path (unix:PATH); host and port unused then

    def __str__(self) -> str:
        if self.path:
            return f"unix:{self.path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, value: str) -> ListenAddress:
        """`[NAME=]HOST:PORT`, `[NAME=][IPV6]:PORT` or `[NAME=]unix:PATH`; UsageError (64)
        for anything else."""
        name, sep, rest = value.partition("=")
        if not sep or name.startswith(("unix:", "[")) or ":" in name:
            name, rest = DEFAULT_NAME, value
        if not _NAME.fullmatch(name):
            raise UsageError(f"--listen {value!r}: the name {name!r} is not 1-64 letters, "
                             "digits, '_', '.' or '-'; write NAME=HOST:PORT")
        if rest.startswith("unix:"):
            return cls(name, path=_unix_path(value, rest[5:]))
        host, port = _host_port(value, rest)
        return cls(name, host=host, port=port)


def _unix_path(value: str, path: str) -> str:
    """A Unix socket path that fits sun_path."""
    if not path or "\0" in path:
        raise UsageError(f"--listen {value!r}: give a path after unix:")
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        raise UsageError(f"--listen {value!r}: the Unix socket path is {size} bytes, longer "
                         f"than the {UNIX_PATH_MAX} a socket address holds; use a shorter "
                         "path (a directory nearer /)")
    return path


def _host_port(value: str, rest: str) -> tuple[str, int]:
    """(host, port) of `HOST:PORT` or `[IPV6]:PORT`; an empty host is every IPv4 address."""
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        ok = bracket and tail.startswith(":") and ":" in host
        port = tail[1:]
    else:
        host, colon, port = rest.rpartition(":")
        ok = colon and ":" not in host
    if not ok or not port.isdigit() or int(port) > 65535 or len(host) > 253:
        raise UsageError(f"--listen {value!r} is not HOST:PORT, [IPV6]:PORT or unix:PATH "
                         "(PORT 0-65535, 0: a free one), optionally after NAME=")
    return host or "0.0.0.0", int(port)


def backlog() -> int:
    """The longest accept queue the kernel grants (net.core.somaxconn)."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(128, int(f.read().strip()))
    except (OSError, ValueError):
        return socket.SOMAXCONN


def bind(address: ListenAddress) -> socket.socket:
    """A listening socket on `address` (close-on-exec: pass_fds hands it on); UsageError (64)
    with the cause and the fix when it cannot be bound."""
    try:
        sock = _bind_unix(address) if address.path else _bind_tcp(address)
    except OSError as exc:
        raise _bind_error(address, exc) from None
    return sock


def _bind_tcp(address: ListenAddress) -> socket.socket:
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"vlaunch: --listen {address}: cannot resolve {address.host!r} "
                         f"({exc.strerror}); give an address of this host") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # a restarted launcher binds again at once, past its predecessor's TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog())
    except OSError:
        sock.close()
        raise
    return sock


def _bind_unix(address: ListenAddress) -> socket.socket:
    path = address.path
    _check_directory(address)
    _clear_stale_unix(address)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600: the launcher's user only
    try:
        sock.bind(path)
        sock.listen(backlog())
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock


def _check_directory(address: ListenAddress) -> None:
    """Warn when another user could replace the socket file: its directory is writable by
    group or others without the sticky bit, or owned by another user than us or root."""
    directory = os.path.dirname(os.path.abspath(address.path))
    try:
        st = os.stat(directory)
    except OSError:
        return  # the bind says why
    shared = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
    if shared or st.st_uid not in (0, os.geteuid()):
        log.warning("--listen %s: its directory %s may be written by other users, who could "
                    "replace the socket; put it in a directory of this user's (mode 0700 or "
                    "0755)", address, directory)


def _clear_stale_unix(address: ListenAddress) -> None:
    """Remove a socket file nobody listens on any more (a killed launcher's); refuse a live
    one or anything that is not a socket."""
    try:
        st = os.lstat(address.path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise UsageError(f"vlaunch: --listen {address}: the path exists and is not a socket; "
                         "remove it or pick another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(address.path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address.path)
            return
    raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))


def _bind_error(address: ListenAddress, exc: OSError) -> UsageError:
    """The usage error for an address the launcher cannot listen on."""
    if exc.errno == errno.EADDRINUSE:
        return UsageError(f"vlaunch: --listen {address}: the address is already in use (another "
                          "server, or a launcher still running); stop it or pick another")
    if exc.errno == errno.EACCES:
        return UsageError(f"vlaunch: --listen {address}: permission denied (a port below 1024 "
                          "needs root or CAP_NET_BIND_SERVICE; a unix: path needs a directory "
                          "this user may write); pick another address, or start under "
                          "systemd's vlaunch@.socket")
    if exc.errno == errno.EADDRNOTAVAIL:
        return UsageError(f"vlaunch: --listen {address}: not an address of this host; give "
                          "one of its addresses, or 0.0.0.0")
    return UsageError(f"vlaunch: --listen {address}: cannot listen ({exc.strerror or exc}); "
                      "fix the address")


@dataclass
class Listeners:
    """The sockets every engine gets, in order, with their names."""

    sockets: list[socket.socket]
    names: list[str]
    activated: bool = False  # taken from systemd's socket activation, not bound here

    def fds(self) -> tuple[int, ...]:
        """Their fd numbers in the launcher (what pass_fds hands on)."""
        return tuple(s.fileno() for s in self.sockets)

    def describe(self) -> str:
        """The addresses, for the log and /status."""
        return ", ".join(f"{n}={_where(s)}" for n, s in zip(self.names, self.sockets,
                                                             strict=True))

    def close(self) -> None:
        """Close our copies; a Unix socket file this launcher bound is removed."""
        for sock in self.sockets:
            path = sock.getsockname() if sock.family == socket.AF_UNIX else ""
            sock.close()
            if path and isinstance(path, str) and not self.activated:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self.sockets = []


def open_listeners(values: Iterable[str],
                   env: MutableMapping[str, str] | None = None) -> Listeners | None:
    """The engine's sockets: systemd's when it passed some to this process (the --listen
    values then only name them), else each --listen bound here; None without either."""
    env = os.environ if env is None else env
    activated = take_activated(env)
    addresses = [ListenAddress.parse(v) for v in values]
    if activated is not None:
        if addresses:
            log.info("socket activation: serving systemd's %d socket(s); --listen %s not "
                     "bound", len(activated.sockets), ", ".join(map(str, addresses)))
        return activated
    if not addresses:
        return None
    if len(addresses) > MAX_LISTEN:
        raise UsageError(f"--listen was given {len(addresses)} times; at most {MAX_LISTEN}")
    sockets: list[socket.socket] = []
    try:
        for address in addresses:
            sockets.append(bind(address))
    except UsageError:
        for sock in sockets:
            sock.close()
        raise
    return Listeners(sockets, [a.name for a in addresses])


def activated(env: Mapping[str, str]) -> bool:
    """Whether the service manager passed sockets to this process (LISTEN_PID is ours)."""
    return bool(env.get("LISTEN_FDS")) and env.get("LISTEN_PID") == str(os.getpid())


def take_activated(env: MutableMapping[str, str]) -> Listeners | None:
    """systemd's sockets when LISTEN_PID names this process (sd_listen_fds(3)); the variables
    are unset either way, so that no child mistakes them for its own."""
    raw_fds, raw_pid = env.get("LISTEN_FDS", ""), env.get("LISTEN_PID", "")
    raw_names = env.get("LISTEN_FDNAMES", "")
    for name in _ENV:
        env.pop(name, None)
    if not raw_fds or raw_pid != str(os.getpid()):
        return None
    if not raw_fds.isdigit() or not 0 < int(raw_fds) <= MAX_LISTEN:
        raise UsageError(f"vlaunch: LISTEN_FDS={raw_fds!r} from the service manager is not a "
                         f"count of 1-{MAX_LISTEN} sockets; fix the .socket unit")
    count = int(raw_fds)
    names = raw_names.split(":") if raw_names else []
    names = [n if _NAME.fullmatch(n) else DEFAULT_NAME for n in names[:count]]
    names += [DEFAULT_NAME] * (count - len(names))
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            raise UsageError(f"vlaunch: the service manager passed LISTEN_FDS={count}, but fd "
                             f"{fd} is not a socket; check the .socket unit") from None
        if sock.type != socket.SOCK_STREAM or \
                not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.detach()
            raise UsageError(f"vlaunch: the socket the service manager passed as fd {fd} is "
                             "not a listening stream socket; use ListenStream= in the "
                             ".socket unit")
        sock.set_inheritable(False)  # pass_fds hands it on, nothing else inherits it
        sockets.append(sock)
    listeners = Listeners(sockets, names, activated=True)
    log.info("socket activation: took %s from the service manager", listeners.describe())
    return listeners


def _where(sock: socket.socket) -> str:
    """A socket's local address, as --listen spells it."""
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix:{name}"
    host, port = name[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
