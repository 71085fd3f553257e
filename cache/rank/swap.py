"""A cache rank's side of a swap (docs/swap.md): the checks, the staging, the cutover, the
rollback, and the versions a trainer publishes.

The launcher drives a swap over the rank's ready channel, the socketpair that only it holds:
`swap_prepare`, `swap_stage`, `swap_commit`, `swap_finish`, `swap_rollback` and `swap_abort`
frames, one at a time; the rank answers each but finish and abort with a `swap_answer`. A
refusal before the commit leaves the served weights as they were; the old weights are kept
(double: their slabs; in place: a host copy) until finish or rollback.

A trainer's published version (rank/publishing.py) is staged by the trainer and then cut over
by the same steps. What a swap holds between its steps is in rank/swapstate.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.errors import (
    CheckpointChangedError,
    PlanError,
    ProtocolError,
    VlaunchError,
)
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.rank import staging
from vlaunch.cache.rank.publishing import Publisher, answer_trainer
from vlaunch.cache.rank.swapstate import (
    ServedShard,
    Staged,
    StagingMemoryError,
    SwapError,
    discard,
    status_of,
    words,
)
from vlaunch.cache.store.manifest import Manifest
from vlaunch.cache.store.slabs import on_device

if TYPE_CHECKING:
    from vlaunch.cache.rank.copies import Copier
    from vlaunch.cache.rank.layouts import LayoutStore
    from vlaunch.cache.rank.parts import SwapHost
    from vlaunch.cache.store.slabs import Backend
    from vlaunch.cache.store.target import Target

log = logging.getLogger("vlaunch.cache")

_RELEASER = ThreadPoolExecutor(1, thread_name_prefix="vlaunch-swap-free")
"""Where a finished swap's host buffers are freed (unpinning 34 GB takes seconds)."""
POLL = 0.05
"""Seconds between two looks at the leases while an in-place commit waits for them to end."""


