"""The engine's client of a cache rank: check the fingerprint, map or copy the slabs.

`CacheClient` is a protocol connection (contract/connection.py) with the engine's requests on
it: the handoff (open + manifest + hello in one round trip), the engine-layout calls' `map`,
artifacts, and the share-mode lease the connection stands for (leases.py); mapping.py turns
the slab fds into tensors.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlaunch.cache.client import requests
from vlaunch.cache.client.leases import WATCHER, Lease
from vlaunch.cache.client.mapping import (
    Opened,
    import_slabs,
    release_after_copies,
    spin_until_readable,
)
from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.connection import Connection, Reply
from vlaunch.cache.contract.errors import CacheBrokenError
from vlaunch.cache.store import columns
from vlaunch.cache.store.manifest import Manifest

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from vlaunch.cache.store.artifacts import Held

log = logging.getLogger("vlaunch.cache.client.connection")

SPIN_FOR_COPY = 0.1
"""Seconds an engine polls for the reply that its copy is done before it sleeps on it: more
than a GPU rank's copy of the largest shard takes."""


def _untraced(step: str) -> None:
    """No trace installed: nothing recorded."""


trace: Callable[[str], None] = _untraced
"""Called as each step of a handoff ends: start, asked (every request sent: in share mode, the
fingerprint computed), replies, imported, viewed, hello, copied, done; then load()'s handed,
collector, weights and closed. A benchmark installs a recorder (`install_trace`)."""


def install_trace(callback: Callable[[str], None] | None) -> None:
    """Call `callback(step)` at each step of the handoffs from now on; None: stop tracing."""
    global trace
    trace = callback or _untraced


