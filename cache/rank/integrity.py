"""A rank's side of checkpoint integrity: read between two stats, watch the files, digest slabs.

- `checked_load` stats the checkpoint's files, computes their identity, loads, and stats them
  again; a file that changed meanwhile is read once more, then the rank ends with
  CHECKPOINT_CHANGED (67). The cache so records the identity of what it actually read.
- `Integrity` (a part the rank's server is built with: rank/parts.py) writes the engine's memo,
  re-stats the files every WATCH_EVERY seconds from a thread and, when one changed, logs it,
  shows it in the rank's status and changes the rank's `checkpoint_data` fingerprint field so
  that no new engine takes the old weights for the new files. It also digests every tensor of
  the slabs for `vlaunch verify` (a `digest` request) and for `--verify`.

One rank per process: the record of the last load is kept here until the server takes it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import protocol, settings
from vlaunch.cache.contract.errors import CheckpointChangedError, VerifyError, VlaunchError
from vlaunch.cache.store import identity

if TYPE_CHECKING:
    from vlaunch.cache.rank.parts import IntegrityHost
    from vlaunch.cache.store.manifest import Manifest, TensorRecord
    from vlaunch.cache.store.ranks import Position
    from vlaunch.cache.store.shard import Shard
    from vlaunch.cache.store.slabs import SlabBytes

log = logging.getLogger("vlaunch.cache")

WATCH_EVERY = settings.WATCH_EVERY
"""Seconds between two stats of the checkpoint's files while a rank serves
($VLAUNCH_WATCH_EVERY overrides it)."""
DIGEST_PAGE = 1024
"""Most tensors one `digest` reply lists (a name is at most 1024 bytes: replies stay < 2 MB)."""

_LAST: dict[str, Any] = {}  # "record": the Record of this process's load, "slabs": its tensors


def checked_load(model: str, rank: int, load: Callable[[], Any]) -> Any:
    """`load()` between two stats of the files; once more if one changed; then exit 67."""
    for attempt in (1, 2):
        rec, _ = identity.record(model)
        shard = load()
        changed = rec.restat() or ([] if shard.checkpoint.identity == rec.header else
                                   ["the headers"])
        if not changed:
            remember(rec, shard.tensors)
            return shard
        release(shard)
        names = ", ".join(changed)
        if attempt == 1:
            log.warning("the checkpoint changed while rank %d read it (%s in %s); reading it "
                        "again", rank, names, rec.root)
    raise CheckpointChangedError(f"the checkpoint changed while rank {rank} read it, twice "
                                 f"({names} in {rec.root}); wait until whatever writes the "
                                 "checkpoint (a download, a copy in place) has finished, then "
                                 "start the cache again")


def release(shard: Shard) -> None:
    """Free a shard's slabs."""
    shard.tensors.clear()
    for slab in shard.slabs:
        slab.release()


def remember(rec: identity.Record, slabs: list[SlabBytes]) -> None:
    """Keep the record and slabs of this process's load for the server."""
    _LAST.update(record=rec, slabs=slabs)


def data_identity(model: str, shard: Shard) -> str:
    """The `checkpoint_data` fingerprint field of what this rank read (or will be seeded with)."""
    rec = _LAST.get("record")
    if rec is None or rec.header != shard.checkpoint.identity:
        rec, _ = identity.record(model)
        remember(rec, shard.tensors)
    return rec.data


