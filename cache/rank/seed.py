"""Seeding: fill a new rank's slabs from the same rank of a running replica, not from disk.

Same host (`unix:/source/socket-dir`): the seeding rank connects to the source rank's socket
(the socket directory checks and SO_PEERCRED apply), takes the manifest and the slab fds, maps
them read-only, copies into its own new slabs (device to device on CUDA, memcpy on CPU) and
unmaps. Across hosts (`tcp://HOST:BASE`): the source listens on BASE + rank only when given a
token; the first request must carry it (compared in constant time), then the client asks for
the manifest and each slab, whose bytes follow a JSON header as a raw, length-announced
stream. Every read has a timeout, every size is capped, nothing is unpickled. Artifacts travel
with the weights. Either way the fingerprint is checked first, and the tensors' checksums,
when the source's manifest has them, are verified after the copy. On CPU slabs (numpy arrays:
`slabs.SlabBytes`) neither side imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.errors import (
    ArtifactError,
    CacheBrokenError,
    ProtocolError,
    SeedError,
    VlaunchError,
)
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
    artifacts: list[tuple[str, str, bytes]]
    seconds: float
    copy_seconds: float = 0.0
    """The bytes' move alone: map + copy + unmap (same host) or the slab streams (TCP)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each step, in order (same host: connect, ask, map, copy, unmap, artifacts)."""


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
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.contract.sockdir import socket_path

    start = time.perf_counter()
    laps = _Laps()
    try:
        client = CacheClient(socket_path(directory, rank, role), timeout=timeout,
                             client="seed")
    except VlaunchError as exc:
        raise SeedError(f"seed source unreachable: {exc}") from None
    try:
        laps.lap("connect")
        check_fingerprint(client.status()["fingerprint"], ours)
        source = client.manifest()
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
        artifacts = [(k, h, client.artifact_get(k, h) or b"") for k, h, _ in
                     client.artifact_list()]
        laps.lap("artifacts")
    except (VlaunchError, OSError) as exc:
        if isinstance(exc, SeedError):
            raise
        raise SeedError(f"seeding from {directory} failed: {exc}") from None
    finally:
        client.close()
    _verify(source, slabs)
    laps.lap("close+verify")
    return Seeded(source, [a for a in artifacts if a[2]], time.perf_counter() - start, moved,
                  laps.phases)


def _map_source(fds: list[int], sizes: tuple[int, ...], device: str) -> list[SlabBytes]:
    """Map the source's slab fds read-only, as our own slabs' bytes are; closes every fd."""
    from vlaunch.cache.client.connection import backend_for

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
             slabs: list[SlabBytes], *, timeout: float = TIMEOUT) -> Seeded:
    """Stream the source rank's slabs over TCP into `slabs`."""
    start = time.perf_counter()
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise SeedError(f"seed source {host}:{port} unreachable: {exc}; start the source with "
                        "--seed-listen-port and check the firewall") from None
    try:
        with sock:
            sock.settimeout(timeout)  # every read below is bounded by it
            _ask(sock, {"op": "seed_auth", "token": token})
            reply = _ask(sock, {"op": "seed_manifest"})
            check_fingerprint(reply.get("fingerprint") or {}, ours)
            source = Manifest.from_wire(reply.get("manifest"))
            check_layout(source, manifest)
            moved = time.perf_counter()
            staging = _Staging(slabs)
            for i, slab in enumerate(slabs):
                head = _ask(sock, {"op": "seed_slab", "slab": i})
                if head.get("nbytes") != source.slab_sizes[i]:
                    raise SeedError(f"seed source announced {head.get('nbytes')!r} bytes for "
                                    f"slab {i}, expected {source.slab_sizes[i]}")
                staging.receive(sock, slab, source.slab_sizes[i])
            _synchronize(slabs)
            moved = time.perf_counter() - moved
            artifacts = []
            for kind, key, _ in reply.get("artifacts") or []:
                got = _ask(sock, {"op": "artifact_get", "kind": kind, "key": key}, miss=True)
                if got.get("ok"):
                    from vlaunch.cache.store.artifacts import decode

                    artifacts.append((str(kind), str(key), decode(got["data"])))
    except (OSError, EOFError, ProtocolError, ArtifactError, ValueError, TypeError) as exc:
        raise SeedError(f"seeding from {host}:{port} failed: {exc or 'timed out'}") from None
    _verify(source, slabs)
    return Seeded(source, artifacts, time.perf_counter() - start, moved)


def _ask(sock: socket.socket, message: dict[str, Any], *, miss: bool = False) -> dict[str, Any]:
    wire.send_frame(sock, message)
    reply, fds = wire.recv_frame(sock)
    wire.close_fds(fds)
    if reply.get("ok") is not True and not (miss and reply.get("error") == "miss"):
        raise SeedError(f"seed source refused {message['op']}: {reply.get('error')}: "
                        f"{reply.get('message')}")
    return reply


class _Staging:
    """Receives raw slab bytes: straight into CPU slabs; into CUDA slabs through two pinned
    host buffers, one filling from the socket while the other is copied to the device."""

    def __init__(self, slabs: list[SlabBytes]) -> None:
        self.buffers: list[Any] = []  # pinned torch tensors
        self.events: list[Any] = []
        if slabs and on_device(slabs[0]):
            import torch

            self.buffers = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
                            for _ in range(2)]
            self.events = [None, None]

    def receive(self, sock: socket.socket, slab: SlabBytes, n: int) -> None:
        """Read exactly n bytes from `sock` into the start of `slab`."""
        from vlaunch.cache.store.reader import host_view

        if not self.buffers:
            _recv_exact(sock, host_view(slab[:n]), 0, n)
            return
        import torch

        for turn, at in enumerate(range(0, n, CHUNK)):
            want, i = min(CHUNK, n - at), turn % 2
            if self.events[i] is not None:
                self.events[i].synchronize()  # its last copy to the device has finished
            _recv_exact(sock, host_view(self.buffers[i][:want]), at, n)
            slab[at:at + want].copy_(self.buffers[i][:want], non_blocking=True)
            self.events[i] = torch.cuda.Event()
            self.events[i].record(torch.cuda.current_stream(slab.device))


