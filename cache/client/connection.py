"""The engine side: connect to a rank's cache, check the fingerprint, map or copy the slabs."""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import select
import socket
import threading
import time
import weakref
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
from vlaunch.cache.contract.protocol import MAX_FDS
from vlaunch.cache.contract.sockdir import check_peer, ensure_socket_dir
from vlaunch.cache.store import columns
from vlaunch.cache.store.manifest import Manifest, checked_int

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from vlaunch.cache.store.slabs import Backend

log = logging.getLogger("vlaunch.cache.client.connection")

IO_TIMEOUT = 30.0
"""Seconds each step of a handoff (a reply, the slab fds) may take: a stalled cache fails."""

SPIN_FOR_COPY = 0.1
"""Seconds an engine polls for the reply that its copy is done before it sleeps on it: the
copy of a shard of up to ~200 GB on an H200 (4.3 TB/s read + write)."""
MANIFEST = {"op": "manifest", "form": "columns"}
"""The manifest request: its columns form, checked and viewed in bulk (store/columns.py)."""
_BACKENDS: dict[str, Backend] = {}
TRACE: dict[str, float] = {}
"""The last handoff's steps (time.perf_counter() at start, asked (every request sent: in share
mode, the fingerprint computed), replies, imported, hello, copied, done; then load()'s handed,
collector, weights and closed), for benchmarks."""


def backend_for(device: str) -> Backend:
    """The slab backend of `device`, made once per process and reused by every handoff."""
    backend = _BACKENDS.get(device)
    if backend is None:
        from vlaunch.cache.store.slabs import get_backend

        backend = _BACKENDS[device] = get_backend(device)
    return backend


