"""The socket directory: where each rank's socket lives, who may use it, one cache per rank."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
from pathlib import Path

from vlaunch.cache.contract import settings
from vlaunch.cache.contract.errors import CacheBusyError, ProtocolError, SocketDirError
from vlaunch.cache.contract.roles import TARGET, stem

MAX_SUN_PATH = 107


def default_socket_dir() -> Path:
    """$VLAUNCH_SOCKET_DIR, else $XDG_RUNTIME_DIR/vlaunch, else /tmp/vlaunch-<uid>."""
    if settings.get("VLAUNCH_SOCKET_DIR"):
        return Path(settings.get("VLAUNCH_SOCKET_DIR"))
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "vlaunch"
    return Path(f"/tmp/vlaunch-{os.geteuid()}")


def ensure_socket_dir(path: Path | str, *, create: bool = True) -> Path:
    """Create (0700) or check the directory: a real directory, ours, no group/other access."""
    path = Path(path)
    if create:
        try:
            path.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
        except OSError as exc:  # a parent that is a file, no permission, a read-only mount
            raise SocketDirError(f"socket directory {path} is not usable: {exc.strerror}; "
                                 "create it or pass --socket-dir") from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise SocketDirError(f"socket directory {path} is not usable: {exc.strerror}; create it "
                             "or pass --socket-dir") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"socket directory {path} is a symlink or not a directory; "
                             "point --socket-dir at a real directory")
    if st.st_uid != os.geteuid():
        raise SocketDirError(f"socket directory {path} is owned by uid {st.st_uid}, not "
                             f"{os.geteuid()}; use a directory of your own")
    if st.st_mode & 0o077:
        raise SocketDirError(f"socket directory {path} has mode {stat.S_IMODE(st.st_mode):04o}; "
                             f"run chmod 700 {path}")
    return path


def socket_path(directory: Path | str, rank: int, role: str = TARGET) -> Path:
    """The socket of global rank `rank` of the `role` group (rank-N.sock, draft-rank-N.sock)."""
    path = Path(directory) / f"{stem(role, rank)}.sock"
    if len(os.fsencode(path)) > MAX_SUN_PATH:
        raise SocketDirError(f"socket path {path} is longer than {MAX_SUN_PATH} bytes; use a "
                             "shorter --socket-dir")
    return path


def memo_name(socket: str) -> str:
    """The identity memo of the rank serving `socket` (…/rank-N.sock): …/rank-N.identity.json
    (cache/store/identity.py writes it, the rank's lock holder removes it)."""
    return socket.removesuffix(".sock") + ".identity.json"


def open_lock(path: Path) -> int:
    """Open (create) a lock file; SocketDirError (73) if something else is there: a symlink
    (followed by nobody), a directory, a file of another user."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.EACCES, errno.EPERM,
                             errno.ENXIO):
            raise
        raise SocketDirError(f"lock path {path} is a symlink or not a file of ours "
                             f"({exc.strerror}); remove it (it is not vlaunch's)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise SocketDirError(f"lock path {path} is a symlink or not a file of ours "
                             f"(owned by uid {st.st_uid}); remove it (it is not vlaunch's)")
    return fd


class RankLock:
    """An exclusive flock per rank: one cache per rank; the holder removes stale sockets and
    identity memos."""

    def __init__(self, directory: Path, rank: int, role: str = TARGET) -> None:
        self.path = directory / f"{stem(role, rank)}.lock"
        self.socket = socket_path(directory, rank, role)
        self.memo = Path(memo_name(str(self.socket)))
        self._fd = -1

    def acquire(self) -> None:
        """Take the lock or raise CacheBusyError; then clear a stale socket file."""
        self._fd = open_lock(self.path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise CacheBusyError(f"another cache process holds {self.path}; stop it first or "
                                 "use another --socket-dir") from None
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.socket).st_mode):
                os.unlink(self.socket)

    def release(self) -> None:
        """Remove the socket (only a socket: a stray file stays for its owner), the identity
        memo (only a regular file) and the lock file, then drop the lock."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.socket).st_mode):
                os.unlink(self.socket)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(self.memo).st_mode):
                os.unlink(self.memo)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1


class LauncherLock:
    """An exclusive flock on SOCKET_DIR/launcher.lock: one launcher per socket directory."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / "launcher.lock"
        self._fd = -1

    def acquire(self) -> None:
        """Take the lock (held until release or exit) or raise CacheBusyError naming the
        launcher that holds it."""
        self._fd = open_lock(self.path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            self._fd = -1
            raise CacheBusyError(f"another launcher (pid {holder}) uses socket directory "
                                 f"{self.path.parent}; stop it first or use another "
                                 "--socket-dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Remove the lock file, then drop the lock."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def check_peer(sock: socket.socket, allowed_uids: frozenset[int] | None = None) -> int:
    """Refuse a peer that runs as another user; returns its pid."""
    pid, uid, _ = peer_credentials(sock)
    if uid not in (allowed_uids or {os.geteuid()}):
        raise ProtocolError(f"peer pid {pid} runs as uid {uid}, not {os.geteuid()}: refused; "
                            "run the engine and the cache as the same user")
    return pid