def _recv_exact(sock: socket.socket, view: memoryview, at: int, n: int) -> None:
    """Fill `view` from the socket (`at`, `n`: where in the slab's n bytes, for the error)."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:], len(view) - got)
        if not k:
            raise EOFError(f"stream ended after {at + got} of {n} bytes (truncated)")
        got += k


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


# ------------------------------------------------------------------------ the source


class SeedSource:
    """Serves one rank's slabs to seeding replicas on a TCP port; needs a token."""

    def __init__(self, server: Any, token: str, *, timeout: float = TIMEOUT) -> None:
        if len(token) < 16:
            raise SeedError("the seed token is shorter than 16 characters; use a long random "
                            "one (openssl rand -hex 32)")
        self.server, self.token, self.timeout = server, token.encode(), timeout

    async def start(self, host: str, port: int) -> asyncio.AbstractServer:
        """Listen on host:port (the caller closes the returned server)."""
        try:
            srv = await asyncio.start_server(self._client, host, port, limit=1 << 16)
        except OSError as exc:
            raise SeedError(f"cannot listen for seeding on {host}:{port}: {exc.strerror}; "
                            "pick another --seed-listen-port or --seed-listen-host") from None
        log.info("rank %d: seed source listening on %s:%d", self.server.rank, host, port)
        return srv

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        loop = asyncio.get_running_loop()
        try:
            authed = False
            while True:
                op, f = await asyncio.wait_for(self._read(reader), self.timeout)
                if not authed:
                    if op != "seed_auth" or not hmac.compare_digest(
                            f.get("token", "").encode(), self.token):
                        raise ProtocolError("wrong or missing seed token")
                    authed = True
                    await self._send(writer, {"ok": True})
                    continue
                await self._dispatch(op, f, writer, loop, sock)
        except (EOFError, ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        except (ProtocolError, TimeoutError, asyncio.TimeoutError) as exc:
            reason = str(exc) or "stalled: no complete request in time"
            log.warning("rank %d: dropping seed client %s: %s", self.server.rank, peer, reason)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send(writer, protocol.error("forbidden", reason)),
                                       1.0)
        finally:
            writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> tuple[str, dict[str, Any]]:
        head = protocol.decode_header(await reader.readexactly(protocol.HEADER_SIZE),
                                      max_body=protocol.MAX_REQUEST_BODY)
        if head.nfds:
            raise ProtocolError("requests may not carry file descriptors")
        body = await reader.readexactly(head.length)
        return protocol.validate_request(protocol.decode_body(body))

    async def _send(self, writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
        writer.write(protocol.encode(msg))
        await asyncio.wait_for(writer.drain(), self.timeout)

    async def _dispatch(self, op: str, f: dict[str, Any], writer: asyncio.StreamWriter,
                        loop: asyncio.AbstractEventLoop, sock: Any) -> None:
        server = self.server
        if server.state != "serving":
            raise ProtocolError("this cache released its copy; it cannot seed")
        if server.handing_over:
            raise ProtocolError("this cache is handing its slabs over to a copy-release "
                                "engine; it cannot seed")
        if op == "seed_manifest":
            await self._send(writer, {"ok": True, "fingerprint": server.fingerprint,
                                      "manifest": server.manifest.to_wire(),
                                      "artifacts": server.artifacts.listing()})
        elif op == "seed_slab":
            await self._stream_slab(f["slab"], writer)
        elif op == "artifact_get":
            reply, _ = server.handle_artifact_get(None, f)
            await self._send(writer, reply)
        else:
            raise ProtocolError(f"{op} is not a seeding request")

    async def _stream_slab(self, index: int, writer: asyncio.StreamWriter) -> None:
        """Stream one slab from a mapping of our own, made for this stream and dropped after
        it: a mapping kept for later would hold the memory after a copy-release. While it
        runs the rank hands no slab over (`CacheServer.reading_raw`)."""
        sizes = self.server.manifest.slab_sizes
        if index >= len(sizes):
            raise ProtocolError(f"no slab {index}")
        from vlaunch.cache.client.connection import backend_for
        from vlaunch.cache.store.reader import chunks

        with self.server.reading_raw():
            slab = backend_for(self.server.device).map_fd(self.server.fds[index], sizes[index],
                                                          readonly=True)
            await self._send(writer, {"ok": True, "slab": index, "nbytes": sizes[index]})
            for part in chunks(slab[:sizes[index]]):
                for at in range(0, len(part), CHUNK):
                    writer.write(part[at:at + CHUNK])
                    await asyncio.wait_for(writer.drain(), self.timeout)


def source_port(base: int, rank: int) -> int:
    """The TCP port of `rank`: base + rank."""
    port = base + rank
    if not 0 < port < 65536:
        raise SeedError(f"seed port {base} + rank {rank} is not a valid port; pick a lower "
                        "--seed-listen-port")
    return port


def seed_into(spec: str, token: str, rank: int, ours: fp.Fingerprint, manifest: Manifest,
              slabs: list[SlabBytes], device: str, *, timeout: float = TIMEOUT,
              role: str = "target", world: int = 0) -> Seeded:
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
                    slabs, timeout=timeout)
