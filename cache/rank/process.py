"""The cache rank process: lock, load (or adopt escrowed slabs), bind, report ready, serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import time
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import protocol, settings, wire
from vlaunch.cache.contract.errors import ProtocolError, VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.launch import RankArgs, check_seed_listening
from vlaunch.cache.contract.logs import setup_logging
from vlaunch.cache.contract.notify import SdNotify
from vlaunch.cache.contract.roles import seat, stem
from vlaunch.cache.contract.sockdir import RankLock, ensure_socket_dir
from vlaunch.cache.rank.connections import raise_nofile_limit
from vlaunch.cache.rank.failures import out_of_memory
from vlaunch.cache.rank.served import Served
from vlaunch.cache.store import collector
from vlaunch.cache.store.fingerprints import fingerprint
from vlaunch.cache.store.identity import CheckpointIdentity
from vlaunch.cache.store.manifest import Manifest
from vlaunch.cache.store.ranks import Position
from vlaunch.cache.store.target import Target

if TYPE_CHECKING:
    from collections.abc import Coroutine
    from pathlib import Path
    from types import FrameType

    from vlaunch.cache.rank.daemon import CacheServer
    from vlaunch.cache.rank.parts import IntegrityHost, IntegrityPart, SwapHost, SwapPart
    from vlaunch.cache.store.artifacts import ArtifactStore
    from vlaunch.cache.store.shard import Shard
    from vlaunch.cache.store.slabs import Backend

log = logging.getLogger("vlaunch.cache")


def main(opts: RankArgs) -> int:
    """Run a cache rank to completion; returns its exit status."""
    rank = opts.rank
    setup_logging("vlaunch-cache", "INFO", rank)
    signal.signal(signal.SIGTERM, _exit_quietly)  # while loading; the loop takes over later
    try:
        _position(opts)  # a rank outside its world is a usage error before anything else
        return _run(opts, rank)
    except VlaunchError as exc:
        log.error("%s", exc)
        return int(exc.status)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        return _failed(exc, opts)


def _failed(exc: Exception, opts: RankArgs) -> int:
    """Log an unexpected failure of the rank in one line where it is the operator's to fix."""
    if out_of_memory(exc):
        log.error("out of memory: %s; rank %d needs room for its shard's slabs, its libraries "
                  "(torch on a GPU) and %d reader threads: raise the memory limit (ulimit -v, "
                  "the container's or the unit's MemoryMax) or lower --threads",
                  _root_cause(exc), opts.rank, opts.threads)
        return int(ExitStatus.OUT_OF_MEMORY)
    if isinstance(exc, OSError):  # reading the checkpoint (or the device) failed underneath us
        log.error("I/O error: %s; check the disk and the file permissions", exc)
        return int(ExitStatus.IO_ERROR)
    log.exception("internal error (a bug: please report it with this traceback)")
    return int(ExitStatus.INTERNAL)


