"""One connection to a cache rank's socket, client side: connect, send requests, read replies.

The protocol's client end, for engines (`client.connection.CacheClient` adds the handoff) and
for a rank that seeds from another (rank/seed.py): the directory and peer checks at connect,
every send and receive bounded by an I/O timeout, requests pipelined in one round trip, and
error replies raised as the errors they mean. Light: nothing beyond the contract.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from vlaunch.cache.contract import settings, wire
from vlaunch.cache.contract.errors import (
    CacheBrokenError,
    CacheUnavailableError,
    FingerprintMismatchError,
    ProtocolError,
    SocketDirError,
)
from vlaunch.cache.contract.sockdir import check_peer, ensure_socket_dir

log = logging.getLogger("vlaunch.cache.connection")

Reply = tuple[dict[str, Any], list[int]]
"""A reply frame: its body and the fds it carried (the receiver closes them)."""


class Connection:
    """One connection to a cache rank; replies are read in the order requests were sent."""

    def __init__(self, path: Path | str, *, timeout: float = 0.0, client: str = "",
                 io_timeout: float | None = None) -> None:
        self.path = Path(path)
        self.client = client or f"pid {os.getpid()}"
        self.io_timeout = settings.get("VLAUNCH_IO_TIMEOUT") if io_timeout is None \
            else io_timeout
        self._lock = threading.Lock()
        self._sock = connect(self.path, timeout, self.io_timeout)
        self._unread = 0  # replies nobody waits for (notify()); read before the next request

    def fileno(self) -> int:
        """The socket's fd (-1 once closed)."""
        return self._sock.fileno()

    def request(self, message: dict[str, Any]) -> Reply:
        """Send one request and return the reply (an error reply raises)."""
        with self._lock:
            self._send(message)
            reply, fds = self._recv()
        return self.checked(reply, fds)

    def exchange(self, messages: list[dict[str, Any]]) -> list[Reply]:
        """Send every request at once, then read every reply in order: one round trip. Error
        replies come back as they are, for the caller to `checked()` in its own order."""
        with self._lock:
            for message in messages:
                self._send(message)
            replies: list[Reply] = []
            try:
                for _ in messages:
                    replies.append(self._recv())
            except BaseException:
                for _, fds in replies:
                    wire.close_fds(fds)
                raise
        return replies

    def notify(self, message: dict[str, Any]) -> None:
        """Send a request without waiting for its reply (read before the next request)."""
        with self._lock:
            self._send(message)
            self._unread += 1

    def _send(self, message: dict[str, Any]) -> None:
        """Send one frame, after reading the replies nobody waits for (lock held)."""
        try:
            while self._unread:
                reply, fds = wire.recv_frame(self._sock)
                self._unread -= 1
                wire.close_fds(fds)
                if reply.get("ok") is not True:
                    log.warning("the vlaunch cache at %s refused a notification: %s: %s",
                                self.path, reply.get("error"), reply.get("message"))
            wire.send_frame(self._sock, message)
        except TimeoutError:
            raise self._stalled() from None
        except (OSError, EOFError) as exc:
            raise CacheUnavailableError(f"cache at {self.path} went away: {exc}") from None

    def _recv(self) -> Reply:
        """Receive one reply frame (lock held)."""
        try:
            return wire.recv_frame(self._sock)
        except TimeoutError:
            raise self._stalled() from None
        except (OSError, EOFError) as exc:
            raise CacheUnavailableError(f"cache at {self.path} went away: {exc}") from None

    def _stalled(self) -> CacheUnavailableError:
        """The error for a cache that stopped answering: the connection is unusable now."""
        self.close()
        return CacheUnavailableError(
            f"the cache at {self.path} did not answer within {self.io_timeout:g} s (stopped or "
            "overloaded?); check the rank with vlaunch status, or raise VLAUNCH_IO_TIMEOUT")

    def checked(self, reply: dict[str, Any], fds: list[int]) -> Reply:
        """The reply if it is ok; else its fds are closed and its error raised (a mismatch as
        FingerprintMismatchError, a busy cache as CacheUnavailableError)."""
        if reply.get("ok") is True:
            return reply, fds
        wire.close_fds(fds)
        code = reply.get("error")
        if code == "busy":  # at its connection bound, or swapping: like no cache at all
            raise CacheUnavailableError(f"cache at {self.path}: {reply.get('message')}", code)
        if code == "mismatch":
            raise FingerprintMismatchError([tuple(m) for m in reply.get("mismatch", [])])
        raise CacheBrokenError(f"cache at {self.path} answered {code}: {reply.get('message')}",
                               code if isinstance(code, str) else "")

    def status(self) -> dict[str, Any]:
        """The cache's status snapshot."""
        return self.request({"op": "status"})[0]["status"]

    def memory(self) -> dict[str, int]:
        """Bytes the cache holds per device."""
        return self.request({"op": "memory"})[0]["bytes_held"]

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()


def connect(path: Path, timeout: float, io_timeout: float) -> socket.socket:
    """Connect to a cache socket, retrying until `timeout`; checks the directory and peer.

    The socket comes back with `io_timeout` set: every later send and receive is bounded."""
    deadline = time.monotonic() + timeout
    busy_until = time.monotonic() + max(timeout, io_timeout)
    while True:
        try:
            ensure_socket_dir(path.parent, create=False)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.setblocking(False)  # a full backlog (a stalled cache) answers EAGAIN
                sock.connect(str(path))
                sock.settimeout(io_timeout)
                check_peer(sock)
            except BaseException:
                sock.close()
                raise
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if time.monotonic() >= deadline:
                raise CacheUnavailableError(f"no cache is serving {path} ({exc.strerror}); "
                                            "start it with vlaunch run or vlaunch cache") from None
            time.sleep(0.05)
        except BlockingIOError:
            if time.monotonic() >= busy_until:
                raise CacheUnavailableError(
                    f"the cache at {path} accepts no connection (its backlog is full for "
                    f"{max(timeout, io_timeout):g} s: stopped or overloaded?); check the rank "
                    "with vlaunch status, or raise VLAUNCH_IO_TIMEOUT") from None
            time.sleep(0.05)
        except SocketDirError as exc:
            if path.parent.exists() or time.monotonic() >= deadline:
                raise CacheUnavailableError(str(exc)) from None
            time.sleep(0.05)
        except ProtocolError as exc:
            raise CacheUnavailableError(str(exc)) from None