class Integrity:
    """What a serving rank knows about the files its slabs came from."""

    def __init__(self, server: IntegrityHost, model: str, plan: str, socket: Path,
                 published: str = "") -> None:
        self.server, self.socket = server, socket
        self.published = published  # the label of a published version: no files to watch
        self.plan = os.path.abspath(plan) if os.path.isfile(plan) else plan  # for verify
        self.model = str(Path(model).absolute())
        self.record: identity.Record | None = _LAST.get("record")
        self.slabs: list[SlabBytes] | None = _LAST.get("slabs")
        self.changed: list[str] = []
        self.changed_at: float | None = None
        self._digests: dict[str, str] | None = None
        self._lock = threading.Lock()
        _LAST.clear()

    def start(self) -> Integrity:
        """Check adopted slabs against the files, write the memo, start watching."""
        if self.record is None and not self.published:  # adopted: nothing was read here
            self._check_adopted()
        if self.record is not None and not self.changed:
            memo = identity.memo_path(self.socket)
            try:
                identity.write_memo(memo, self.record)
                atexit.register(_unlink, memo)
            except OSError as exc:
                log.warning("rank %d: cannot write the identity memo %s (%s); engines read "
                            "samples of the checkpoint instead", self.server.rank, memo, exc)
        threading.Thread(target=self._watch, name="vlaunch-watch", daemon=True).start()
        return self

    def _check_adopted(self) -> None:
        fp = self.server.fingerprint
        try:
            rec, _ = identity.record(self.model)
        except (VlaunchError, OSError) as exc:
            self._mark([f"{self.model} ({exc})"])
            return
        if (rec.header, rec.data) != (fp.get("checkpoint"), fp.get("checkpoint_data")):
            self._mark([f"{rec.root} (its identity differs from the escrowed slabs')"])
        else:
            self.record = rec

    def _watch(self) -> None:
        every = float(settings.get("VLAUNCH_WATCH_EVERY"))
        while True:
            time.sleep(every)
            self.poll()

    def poll(self) -> list[str]:
        """Re-stat the files; report and act on any that changed since the load."""
        rec = self.record
        if rec is None:
            return self.changed
        new = [n for n in rec.restat() if n not in self.changed]
        if new:
            self._mark(new, rec)
        return self.changed

    def rebase(self, model: str, record: identity.Record | None, slabs: list[SlabBytes] | None,
               published: str = "") -> None:
        """The rank serves other weights (a swap): their files (none for a published
        version), memo and digests; what changed under the old files no longer matters."""
        with self._lock:
            self.model = str(Path(model).absolute())
            self.record, self.slabs, self.published = record, slabs, published
            self.changed, self.changed_at, self._digests = [], None, None
        memo = identity.memo_path(self.socket)
        try:
            if record is None:
                memo.unlink(missing_ok=True)  # nothing on disk is what the rank serves
            else:
                identity.write_memo(memo, record)
                atexit.register(_unlink, memo)
        except OSError as exc:
            log.warning("rank %d: cannot write the identity memo %s (%s); engines read "
                        "samples of the checkpoint instead", self.server.rank, memo, exc)

    def _mark(self, names: list[str], rec: identity.Record | None = None) -> None:
        with self._lock:
            if rec is not None and rec is not self.record:
                return  # a swap replaced those files meanwhile
            self.changed = [*self.changed, *names]
            self.changed_at = self.changed_at or time.time()
            first = self.changed[0]
            more = f" and {len(self.changed) - 1} more" if len(self.changed) > 1 else ""
            # new engines now get a mismatch naming this field
            self.server.change_fingerprint(
                checkpoint_data=f"changed on disk since loaded: {first[:200]}{more}")
        log.warning("rank %d: the checkpoint changed under the serving cache (%s); engines that "
                    "hold its weights keep them, new engines get a fingerprint mismatch "
                    "(checkpoint_data); restart the cache to serve the new checkpoint",
                    self.server.rank, ", ".join(names))

    def status(self) -> dict[str, Any]:
        """The rank status's `checkpoint` field."""
        rec = self.record
        published = self.server.fingerprint.get("checkpoint_data") if self.published else None
        return {"model": self.model, "plan": self.plan,
                "identity": rec.data if rec else published,
                "files": list(rec.names) if rec else [],
                "changed": list(self.changed), "changed_at": self.changed_at,
                "published": self.published or None}

    # ------------------------------------------------------------------------- digests

    def digests(self, manifest: Manifest, threads: int = 8) -> dict[str, str]:
        """blake2b of every tensor's bytes in the slabs (CUDA slabs are copied to host)."""
        slabs = self.slabs if self.slabs else self._import(manifest)
        return slab_digests(manifest, slabs, threads)

    def _import(self, manifest: Manifest) -> list[SlabBytes]:
        from vlaunch.cache.store.slabs import get_backend

        backend = get_backend(self.server.device)
        return [backend.map_fd(fd, size, readonly=True)
                for fd, size in zip(self.server.fds, manifest.slab_sizes, strict=True)]

    async def digest_reply(self, f: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """A `digest` request's reply: a page of (name, digest), computed on the first page."""
        if not self.server.fds:
            return protocol.error("released", "this rank no longer holds its checkpoint-shaped "
                                  "slabs, so there is nothing to verify"), []
        if self.server.handing_over:  # the engine taking them may write into them
            return protocol.error("busy", "the cache is handing its slabs over to a "
                                  "copy-release engine; there is nothing to verify"), []
        if f["start"] == 0 or self._digests is None:
            loop = asyncio.get_running_loop()
            with self.server.reading_raw():  # no handover while the slabs are read
                self._digests = await loop.run_in_executor(None, self.digests,
                                                           self.server.manifest)
        names = list(self._digests)
        page = names[f["start"]:f["start"] + min(f["count"], DIGEST_PAGE)]
        return {"ok": True, "total": len(names),
                "digests": [[n, self._digests[n]] for n in page]}, []


def slab_digests(manifest: Manifest, slabs: list[SlabBytes], threads: int = 8
                 ) -> dict[str, str]:
    """blake2b of each tensor's bytes, in manifest order (the same hash as expected_digests)."""
    from vlaunch.cache.store.reader import chunks

    def one(rec: TensorRecord) -> tuple[str, str]:
        h = identity.digest()
        for part in chunks(slabs[rec.slab][rec.offset:rec.offset + rec.nbytes]):
            h.update(part)
        return rec.name, h.hexdigest()

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="vlaunch-digest") as pool:
        return dict(pool.map(one, manifest.tensors))


def verify_loaded(model: str, plan: str, position: Position, manifest: Manifest,
                  slabs: list[SlabBytes], rank: int, threads: int = 8) -> None:
    """`--verify`: compare every tensor's bytes with the files; VerifyError (79) on a mismatch."""
    from vlaunch.cache.store.plan import HookPlan, load_plan

    if isinstance(load_plan(plan), HookPlan):
        log.warning("rank %d: --verify skipped: plan %s builds its tensors in a hook, so they are "
                    "not slices of the files", rank, plan)
        return
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        expected = pool.submit(identity.expected_digests, model, plan, position, threads=threads)
        held = pool.submit(slab_digests, manifest, slabs, threads)
        bad = identity.compare_digests(held.result(), expected.result())
    for line in bad[:20]:
        log.error("rank %d: verify: %s", rank, line)
    if bad:
        raise VerifyError(f"verify found tensors of rank {rank} that differ from the checkpoint "
                          f"files ({len(bad)} of {len(manifest.tensors)}); restart the cache to "
                          "read them again, and check the disk and host memory if it happens "
                          "again")
    log.info("rank %d: verify: %d tensors, %.2f GB match the checkpoint files (%.1fs)", rank,
             len(manifest.tensors), manifest.nbytes / 1e9, time.perf_counter() - start)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