class CacheClient:
    """One connection to a cache rank; while it is open, the engine holds a lease."""

    def __init__(self, path: Path | str, *, timeout: float = 0.0, client: str = "",
                 io_timeout: float | None = None) -> None:
        self.path = Path(path)
        self.client = client or f"pid {os.getpid()}"
        self.bytes_mapped = 0
        self.mode = ""
        self.io_timeout = io_timeout_default() if io_timeout is None else io_timeout
        self._lock = threading.Lock()
        self._sock = _connect(self.path, timeout, self.io_timeout)
        self._watching = False
        self._slabs_alive: list[None] = []  # one entry per mapped slab still referenced
        self._unread = 0  # replies to notify() not read yet; read before the next request
        self._received: tuple[Any, ...] = ()  # the last handoff's manifest and its reply

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Send one request and return the reply (an error reply raises)."""
        with self._lock:
            self._send(message)
            reply, fds = self._recv()
        return self.checked(reply, fds)

    def exchange(self, messages: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
        """Send every request at once, then read every reply in order: one round trip. Error
        replies come back as they are, for the caller to `checked()` in its own order."""
        with self._lock:
            for message in messages:
                self._send(message)
            replies: list[tuple[dict[str, Any], list[int]]] = []
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
        """Send one frame, after reading the replies still owed to notify() (lock held)."""
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

    def _recv(self) -> tuple[dict[str, Any], list[int]]:
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

    def checked(self, reply: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """The reply if it is ok; else its fds are closed and its error raised (a mismatch as
        FingerprintMismatchError, a busy cache as CacheUnavailableError)."""
        if reply.get("ok") is True:
            return reply, fds
        wire.close_fds(fds)
        if reply.get("error") == "busy":  # at its connection bound: like no cache at all
            raise CacheUnavailableError(f"cache at {self.path}: {reply.get('message')}")
        if reply.get("error") == "mismatch":
            raise FingerprintMismatchError([tuple(m) for m in reply.get("mismatch", [])])
        raise CacheBrokenError(f"cache at {self.path} answered {reply.get('error')}: "
                               f"{reply.get('message')}")

    def hello(self, fingerprint: fp.Fingerprint) -> fp.Fingerprint:
        """Check our fingerprint against the cache's; a mismatch raises with every field."""
        reply, _ = self.request(self.hello_request(fingerprint))
        return reply["fingerprint"]

    def hello_request(self, fingerprint: fp.Fingerprint) -> dict[str, Any]:
        """The `hello` frame for our fingerprint (an engine layout's adds its key)."""
        return {"op": "hello", "fingerprint": fingerprint, "client": self.client,
                "pid": os.getpid()}

    def manifest(self) -> Manifest:
        """The validated manifest of the rank (its columns form: checked in bulk)."""
        reply = self.request(MANIFEST)[0]
        return columns.from_wire(reply["manifest"], reply.get("tail"))

    def map(self, manifest: Manifest, *, mode: str = "share", device: str = "cpu",
            layout: str = "") -> dict[str, torch.Tensor]:
        """Map the slabs (share) or copy them into our own memory (copy, copy-release);
        `layout`: an engine layout's key (docs/engine-layout.md), else the raw layout."""
        reply, fds = self.request({"op": "open", "mode": mode,
                                   **({"layout": layout} if layout else {})})
        return self.map_reply(reply, fds, manifest, mode=mode, device=device)

    def map_reply(self, reply: dict[str, Any], fds: list[int], manifest: Manifest, *,
                  mode: str, device: str) -> dict[str, torch.Tensor]:
        """`map()` from an `open` reply already received (and checked): its fds are closed."""
        copying, handed_over = _copying(reply, mode), _handed_over(reply, mode)
        copies: list[torch.Tensor] | None = [] if mode != "share" and not (
            copying or handed_over) else None
        try:
            pieces = _slab_pieces(reply.get("pieces"), manifest.slab_sizes) if copying else None
        except CacheBrokenError:
            wire.close_fds(fds)
            raise
        slabs = import_slabs(fds, manifest.slab_sizes, device, copies, readonly=not copying,
                             pieces=pieces, handed_over=handed_over)
        if copying:
            self.request({"op": "copied"})  # the cache's copy into them is done
        elif copies is not None:
            release_after_copies(slabs, device)
            slabs = copies  # one device copy per slab
        tensors = columns.views(manifest, slabs)
        with self._lock:
            self._mapped(manifest, mode, slabs)
        return tensors

    def handoff(self, fingerprint: Callable[[], fp.Fingerprint], *, mode: str = "share",
                device: str = "cpu") -> dict[str, torch.Tensor]:
        """open + manifest + hello + map (or copy) in one round trip: the engine's fast path.

        The three requests go out at once, open first: its reply carries the slab fds and
        sizes, so the slabs are mapped (and in the copy modes their copies launched) before
        the manifest's reply is even read. In share mode `fingerprint()` is computed while
        the cache answers; in the copy modes, while the copies run. The manifest must agree
        with the sizes the slabs were mapped at, and the hello's reply is read last (then,
        where a GPU rank is making our copy, the reply to `copied`). Nothing is returned
        unless the hello succeeded: on an error (a mismatch first, as hello() reports it) the
        mappings and copies are dropped before it is raised.
        """
        with self._lock:
            TRACE.clear()
            TRACE["start"] = time.perf_counter()
            self._send({"op": "open", "mode": mode})
            self._send(MANIFEST)
            owed = 2  # replies not read yet; on an error, a later request reads them
            hello_sent = False
            try:
                if mode == "share":
                    self._send(self.hello_request(fingerprint()))
                    owed, hello_sent = owed + 1, True
                TRACE["asked"] = time.perf_counter()
                _while_the_cache_answers(mode, device)
                orep, ofds = self._recv()
                owed -= 1
                sizes: tuple[int, ...] = ()
                pieces: list[tuple[int, ...]] | None = None
                bad_open: CacheBrokenError | None = None
                if orep.get("ok") is True:
                    try:
                        sizes = _slab_sizes(orep.get("sizes"))
                        pieces = _slab_pieces(orep.get("pieces"), sizes)
                    except CacheBrokenError as exc:  # e.g. a cache of another version
                        bad_open = exc
                if orep.get("ok") is not True or bad_open:
                    wire.close_fds(ofds)
                copying = _copying(orep, mode) and not bad_open  # the cache copies for us
                handed_over = _handed_over(orep, mode) and not bad_open  # no copy at all
                TRACE["replies"] = time.perf_counter()
                mapped: list[torch.Tensor] = []
                copies: list[torch.Tensor] = []
                tensors: dict[str, torch.Tensor] = {}
                # we copy the slabs into memory we own
                own = mode != "share" and not (copying or handed_over)
                try:
                    if orep.get("ok") is True and not bad_open:
                        # our copies start as each slab is mapped
                        mapped.extend(import_slabs(ofds, sizes, device, copies if own else None,
                                                   readonly=not copying,
                                                   pieces=pieces if copying else None,
                                                   handed_over=handed_over))
                    TRACE["imported"] = time.perf_counter()
                    mrep, mfds = self._recv()
                    owed -= 1
                    if not hello_sent:
                        self._send(self.hello_request(fingerprint()))
                        owed, hello_sent = owed + 1, True
                    if copying:  # answered when the cache's copy into our slabs is done: last
                        self._send({"op": "copied"})
                        owed += 1
                    if mrep.get("ok") is not True or orep.get("ok") is not True or mfds or \
                            bad_open:
                        wire.close_fds(mfds)
                        reply = self._recv()
                        owed -= 1
                        self.checked(*reply)  # the hello's error comes first
                        self.checked(orep, [])
                        self.checked(mrep, [])
                        if bad_open:
                            raise bad_open
                        raise CacheBrokenError(f"cache at {self.path} sent fds with its "
                                               "manifest")
                    manifest = columns.from_wire(mrep["manifest"], mrep.get("tail"))
                    if manifest.slab_sizes != sizes:
                        raise CacheBrokenError(
                            f"cache at {self.path} sent slabs of {list(sizes)[:8]} bytes for a "
                            f"manifest of {list(manifest.slab_sizes)[:8]}")
                    # the views first: the replies below may still be on their way (the
                    # cache's copy into our slabs, when it makes one)
                    tensors = columns.views(manifest, copies if own else mapped)
                    TRACE["viewed"] = time.perf_counter()
                    reply = self._recv()
                    owed -= 1
                    self.checked(*reply)  # the hello's error comes first
                    if copying:
                        _spin_until_readable(self._sock, SPIN_FOR_COPY)
                        reply = self._recv()
                        owed -= 1
                        self.checked(*reply)  # the cache's copy into our slabs is done
                    TRACE["hello"] = time.perf_counter()
                except BaseException:
                    tensors.clear()
                    copies.clear()
                    mapped.clear()
                    raise
            except BaseException:
                self._unread += owed
                raise
            held = list(mapped) if mode == "share" else []
            TRACE["copied"] = time.perf_counter()
            if own:
                release_after_copies(mapped, device)
            else:  # our views hold the mappings: the cache's slabs, or our copy of them
                mapped.clear()
            self._mapped(manifest, mode, held)
            # freed with the client (the weights hold it), not on the engine's start path:
            # the records and their reply took 0.12 ms of a 318-tensor handoff to free here
            self._received = (manifest, mrep)
            TRACE["done"] = time.perf_counter()
        return tensors

    def _mapped(self, manifest: Manifest, mode: str, slabs: list[torch.Tensor]) -> None:
        """Share: tell the cache what we hold, without a round trip (a lease, which ends once
        `slabs` are unused). Copy-release: have the cache drop its copy, and wait for that.
        Copy: nothing to say (the open named the mode, and we hold nothing of the cache's);
        a report would cost a send that wakes the rank, on the handoff's path (lock held)."""
        self.mode, self.bytes_mapped = mode, manifest.nbytes if mode == "share" else 0
        if mode == "copy-release":
            self._send({"op": "drop"})
            self.checked(*self._recv())
        elif mode == "share":
            self._send({"op": "mapped", "mode": mode, "bytes": self.bytes_mapped})
            self._unread += 1
            self._hold(slabs)
            self.watch()

    def _hold(self, slabs: list[torch.Tensor]) -> None:
        """End the lease when the last tensor over these slabs is gone (any view keeps it)."""
        self._slabs_alive = [None] * len(slabs)
        for slab in slabs:
            # A storage's Python object lives exactly as long as its memory (torch keeps it
            # alive while any tensor uses the storage), so this fires when the mapping goes.
            weakref.finalize(slab.untyped_storage(), self._slab_gone)

    def _slab_gone(self) -> None:
        """A mapped slab was freed; after the last one, the lease ends (GC may call this)."""
        with contextlib.suppress(IndexError):
            self._slabs_alive.pop()  # atomic under the GIL: no lock a finalizer could block on
        if not self._slabs_alive:
            log.debug("lease on %s ended: the engine dropped its tensors", self.path)
            self.close()

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
        reply, _ = self.checked(reply, fds)
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
        """Warn once when the cache process goes away (one watcher thread serves every lease)."""
        if not self._watching and self._sock.fileno() >= 0:
            self._watching = True
            _WATCHER.add(self)

    def went_away(self) -> None:
        """Called by the watcher when the cache closed this lease's connection."""
        log.warning("the vlaunch cache at %s went away; the %d bytes already mapped stay valid "
                    "and the engine keeps serving", self.path, self.bytes_mapped)

    def close(self) -> None:
        """End the lease (mapped tensors stay valid: the mappings hold the memory)."""
        if self._watching:
            self._watching = False
            _WATCHER.remove(self)
        self._sock.close()


