"""A rank's shard: plan it, pack it into slabs, read it; shared by the cache and the fallback.

Loading a built-in or file plan moves bytes only and imports no torch on a CPU backend (the
slabs' bytes are numpy arrays there: `slabs.SlabBytes`); a hook plan's tensors, and `named()`,
are torch's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.engine_env import READER_THREADS
from vlaunch.cache.store.checkpoint import Checkpoint, open_checkpoint
from vlaunch.cache.store.manifest import Manifest, pack, views
from vlaunch.cache.store.plan import HookPlan, Position, load_plan, plan_rank

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.store.slabs import Backend, SlabBytes

MAX_SLAB = 64 << 30


@dataclass
class Shard:
    """What a rank holds: manifest, each slab's bytes (`tensors`: `Slab.buffer()`) and the
    objects that own the memory."""

    manifest: Manifest
    slabs: list[Any]
    tensors: list[SlabBytes]
    checkpoint: Checkpoint
    plan_identity: str
    seconds: float
    prepared: float = 0.0  # of `seconds`: checkpoint opened, planned, slabs allocated

    def named(self) -> dict[str, torch.Tensor]:
        """Named zero-copy torch views over the slabs (imports torch)."""
        return views(self.manifest, _as_torch(self.tensors))


def load_shard(model: str, plan_spec: str, position: Position, backend: Backend, *,
               threads: int = READER_THREADS, label: str = "loading") -> Shard:
    """Plan, allocate and read a rank's shard into fresh slabs of `backend`."""
    from vlaunch.cache.store.reader import fill

    start = time.perf_counter()
    ckpt = open_checkpoint(model)
    plan = load_plan(plan_spec)
    if isinstance(plan, HookPlan):
        return _from_hook(ckpt, plan, position, backend, start)
    shard, specs = _allocate(ckpt, plan, position, backend, start)
    shard.prepared = shard.seconds
    fill(specs, shard.manifest, shard.tensors, threads=threads, label=label)
    shard.seconds = time.perf_counter() - start
    return shard


def empty_shard(model: str, plan_spec: str, position: Position, backend: Backend) -> Shard:
    """Plan and allocate a rank's shard without reading any tensor data (to be seeded)."""
    from vlaunch.cache.contract.errors import SeedError

    ckpt = open_checkpoint(model)
    plan = load_plan(plan_spec)
    if isinstance(plan, HookPlan):
        raise SeedError("seeding does not support hook plans (module:callable); load from "
                        "disk instead")
    return _allocate(ckpt, plan, position, backend, time.perf_counter())[0]


def _allocate(ckpt: Checkpoint, plan: Any, position: Position, backend: Backend,
              start: float) -> tuple[Shard, list[Any]]:
    specs = plan_rank(ckpt, plan, position)
    manifest = pack([(s.name, s.dtype, s.shape) for s in specs], backend=backend.name,
                    alignment=backend.alignment, max_slab=MAX_SLAB)
    slabs = [backend.allocate(size) for size in manifest.slab_sizes]
    tensors = [s.buffer() for s in slabs]
    return Shard(manifest, slabs, tensors, ckpt, plan.identity,
                 time.perf_counter() - start), specs


def _from_hook(ckpt: Checkpoint, plan: HookPlan, position: Position, backend: Backend,
               start: float) -> Shard:
    """Let an engine's hook build the rank's tensors, then pack them into slabs."""
    from vlaunch.cache.store.dtypes import from_torch, header_shape

    built = plan.build(ckpt, position)
    items = [(name, from_torch(t.dtype), header_shape(t.dtype, tuple(t.shape)))
             for name, t in built.items()]
    manifest = pack(items, backend=backend.name, alignment=backend.alignment,
                    max_slab=MAX_SLAB)
    slabs = [backend.allocate(size) for size in manifest.slab_sizes]
    tensors = [s.buffer() for s in slabs]
    for name, view in views(manifest, _as_torch(tensors)).items():
        view.copy_(built[name].view(view.dtype))  # packed dtypes (F4) copy as they are
    return Shard(manifest, slabs, tensors, ckpt, plan.identity, time.perf_counter() - start)


def _as_torch(buffers: list[SlabBytes]) -> list[torch.Tensor]:
    """Torch tensors over slab bytes (numpy arrays are wrapped, zero-copy)."""
    import numpy as np
    import torch

    return [torch.from_numpy(b) if isinstance(b, np.ndarray) else b for b in buffers]


class PlainBackend:
    """Ordinary tensors as slabs: the disk fallback reads into the engine's own memory."""

    name = "plain"
    alignment = 256

    def __init__(self, device: str) -> None:
        self.device = device

    def allocate(self, size: int) -> _PlainSlab:
        """A plain uint8 tensor on the device."""
        return _PlainSlab(size, self.device)


class _PlainSlab:
    def __init__(self, size: int, device: str) -> None:
        import torch

        self.size = size
        self._t = torch.empty(size, dtype=torch.uint8, device=device)

    def tensor(self) -> torch.Tensor:
        return self._t

    def buffer(self) -> torch.Tensor:
        return self._t
