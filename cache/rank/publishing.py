"""A trainer's published versions on one rank (docs/swap.md#the-rl-loop-publishing-versions).

A trainer publishes on the rank's socket (cache/client/publish.py; the same peer checks as any
client): `publish_begin` hands it writable staging slabs shaped as the served shard,
`publish_commit` names what it wrote; the rank then tells the launcher ("published"), which cuts
over as for a swap (rank/swap.py), and the commit's reply says how that ended.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from vlaunch.cache.contract import protocol
from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.rank import staging
from vlaunch.cache.rank.swapstate import Staged, SwapError, status_of, words
from vlaunch.cache.store.manifest import Manifest

if TYPE_CHECKING:
    from vlaunch.cache.rank.leases import Lease
    from vlaunch.cache.rank.parts import SwapHost
    from vlaunch.cache.store.slabs import Backend

log = logging.getLogger("vlaunch.cache")

MAX_LABEL = 256
"""The longest label a published version may carry (printable characters)."""


class Swapper(Protocol):
    """What publishing needs of the rank's swap (rank/swap.RankSwap; named here, so that the
    two modules do not import each other)."""

    server: SwapHost
    backend: Backend
    model: str
    threads: int
    digests: dict[str, str] | None

    @property
    def staged(self) -> Staged | None: ...
    @property
    def busy(self) -> bool: ...

    def hold(self, staged: Staged) -> None: ...
    def let_go(self, staged: Staged) -> None: ...
    def occupied(self) -> AbstractContextManager[None]: ...
    def answer(self, answer: str, version: int, fds: list[int] = ..., **fields: Any) -> None: ...
    def allocate(self, sizes: tuple[int, ...], where: str) -> list[Any]: ...
    def room_on_host(self, staged: Staged) -> None: ...
    def keep_served(self, staged: Staged) -> None: ...
    def with_checksums(self, manifest: Manifest, buffers: list[Any]) -> Manifest: ...


class Publisher:
    """The trainers' requests on one rank, staged into (and cut over by) its RankSwap."""

    def __init__(self, swap: Swapper) -> None:
        self.swap = swap

    def request(self, op: str, lease: Lease, f: dict[str, Any]) -> Any:
        """A trainer's publish_* request (a coroutine for publish_commit): every one that
        fails is answered with its status, never with a closed connection."""
        if op == "published_digests":
            return self._digest_page(f)
        try:
            result = getattr(self, f"_{op}")(lease, f)
        except Exception as exc:
            return self._refusal(op, exc)
        if asyncio.iscoroutine(result):
            return self._answered(op, result)
        return result

    async def _answered(self, op: str, commit: Any) -> tuple[dict[str, Any], list[int]]:
        """The reply of a coroutine request (publish_commit), or its refusal."""
        try:
            return await commit
        except Exception as exc:
            return self._refusal(op, exc)

    def _refusal(self, op: str, exc: Exception) -> tuple[dict[str, Any], list[int]]:
        """The error reply of a failed publish request, with its exit status."""
        if isinstance(exc, SwapError):
            return protocol.error("refused", str(exc), status=int(exc.code)), []
        if isinstance(exc, VlaunchError):
            return protocol.error("refused", str(exc), status=int(exc.status)), []
        status = status_of(exc)  # the machine (no memory, an I/O error), or a bug
        if status is ExitStatus.INTERNAL:
            log.exception("rank %d: %s failed", self.swap.server.rank, op)
        else:
            log.error("rank %d: %s failed: %s", self.swap.server.rank, op, words(exc))
        return protocol.error("refused", f"{op} failed on rank {self.swap.server.rank}: "
                              f"{words(exc)}", status=int(status)), []

    def _publish_begin(self, lease: Lease, f: dict[str, Any]
                       ) -> tuple[dict[str, Any], list[int]]:
        """Staging slabs shaped as the served shard, writable, for the trainer to fill."""
        label, mode = f["label"], f.get("mode", "auto")
        if not 0 < len(label) <= MAX_LABEL or not label.isprintable():
            raise SwapError(f"a published version's label must be 1..{MAX_LABEL} printable "
                            "characters")
        if mode not in ("auto", "double", "in-place"):
            raise SwapError(f"publish mode must be auto, double or in-place, not {mode[:32]!r}")
        if self.swap.server.escrow is None:
            raise SwapError("publishing needs the launcher (vlaunch run), which cuts every rank "
                            "over together; this rank runs without one")
        if self.swap.staged is not None or self.swap.busy:
            raise SwapError(f"rank {self.swap.server.rank} is busy with another swap or publish")
        manifest = self.swap.server.manifest
        margin = f.get("margin", 1 << 30)
        double = mode == "double" or (mode == "auto" and staging.free_device_bytes(
            self.swap.backend) >= manifest.nbytes + margin)
        staged = Staged(0, self.swap.model, label=label, mode="double" if double else "in-place",
                        owner=id(lease), margin=margin)
        if double:
            staged.slabs = self.swap.allocate(manifest.slab_sizes,
                                          "on the device beside the served one")
        else:
            blocked = self.swap.server.openers.unknown
            if blocked:
                raise SwapError(f"rank {self.swap.server.rank} cannot take a version in place: "
                                f"it cannot tell which processes still map its slabs "
                                f"({blocked}); publish with mode=\"double\" (room for both "
                                "shards on the device), or restart the launcher")
            self.swap.room_on_host(Staged(0, "", keep=True, margin=margin, manifest=manifest))
            from vlaunch.cache.store.slabs import CpuSlab

            staged.slabs = [CpuSlab(n) for n in manifest.slab_sizes]
        staged.buffers = [s.buffer() for s in staged.slabs]
        staged.manifest = manifest._replace(tensors=tuple(
            t._replace(checksum=None) for t in manifest.tensors))
        self.swap.hold(staged)
        weakref.finalize(lease, self._publisher_gone, id(lease))
        log.info("rank %d: pid %d publishes %r (%s, %.2f GB of staging)", self.swap.server.rank,
                 lease.pid, label, staged.mode, manifest.nbytes / 1e9)
        return ({"ok": True, "mode": staged.mode, "manifest": staged.manifest.to_wire()},
                staging.slab_fds(staged.slabs))

    async def _publish_commit(self, lease: Lease, f: dict[str, Any]
                              ) -> tuple[dict[str, Any], list[int]]:
        """The trainer wrote every tensor: check the names, shapes and dtypes, take the
        version's identity, tell the launcher; answered once the cutover ended."""
        staged = self.swap.staged
        if staged is None or staged.owner != id(lease) or staged.reply is not None:
            raise SwapError("publish_commit without a publish_begin on this connection")
        assert staged.manifest is not None
        if f["label"] != staged.label:
            raise SwapError(f"publish_commit names {f['label'][:64]!r}, publish_begin "
                            f"{staged.label!r}")
        why = tensors_difference(staged.manifest, f["tensors"])
        if why:
            self.swap.let_go(staged)
            raise SwapError(f"published tensors refused: {why}; publish exactly the shard's "
                            "tensors, with their names, dtypes and shapes")
        loop = asyncio.get_running_loop()
        staged.reply = loop.create_future()
        try:
            with self.swap.occupied():
                await loop.run_in_executor(None, self._take_published, staged)
        except BaseException:
            self.swap.let_go(staged)
            raise
        self.swap.answer("published", 0, label=staged.label, mode=staged.mode,
                    fingerprint=staged.fingerprint, model=staged.model)
        return await staged.reply

    def _take_published(self, staged: Staged) -> None:
        """A published version's digests and identity (in a thread), and the host copy of
        the served weights an in-place rollback needs."""
        from vlaunch.cache.rank.integrity import slab_digests

        assert staged.manifest is not None
        for slab in staged.slabs:
            slab.seal()  # no new writable mapping: the trainer's own is dropped already
        staged.digests = slab_digests(staged.manifest, staged.buffers, self.swap.threads)
        h = hashlib.blake2b(digest_size=16, person=b"vlaunch-publish")
        for name in sorted(staged.digests):
            h.update(name.encode() + b"\0" + staged.digests[name].encode())
        # no label in it: engines get it in a comma list (VLAUNCH_CHECKPOINT_DATA)
        staged.fingerprint = {**self.swap.server.fingerprint,
                              "checkpoint_data": f"published-{h.hexdigest()}"}
        staged.manifest = self.swap.with_checksums(staged.manifest, staged.buffers)
        if staged.mode == "in-place":
            self.swap.keep_served(staged)

    def _publish_abort(self, lease: Lease, f: dict[str, Any]
                       ) -> tuple[dict[str, Any], list[int]]:
        """Drop this connection's staging (before its commit)."""
        self._publisher_gone(id(lease))
        return {"ok": True}, []

    def _publisher_gone(self, owner: int) -> None:
        """A trainer left (or aborted) before its commit: drop its staging."""
        staged = self.swap.staged
        if staged is not None and staged.owner == owner and staged.reply is None:
            self.swap.let_go(staged)
            log.info("rank %d: the publish of %r was abandoned before its commit",
                     self.swap.server.rank, staged.label)

    def _digest_page(self, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """A page of a published version's digests, as taken at its commit."""
        from vlaunch.cache.rank.integrity import DIGEST_PAGE

        if self.swap.digests is None:
            return protocol.error("refused", "the weights this rank serves were not published "
                                  "(vlaunch verify compares them with their files)"), []
        names = list(self.swap.digests)
        page = names[f["start"]:f["start"] + min(f["count"], DIGEST_PAGE)]
        return {"ok": True, "total": len(names),
                "digests": [[n, self.swap.digests[n]] for n in page]}, []


def answer_trainer(staged: Staged, reply: dict[str, Any]) -> None:
    """Answer the trainer waiting on its publish_commit (if one is) with how the cutover ended."""
    if staged.reply is not None and not staged.reply.done():
        staged.reply.set_result((reply, []))


def tensors_difference(manifest: Manifest, rows: list[Any]) -> str:
    """The first way a publish_commit's [name, dtype, shape] rows differ from the shard."""
    want = {t.name: (t.dtype, list(t.shape)) for t in manifest.tensors}
    seen: set[str] = set()
    if len(rows) > len(want):
        return f"{len(rows)} tensors named, the shard has {len(want)}"
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)):
            return "each tensor must be [name, dtype, shape]"
        name, dtype, shape = row
        if name not in want:
            return f"{name[:200]!r} is not a tensor of this rank's shard"
        if name in seen:
            return f"{name[:200]!r} is named twice"
        seen.add(name)
        if [dtype, shape] != list(want[name]):
            return f"{name!r} is {dtype}{shape}, the shard's is {want[name][0]}{want[name][1]}"
    missing = sorted(set(want) - seen)
    return f"{len(missing)} tensor(s) not published, first {missing[0]!r}" if missing else ""
