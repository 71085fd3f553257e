"""`vlaunch.cache.publish`: a trainer on the same host publishes new weights for one rank, and
the launcher cuts every rank over to them as for `vlaunch swap` (docs/swap.md).

    vlaunch.cache.publish(shard, label="step-1200", rank=r)   # every tensor of rank r's shard

The bytes move by file descriptor: the rank allocates staging slabs shaped as the shard it
serves (on its GPU when there is room for both, so the copy is device to device; else in host
memory) and hands them over writable; the trainer copies each tensor into its place, drops
its mappings and commits. Names, dtypes and shapes must be the shard's exactly: anything else
is refused before the commit, here and again by the rank. The call returns once the new
version serves on every rank (or raises: it was refused, or rolled back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.client.mapping import Opened, import_slabs
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.engine_env import EngineEnv
from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.sockdir import default_socket_dir, socket_path
from vlaunch.cache.store.manifest import Manifest, views

if TYPE_CHECKING:
    import torch

GIB = 1 << 30


class PublishError(VlaunchError):
    """A published version was refused, or did not come to serve; `code` is the exit status
    the launcher gave it (docs/exit-codes.md), 0 when refused before the commit."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Published:
    """A version that serves now: its launcher version number, label and mode."""

    version: int
    label: str
    mode: str


def publish(tensors: Mapping[str, torch.Tensor], *, label: str, rank: int = 0,
            socket_dir: str | None = None, mode: str = "auto", margin_gib: float = 1.0,
            device: str | None = None, timeout: float = 600.0) -> Published:
    """Publish rank `rank`'s whole shard as a new version `label`, and wait until every rank
    serves it (the other ranks' trainers publish theirs with the same label).

    `mode`: double (staging on the rank's device), in-place (in host memory) or auto (double
    when the device has room beside the served shard, with `margin_gib` to spare); every rank
    must end up in the same mode. `device`: where this process maps GPU staging
    (default: $VLAUNCH_ENGINE_DEVICES' entry for the rank, else cuda)."""
    path = socket_path(socket_dir or default_socket_dir(), rank)
    client = CacheClient(path, client=f"publish {label[:64]}", io_timeout=timeout)
    try:
        (reply, fds), = client.exchange([{"op": "publish_begin", "label": label, "mode": mode,
                                          "margin": int(margin_gib * GIB)}])
        _raise(reply, fds)
        manifest = Manifest.from_wire(reply["manifest"])
        staged_on = _device(manifest, reply.get("mode", ""), rank, device)
        rows, problems = _rows(tensors, manifest)
        if problems:
            wire.close_fds(fds)
            client.request({"op": "publish_abort"})
            raise PublishError(f"not published: {problems}; publish exactly rank {rank}'s "
                               "shard, with its names, dtypes and shapes")
        _write(tensors, manifest, fds, staged_on)
        (reply, fds), = client.exchange([{"op": "publish_commit", "label": label,
                                          "tensors": rows}])
        _raise(reply, fds)
        return Published(int(reply.get("version", 0)), label, str(reply.get("mode", "")))
    finally:
        client.close()


def _raise(reply: dict[str, Any], fds: list[int]) -> None:
    """PublishError for an error reply (its fds closed)."""
    if reply.get("ok") is True:
        return
    wire.close_fds(fds)
    raise PublishError(str(reply.get("message", reply.get("error"))),
                       int(reply.get("status", 0) or 0))


def _rows(tensors: Mapping[str, torch.Tensor], manifest: Manifest
          ) -> tuple[list[list[Any]], str]:
    """The commit's [name, dtype, shape] rows, and the first problem against the shard."""
    from vlaunch.cache.store.dtypes import from_torch, header_shape

    want = {t.name: t for t in manifest.tensors}
    rows = []
    for name, t in tensors.items():
        record = want.get(name)
        if record is None:
            return [], f"{name!r} is not a tensor of the rank's shard"
        dtype, shape = from_torch(t.dtype), list(header_shape(t.dtype, tuple(t.shape)))
        if (dtype, tuple(shape)) != (record.dtype, record.shape):
            return [], (f"{name!r} is {dtype}{shape}, the shard's is "
                        f"{record.dtype}{list(record.shape)}")
        rows.append([name, dtype, shape])
    missing = sorted(set(want) - set(tensors))
    if missing:
        return [], f"{len(missing)} tensor(s) missing, first {missing[0]!r}"
    return rows, ""


def _device(manifest: Manifest, mode: str, rank: int, device: str | None) -> str:
    """Where this process maps the staging slabs: the rank's GPU, or the host."""
    if manifest.backend != "cuda" or mode != "double":
        return "cpu"
    if device:
        return device
    return EngineEnv.from_env().engine_device(rank) or "cuda"


def _write(tensors: Mapping[str, torch.Tensor], manifest: Manifest, fds: list[int],
           device: str) -> None:
    """Map the staging slabs writable, copy every tensor into its place (device to device
    where both are on the GPU), and drop the mappings: nothing of ours writes after commit."""
    slabs = import_slabs(fds, Opened(manifest.slab_sizes), device, writable=True)
    try:
        places = views(manifest, slabs)
        for name, t in tensors.items():
            places[name].copy_(t.view(places[name].dtype) if t.dtype != places[name].dtype
                               else t)
        if device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(device)
        places.clear()
    finally:
        slabs.clear()