def _root_cause(exc: BaseException) -> str:
    """The innermost cause's message, on one line (numpy wraps a library that failed to map
    in a page of advice)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return " ".join(str(exc).split()) or type(exc).__name__


def _exit_quietly(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _run(opts: RankArgs, rank: int) -> int:
    from vlaunch.cache.contract.sockdir import default_socket_dir
    from vlaunch.cache.store.slabs import backend_for

    check_seed_listening(opts.seed_listen_port, opts.seed_token)  # as vlaunch run checks it
    directory = ensure_socket_dir(opts.socket_dir or default_socket_dir())
    lock = RankLock(directory, rank, opts.role)
    lock.acquire()
    try:
        _check_socket_path(lock.socket)
        soft, hard = raise_nofile_limit()
        log.debug("RLIMIT_NOFILE %d (hard %d)", soft, hard)
        backend = backend_for(opts.device)  # the one the fingerprint's device fields are of
        from vlaunch.cache.store.artifacts import ArtifactStore

        store = ArtifactStore(_artifact_dir(opts.artifact_dir, stem(opts.role, rank)))
        target = _target(opts, lock.socket)
        if opts.adopt_fd >= 0:
            served = _adopt(opts.adopt_fd, store)
        elif opts.seed:
            with collector.paused():  # per-tensor objects that live as long as the rank
                served = _seed_or_load(opts, target, backend, store)
        else:
            with collector.paused():
                served = _load(opts, target, backend)
        asyncio_run(_serve(_server(opts, served, target, backend, store, lock.socket),
                           lock, opts))
        log.info("stopped; socket and lock removed")
        return int(ExitStatus.OK)
    finally:
        lock.release()


def _server(opts: RankArgs, served: Served, target: Target, backend: Backend,
            store: ArtifactStore, path: Path) -> CacheServer:
    """The rank's server, built with its parts (rank/parts.py): the engine layouts, the
    copier, who opened the slabs, the integrity of their files, and the swap."""
    from vlaunch.cache.rank.daemon import CacheServer
    from vlaunch.cache.rank.integrity import Integrity
    from vlaunch.cache.rank.layouts import LayoutStore
    from vlaunch.cache.rank.openers import Openers
    from vlaunch.cache.rank.swap import RankSwap

    layouts = LayoutStore(backend, served.manifest.nbytes)
    for layout in served.layouts:
        layouts.add(layout)
    copier = None
    if backend.name == "cuda" and served.fds:  # the rank makes copy-mode engines' copies
        from vlaunch.cache.rank.copies import RankCopier

        copier = RankCopier(backend, served.fds, served.manifest.slab_sizes)
    openers = Openers(opts.rank)
    if opts.adopt_fd >= 0:  # who maps them now: what the rank that exited had noted
        openers.adopt(served.fds, backend.name, opened=list(served.opened),
                      incomplete=served.incomplete)

    def integrity(host: IntegrityHost) -> IntegrityPart:
        return Integrity(host, opts.model, opts.plan, path, published=served.label).start()

    def swap(host: SwapHost) -> SwapPart:
        return RankSwap(host, target, backend=backend, threads=opts.threads,
                        version=served.version, label=served.label, checksum=opts.checksum)

    return CacheServer(opts.rank, served, device=backend.device, artifacts=store,
                       layouts=layouts, copier=copier, openers=openers, integrity=integrity,
                       swap=swap)


def _load(opts: RankArgs, target: Target, backend: Backend) -> Served:
    """Read the rank's shard from the checkpoint (between two looks at its files)."""
    from vlaunch.cache.rank.integrity import checked_load
    from vlaunch.cache.store.manifest import with_checksums
    from vlaunch.cache.store.progress import reported_on
    from vlaunch.cache.store.reader import checksums
    from vlaunch.cache.store.shard import load_shard

    rank = target.rank
    with reported_on(opts.ready_fd, rank):  # the launcher shows loaded bytes while we load
        shard = checked_load(opts.model, rank, lambda: load_shard(
            opts.model, opts.plan, target.position, backend, threads=opts.threads,
            label=f"rank {rank} loading"))
    manifest = shard.manifest
    if opts.checksum if opts.checksum is not None else backend.name == "cpu":
        manifest = with_checksums(manifest, checksums(manifest, shard.tensors, opts.threads))
    log.info("loaded %d tensors, %.2f GB in %d slab(s) on %s in %.2fs (%.2f GB/s); opened, "
             "planned and allocated in %.3fs of it", len(manifest.tensors),
             manifest.nbytes / 1e9, len(shard.slabs), backend.device, shard.seconds,
             manifest.nbytes / 1e9 / max(shard.seconds, 1e-9), shard.prepared)
    if opts.verify:  # every byte against the files, once, before ready (79 on a mismatch)
        from vlaunch.cache.rank.integrity import verify_loaded

        verify_loaded(opts.model, opts.plan, target.position, shard.manifest, shard.tensors,
                      rank, opts.threads)
    return _finish(opts, target, shard, manifest)


def _finish(opts: RankArgs, target: Target, shard: Shard, manifest: Manifest) -> Served:
    """Seal and export a filled shard; its fingerprint and release hook."""
    for slab in shard.slabs:
        slab.seal()
    fds = [slab.export_fd() for slab in shard.slabs]

    def release() -> None:
        shard.tensors.clear()
        for slab in shard.slabs:
            slab.release()

    return Served(manifest, fds, _fingerprint(opts, target, shard), release)


def _fingerprint(opts: RankArgs, target: Target, shard: Shard) -> fp.Fingerprint:
    """The fingerprint of what the rank read: the Target's, built as an engine builds it
    (store/target.py), from the identity of the files the shard came from."""
    from vlaunch.cache.rank.integrity import data_identity

    read = CheckpointIdentity(shard.checkpoint.identity, data_identity(opts.model, shard))
    return fingerprint(target, read, shard.plan_identity)