class _Watcher:
    """One daemon thread that polls every lease's connection for the cache hanging up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[int, CacheClient] = {}  # fd -> client
        self._wake_r, self._wake_w = -1, -1
        self._thread = False

    def add(self, client: CacheClient) -> None:
        """Watch `client`'s connection until it is removed or hangs up."""
        with self._lock:
            self._clients[client._sock.fileno()] = client
            self._start()
        self._wake()

    def remove(self, client: CacheClient) -> None:
        """Stop watching (before the socket closes, so its fd number is never misread)."""
        with self._lock:
            fd = next((f for f, c in self._clients.items() if c is client), None)
            if fd is not None:
                del self._clients[fd]
        if fd is not None:
            self._wake()

    def count(self) -> int:
        """Leases being watched."""
        return len(self._clients)

    def start(self) -> None:
        """Start the thread now, if it is not running (`add` starts it otherwise)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        """Start the thread once per process (lock held)."""
        if self._thread:
            return
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = True
        # _thread, not threading: Thread.start() waits until the new thread has run, which
        # costs a scheduler wake-up (a quarter of a millisecond) inside the first handoff.
        _thread.start_new_thread(self._run, (self._wake_r,))

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self, wake: int) -> None:
        hangup = select.POLLRDHUP | select.POLLHUP
        while True:
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            with self._lock:
                watched = dict(self._clients)
            for fd in watched:
                poller.register(fd, hangup)
            for fd, event in poller.poll():
                if fd == wake:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake, 4096)
                elif event & (hangup | select.POLLERR | select.POLLNVAL):
                    self._hung_up(fd, watched[fd], warn=not event & select.POLLNVAL)

    def _hung_up(self, fd: int, client: CacheClient, *, warn: bool) -> None:
        with self._lock:
            if self._clients.get(fd) is not client:
                return  # removed (and maybe closed) while we polled
            del self._clients[fd]
        if warn and client._sock.fileno() >= 0:
            client.went_away()

    def after_fork(self) -> None:
        """A forked child has no watcher thread and no leases of its own."""
        self._lock = threading.Lock()
        self._clients.clear()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r, self._wake_w, self._thread = -1, -1, False


_WATCHER = _Watcher()
os.register_at_fork(after_in_child=_WATCHER.after_fork)


def _while_the_cache_answers(mode: str, device: str) -> None:
    """What a handoff needs later and can do before the cache's replies arrive, in time it
    would otherwise spend waiting for them: the slab backend (on a GPU, the driver library
    and the device's allocation properties), the dtype table the manifest's parse reads and,
    for a share lease, the watcher thread."""
    from vlaunch.cache.store import dtypes  # noqa: F401

    backend_for(device)
    if mode == "share":
        _WATCHER.start()


def io_timeout_default() -> float:
    """$VLAUNCH_IO_TIMEOUT (seconds), else IO_TIMEOUT."""
    raw = os.environ.get("VLAUNCH_IO_TIMEOUT", "")
    try:
        value = float(raw) if raw else IO_TIMEOUT
    except ValueError:
        value = IO_TIMEOUT
    return value if value > 0 else IO_TIMEOUT


def release_after_copies(mapped: list[torch.Tensor], device: str) -> None:
    """Drop the slab mappings once the copies queued on this stream are done: the copies are
    waited for here, the unmapping (a driver call per slab, milliseconds for a large shard,
    after a device synchronisation) runs on a thread the engine does not wait for."""
    if not mapped or not device.startswith("cuda"):
        mapped.clear()
        return
    import torch

    torch.cuda.current_stream(device).synchronize()
    held = list(mapped)
    mapped.clear()
    threading.Thread(target=held.clear, name="vlaunch-unmap", daemon=True).start()


def _slab_sizes(sizes: Any) -> tuple[int, ...]:
    """The slab sizes of an open reply, checked (the manifest must agree before any view)."""
    try:
        if not isinstance(sizes, list) or len(sizes) > 4096:
            raise ValueError("no list of at most 4096 slab sizes")
        return tuple(checked_int(s, "slab size") for s in sizes)
    except (TypeError, ValueError) as exc:
        raise CacheBrokenError(f"invalid open reply from cache: {exc}") from exc


def _slab_pieces(pieces: Any, sizes: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """The pieces of an open reply (per slab, the sizes of the allocations it is made of, an
    fd each), checked; None where each slab is one fd."""
    if pieces is None:
        return None
    try:
        if not isinstance(pieces, list) or len(pieces) != len(sizes):
            raise ValueError("no list of pieces per slab")
        out = [tuple(checked_int(k, "piece size") for k in cut) for cut in pieces
               if isinstance(cut, list)]
        if len(out) != len(sizes) or sum(map(len, out)) > MAX_FDS or not all(
                cut and min(cut) > 0 and sum(cut) >= n for cut, n in zip(out, sizes, strict=True)):
            raise ValueError("pieces that do not cover their slabs")
        return out
    except (TypeError, ValueError) as exc:
        raise CacheBrokenError(f"invalid open reply from cache: {exc}") from exc


def _copying(reply: dict[str, Any], mode: str) -> bool:
    """Whether an open reply's fds are of our own copy, which the cache is still making (a GPU
    rank copies for the copy modes: rank/copies.py); `copied` is then answered when done."""
    return reply.get("ok") is True and reply.get("copying") is True and mode != "share"


def _handed_over(reply: dict[str, Any], mode: str) -> bool:
    """Whether an open reply's fds are the rank's own slabs, handed over for us to map as our
    own (copy-release when nobody else maps them; the rank then serves nothing)."""
    return reply.get("ok") is True and reply.get("handover") is True and \
        mode == "copy-release" and reply.get("copying") is not True


def _spin_until_readable(sock: socket.socket, seconds: float) -> None:
    """Poll `sock` without sleeping until it is readable, for at most `seconds`.

    For the one reply a copy-mode handoff waits milliseconds for (the rank's copy of a 17.4
    GB shard: 8-9 ms on an H200): a thread asleep in recv() was woken up to a few tenths of a
    millisecond late. The engine burns one core for as long as the copy runs, once per start,
    as CUDA's own spin-wait does; past `seconds` it sleeps in recv() as for any reply."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP)
    deadline = time.perf_counter() + seconds
    while not poller.poll(0) and time.perf_counter() < deadline:
        pass