class RankSwap:
    """Swaps and publishes on one rank: the channel's frames and the trainers' requests."""

    def __init__(self, server: SwapHost, target: Target, *, backend: Backend, threads: int,
                 version: int = 0, label: str = "", checksum: bool | None = None) -> None:
        """`target`: what the rank serves (its plan, position, checkpoint and quantization
        hold for every version it swaps to; only the checkpoint moves)."""
        self.server, self.plan, self.position, self.backend = (
            server, target.plan, target.position, backend)
        self.quantization = target.quantization or None
        self.threads, self.checksum = threads, checksum
        self.version, self.model, self.label = (
            version, str(Path(target.model).absolute()), label)
        integrity = server.integrity
        # the same list as the load's (its release clears it): a view kept here would keep
        # the slabs' memory mapped after the rank released them
        self.buffers: list[Any] | None = integrity.slabs if integrity is not None and \
            integrity.slabs else None
        self.digests: dict[str, str] | None = None
        self.staged: Staged | None = None
        self.busy = False
        self.releasing: Future[None] | None = None  # finish's freeing, on a thread
        self.aborted = False  # the launcher aborted the swap whose step runs now
        self._tasks: set[asyncio.Task[None]] = set()
        self.publisher = Publisher(self)  # the trainers' requests (rank/publishing.py)

    # ------------------------------------------------------------------- the channel

    def listen(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """Read the launcher's swap frames from the ready channel on a thread of their own."""
        threading.Thread(target=self._read, args=(sock, loop), name="vlaunch-swap",
                         daemon=True).start()

    def _read(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                msg, fds = wire.recv_frame(sock)
            except (OSError, EOFError, VlaunchError):
                return  # the launcher (or the rank) is going away
            wire.close_fds(fds)  # the launcher's frames carry none
            loop.call_soon_threadsafe(self.on_frame, msg)

    def on_frame(self, msg: dict[str, Any]) -> None:
        """One launcher frame: check it, then run its step (one at a time)."""
        try:
            protocol.validate_event(msg, *protocol.SWAP_STEPS)
        except ProtocolError as exc:
            log.error("rank %d: bad swap frame from the launcher (%s): ignored",
                      self.server.rank, exc)
            return
        step = msg["event"].removeprefix("swap_")
        task = asyncio.ensure_future(self._step(step, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _step(self, step: str, msg: dict[str, Any]) -> None:
        version = msg["version"]
        if step in ("finish", "abort"):
            getattr(self, step)(msg)
            return
        if self.busy:
            self.answer("refused", version, status=int(ExitStatus.SWAP_UNAVAILABLE),
                        message=f"rank {self.server.rank} is still busy with the last swap step")
            return
        self.busy, self.aborted = True, False
        try:
            if self.releasing is not None:  # the last swap's host memory, still being freed
                releasing, self.releasing = self.releasing, None
                await asyncio.wrap_future(releasing)
            await getattr(self, step)(msg)
        except VlaunchError as exc:
            status = exc.code if isinstance(exc, SwapError) else exc.status
            log.error("rank %d: swap to version %d: %s", self.server.rank, version, exc)
            self.answer("refused", version, status=int(status), message=str(exc))
        except Exception as exc:  # a bug or the machine: refuse, keep serving
            status = status_of(exc)
            if status is ExitStatus.INTERNAL:
                log.exception("rank %d: swap step %s failed", self.server.rank, step)
            self.answer("refused", version, status=int(status),
                        message=f"{step} failed: {words(exc)}")
        finally:
            self.busy = False

    def answer(self, answer: str, version: int, fds: list[int] = (),  # type: ignore[assignment]
               **fields: Any) -> None:
        """Send a swap_answer to the launcher (fds: duplicates, closed here)."""
        try:
            self.server.send_escrow(protocol.event("swap_answer", answer=answer,
                                                    version=version, **fields), list(fds))
        finally:
            wire.close_fds(list(fds))

    def hold(self, staged: Staged) -> None:
        """Hold `staged` (a trainer's publish_begin) until it is cut over or dropped."""
        self.staged = staged

    def let_go(self, staged: Staged) -> None:
        """Drop `staged` (a publish refused or abandoned): nothing is staged any more."""
        self.staged = None
        staged.release()

    @contextlib.contextmanager
    def occupied(self) -> Iterator[None]:
        """A publish's commit runs in this block: the launcher's swap steps are refused."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def _answer_served(self, answer: str, version: int) -> None:
        """Answer with what the rank serves now (its fds to escrow), then its layouts."""
        server = self.server
        fds = [_dup(fd) for fd in server.fds]
        self.answer(answer, version, fds, manifest=server.manifest.to_wire(),
                    fingerprint=server.fingerprint, model=self.model, label=self.label)
        for layout in server.layouts.layouts.values():
            server.send_escrow(layout.escrow(), layout.fds)
        server.tell_openers(everything=True)  # the launcher holds these slabs anew

    # ------------------------------------------------------------------------ steps

    async def prepare(self, msg: dict[str, Any]) -> None:
        """Check the new checkpoint against the served one; answer whether both fit."""
        if self.staged is not None:
            raise SwapError(f"a swap to version {self.staged.version} is already staged on "
                            f"rank {self.server.rank}")
        if self.server.handing_over:
            raise SwapError("the cache is handing its slabs over to a copy-release engine")
        staged = Staged(msg["version"], str(Path(msg["model"]).absolute()),
                        keep=msg["keep"], margin=msg["margin"])
        fits = await asyncio.get_running_loop().run_in_executor(None, self._check, staged)
        if self.aborted:  # abandoned while it was being checked
            return
        self.staged = staged
        self.answer("prepared", staged.version, fits=fits, model=staged.model,
                    fingerprint=staged.fingerprint, in_place=self.in_place_blocker())

    def in_place_blocker(self) -> str:
        """Why an in-place cutover would be refused whatever happens until then ("" when it
        would not): the rank cannot tell who maps its slabs, for its life."""
        unknown = self.server.openers.unknown
        return f"it cannot tell which processes still map its slabs ({unknown})" if unknown \
            else ""

    def _check(self, staged: Staged) -> bool:
        """Every check of the new checkpoint (in a thread); whether the device has room."""
        from vlaunch.cache.store import identity, quant
        from vlaunch.cache.store.checkpoint import open_checkpoint
        from vlaunch.cache.store.manifest import pack
        from vlaunch.cache.store.plan import HookPlan, load_plan, plan_rank
        from vlaunch.cache.store.shard import MAX_SLAB

        rank, model = self.server.rank, staged.model
        plan = load_plan(self.plan)
        if isinstance(plan, HookPlan):
            raise PlanError(f"plan {self.plan} builds its tensors in a hook: its weights cannot "
                            "be swapped; restart the caches to load another checkpoint")
        ckpt = open_checkpoint(model)
        staged.specs = plan_rank(ckpt, plan, self.position)
        staged.manifest = pack([(s.name, s.dtype, s.shape) for s in staged.specs],
                               backend=self.backend.name, alignment=self.backend.alignment,
                               max_slab=MAX_SLAB)
        served = self.server.fingerprint
        quantization = quant.fingerprint_fields(model, self.quantization)
        why = staging.manifest_difference(self.server.manifest, staged.manifest) or \
            staging.config_difference(self.model, model) or next(
                (f"{k} is {served.get(k)!r} served, {v!r} in the new one"
                 for k, v in quantization.items() if served.get(k) != v), "")
        if why:
            raise PlanError(f"{model} cannot replace the weights rank {rank} serves: {why}; a "
                            "swap keeps the architecture, the plan and the layout (restart the "
                            "caches to serve another model)")
        rec, _ = identity.record(model)
        if rec.header != ckpt.identity:
            raise CheckpointChangedError(f"the checkpoint at {model} changed while rank {rank} "
                                         "checked it; wait until whatever writes it has "
                                         "finished, then swap again")
        if rec.data == served.get("checkpoint_data"):
            raise SwapError(f"the checkpoint at {model} is the one rank {rank} serves (the same "
                            "sampled identity): nothing to swap")
        staged.record = rec
        staged.fingerprint = {**served, "checkpoint": rec.header, "checkpoint_data": rec.data}
        return staging.free_device_bytes(self.backend) >= staged.manifest.nbytes + \
            staged.margin

    async def stage(self, msg: dict[str, Any]) -> None:
        """Read the new shard beside the served one: new slabs (double) or host memory."""
        staged = self._staged(msg["version"])
        staged.mode = msg["mode"]
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._read_staged, staged)
        except BaseException:
            staged.release()
            self.staged = None
            raise
        if self.aborted:  # abandoned while it was being read
            staged.release()
            self.staged = None
            return
        self.answer("staged", staged.version)

    def _read_staged(self, staged: Staged) -> None:
        """Allocate the staging memory, read the shard into it, check nothing changed."""
        from vlaunch.cache.store.reader import fill

        assert staged.manifest is not None
        rank, sizes = self.server.rank, staged.manifest.slab_sizes
        start = time.perf_counter()
        if staged.mode == "double":
            staged.slabs = self.allocate(sizes, "on the device beside the served one")
            staged.buffers = [s.buffer() for s in staged.slabs]
        else:
            self.room_on_host(staged)
            staged.buffers, staged.free = staging.host_buffers(
                sizes, pinned=self.backend.name == "cuda")
        fill(staged.specs, staged.manifest, staged.buffers, threads=self.threads,
             label=f"rank {rank} staging")
        changed = staged.record.restat()
        if changed:
            raise CheckpointChangedError(
                f"the checkpoint at {staged.model} changed while rank {rank} staged it "
                f"({', '.join(changed[:4])}); wait until whatever writes it has finished, "
                "then swap again")
        staged.manifest = self.with_checksums(staged.manifest, staged.buffers)
        if staged.mode == "in-place" and staged.keep:
            self.keep_served(staged)
        log.info("rank %d: staged version %d (%s, %.2f GB, %s) in %.2fs", rank, staged.version,
                 staged.model, staged.manifest.nbytes / 1e9, staged.mode,
                 time.perf_counter() - start)

    def allocate(self, sizes: tuple[int, ...], where: str) -> list[Any]:
        """New slabs of the rank's backend; StagingMemoryError when the device has no room."""
        from vlaunch.cache.contract.errors import DeviceError

        slabs: list[Any] = []
        try:
            for n in sizes:
                slabs.append(self.backend.allocate(n))
        except (DeviceError, MemoryError, OSError) as exc:
            for slab in slabs:
                slab.release()
            raise StagingMemoryError(
                f"no room for the new shard {where} ({sum(sizes) / 1e9:.2f} GB: {words(exc)}); "
                "swap in place (vlaunch swap --mode in-place) or free device memory") from None
        return slabs

    def room_on_host(self, staged: Staged) -> None:
        """StagingMemoryError unless the host has room for an in-place swap's buffers (once
        the last swap's are freed)."""
        assert staged.manifest is not None
        if self.releasing is not None:
            releasing, self.releasing = self.releasing, None
            releasing.result()
        need = staged.manifest.nbytes * (2 if staged.keep else 1) + staged.margin
        free = staging.available_host_bytes()
        if need > free:
            kept = " and the served one, kept for a rollback" if staged.keep else ""
            raise StagingMemoryError(
                f"not enough host memory to swap in place on rank {self.server.rank}: "
                f"{need / 1e9:.2f} GB needed (the new shard{kept}), {free / 1e9:.2f} GB "
                "available; free host memory, or swap with --on-failure stop (no copy kept)")

    def keep_served(self, staged: Staged) -> None:
        """A host copy of the served bytes, for a rollback after an in-place commit."""
        served = self.server.manifest
        staged.backup, staged.backup_free = staging.host_buffers(
            served.slab_sizes, pinned=self.backend.name == "cuda")
        source = self._served_bytes()
        if source is not None:
            staging.copy_bytes(staged.backup, source)
            return
        if self.label or self.server.integrity is None or \
                self.server.integrity.record is None:
            raise SwapError("cannot keep the served weights for a rollback: the rank no longer "
                            "holds them as the checkpoint shaped them (an engine layout "
                            "replaced them) and no files hold them (a published version); "
                            "swap with --on-failure stop", ExitStatus.SWAP_UNAVAILABLE)
        self._reread_served(staged.backup)

    def _served_bytes(self) -> list[Any] | None:
        """The served raw slabs' bytes, readable (None once an engine layout replaced them)."""
        if self.server.raw_released or not self.server.fds:
            return None
        if self.buffers is not None:
            return self.buffers
        return [self.backend.map_fd(fd, n, readonly=True)
                for fd, n in zip(self.server.fds, self.server.manifest.slab_sizes, strict=True)]

    def _reread_served(self, into: list[Any]) -> None:
        """Read the served shard from its files again (their identity must be unchanged)."""
        from vlaunch.cache.store import identity
        from vlaunch.cache.store.checkpoint import open_checkpoint
        from vlaunch.cache.store.plan import load_plan, plan_rank
        from vlaunch.cache.store.reader import fill

        rec, _ = identity.record(self.model)
        if rec.data != self.server.integrity.record.data:
            raise SwapError(f"cannot keep the served weights for a rollback: the files at "
                            f"{self.model} changed since the rank read them; swap with "
                            "--on-failure stop", ExitStatus.CHECKPOINT_CHANGED)
        specs = plan_rank(open_checkpoint(self.model), load_plan(self.plan), self.position)
        fill(specs, self.server.manifest, into, threads=self.threads,
             label=f"rank {self.server.rank} keeping the served weights")

    def with_checksums(self, manifest: Manifest, buffers: list[Any]) -> Manifest:
        """The manifest with crc32 per tensor where the rank's first load had them."""
        on = self.checksum if self.checksum is not None else self.backend.name == "cpu"
        if not on:
            return manifest
        from vlaunch.cache.store.manifest import with_checksums
        from vlaunch.cache.store.reader import checksums

        return with_checksums(manifest, checksums(manifest, buffers, self.threads))

    async def commit(self, msg: dict[str, Any]) -> None:
        """Cut over: serve the new slabs (double), or copy the new bytes into the served
        slabs once nothing maps them (in place)."""
        staged = self._staged(msg["version"], publish=True)
        staged.version = msg["version"]
        if staged.record is not None:
            changed = staged.record.restat()
            if changed:
                raise CheckpointChangedError(
                    f"the checkpoint at {staged.model} changed after rank {self.server.rank} "
                    f"staged it ({', '.join(changed[:4])}); swap again once it is written")
        if self.server.handing_over:
            raise SwapError("the cache is handing its slabs over to a copy-release engine")
        start = time.perf_counter()
        steps = ""
        if staged.mode == "double":
            self._commit_double(staged)
        else:
            await self._wait_unheld(msg["lease_wait_ms"] / 1000, "overwrite them")
            steps = await self._commit_in_place(staged, start)
        staged.committed = True
        log.info("rank %d: serving version %d (%s, %s) after a %.3fs cutover%s",
                 self.server.rank, staged.version, staged.label or staged.model, staged.mode,
                 time.perf_counter() - start, steps)
        self._answer_served("committed", staged.version)

    def _commit_double(self, staged: Staged) -> None:
        """Serve the staged slabs; the old ones stay (the old engine maps them) until finish."""
        assert staged.manifest is not None
        staged.previous = self._capture()
        slabs = staged.slabs
        fds = staging.slab_fds(slabs)
        for slab in slabs:
            slab.seal()
        staged.slabs = []  # served now: released by the release hook below

        buffers = staged.buffers

        def release() -> None:
            buffers.clear()  # the rank's views go with the slabs
            for slab in slabs:
                slab.release()

        self._install(ServedShard(staged.version, staged.model, staged.label, staged.fingerprint,
                              staged.manifest, fds, release, buffers,
                              self._layouts(staged.manifest.nbytes), False,
                              self._copier(fds, staged.manifest), staged.record,
                              staged.digests))
        staged.buffers = []

    async def _commit_in_place(self, staged: Staged, start: float) -> str:
        """Nothing maps the served slabs: copy the new bytes into them (in a thread), or, where
        the rank holds none it can write (an engine layout replaced them), free the old
        device memory first and copy into new slabs: never two copies. Returns the steps'
        times, for the cutover's log line."""
        assert staged.manifest is not None
        server = self.server
        previous = self._capture()
        target = self._writable()
        times = {"waited": time.perf_counter() - start}
        with server.swapping():  # no handoff, no layout request, until the copy is in
            at = time.perf_counter()
            # the old layouts derive from the old weights; nothing maps them any more
            server.replace_layouts(self._layouts(staged.manifest.nbytes)).close()
            if target is None:
                server.free_raw()
            times["freed"] = time.perf_counter() - at
            slabs = await asyncio.get_running_loop().run_in_executor(
                None, self._copy_in, staged, target, times)
        fds, release, copier = server.fds, server.release_hook, server.copier
        if slabs:
            target = [s.buffer() for s in slabs]
            fds = staging.slab_fds(slabs)
            views = target

            def release() -> None:
                views.clear()  # the rank's views go with the slabs
                for slab in slabs:
                    slab.release()

            copier = self._copier(fds, staged.manifest)
        previous.fds, previous.release, previous.buffers = [], None, None  # the same slabs
        staged.previous = previous
        self._install(ServedShard(staged.version, staged.model, staged.label, staged.fingerprint,
                              staged.manifest, fds, release, target, server.layouts, False,
                              copier, staged.record, staged.digests))
        # the staging's host memory goes at finish (or rollback), once the new engine serves:
        # unpinning 17 GB took 1.5 s of the cutover on an H200 host
        staged.buffers = []
        for slab in staged.slabs:  # a published version staged in host slabs
            slab.release()
        staged.slabs = []
        rate = staged.manifest.nbytes / max(times["copied"], 1e-9) / 1e9
        return " (" + ", ".join(f"{k} {v:.3f}s" for k, v in times.items()) + \
            f"; {rate:.1f} GB/s)"

    def _copy_in(self, staged: Staged, target: list[Any] | None,
                 times: dict[str, float]) -> list[Any]:
        """The staged bytes into `target`, or into new slabs (returned) where it is None;
        each step's seconds go into `times`."""
        assert staged.manifest is not None
        slabs: list[Any] = []
        at = time.perf_counter()
        if target is None:
            slabs = self.allocate(staged.manifest.slab_sizes, "on the device")
            target = [s.buffer() for s in slabs]
            times["allocated"] = time.perf_counter() - at
            at = time.perf_counter()
        staging.copy_bytes(target, staged.buffers)
        times["copied"] = time.perf_counter() - at
        at = time.perf_counter()
        for slab in slabs:
            slab.seal()
        times["sealed"] = time.perf_counter() - at
        return slabs

    def finish(self, msg: dict[str, Any]) -> None:
        """The new weights serve: drop the old ones (and the host copy)."""
        staged = self.staged
        if staged is None or not staged.committed or staged.version != msg["version"]:
            return
        self.staged = None
        previous = staged.previous
        if previous is not None and staged.mode == "double":
            discard(previous)
        # host buffers (in place: the staging and the kept copy, pinned on a GPU rank) go in a
        # thread: unpinning 34 GB takes seconds the loop must not wait; the next step waits
        self.releasing = _RELEASER.submit(staged.release)
        answer_trainer(staged, {"ok": True, "version": staged.version,
                                      "mode": staged.mode})
        log.info("rank %d: version %d serves; the old weights are dropped", self.server.rank,
                 staged.version)

    async def rollback(self, msg: dict[str, Any]) -> None:
        """Restore the old weights (a rank that did not commit drops what it staged)."""
        staged = self.staged
        if staged is not None and staged.committed:
            await self._restore(staged)
        self.staged = None
        if staged is not None:
            staged.release()
            answer_trainer(staged, protocol.error("swap", msg["message"] or
                                                        "rolled back", status=msg["status"]))
        self._answer_served("rolled_back", msg["version"])

    async def _restore(self, staged: Staged) -> None:
        """Serve what served before the commit again."""
        previous = staged.previous
        assert previous is not None
        if staged.mode == "double":
            discard(self._capture())
            self._install(previous)
            return
        if staged.backup is None:
            raise SwapError("no copy of the old weights was kept (--on-failure stop): rank "
                            f"{self.server.rank} cannot roll back", ExitStatus.SWAP_FAILED)
        await self._wait_unheld(30.0, "restore the old weights")
        server = self.server
        with server.swapping():  # nothing is handed out while the copy runs
            target = self._writable()
            assert target is not None  # the commit left writable raw slabs
            await asyncio.get_running_loop().run_in_executor(
                None, staging.copy_bytes, target, staged.backup)
        server.layouts.close()
        self._install(ServedShard(previous.version, previous.model, previous.label,
                              previous.fingerprint, previous.manifest, server.fds,
                              server.release_hook, target,
                              self._layouts(previous.manifest.nbytes),
                              False, server.copier, previous.record, previous.digests))

    def abort(self, msg: dict[str, Any]) -> None:
        """Drop what was staged and not committed (the served weights never changed): this
        swap's, or a published version the launcher was told of (a trainer's staging that it
        was not told of yet is the trainer's)."""
        if self.busy and (self.staged is None or not self.staged.committed):
            self.aborted = True  # the prepare or stage running now drops what it makes
        staged = self.staged
        if staged is None or staged.committed or not (
                staged.version == msg["version"] or staged.reply is not None):
            return
        self.staged = None
        staged.release()
        answer_trainer(staged, protocol.error("swap", msg["message"] or "aborted",
                                                    status=msg["status"]))
        log.info("rank %d: swap to version %d abandoned; still serving version %d",
                 self.server.rank, staged.version, self.version)

    # -------------------------------------------------------------------- the server

    def status(self) -> dict[str, Any]:
        """The weights the rank serves and what it has staged, for its status."""
        staged = self.staged
        return {"version": self.version, "model": self.model, "label": self.label,
                "staged": None if staged is None else {
                    "version": staged.version, "model": staged.model, "label": staged.label,
                    "mode": staged.mode, "committed": staged.committed,
                    "bytes": sum(self.held().values())}}

    def held(self) -> dict[str, int]:
        """Bytes a swap holds beyond the served weights, by where: the staging (the device's
        slabs, or "host"), the host copy of the old weights, the old slabs until finish."""
        staged = self.staged
        if staged is None:
            return {}
        device = self.server.device
        host = device if self.backend.name == "cpu" else "host"
        out: dict[str, int] = {}
        for b in staged.buffers:
            where = device if on_device(b) else host
            out[where] = out.get(where, 0) + len(b)
        for b in staged.backup or []:
            out[host] = out.get(host, 0) + len(b)
        previous = staged.previous
        if previous is not None and staged.mode == "double":  # the old slabs, until finish
            out[device] = out.get(device, 0) + previous.layouts.nbytes + (
                previous.manifest.nbytes if previous.fds else 0)
        return out

    def holders(self) -> list[str]:
        """What still maps, or reads, the served slabs (an in-place copy must wait)."""
        server = self.server
        out = [f"{x.who} ({x.mode}{_named(x.client, x.pid)})" for x in
               server.leases.values() if x.mode]
        if server.raw_readers:
            out.append(f"{server.raw_readers} read(s) of the slabs (vlaunch verify, a seed "
                       "stream)")
        if server.openers.unknown:
            out.append(f"processes it cannot name ({server.openers.unknown})")
        elif server.openers.alive():  # those that hold a lease now are named above
            opened = server.openers.describe(frozenset(x.pid for x in server.leases.values()
                                                       if x.mode))
            out += [opened] if opened else []
        copier = server.copier
        if copier is not None and copier.status()["in_flight"]:
            out.append("a copy for a copy-mode engine")
        return out

    async def _wait_unheld(self, seconds: float, what: str) -> None:
        """Wait up to `seconds` until nothing maps the served slabs; SwapError otherwise."""
        deadline = time.monotonic() + seconds
        while True:
            held = self.holders()
            if not held:
                return
            if time.monotonic() >= deadline:
                raise SwapError(f"rank {self.server.rank} cannot {what}: still mapped by "
                                f"{'; '.join(held[:4])} after {seconds:g} s; stop those "
                                "processes, or swap double-buffered (--mode double)")
            await asyncio.sleep(POLL)

    def _staged(self, version: int, publish: bool = False) -> Staged:
        staged = self.staged
        if staged is None or not (staged.version == version or
                                  (publish and staged.version == 0 and staged.label)):
            raise SwapError(f"rank {self.server.rank} has nothing staged for version {version}")
        return staged

    def _capture(self) -> ServedShard:
        """What the server serves now."""
        s = self.server
        integrity = s.integrity
        return ServedShard(self.version, self.model, self.label, s.fingerprint, s.manifest,
                       s.fds, s.release_hook, self.buffers, s.layouts, s.raw_released, s.copier,
                       integrity.record if integrity is not None else None, self.digests,
                       s.openers)

    def _install(self, w: ServedShard) -> None:
        """Serve `w`: the server's fields switch at once (the loop's thread, or a thread while
        the server refuses handoffs: `swapping`), then the version and the integrity's files."""
        s = self.server
        s.install(w)
        self.version, self.model, self.label = w.version, w.model, w.label
        self.buffers, self.digests = w.buffers, w.digests
        if s.integrity is not None:
            s.integrity.rebase(w.model, w.record, w.buffers, w.label)

    def raw_closed(self) -> None:
        """The server let go of its raw slabs (an engine layout or a copy-release replaced
        them): drop every view of them too, or their memory stays mapped."""
        if self.buffers is not None:
            self.buffers.clear()
        self.buffers = None

    def _writable(self) -> list[Any] | None:
        """Writable views of the served raw slabs (None where the rank has none: an engine
        layout replaced them, or a CPU rank adopted sealed slabs from the escrow)."""
        s = self.server
        if s.raw_released or not s.fds:
            return None
        if self.buffers is None and self.backend.name == "cuda":
            self.buffers = [self.backend.map_fd(fd, n, readonly=False)
                            for fd, n in zip(s.fds, s.manifest.slab_sizes, strict=True)]
        return self.buffers

    def _layouts(self, nbytes: int) -> LayoutStore:
        from vlaunch.cache.rank.layouts import LayoutStore

        return LayoutStore(self.backend, nbytes)

    def _copier(self, fds: list[int], manifest: Manifest) -> Copier | None:
        if self.backend.name != "cuda" or not fds:
            return None
        from vlaunch.cache.rank.copies import RankCopier

        return RankCopier(self.backend, fds, manifest.slab_sizes)


def _named(client: str, pid: int) -> str:
    """", what the client calls itself" unless that is only its pid again."""
    return "" if not client or client == f"pid {pid}" else f", {client[:64]}"


def _dup(fd: int) -> int:
    import os

    return os.dup(fd)