def _target(opts: RankArgs, socket: Path) -> Target:
    """What this rank serves, as an engine's Target names it: the same fields, so that both
    ends build the same fingerprint."""
    return Target(opts.model, _position(opts), opts.device, opts.plan, opts.kernel_backends,
                  opts.loader, settings.get("VLAUNCH_QUANTIZATION"), opts.role, socket)


def _position(opts: RankArgs) -> Position:
    """Where this rank sits in the tensor/pipeline/data-parallel world."""
    return Position.from_global(opts.rank, opts.tensor_parallel_size,
                                opts.pipeline_parallel_size, opts.data_parallel_size)


def _artifact_dir(root: str, name: str) -> str:
    """Each rank keeps its artifacts in its own subdirectory of --artifact-dir (its socket's
    stem: rank-N, draft-rank-N)."""
    return os.path.join(root, name) if root else ""


def _seed_or_load(opts: RankArgs, target: Target, backend: Backend, store: ArtifactStore
                  ) -> Served:
    """Seed from a running replica; on failure, end with SEED_FAILED or (--seed-fallback)
    load from disk with a warning."""
    from vlaunch.cache.contract.errors import SeedError
    from vlaunch.cache.rank.seed import seed_into
    from vlaunch.cache.store.shard import empty_shard

    try:
        shard = empty_shard(opts.model, opts.plan, target.position, backend)
        try:
            seeded = seed_into(opts.seed, opts.seed_token, target.rank,
                               _fingerprint(opts, target, shard), shard.manifest,
                               shard.tensors, backend.device, timeout=opts.seed_timeout,
                               role=opts.role, world=target.position.world_size,
                               streams=opts.seed_streams)
        except BaseException:
            shard.tensors.clear()
            for slab in shard.slabs:
                slab.release()
            raise
    except SeedError as exc:
        if not opts.seed_fallback:
            raise
        log.warning("seeding failed (%s); loading from disk instead (--seed-fallback)", exc)
        return _load(opts, target, backend)
    for kind, key, data in seeded.artifacts:
        store.put(kind, key, data)
    log.info("seeded %.2f GB and %d artifact(s) from %s in %.2fs (%.2f GB/s%s); serving on "
             "our own", seeded.manifest.nbytes / 1e9, len(seeded.artifacts), opts.seed,
             seeded.seconds, seeded.manifest.nbytes / 1e9 / max(seeded.seconds, 1e-9),
             f", {seeded.streams} streams" if seeded.streams else "")
    return _finish(opts, target, shard, seeded.manifest)


def _adopt(fd: int, store: ArtifactStore) -> Served:
    """Take over escrowed slabs (fds + manifest) from the launcher instead of loading: the raw
    layout's (unless it was released), then any engine layout's (docs/engine-layout.md), and
    the escrowed artifacts into `store`; with the version and label a swap made the rank
    serve."""
    from vlaunch.cache.rank.layouts import EngineLayout, LayoutError, adopt

    layouts: list[EngineLayout] = []
    with socket.socket(fileno=fd) as sock:
        msg, fds = wire.recv_frame(sock)
        try:
            while True:
                frame, layout_fds = wire.recv_frame(sock)
                if frame.get("event") == "artifact":
                    _adopt_artifact(frame, layout_fds, store)
                    continue
                try:
                    if frame.get("event") != "layout":
                        raise ProtocolError("adopt channel carried an unknown frame")
                    layouts.append(adopt(frame, layout_fds))
                except (LayoutError, KeyError, TypeError, AttributeError) as exc:
                    for x in layout_fds:
                        os.close(x)
                    raise ProtocolError(f"bad escrowed engine layout: {exc}") from None
        except EOFError:
            pass
    if msg.get("event") != "escrow" or not isinstance(msg.get("fingerprint"), dict):
        raise ProtocolError("adopt channel did not carry an escrow frame")
    from vlaunch.cache.store.columns import from_wire

    manifest = from_wire(msg["manifest"])  # the columns form the ready frame gave the escrow
    released = msg.get("released") is True and not fds
    if len(fds) != len(manifest.slab_sizes) and not released:
        raise ProtocolError(f"escrow carries {len(fds)} fds for {len(manifest.slab_sizes)} slabs")
    log.info("adopted %d escrowed slab(s), %.2f GB%s, and %d engine layout(s), without reading "
             "the checkpoint", len(fds), 0 if released else manifest.nbytes / 1e9,
             " (raw layout released)" if released else "", len(layouts))
    return Served(manifest, fds, {str(k): str(v) for k, v in msg["fingerprint"].items()},
                  layouts=layouts, raw_released=released, version=int(msg.get("version", 0)),
                  label=str(msg.get("label", "")), incomplete=msg.get("incomplete") is True,
                  opened=_opened(msg.get("opened", [])))


