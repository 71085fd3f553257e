"""The per-rank cache server: holds a rank's slabs and hands them out as file descriptors.

It serves many clients at once on one Unix socket (asyncio on uvloop). Each connection is a
lease: the cache knows who mapped what, and a client notices when the cache goes away. A
client that stalls or sends garbage loses its own connection and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import engine_layout as el
from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import peers, protocol, wire
from vlaunch.cache.contract.errors import (
    ArtifactError,
    CacheBrokenError,
    DeviceError,
    ProtocolError,
)
from vlaunch.cache.contract.sockdir import check_peer
from vlaunch.cache.rank.connections import Connections, connection_bound, starved_after
from vlaunch.cache.rank.layouts import LayoutError, LayoutStore
from vlaunch.cache.rank.leases import Lease
from vlaunch.cache.rank.openers import Openers
from vlaunch.cache.store import artifacts as art
from vlaunch.cache.store.artifacts import ArtifactStore

if TYPE_CHECKING:
    from vlaunch.cache.rank.copies import Copier, Copy
    from vlaunch.cache.rank.parts import (
        IntegrityHost,
        IntegrityPart,
        SwapHost,
        SwapPart,
    )
    from vlaunch.cache.rank.served import Served
    from vlaunch.cache.rank.swapstate import ServedShard

log = logging.getLogger("vlaunch.cache")
FRAME_TIMEOUT = 10.0
MAX_HELLOS_TOLD = 256
"""Client pids whose last hello answer the rank remembers (it tells the launcher only news)."""


_COPIED = protocol.encode({"ok": True})  # the reply to `copied`, which a thread may send


class CacheServer:
    """Serves one rank's manifest and slab fds on a Unix socket.

    Built once with its parts (rank/parts.py): `integrity` and `swap` are factories, called
    here with the server as the host each part needs, once every field they read is set."""

    def __init__(self, rank: int, served: Served, *, device: str,
                 allowed_uids: frozenset[int] | None = None,
                 artifacts: ArtifactStore | None = None, layouts: LayoutStore | None = None,
                 copier: Copier | None = None, openers: Openers | None = None,
                 integrity: Callable[[IntegrityHost], IntegrityPart] | None = None,
                 swap: Callable[[SwapHost], SwapPart] | None = None) -> None:
        manifest, fds = served.manifest, served.fds
        self.rank, self.fingerprint, self.manifest = rank, served.fingerprint, manifest
        self.fds, self.device = fds, device
        self.allowed_uids = allowed_uids
        self.artifacts = artifacts if artifacts is not None else ArtifactStore()
        self.state = "serving"
        self._handed_to: int | None = None  # the lease the raw slabs went to (copy-release)
        self.raw_readers = 0  # reads of the raw slabs in flight: seed streams, digests
        # the processes that opened the raw layout
        self.openers = openers if openers is not None else Openers(rank)
        self._hellos_told: dict[int, tuple[bool, str]] = {}  # pid -> its last hello's answer
        self.leases: dict[int, Lease] = {}
        self.started = time.time()
        self._release = served.release
        # engine-shaped layouts (docs/engine-layout.md) and the raw layout's state
        self.layouts = layouts if layouts is not None else LayoutStore(None, manifest.nbytes)
        self.raw_released = served.raw_released
        self.copier = copier  # rank.copies.RankCopier on a GPU: the rank makes engines' copies
        self._copies: dict[int, Copy] = {}  # id(lease) -> its copy in flight
        self.escrow: socket.socket | None = None  # the launcher's ready channel, kept open
        self._next = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.bound = asyncio.Event()  # set once the socket is bound and listening
        self.connections = Connections(rank, connection_bound(os.environ, len(fds)),
                                       starved_after(os.environ))
        self.swap: SwapPart | None = None  # what the integrity may call reads it while built
        # the files, their watch and the digests; then swaps and versions trainers publish
        self.integrity = integrity(self) if integrity is not None else None
        self.swap = swap(self) if swap is not None else None

    async def serve(self, path: Path, stop: asyncio.Event) -> None:
        """Bind `path` (mode 0600), accept clients until `stop` is set, then clean up."""
        loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(path))
        except OSError as exc:
            listener.close()
            raise socket_path_taken(path, exc.strerror or str(exc)) from None
        finally:
            os.umask(old)
        listener.listen(128)
        listener.setblocking(False)
        self.bound.set()
        accept = asyncio.ensure_future(self.connections.accept_loop(
            loop, listener, self.leases, lambda conn: self._start_client(loop, conn)))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({accept, stopped}, return_when=asyncio.FIRST_COMPLETED)
        # Read the accept loop's failure before cancelling it: a cancel only requests, so
        # asking a task that is still running for its exception raises InvalidStateError.
        failure = accept.exception() if accept.done() and not accept.cancelled() else None
        accept.cancel()
        stopped.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(accept, stopped, *self._tasks, return_exceptions=True)
        listener.close()
        if failure is not None:
            raise failure  # e.g. RankStarvedError

    def _start_client(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        task = asyncio.ensure_future(self._client(loop, conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _client(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        cid = self._next = self._next + 1
        self.connections.add(cid, conn)
        try:
            try:
                pid = check_peer(conn, self.allowed_uids)
            except ProtocolError as exc:
                log.warning("rank %d: %s", self.rank, exc)
                await wire.write_frame(loop, conn, protocol.error("forbidden", str(exc)))
                return
            self.leases[cid] = Lease(pid, conn)
            while True:
                op, fields = await wire.read_request(loop, conn, frame_timeout=FRAME_TIMEOUT)
                self.connections.touch(cid)
                if op.startswith("seed_"):
                    raise ProtocolError(f"{op} is only served on the seeding TCP port")
                result = self._dispatch(cid, op, fields)
                reply, fds = await result if asyncio.iscoroutine(result) else result
                if op == "hello":
                    self._tell_hello(self.leases[cid], reply, bool(fields.get("layout")))
                # a client that stops reading its replies loses its connection, not a task
                await wire.write_frame(loop, conn, reply, fds, timeout=FRAME_TIMEOUT)
        except (EOFError, ConnectionError, asyncio.CancelledError):
            pass
        except (ProtocolError, TimeoutError, asyncio.TimeoutError) as exc:
            reason = str(exc) or "stalled in the middle of a frame"
            log.warning("rank %d: dropping client %s: %s", self.rank, self._who(cid), reason)
            with contextlib.suppress(Exception):
                await wire.write_frame(loop, conn, protocol.error("protocol", reason),
                                       timeout=1.0)
        finally:
            lease = self.leases.pop(cid, None)
            copy = self._copies.pop(id(lease), None) if lease else None
            if copy is not None:  # an engine that left in the middle of its copy-mode handoff
                copy.close()
            if lease is not None and self._handed_to == id(lease):  # left before its drop
                self._handed_to = None
                log.info("rank %d: %s left before taking the slabs handed over; serving "
                         "them again", self.rank, lease.who)
            self.connections.remove(cid)
            conn.close()

    def _who(self, cid: int) -> str:
        lease = self.leases.get(cid)
        return lease.who if lease else f"#{cid}"

    def _dispatch(self, cid: int, op: str,
                  f: dict[str, Any]) -> tuple[dict[str, Any] | bytes, list[int]]:
        if self.state == "swapping" and (op in ("hello", "manifest", "open")
                                         or op.startswith("layout")):
            return protocol.error("busy", "the cache is copying new weights into its slabs (a "
                                  "swap in place); try again in a moment"), []
        if op.startswith("publish"):
            if self.swap is None:
                return protocol.error("refused", "this rank takes no published weights"), []
            return self.swap.publisher.request(op, self.leases[cid], f)
        if self.state == "released" and op in ("hello", "manifest", "open"):
            return protocol.error("released", "the cache released its copy after a copy-release "
                                  "handoff; restart the cache to serve again"), []
        if f.get("layout"):
            return self._layout_request(op, self.leases[cid], f)
        if self.raw_released and op in ("hello", "manifest", "open"):
            changed = self.integrity is not None and bool(self.integrity.changed)
            return protocol.error("changed" if changed else "released",
                                  self._raw_released_message()), []
        return getattr(self, f"handle_{op}")(self.leases[cid], f)

    def _raw_released_message(self) -> str:
        """Why a raw hello, manifest or open is refused once an engine layout replaced the raw
        layout, naming the likely cause (the files changed) and the way forward."""
        changed = self.integrity.changed if self.integrity is not None else []
        if changed:
            return (f"the checkpoint changed on disk since this cache loaded it "
                    f"({', '.join(changed[:3])}), and the cache holds only an engine layout "
                    "of the old weights (its raw layout was released when that layout was "
                    "handed back); serve the new checkpoint without a cold start with "
                    "vlaunch swap --model PATH, or restart the cache")
        return ("the raw layout was released once an engine layout was handed back; start the "
                "engine with that layout's fields, serve other weights with vlaunch swap "
                "--model PATH, or restart the cache")

    def handle_hello(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """hello: compare the client's fingerprint with ours."""
        lease.client = f.get("client", "")
        diff = fp.compare(self.fingerprint, f["fingerprint"])
        if diff:
            return protocol.error("mismatch", "fingerprint mismatch",
                                  mismatch=[list(d) for d in diff]), []
        return {"ok": True, "fingerprint": self.fingerprint, "rank": self.rank}, []

    @functools.cached_property
    def manifest_frame(self) -> bytes:
        """The reply to `manifest`, encoded once (the manifest never changes): every handoff
        waits for it."""
        return protocol.encode({"ok": True, "manifest": self.manifest.to_wire()})

    @functools.cached_property
    def manifest_columns_frame(self) -> bytes:
        """The reply to `manifest` in the columns form (store/columns.py), encoded once."""
        from vlaunch.cache.store import columns

        head, tail = columns.encode(self.manifest)
        return protocol.encode({"ok": True, "manifest": head}, tail=tail)

    def handle_manifest(self, lease: Lease, f: dict[str, Any]) -> tuple[bytes, list[int]]:
        """manifest: every tensor's place in the slabs, in rows or (asked) in columns."""
        if f.get("form") == "columns":
            return self.manifest_columns_frame, []
        return self.manifest_frame, []

    def handle_open(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """open: send the slab fds (SCM_RIGHTS) and their sizes, which the client maps them at
        before it has read the manifest. In a copy mode on a GPU, the fds are of the engine's
        own copy, which the rank has started making ("copying": ask `copied` before use); a
        slab of it may be several allocations ("pieces": per slab, their sizes, an fd each,
        mapped one after another into one range)."""
        lease.mode = f["mode"]
        sizes = list(self.manifest.slab_sizes)
        old = self._copies.pop(id(lease), None)  # an earlier open's copy, never asked for
        if old is not None:
            old.close()
        if self._handed_to not in (None, id(lease)):
            return protocol.error("busy", "the cache is handing its slabs over to a "
                                  "copy-release engine; it serves nothing once that engine has "
                                  "them"), []
        if f["mode"] == "copy-release":
            why = self._why_not_hand_over(lease)
            if not why:
                return self._hand_over(lease, sizes)
            log.info("rank %d: copy-release by %s: a copy, not the slabs themselves: %s",
                     self.rank, lease.who, why)
        # a share engine may keep its tensors past its lease: followed until it exits. A copy
        # mode's drops its mapping of the slabs (or, on a GPU, gets only its copy) before its
        # connection ends, so its lease, not its process, is what holds them
        if f["mode"] == "share":
            if self.openers.note(lease.conn, lease.pid):
                self.tell_openers()
            else:  # /proc: off the reply's path
                asyncio.get_running_loop().call_soon(self._note_by_pid, lease.pid)
        copy = self.copier.start(f"rank {self.rank}: {lease.who}") \
            if self.copier and f["mode"] != "share" else None
        if copy is None:
            return {"ok": True, "slabs": len(self.fds), "sizes": sizes}, list(self.fds)
        self._copies[id(lease)] = copy
        reply = {"ok": True, "slabs": len(sizes), "sizes": sizes, "copying": True}
        if copy.pieces and any(len(cut) > 1 for cut in copy.pieces):
            reply["pieces"] = copy.pieces  # a slab's fds, one per allocation it is made of
        return reply, copy.fds

    def _why_not_hand_over(self, lease: Lease) -> str:
        """Why a copy-release engine cannot take the raw slabs themselves ("" if it can): no
        other connection may have opened them (a share engine maps them, a copy-mode one may
        be reading them), no process that opened them before may still run, and the rank
        itself must not be reading them (a copy, a seed stream or a digest in flight)."""
        if any(other.mode for other in self.leases.values() if other is not lease):
            return "another engine holds a lease on them"
        if self._copies or (self.copier and self.copier.status()["in_flight"]):
            return "the rank is copying them for another engine"
        if self.raw_readers:
            return "the rank is reading them (a seed stream or a digest)"
        if self.raw_released:
            return "they were released"
        if self.openers.alive():
            return self.openers.unknown or self.openers.describe() or \
                "a process that opened them before may still run"
        return ""

    @contextlib.contextmanager
    def reading_raw(self) -> Iterator[None]:
        """The rank itself reads its raw slabs in this block (a seed stream, digests): no
        handover meanwhile."""
        self.raw_readers += 1
        try:
            yield
        finally:
            self.raw_readers -= 1

    @property
    def handing_over(self) -> bool:
        """Whether a copy-release engine is taking the raw slabs (until its `drop`)."""
        return self._handed_to is not None

    def _hand_over(self, lease: Lease, sizes: list[int]) -> tuple[dict[str, Any], list[int]]:
        """copy-release with nobody else on the raw layout: send the slabs themselves, for
        the engine to map writable as its own (no copy, never two copies on the device).

        The engine's fingerprint is checked after this (its `hello` follows the `open`), so
        nothing is given up yet: other engines' opens are refused as busy until the engine
        says `drop` (it writes nothing before), and then the rank serves nothing and the
        launcher drops its escrowed duplicates. An engine that leaves without `drop` (a
        mismatch) wrote nothing into them (on a CPU its mapping is copy-on-write anyway), and
        the rank serves again."""
        log.info("rank %d: copy-release by %s: handing the slabs over (%.2f GB, no copy)",
                 self.rank, lease.who, sum(sizes) / 1e9)
        self._handed_to = id(lease)
        return {"ok": True, "slabs": len(sizes), "sizes": sizes, "handover": True}, \
            list(self.fds)

    async def handle_copied(self, lease: Lease, f: dict[str, Any]
                            ) -> tuple[dict[str, Any] | bytes, list[int]]:
        """copied: answered once the copy this connection's `open` started is done; by the
        copy's own thread when it can (rank/copies.py), then the reply left to send is none."""
        copy = self._copies.pop(id(lease), None)
        if copy is None:
            return protocol.error("refused", "copied follows an open whose reply said "
                                  "copying"), []
        copy.answer_on(lease.conn, _COPIED)
        try:
            sent = await copy.done()
        except DeviceError as exc:
            log.error("rank %d: %s", self.rank, exc)
            return protocol.error("copy_failed", f"{exc}; the engine falls back to the disk "
                                  "(check the GPU: nvidia-smi, dmesg)"), []
        except BaseException:  # cancelled: the connection or the rank is going away
            copy.close()
            raise
        finally:  # once this reply (and any request already waiting) is answered
            asyncio.get_running_loop().call_soon(copy.close)
        return _COPIED[sent:], []

    def handle_mapped(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """mapped: the client reports what it holds."""
        lease.mode, lease.bytes = f["mode"], f["bytes"]
        return {"ok": True}, []

    def handle_drop(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """drop: after a copy-release handoff, free our copy (or, handed over, our fds)."""
        if lease.mode != "copy-release":
            return protocol.error("refused", "drop is only allowed after open(copy-release)"), []
        log.info("rank %d: copy-release by %s: %s", self.rank, lease.who,
                 "the slabs are its own now" if self._handed_to == id(lease)
                 else "dropping the cache's copy")
        self.drop(later=True)  # answer first: freeing a large slab takes a while
        return {"ok": True}, []

    def handle_release(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """release: the client unmapped everything."""
        lease.bytes, lease.mode = 0, ""
        return {"ok": True}, []

    def handle_status(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """status: state, memory, leases (the asking connection is not one), fingerprint."""
        return {"ok": True, "status": self.status(exclude=lease)}, []

    def _layout_request(self, op: str, lease: Lease, f: dict[str, Any]
                        ) -> tuple[dict[str, Any] | bytes, list[int]]:
        """hello, manifest or open for an engine layout, named by its key."""
        layout = self.layouts.get(f["layout"])
        if layout is None:
            diff = el.nearest([x.fingerprint for x in self.layouts.layouts.values()],
                              f.get("fingerprint", {}))
            if op == "hello" and diff:
                return protocol.error("mismatch", "fingerprint mismatch",
                                      mismatch=[list(d) for d in diff]), []
            return protocol.error("no_layout", f"this rank holds no engine layout "
                                  f"{f['layout'][:64]!r}; the engine hands one back after its "
                                  "first load (vlaunch.cache.hand_back)"), []
        if op == "hello":
            lease.client = f.get("client", "")
            diff = fp.compare(layout.fingerprint, f["fingerprint"])
            if diff:
                return protocol.error("mismatch", "fingerprint mismatch",
                                      mismatch=[list(d) for d in diff]), []
            return {"ok": True, "fingerprint": layout.fingerprint, "rank": self.rank}, []
        if op == "manifest":
            return layout.manifest_frame, []
        if op == "open":
            lease.mode = f["mode"]
            return {"ok": True, "slabs": len(layout.fds),
                    "sizes": list(layout.manifest.slab_sizes)}, list(layout.fds)
        raise ProtocolError(f"{op} takes no layout field")

    def handle_layouts(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any],
                                                                       list[int]]:
        """layouts: a summary (key, fields, fingerprint, sizes) of every engine layout held."""
        return {"ok": True, "layouts": self.layouts.listing(),
                "raw_released": self.raw_released}, []

    def handle_layout_alloc(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any],
                                                                            list[int]]:
        """layout_alloc: writable slabs (fds) for an engine layout of this rank's weights."""
        diff = fp.compare(self.fingerprint, f["fingerprint"])
        if diff:
            return protocol.error("mismatch", "fingerprint mismatch",
                                  mismatch=[list(d) for d in diff]), []
        owner = id(lease)
        try:
            fds = self.layouts.alloc(owner, f["fields"], f["sizes"])
        except LayoutError as exc:
            return protocol.error("refused", str(exc)), []
        # an allocation dies with its connection: the lease object goes when the client does
        weakref.finalize(lease, self.layouts.forget, owner)
        return {"ok": True, "slabs": len(fds)}, fds

    def handle_layout_commit(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any],
                                                                             list[int]]:
        """layout_commit: seal the slabs and serve them as an engine layout; maybe drop raw."""
        try:
            layout = self.layouts.commit(id(lease), lease.pid, self.fingerprint, f["fields"],
                                         f["tensors"], f["copy"])
        except (LayoutError, CacheBrokenError) as exc:
            return protocol.error("refused", str(exc)), []
        log.info("rank %d: engine layout %s adopted from %s: %d tensors, %.2f GB; %d "
                 "shared, %d copied%s", self.rank, layout.key, lease.who,
                 len(layout.manifest.tensors), layout.manifest.nbytes / 1e9,
                 len(layout.manifest.tensors) - len(layout.copy), len(layout.copy),
                 f" ({', '.join(layout.copy[:8])}{', ...' if len(layout.copy) > 8 else ''})"
                 if layout.copy else "")
        self.send_escrow(layout.escrow(), layout.fds)
        if f["release_raw"] and not self.raw_released:
            self.release_raw()
        return {"ok": True, "key": layout.key, "fingerprint": layout.fingerprint}, []

    def release_raw(self) -> None:
        """Drop the raw layout's slabs (an engine layout replaces it); the escrow drops too."""
        log.info("rank %d: releasing the raw layout (%.2f GB): the engine layout replaces it",
                 self.rank, self.manifest.nbytes / 1e9)
        self.raw_released = True
        self._close_raw()
        release, self._release = self._release, None
        self.send_escrow({"event": "release", "layout": "raw"}, [])
        if release:
            asyncio.get_running_loop().call_soon(release)  # answer first: freeing takes a while

    def _close_raw(self) -> None:
        """Close the raw layout's fds and the copier's (and a swap's) views of its slabs."""
        wire.close_fds(self.fds)
        self.fds = []
        self.openers.close()  # nothing is left to hand over
        if self.copier is not None:
            self.copier.close()
        if self.swap is not None:
            self.swap.raw_closed()

    def free_raw(self) -> None:
        """Close the raw layout and free its slabs now (an in-place swap that copies into new
        slabs: never two copies on the device); the launcher is told by the swap's answer."""
        self._close_raw()
        release, self._release = self._release, None
        if release is not None:
            release()

    @property
    def release_hook(self) -> Callable[[], None] | None:
        """What frees the served raw slabs (None once they were let go)."""
        return self._release

    @contextlib.contextmanager
    def swapping(self) -> Iterator[None]:
        """A swap writes the served slabs (or switches them) in this block: no handoff, no
        layout request, until it is done."""
        self.state = "swapping"
        try:
            yield
        finally:
            self.state = "serving"

    def replace_layouts(self, layouts: LayoutStore) -> LayoutStore:
        """Serve `layouts` as the engine layouts from now on; the old store, returned."""
        old, self.layouts = self.layouts, layouts
        return old

    def install(self, weights: ServedShard) -> None:
        """Serve `weights`: every field a request reads switches at once (on the loop's
        thread, or on a thread while `swapping` refuses handoffs)."""
        w = weights
        self.fingerprint, self.manifest, self.fds, self._release = (
            w.fingerprint, w.manifest, w.fds, w.release)
        self.layouts, self.raw_released, self.copier = w.layouts, w.raw_released, w.copier
        for frame in ("manifest_frame", "manifest_columns_frame"):  # the old manifest's
            self.__dict__.pop(frame, None)
        # who opened these slabs: new ones (or new bytes), nobody yet; the old weights' stay
        # with them (a rollback brings them back)
        self.openers = w.openers if w.openers is not None else Openers(self.rank)
        if self.state == "released":
            self.state = "serving"

    def change_fingerprint(self, **fields: str) -> None:
        """New engines get these fingerprint fields from now on (a new dict: a reply being
        built keeps the one it read)."""
        self.fingerprint = {**self.fingerprint, **fields}

    def _tell_hello(self, lease: Lease, reply: dict[str, Any] | bytes, layout: bool) -> None:
        """Tell the launcher how a client's hello was answered: whether that process maps
        the weights from this cache, or why not (a swap's new engine that falls back to the
        disk is no finished swap: core/swap.py). A refused engine-layout hello is none: the
        client asks for the raw layout next."""
        if self.escrow is None or lease.pid == peers.UNKNOWN_PID or not isinstance(reply, dict):
            return
        ok = reply.get("ok") is True
        if layout and not ok:
            return
        if ok:
            why = ""
        elif reply.get("error") == "mismatch" and reply.get("mismatch"):
            field, ours, theirs = reply["mismatch"][0]
            why = (f"fingerprint mismatch: {field} is {str(theirs)[:120]!r} for it, "
                   f"{str(ours)[:120]!r} here")
        else:
            why = f"{reply.get('error')}: {str(reply.get('message', ''))[:200]}"
        told = self._hellos_told  # a process's repeats are not news (a loop of loads)
        if told.get(lease.pid) == (ok, why):
            return
        told.pop(lease.pid, None)
        told[lease.pid] = (ok, why)
        while len(told) > MAX_HELLOS_TOLD:
            told.pop(next(iter(told)))
        self.send_escrow(protocol.event("hello", pid=lease.pid, ok=ok, why=why), [])

    def _note_by_pid(self, pid: int) -> None:
        self.openers.note_by_pid(pid)
        self.tell_openers()

    def tell_openers(self, everything: bool = False) -> None:
        """Tell the launcher who opened the raw slabs (pid and start time), or that not every
        opener can be named: its escrow hands that on to a respawn, which adopts the slabs
        without having seen those opens. `everything`: the launcher holds the slabs anew."""
        news, incomplete = self.openers.to_tell(everything)
        for pid, started in news:
            self.send_escrow(protocol.event("openers", pid=pid, started=started), [])
        if incomplete:
            self.send_escrow(protocol.event("openers", incomplete=True), [])

    def keep_escrow(self, sock: socket.socket) -> None:
        """Keep the launcher's ready channel open (its ready frame sent): engine layouts and
        the raw layout's release follow on it (docs/engine-layout.md), so that the launcher's
        escrow holds what the rank holds; the launcher's swap steps come the other way
        (docs/swap.md)."""
        self.escrow = sock
        if self.swap is not None:
            self.swap.listen(sock, asyncio.get_running_loop())
        for layout in self.layouts.layouts.values():
            self.send_escrow(layout.escrow(), layout.fds)
        if self.raw_released:
            self.send_escrow({"event": "release", "layout": "raw"}, [])
        self.tell_openers(everything=True)
        self.escrow_artifacts()  # from --artifact-dir, a seed or the escrow: kept there too

    def send_escrow(self, frame: dict[str, Any], fds: list[int]) -> None:
        """Tell the launcher (if it listens) what to escrow or drop (docs/engine-layout.md),
        or answer its swap steps (docs/swap.md)."""
        if self.escrow is None:
            return
        try:
            wire.send_frame(self.escrow, frame, fds)
        except OSError as exc:  # the launcher (or a test) closed its end: nobody escrows
            log.debug("rank %d: escrow channel closed (%s)", self.rank, exc)
            self.escrow.close()
            self.escrow = None

    def escrow_artifacts(self, *only: tuple[str, str, str]) -> None:
        """Hand artifacts to the launcher's escrow, so that a respawned rank gets them back:
        `only` (kind, key, base64 data), or every one held."""
        items = only or tuple((k, h, art.encode(self.artifacts.get(k, h) or b""))
                              for k, h, _ in self.artifacts.listing())
        for kind, key, data in items:
            self.send_escrow(protocol.event("artifact", kind=kind, key=key, data=data), [])

    def handle_digest(self, lease: Lease, f: dict[str, Any]) -> Any:
        """digest: a page of (tensor, blake2b of its bytes in the slabs), for vlaunch verify."""
        if self.integrity is None:
            return protocol.error("refused", "this rank does not digest its slabs"), []
        return self.integrity.digest_reply(f)  # a coroutine: hashing runs in a thread

    def handle_memory(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """memory: bytes held per device."""
        return {"ok": True, "bytes_held": self.bytes_held()}, []

    def handle_artifact_get(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any],
                                                                           list[int]]:
        """artifact_get: the artifact's bytes (base64), or a miss."""
        return self.artifact_reply(f["kind"], f["key"]), []

    def artifact_reply(self, kind: str, key: str) -> dict[str, Any]:
        """The reply to an `artifact_get` (on the socket, or a seed client's on the seeding
        port): the artifact's bytes (base64), or a miss."""
        data = self.artifacts.get(kind, key)
        if data is None:
            return protocol.error("miss", "no such artifact")
        return {"ok": True, "data": art.encode(data)}

    def handle_artifact_put(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any],
                                                                           list[int]]:
        """artifact_put: keep an artifact an engine produced (bounded in size and count)."""
        try:
            data = art.decode(f["data"])
            self.artifacts.put(f["kind"], f["key"], data)
        except ArtifactError as exc:
            code = "too_large" if "over the limit" in str(exc) else "refused"
            return protocol.error(code, str(exc)), []
        log.info("rank %d: artifact %s/%s (%d bytes) from %s", self.rank, f["kind"],
                 f["key"][:12], len(data), lease.who)
        self.escrow_artifacts((f["kind"], f["key"], f["data"]))
        return {"ok": True}, []

    def handle_artifact_list(self, lease: Lease, f: dict[str, Any]) -> tuple[dict[str, Any],
                                                                             list[int]]:
        """artifact_list: [kind, key, size] of every artifact held."""
        return {"ok": True, "artifacts": self.artifacts.listing()}, []

    def bytes_held(self) -> dict[str, int]:
        """Slab bytes held, keyed by device (a swap's staging and kept weights included; in
        host memory under "host")."""
        raw = 0 if self.state == "released" or self.raw_released else self.manifest.nbytes
        held = {self.device: raw + self.layouts.nbytes}
        for where, n in (self.swap.held() if self.swap is not None else {}).items():
            held[where] = held.get(where, 0) + n
        return held

    def status(self, exclude: Lease | None = None) -> dict[str, Any]:
        """A JSON-able status snapshot."""
        return {"rank": self.rank, "pid": os.getpid(), "state": self.state,
                "device": self.device, "backend": self.manifest.backend,
                "bytes_held": self.bytes_held(), "tensors": len(self.manifest.tensors),
                "slabs": len(self.manifest.slab_sizes), "uptime": time.time() - self.started,
                "artifacts": len(self.artifacts),
                "leases": [x.to_status() for x in self.leases.values() if x is not exclude],
                "copies": self.copier.status() if self.copier else {"in_flight": 0, "bytes": 0},
                "checkpoint": self.integrity.status() if self.integrity else None,
                "fingerprint": self.fingerprint,
                "raw": "released" if self.raw_released else "held",
                "handover_blocked": self._why_not_hand_over(exclude) if self.fds else "",
                "layouts": self.layouts.listing(),
                "weights": self.swap.status() if self.swap is not None else None,
                **self.slab_pages()}

    def slab_pages(self) -> dict[str, str]:
        """The page size the CPU slabs got ("2M" or "4k": the host decides); {} on CUDA."""
        if self.manifest.backend != "cpu":
            return {}
        from vlaunch.cache.store.cpubacking import page_label

        return {"slab_pages": page_label()}

    def drop(self, *, later: bool = False) -> None:
        """Close our fds and mappings; memory goes once every client has unmapped."""
        self._close_raw()
        self.state, self._handed_to = "released", None
        self.send_escrow(protocol.event("release", layout="raw"), [])  # the launcher's too
        release, self._release = self._release, None
        if release and later:
            asyncio.get_running_loop().call_soon(release)
        elif release:
            release()


def socket_path_taken(path: Path, why: str) -> Exception:
    """The error (SOCKET_DIR) for a socket path that holds something other than our socket."""
    from vlaunch.cache.contract.errors import SocketDirError

    return SocketDirError(f"cannot serve on {path}: {why}; something that is not this rank's "
                          f"socket is there (a stray file or a symlink): remove it (rm {path}) "
                          "and start the rank again")