def import_slabs(fds: list[int], sizes: tuple[int, ...], device: str,
                 copies: list[torch.Tensor] | None = None, *,
                 readonly: bool = True, pieces: list[tuple[int, ...]] | None = None,
                 handed_over: bool = False) -> list[torch.Tensor]:
    """Map each slab fd (read-only unless the slabs are our own copy); closes every fd. A slab
    made of `pieces` (a rank's copy for us) comes as an fd per piece, mapped into one range.
    Slabs `handed_over` (copy-release, nobody else mapping them) are mapped as our own.
    With `copies`, also copy each slab into memory of our own (appended to `copies` in order):
    every slab is mapped first, then each destination allocated, then one copy per slab
    queued on the current stream.

    In that order, not overlapped: on an H200 the import and the allocation of a 16 GiB
    shard took 1.65 ms one after the other and 2.3-2.6 ms on two threads (the driver
    serialises them); mapping a slab while earlier copies ran stalled on them.
    """
    try:
        if len(fds) != (sum(map(len, pieces)) if pieces else len(sizes)):
            raise CacheBrokenError(f"cache sent {len(fds)} fds for {len(sizes)} slabs")
        backend = backend_for(device)
        if handed_over:
            mapped = [backend.import_handed_over(fd, size)
                      for fd, size in zip(fds, sizes, strict=True)]
        elif pieces is None:
            mapped = [backend.import_fd(fd, size, readonly=readonly)
                      for fd, size in zip(fds, sizes, strict=True)]
        else:
            mapped, at = [], 0
            for size, cut in zip(sizes, pieces, strict=True):
                mapped.append(backend.import_pieces(fds[at:at + len(cut)], cut, size,
                                                    readonly=readonly))
                at += len(cut)
        if copies is not None:
            from vlaunch.cache.store.slabs import empty_for_copy

            copies.extend(empty_for_copy(n, device) for n in sizes)
            for destination, slab in zip(copies, mapped, strict=True):
                destination.copy_(slab, non_blocking=True)
        return mapped
    finally:
        wire.close_fds(fds)


def _connect(path: Path, timeout: float, io_timeout: float = IO_TIMEOUT) -> socket.socket:
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