def _opened(rows: Any) -> tuple[tuple[int, float], ...]:
    """The escrow's openers of the slabs: [pid, start time] rows, bounded and checked."""
    from vlaunch.cache.rank.openers import MAX_OPENERS

    if not isinstance(rows, list) or len(rows) > MAX_OPENERS or not all(
            isinstance(r, list) and len(r) == 2 and type(r[0]) is int and r[0] > 0
            and type(r[1]) in (int, float) and r[1] > 0 for r in rows):
        raise ProtocolError("bad escrowed openers: [pid, start time] rows expected")
    return tuple((r[0], float(r[1])) for r in rows)


def _adopt_artifact(frame: dict[str, Any], fds: list[int], store: ArtifactStore) -> None:
    """Keep an escrowed artifact; a bad one is one warning (the engine tunes again)."""
    from vlaunch.cache.store.artifacts import decode

    for x in fds:
        os.close(x)
    try:
        protocol.validate_event(frame, "artifact")
        store.put(frame["kind"], frame["key"], decode(frame["data"]))
    except VlaunchError as exc:
        log.warning("escrowed artifact not adopted: %s", exc)
        return
    log.info("adopted escrowed artifact %s/%s", frame["kind"], frame["key"][:12])


def asyncio_run(coro: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine on uvloop."""
    import uvloop

    uvloop.run(coro)


async def _serve(server: CacheServer, lock: RankLock, opts: RankArgs) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    seeding = None
    if opts.seed_listen_port and opts.seed_token:
        from vlaunch.cache.rank.seedsource import SeedSource, source_port

        seeding = await SeedSource(server, opts.seed_token, timeout=opts.seed_timeout).start(
            opts.seed_listen_host, source_port(opts.seed_listen_port, seat(
                opts.role, server.rank, _position(opts).world_size)))
    task = asyncio.ensure_future(server.serve(lock.socket, stop))
    bound = asyncio.ensure_future(server.bound.wait())
    await asyncio.wait({task, bound}, return_when=asyncio.FIRST_COMPLETED)
    bound.cancel()
    if server.bound.is_set() and not task.done():  # never ready on a socket we did not bind
        _report_ready(server, lock, opts)
    await task
    if seeding is not None:
        seeding.close()


def _check_socket_path(path: Path) -> None:
    """Refuse, before loading, a socket path that holds a stray file or a symlink (the lock
    holder already removed a stale socket of a killed rank)."""
    from vlaunch.cache.rank.daemon import socket_path_taken

    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        kind = "a symlink" if stat.S_ISLNK(mode) else "a socket" if stat.S_ISSOCK(mode) \
            else "a directory" if stat.S_ISDIR(mode) else "a file"
        raise socket_path_taken(path, f"the path is {kind}")


def _report_ready(server: CacheServer, lock: RankLock, opts: RankArgs) -> None:
    """Tell whoever waits: the launcher (ready fd, with escrow), systemd, and the log."""
    from vlaunch.cache.store import columns

    rank = server.rank
    log.info("ready: serving %.2f GB on %s", server.manifest.nbytes / 1e9, lock.socket)
    if opts.ready_fd >= 0:
        sock = socket.socket(fileno=opts.ready_fd)
        try:
            weights = {"version": server.swap.version, "model": server.swap.model,
                       "label": server.swap.label} if server.swap is not None else {}
            wire.send_frame(sock, protocol.event(
                "ready", rank=rank, pid=os.getpid(), socket=str(lock.socket), at=time.time(),
                bytes=server.manifest.nbytes, device=server.device,
                manifest=columns.to_json(server.manifest), fingerprint=server.fingerprint,
                **weights), server.fds)
        except OSError:
            sock.close()
            raise
        server.keep_escrow(sock)  # the channel stays open, both ways
    notify = SdNotify()  # `vlaunch cache` under its own unit; never blocks, never raises
    notify.send({"READY": "1", "STATUS": f"rank {rank} serving"})
    notify.close()
