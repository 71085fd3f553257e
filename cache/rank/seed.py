"""Seeding: fill a new rank's slabs from the same rank of a running replica, not from disk.

Same host (`unix:/source/socket-dir`): the seeding rank connects to the source rank's socket
(the socket directory checks and SO_PEERCRED apply), takes the manifest and the slab fds, maps
them read-only, copies into its own new slabs (device to device on CUDA, memcpy on CPU) and
unmaps. Across hosts (`tcp://HOST:BASE`): the source listens on BASE + rank only when given a
token (seedsource.py); every connection's first request must carry it (compared in constant
time). The seeding rank asks for the fingerprint, the manifest and the artifacts on one
connection, then opens more and receives the slabs' byte ranges on all of them at once
(seedwire.py). Every read has a timeout, every size is capped, nothing is unpickled. Either
way the fingerprint is checked first, and the tensors' checksums, when the source's manifest
has them, are verified after the copy; the rank serves nothing before. On CPU slabs (numpy
arrays: `slabs.SlabBytes`) neither side imports torch.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import (
    ArtifactError,
    CacheBrokenError,
    ProtocolError,
    SeedError,
    VlaunchError,
)
from vlaunch.cache.rank import seedwire
from vlaunch.cache.rank.seedsource import source_port
from vlaunch.cache.store.artifacts import Artifact
from vlaunch.cache.store.manifest import Manifest
from vlaunch.cache.store.slabs import on_device

if TYPE_CHECKING:
    from vlaunch.cache.store.slabs import SlabBytes

log = logging.getLogger("vlaunch.cache.rank.seed")
CHUNK = 16 << 20
TIMEOUT = 30.0
SEED_IGNORED = ("device_uuid", "driver")
"""Fingerprint fields that may differ between replicas: they do not shape the bytes."""


@dataclass
class Seeded:
    """What a seeding brought: the manifest (with the source's checksums) and artifacts."""

    manifest: Manifest
    artifacts: list[Artifact]
    seconds: float
    copy_seconds: float = 0.0
    """The bytes' move alone: map + copy + unmap (same host) or the slab streams (TCP)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each step, in order (same host: connect, ask, map, copy, unmap, artifacts;
    TCP: ask (fingerprint, manifest, artifacts), connect (the other streams), streams,
    verify)."""
    streams: int = 0
    """TCP connections the bytes came on (0: same host)."""


class _Laps:
    """Seconds between successive `lap(name)` calls."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name], self.last = now - self.last, now


def parse_source(spec: str) -> tuple[str, str, int]:
    """`unix:/dir` or `tcp://host:base_port` -> (scheme, host or dir, base port)."""
    if spec.startswith("unix:"):
        return "unix", spec[5:], 0
    if spec.startswith("tcp://"):
        host, _, port = spec[6:].rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return "tcp", host.strip("[]"), int(port)
    raise SeedError(f"bad --seed {spec!r}: use unix:/path/to/source/socket-dir or "
                    "tcp://HOST:BASE_PORT")


def check_fingerprint(source: dict[str, Any], ours: fp.Fingerprint) -> None:
    """Refuse a source whose weights differ from ours, naming every differing field."""
    diff = [d for d in fp.compare(source, ours) if d[0] not in SEED_IGNORED]
    if diff:
        fields = "; ".join(f"{f}: source={s!r} ours={o!r}" for f, s, o in diff)
        raise SeedError(f"seed source holds different weights: {fields}; seed from a replica "
                        "started with the same model, plan and layout")


def check_layout(source: Manifest, ours: Manifest) -> None:
    """The source's tensors must sit where ours do (checksums aside)."""
    strip = [(t.name, t.dtype, t.shape, t.stride, t.slab, t.offset, t.nbytes)
             for t in source.tensors]
    if source.slab_sizes != ours.slab_sizes or strip != [
            (t.name, t.dtype, t.shape, t.stride, t.slab, t.offset, t.nbytes)
            for t in ours.tensors]:
        raise SeedError("seed source packs its slabs differently; run the same vlaunch version "
                        "and plan on both replicas")


# ------------------------------------------------------------------------ same host


def seed_unix(directory: str, rank: int, ours: fp.Fingerprint, manifest: Manifest,
              slabs: list[SlabBytes], device: str, *, timeout: float = TIMEOUT,
              role: str = "target") -> Seeded:
    """Copy the source rank's slabs (mapped from its fds) into `slabs`."""
    from vlaunch.cache.client import requests
    from vlaunch.cache.contract.connection import Connection
    from vlaunch.cache.contract.sockdir import socket_path

    start = time.perf_counter()
    laps = _Laps()
    try:
        client = Connection(socket_path(directory, rank, role), timeout=timeout,
                            client="seed")
    except VlaunchError as exc:
        raise SeedError(f"seed source unreachable: {exc}") from None
    try:
        laps.lap("connect")
        check_fingerprint(client.status()["fingerprint"], ours)
        source = requests.manifest(client)
        check_layout(source, manifest)
        # share: we map the source read-only while we copy (a copy mode would have a GPU
        # source make a copy of its own for us first)
        _, fds = client.request({"op": "open", "mode": "share"})
        laps.lap("ask")
        mapped = _map_source(fds, source.slab_sizes, device)
        laps.lap("map")
        for dst, src in zip(slabs, mapped, strict=True):
            _copy(dst, src)
        _synchronize(slabs)  # every copy done before the source's memory is unmapped
        laps.lap("copy")
        mapped.clear()  # unmaps: we no longer depend on the source
        laps.lap("unmap")
        moved = sum(laps.phases[k] for k in ("map", "copy", "unmap"))
        held = [Artifact(k, h, requests.artifact_get(client, k, h) or b"") for k, h, _ in
                requests.artifact_list(client)]
        laps.lap("artifacts")
    except (VlaunchError, OSError) as exc:
        if isinstance(exc, SeedError):
            raise
        raise SeedError(f"seeding from {directory} failed: {exc}") from None
    finally:
        client.close()
    _verify(source, slabs)
    laps.lap("close+verify")
    return Seeded(source, [a for a in held if a.data], time.perf_counter() - start, moved,
                  laps.phases)


def _map_source(fds: list[int], sizes: tuple[int, ...], device: str) -> list[SlabBytes]:
    """Map the source's slab fds read-only, as our own slabs' bytes are; closes every fd."""
    from vlaunch.cache.store.slabs import backend_for

    try:
        if len(fds) != len(sizes):
            raise CacheBrokenError(f"cache sent {len(fds)} fds for {len(sizes)} slabs")
        backend = backend_for(device)
        return [backend.map_fd(fd, size, readonly=True) for fd, size in zip(fds, sizes,
                                                                            strict=True)]
    finally:
        wire.close_fds(fds)


def _synchronize(slabs: list[SlabBytes]) -> None:
    """Wait for the copies queued on the CUDA slabs' device (nothing to wait for on CPU)."""
    if slabs and on_device(slabs[0]):
        import torch

        torch.cuda.synchronize(slabs[0].device)


def _copy(dst: SlabBytes, src: SlabBytes, threads: int = 8) -> None:
    """Copy a slab: on CUDA one device-to-device copy (both sides are device memory: the
    source's slab is mapped from its fd on our device, no host round trip); on CPU (numpy,
    which copies without the GIL) in chunks on several threads, so that the page faults of the
    fresh destination (and of the source mapping) are taken in parallel."""
    if on_device(dst) != on_device(src):
        raise SeedError(f"seeding maps the source on {_where(src)} but our slabs are on "
                        f"{_where(dst)}; start both replicas with the same --device")
    if on_device(dst):
        dst.copy_(src)
        return
    import numpy as np

    if len(dst) <= CHUNK:
        np.copyto(dst, src)
        return
    from concurrent.futures import ThreadPoolExecutor

    def one(at: int) -> None:
        np.copyto(dst[at:at + CHUNK], src[at:at + CHUNK])

    with ThreadPoolExecutor(threads, thread_name_prefix="vlaunch-seed") as pool:
        list(pool.map(one, range(0, len(dst), CHUNK)))


def _where(b: SlabBytes) -> str:
    """The device slab bytes live on, for a message."""
    return str(b.device) if on_device(b) else "cpu"


# ----------------------------------------------------------------------- over TCP


def seed_tcp(host: str, port: int, token: str, ours: fp.Fingerprint, manifest: Manifest,
             slabs: list[SlabBytes], *, timeout: float = TIMEOUT,
             streams: int = seedwire.DEFAULT_STREAMS) -> Seeded:
    """Receive the source rank's slabs over TCP into `slabs`, on `streams` connections (one
    for a source of an earlier version, which serves whole slabs on one)."""
    start = time.perf_counter()
    laps = _Laps()
    socks: list[socket.socket] = []
    try:
        socks.append(seedwire.connect(host, port, token, timeout))
        reply = seedwire.ask(socks[0], {"op": "seed_manifest"})
        check_fingerprint(reply.get("fingerprint") or {}, ours)
        source = Manifest.from_wire(reply.get("manifest"))
        check_layout(source, manifest)
        artifacts = _artifacts(socks[0], reply.get("artifacts"))
        laps.lap("ask")
        if reply.get("ranges") is True:
            work = seedwire.ranges(source.slab_sizes)
            offered = reply.get("streams")
            most = offered if type(offered) is int and offered > 0 else 1
            for _ in range(max(1, min(streams, most, len(work))) - 1):
                socks.append(seedwire.connect(host, port, token, timeout))
            laps.lap("connect")
            seedwire.receive(socks, work, slabs)
        else:  # a source of an earlier version: whole slabs, one after another
            seedwire.receive(socks, [(i, 0, n) for i, n in enumerate(source.slab_sizes)],
                             slabs, op="seed_slab")
        _synchronize(slabs)
        laps.lap("streams")
    except (OSError, EOFError, ProtocolError, ArtifactError, ValueError, TypeError) as exc:
        raise SeedError(f"seeding from {host}:{port} failed: {exc or 'timed out'}") from None
    finally:
        for sock in socks:
            sock.close()
    _verify(source, slabs)
    laps.lap("verify")
    return Seeded(source, artifacts, time.perf_counter() - start,
                  laps.phases.get("connect", 0.0) + laps.phases["streams"], laps.phases,
                  len(socks))


def _artifacts(sock: socket.socket, listing: Any) -> list[Artifact]:
    """Every artifact the source listed, fetched on the control connection."""
    from vlaunch.cache.store.artifacts import decode

    out = []
    for kind, key, _ in listing or []:
        got = seedwire.ask(sock, {"op": "artifact_get", "kind": kind, "key": key}, miss=True)
        if got.get("ok"):
            out.append(Artifact(str(kind), str(key), decode(got["data"])))
    return out


def _verify(source: Manifest, slabs: list[SlabBytes]) -> None:
    """Check the copied bytes against the source manifest's checksums, when it has them."""
    if not source.tensors or any(t.checksum is None for t in source.tensors):
        return
    from vlaunch.cache.store.reader import checksums

    got = checksums(source, slabs)
    bad = [t.name for t in source.tensors if got.get(t.name) != t.checksum]
    if bad:
        raise SeedError(f"seeded bytes fail their checksums ({len(bad)} tensors, first "
                        f"{bad[0]!r}); the stream was corrupted in transit")


def seed_into(spec: str, token: str, rank: int, ours: fp.Fingerprint, manifest: Manifest,
              slabs: list[SlabBytes], device: str, *, timeout: float = TIMEOUT,
              role: str = "target", world: int = 0,
              streams: int = seedwire.DEFAULT_STREAMS) -> Seeded:
    """Seed `slabs` from the source named by --seed (a draft rank from the source's draft
    group: its socket, or its port after the target's block of `world`)."""
    from vlaunch.cache.contract.roles import seat

    scheme, where, base = parse_source(spec)
    if scheme == "unix":
        return seed_unix(where, rank, ours, manifest, slabs, device, timeout=timeout,
                         role=role)
    if not token:
        raise SeedError("seeding over TCP needs the source's token: set --seed-token or "
                        "VLAUNCH_SEED_TOKEN")
    return seed_tcp(where, source_port(base, seat(role, rank, world)), token, ours, manifest,
                    slabs, timeout=timeout, streams=streams)