class CacheClient(Connection):
    """One connection to a cache rank; while it is open in share mode, the engine holds a
    lease on what it mapped."""

    def __init__(self, path: Path | str, *, timeout: float = 0.0, client: str = "",
                 io_timeout: float | None = None) -> None:
        super().__init__(path, timeout=timeout, client=client, io_timeout=io_timeout)
        self.bytes_mapped = 0
        self.mode = ""
        self._watching = False
        self._lease: Lease | None = None
        self._owed = 0  # replies to the running handoff's requests not read yet
        self._received: tuple[Any, ...] = ()  # the last handoff's manifest and its reply

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
        return requests.manifest(self)

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
        try:
            opened = Opened.of(reply, mode, manifest.slab_sizes)
        except CacheBrokenError:
            wire.close_fds(fds)
            raise
        copies: list[torch.Tensor] | None = [] if _own(mode, opened) else None
        slabs = import_slabs(fds, opened, device, copies)
        if opened.copying:
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
        with self._lock, self._owing():
            trace("start")
            self._ask({"op": "open", "mode": mode})
            self._ask(requests.MANIFEST)
            if mode == "share":
                self._ask(self.hello_request(fingerprint()))
            trace("asked")
            _while_the_cache_answers(mode, device)
            orep, ofds = self._answer()
            opened, broken = _opened(orep, ofds, mode)
            trace("replies")
            own = _own(mode, opened)
            mapped: list[torch.Tensor] = []
            copies: list[torch.Tensor] = []
            tensors: dict[str, torch.Tensor] = {}
            try:
                if opened is not None:  # our copies start as each slab is mapped
                    mapped = import_slabs(ofds, opened, device, copies if own else None)
                trace("imported")
                mrep, mfds = self._answer()
                if mode != "share":
                    self._ask(self.hello_request(fingerprint()))
                if opened is not None and opened.copying:  # answered when our copy is done
                    self._ask({"op": "copied"})
                if opened is None or mrep.get("ok") is not True or mfds:
                    wire.close_fds(mfds)
                    self._refused(orep, mrep, broken)
                manifest = columns.from_wire(mrep["manifest"], mrep.get("tail"))
                if manifest.slab_sizes != opened.sizes:
                    raise CacheBrokenError(
                        f"cache at {self.path} sent slabs of {list(opened.sizes)[:8]} bytes "
                        f"for a manifest of {list(manifest.slab_sizes)[:8]}")
                # the views first: the replies below may still be on their way (the
                # cache's copy into our slabs, when it makes one)
                tensors = columns.views(manifest, copies if own else mapped)
                trace("viewed")
                self.checked(*self._answer())  # the hello
                if opened.copying:
                    spin_until_readable(self._sock, SPIN_FOR_COPY)
                    self.checked(*self._answer())  # the cache's copy into our slabs is done
                trace("hello")
            except BaseException:
                tensors.clear()
                copies.clear()
                mapped.clear()
                raise
            held = list(mapped) if mode == "share" else []
            trace("copied")
            if own:
                release_after_copies(mapped, device)
            else:  # our views hold the mappings: the cache's slabs, or our copy of them
                mapped.clear()
            self._mapped(manifest, mode, held)
            # freed with the client (the weights hold it), not on the engine's start path
            self._received = (manifest, mrep)
            trace("done")
        return tensors

    def _ask(self, message: dict[str, Any]) -> None:
        """Send a request of the running handoff (lock held)."""
        self._send(message)
        self._owed += 1

    def _answer(self) -> Reply:
        """Read the next reply of the running handoff (lock held)."""
        reply = self._recv()
        self._owed -= 1
        return reply

    @contextlib.contextmanager
    def _owing(self) -> Iterator[None]:
        """A handoff that fails leaves its unread replies for the next request to drop."""
        try:
            yield
        except BaseException:
            self._unread += self._owed
            raise
        finally:
            self._owed = 0

    def _refused(self, orep: dict[str, Any], mrep: dict[str, Any],
                 broken: CacheBrokenError | None) -> None:
        """Raise why a handoff cannot go on: the hello's error first, as hello() would."""
        self.checked(*self._answer())
        self.checked(orep, [])
        self.checked(mrep, [])
        if broken:
            raise broken
        raise CacheBrokenError(f"cache at {self.path} sent fds with its manifest")

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
            self._lease = Lease(slabs, self._lease_ended)
            self.watch()

    def _lease_ended(self) -> None:
        """The engine dropped the last tensor over our mappings (GC may call this)."""
        log.debug("lease on %s ended: the engine dropped its tensors", self.path)
        self.close()

    def artifact_get(self, kind: str, key: str) -> bytes | None:
        """An artifact's bytes, or None when the cache does not hold it."""
        return requests.artifact_get(self, kind, key)

    def artifact_put(self, kind: str, key: str, data: bytes) -> None:
        """Hand an artifact to the cache (checked here first: name and size)."""
        requests.artifact_put(self, kind, key, data)

    def artifact_list(self) -> list[Held]:
        """(kind, key, size) of every artifact the cache holds."""
        return requests.artifact_list(self)

    def watch(self) -> None:
        """Warn once when the cache process goes away (one watcher thread serves every lease)."""
        if not self._watching and self.fileno() >= 0:
            self._watching = True
            WATCHER.add(self)

    def went_away(self) -> None:
        """Called by the watcher when the cache closed this lease's connection."""
        log.warning("the vlaunch cache at %s went away; the %d bytes already mapped stay valid "
                    "and the engine keeps serving", self.path, self.bytes_mapped)

    def close(self) -> None:
        """End the lease (mapped tensors stay valid: the mappings hold the memory)."""
        if self._watching:
            self._watching = False
            WATCHER.remove(self)
        super().close()


def _opened(reply: dict[str, Any], fds: list[int], mode: str
            ) -> tuple[Opened | None, CacheBrokenError | None]:
    """How to take an `open` reply's fds; None (its fds closed) when it is an error or
    malformed, and then the CacheBrokenError that a malformed one is."""
    if reply.get("ok") is not True:
        wire.close_fds(fds)
        return None, None
    try:
        return Opened.of(reply, mode), None
    except CacheBrokenError as exc:  # e.g. a cache of another version
        wire.close_fds(fds)
        return None, exc


def _own(mode: str, opened: Opened | None) -> bool:
    """Whether the engine copies the slabs into memory of its own (the copy modes, unless the
    rank makes our copy or hands its slabs over)."""
    return mode != "share" and not (opened is not None and (opened.copying or
                                                            opened.handed_over))


def _while_the_cache_answers(mode: str, device: str) -> None:
    """What a handoff needs later and can do before the cache's replies arrive, in time it
    would otherwise spend waiting for them: the slab backend (on a GPU, the driver library
    and the device's allocation properties), the dtype table the manifest's parse reads and,
    for a share lease, the watcher thread."""
    from vlaunch.cache.store import dtypes  # noqa: F401
    from vlaunch.cache.store.slabs import backend_for

    backend_for(device)
    if mode == "share":
        WATCHER.start()
