"""The engine side: connect to a rank's cache, check the fingerprint, map or copy the slabs."""

from __future__ import annotations

import _thread
import logging
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import (
    CacheBrokenError,
    CacheUnavailableError,
    FingerprintMismatchError,
    ProtocolError,
    SocketDirError,
)
from vlaunch.cache.contract.sockdir import check_peer, ensure_socket_dir
from vlaunch.cache.store.manifest import Manifest, _int, views

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from vlaunch.cache.store.slabs import Backend

log = logging.getLogger("vlaunch.cache.client.connection")

_BACKENDS: dict[str, Backend] = {}


def backend_for(device: str) -> Backend:
    """The slab backend of `device`, made once per process and reused by every handoff."""
    backend = _BACKENDS.get(device)
    if backend is None:
        from vlaunch.cache.store.slabs import get_backend

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
        self._watching = False
        self._unread = 0  # replies to notify() not read yet; read before the next request

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Send one request and return the reply (an error reply raises)."""
        with self._lock:
            self._send(message)
            reply, fds = self._recv()
        return self._checked(reply, fds)

    def notify(self, message: dict[str, Any]) -> None:
        """Send a request without waiting for its reply (read before the next request)."""
        with self._lock:
            self._send(message)
            self._unread += 1

    def _send(self, message: dict[str, Any]) -> None:
        """Send one frame, after reading the replies still owed to notify() (lock held)."""
        try:
            while self._unread:
                reply, fds = wire.recv_frame(self._sock)
                self._unread -= 1
                for fd in fds:
                    os.close(fd)
                if reply.get("ok") is not True:
                    log.warning("the vlaunch cache at %s refused a notification: %s: %s",
                                self.path, reply.get("error"), reply.get("message"))
            wire.send_frame(self._sock, message)
        except (OSError, EOFError) as exc:
            raise CacheUnavailableError(f"cache at {self.path} went away: {exc}") from None

    def _recv(self) -> tuple[dict[str, Any], list[int]]:
        """Receive one reply frame (lock held)."""
        try:
            return wire.recv_frame(self._sock)
        except (OSError, EOFError) as exc:
            raise CacheUnavailableError(f"cache at {self.path} went away: {exc}") from None

    def _checked(self, reply: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """The reply if it is ok; else its fds are closed and its error raised."""
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
        reply, _ = self.request(self._hello(fingerprint))
        return reply["fingerprint"]

    def _hello(self, fingerprint: fp.Fingerprint) -> dict[str, Any]:
        return {"op": "hello", "fingerprint": fingerprint, "client": self.client,
                "pid": os.getpid()}

    def manifest(self) -> Manifest:
        """The validated manifest of the rank."""
        return Manifest.from_wire(self.request({"op": "manifest"})[0]["manifest"])

    def map(self, manifest: Manifest, *, mode: str = "share",
            device: str = "cpu") -> dict[str, torch.Tensor]:
        """Map the slabs (share) or copy them into our own memory (copy, copy-release)."""
        _, fds = self.request({"op": "open", "mode": mode})
        slabs = _import(fds, manifest.slab_sizes, device)
        if mode != "share":
            slabs = [s.clone() for s in slabs]  # one device copy per slab; mappings drop here
        tensors = views(manifest, slabs)
        with self._lock:
            self._mapped(manifest, mode)
        return tensors

    def handoff(self, fingerprint: Callable[[], fp.Fingerprint], *, mode: str = "share",
                device: str = "cpu") -> dict[str, torch.Tensor]:
        """hello + manifest + open + map (or copy) in one round trip: the engine's fast path.

        The manifest and open requests go out at once. In share mode `fingerprint()` is
        computed while the cache answers them; in the copy modes, while the copies run, which
        start as soon as the slabs are mapped. The hello's reply is read last. Nothing is
        returned unless the hello succeeded: on an error (a mismatch first, as hello() reports
        it) the mappings and copies are dropped before it is raised.
        """
        with self._lock:
            self._send({"op": "manifest"})
            self._send({"op": "open", "mode": mode})
            owed = 2  # replies not read yet; on an error, a later request reads them
            try:
                if mode == "share":
                    self._send(self._hello(fingerprint()))
                    owed += 1
                mrep, mfds = self._recv()
                owed -= 1
                orep, ofds = self._recv()
                owed -= 1
                if mrep.get("ok") is not True or orep.get("ok") is not True or mfds:
                    for fd in mfds + ofds:
                        os.close(fd)
                    if not owed:
                        self._send(self._hello(fingerprint()))
                        owed += 1
                    reply = self._recv()
                    owed -= 1
                    self._checked(*reply)  # the hello's error comes first
                    self._checked(mrep, [])
                    self._checked(orep, [])
                    raise CacheBrokenError(f"cache at {self.path} sent fds with its manifest")
                try:
                    sizes = _slab_sizes(mrep.get("manifest"))
                except BaseException:
                    for fd in ofds:
                        os.close(fd)
                    raise
                mapped: list[torch.Tensor] = []
                copies: list[torch.Tensor] = []
                try:
                    mapped.extend(_import(ofds, sizes, device))
                    if mode != "share":
                        copies.extend(s.clone() for s in mapped)  # the copies start here
                        self._send(self._hello(fingerprint()))
                        owed += 1
                    manifest = Manifest.from_wire(mrep["manifest"])
                    reply = self._recv()
                    owed -= 1
                    self._checked(*reply)
                    tensors = views(manifest, copies if mode != "share" else mapped)
                except BaseException:
                    copies.clear()
                    mapped.clear()
                    raise
            except BaseException:
                self._unread += owed
                raise
            mapped.clear()  # copy modes: waits for the copies, then unmaps
            self._mapped(manifest, mode)
        return tensors

    def _mapped(self, manifest: Manifest, mode: str) -> None:
        """Tell the cache what we hold, without a round trip; after copy-release, have it drop
        its copy and wait for that (lock held)."""
        self.mode, self.bytes_mapped = mode, manifest.nbytes if mode == "share" else 0
        self._send({"op": "mapped", "mode": mode, "bytes": self.bytes_mapped})
        if mode == "copy-release":
            self._send({"op": "drop"})
            self._checked(*self._recv())  # mapped
            self._checked(*self._recv())  # drop
        else:
            self._unread += 1
        if mode == "share":  # a lease; the copy modes hold nothing of the cache's
            self.watch()

    def status(self) -> dict[str, Any]:
        """The cache's status snapshot."""
        return self.request({"op": "status"})[0]["status"]

    def memory(self) -> dict[str, int]:
        """Bytes the cache holds per device."""
        return self.request({"op": "memory"})[0]["bytes_held"]

    def artifact_get(self, kind: str, key: str) -> bytes | None:
        """An artifact's bytes, or None when the cache does not hold it."""
        from vlaunch.cache.store.artifacts import decode

        with self._lock:
            self._send({"op": "artifact_get", "kind": kind, "key": key})
            reply, fds = self._recv()
        if reply.get("error") == "miss":
            return None
        reply, _ = self._checked(reply, fds)
        if not isinstance(reply.get("data"), str):
            raise CacheBrokenError(f"cache at {self.path} sent an artifact without data")
        return decode(reply["data"])

    def artifact_put(self, kind: str, key: str, data: bytes) -> None:
        """Hand an artifact to the cache (checked here first: name and size)."""
        from vlaunch.cache.store.artifacts import check_name, check_size, encode

        check_name(kind, key)
        check_size(kind, len(data))
        self.request({"op": "artifact_put", "kind": kind, "key": key, "data": encode(data)})

    def artifact_list(self) -> list[tuple[str, str, int]]:
        """(kind, key, size) of every artifact the cache holds."""
        rows = self.request({"op": "artifact_list"})[0].get("artifacts")
        if not isinstance(rows, list) or len(rows) > 4096:
            raise CacheBrokenError(f"cache at {self.path} sent a bad artifact list")
        return [(str(k), str(h), int(n)) for k, h, n in rows]

    def watch(self) -> None:
        """Warn once, from a daemon thread, when the cache process goes away."""
        if not self._watching:
            self._watching = True
            # _thread, not threading: Thread.start() waits until the new thread has run, which
            # costs a scheduler wake-up (a quarter of a millisecond) inside the handoff.
            _thread.start_new_thread(self._watch, ())

    def _watch(self) -> None:
        poller = select.poll()
        try:
            poller.register(self._sock.fileno(), select.POLLRDHUP | select.POLLHUP)
        except (ValueError, OSError):  # closed before this thread ran: nothing to watch
            return
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


def _slab_sizes(obj: Any) -> tuple[int, ...]:
    """The manifest's slab sizes, checked (the rest of it is validated before any view)."""
    try:
        sizes = obj["slab_sizes"]
        if not isinstance(sizes, list) or len(sizes) > 4096:
            raise ValueError("too many slabs")
        return tuple(_int(s, "slab size") for s in sizes)
    except (TypeError, ValueError, KeyError) as exc:
        raise CacheBrokenError(f"invalid manifest from cache: {exc}") from exc


def _import(fds: list[int], sizes: tuple[int, ...], device: str) -> list[torch.Tensor]:
    """Map each slab fd read-only; closes every fd."""
    try:
        if len(fds) != len(sizes):
            raise CacheBrokenError(f"cache sent {len(fds)} fds for {len(sizes)} slabs")
        backend = backend_for(device)
        return [backend.import_fd(fd, size, readonly=True)
                for fd, size in zip(fds, sizes, strict=True)]
    finally:
        for fd in fds:
            os.close(fd)


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
