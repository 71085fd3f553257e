"""The engine side: connect to a rank's cache, check the fingerprint, map or copy the slabs."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import fingerprint as fp
from . import wire
from .errors import (
    CacheBrokenError,
    CacheUnavailableError,
    FingerprintMismatchError,
    ProtocolError,
    SocketDirError,
)
from .manifest import Manifest, views
from .sockdir import check_peer, ensure_socket_dir

if TYPE_CHECKING:
    import torch

    from .slabs import Backend

log = logging.getLogger("vlaunch.cache.client")

_BACKENDS: dict[str, Backend] = {}


def backend_for(device: str) -> Backend:
    """The slab backend of `device`, made once per process and reused by every handoff."""
    backend = _BACKENDS.get(device)
    if backend is None:
        from .slabs import get_backend

        backend = _BACKENDS[device] = get_backend(device)
    return backend


class CacheClient:
    """One connection to a cache rank; while it is open, the engine holds a lease."""

    def __init__(self, path: Path | str, *, timeout: float = 0.0, client: str = "") -> None:
        self.path = Path(path)
        self.client = client or f"pid {os.getpid()}"
        self.bytes_mapped = 0
        self.mode = ""
        self._lock = threading.Lock()
        self._sock = _connect(self.path, timeout)
        self._watcher: threading.Thread | None = None

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Send one request and return the reply (an error reply raises)."""
        with self._lock:
            try:
                wire.send_frame(self._sock, message)
                reply, fds = wire.recv_frame(self._sock)
            except (OSError, EOFError) as exc:
                raise CacheUnavailableError(f"cache at {self.path} went away: {exc}") from None
        if reply.get("ok") is True:
            return reply, fds
        for fd in fds:
            os.close(fd)
        if reply.get("error") == "mismatch":
            raise FingerprintMismatchError([tuple(m) for m in reply.get("mismatch", [])])
        raise CacheBrokenError(f"cache at {self.path} answered {reply.get('error')}: "
                               f"{reply.get('message')}")

    def hello(self, fingerprint: fp.Fingerprint) -> fp.Fingerprint:
        """Check our fingerprint against the cache's; a mismatch raises with every field."""
        reply, _ = self.request({"op": "hello", "fingerprint": fingerprint,
                                 "client": self.client, "pid": os.getpid()})
        return reply["fingerprint"]

    def manifest(self) -> Manifest:
        """The validated manifest of the rank."""
        return Manifest.from_wire(self.request({"op": "manifest"})[0]["manifest"])

    def map(self, manifest: Manifest, *, mode: str = "share",
            device: str = "cpu") -> dict[str, torch.Tensor]:
        """Map the slabs (share) or copy them into our own memory (copy, copy-release)."""
        _, fds = self.request({"op": "open", "mode": mode})
        try:
            if len(fds) != len(manifest.slab_sizes):
                raise CacheBrokenError(f"cache sent {len(fds)} fds for "
                                       f"{len(manifest.slab_sizes)} slabs")
            backend = backend_for(device)
            slabs = [backend.import_fd(fd, size, readonly=True)
                     for fd, size in zip(fds, manifest.slab_sizes, strict=True)]
        finally:
            for fd in fds:
                os.close(fd)
        if mode != "share":
            slabs = [s.clone() for s in slabs]  # one device copy per slab; mappings drop here
        tensors = views(manifest, slabs)
        self.mode, self.bytes_mapped = mode, manifest.nbytes if mode == "share" else 0
        self.request({"op": "mapped", "mode": mode, "bytes": self.bytes_mapped})
        if mode == "copy-release":
            self.request({"op": "drop"})
        self.watch()
        return tensors

    def status(self) -> dict[str, Any]:
        """The cache's status snapshot."""
        return self.request({"op": "status"})[0]["status"]

    def memory(self) -> dict[str, int]:
        """Bytes the cache holds per device."""
        return self.request({"op": "memory"})[0]["bytes_held"]

    def watch(self) -> None:
        """Warn once, from a daemon thread, when the cache process goes away."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="vlaunch-lease",
                                             daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLRDHUP | select.POLLHUP)
        while self._sock.fileno() >= 0:
            for _, event in poller.poll(1000):
                if event & (select.POLLRDHUP | select.POLLHUP | select.POLLNVAL):
                    if self._sock.fileno() >= 0:
                        log.warning("the vlaunch cache at %s went away; the %d bytes already "
                                    "mapped stay valid and the engine keeps serving", self.path,
                                    self.bytes_mapped)
                    return

    def close(self) -> None:
        """End the lease (mapped tensors stay valid: the mappings hold the memory)."""
        self._sock.close()


def _connect(path: Path, timeout: float) -> socket.socket:
    """Connect to a cache socket, retrying until `timeout`; checks the directory and peer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ensure_socket_dir(path.parent, create=False)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(str(path))
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
        except SocketDirError as exc:
            if path.parent.exists() or time.monotonic() >= deadline:
                raise CacheUnavailableError(str(exc)) from None
            time.sleep(0.05)
        except ProtocolError as exc:
            raise CacheUnavailableError(str(exc)) from None
