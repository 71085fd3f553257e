"""Where a reference-engine rank's memory goes: its weights (mapped from the cache, or its own),
torch's allocator, its KV cache, and on CUDA the rest of what the process holds on the device.

    split = weight_split(tensors, device)       # once, after the weights are in place
    mem = rank_memory(rank, split, device)      # now
    mem.line()  # 'rank 0: weights 8.68 GB mapped from the cache, 0.00 GB own; torch ...'

`shared` and `own` come from where each tensor's memory is, not from bookkeeping: on CUDA a
tensor inside one of torch's allocator segments is the engine's own, anything else is a
mapping (the cache's VMM slabs); on CPU a tensor inside a shared mapping (the cache's memfd
or file slabs) is shared, anything in private memory is the engine's own. `device_bytes` is
the process's device memory as NVML reports it (the driver's per-process figure nvidia-smi
shows; it leaves out the mapped slabs, which the cache rank owns: contract/nvml.py); None on
CPU or where NVML cannot say (no library, another PID namespace). `other` is what the
process holds beyond torch's reserved memory: the CUDA context, NCCL's buffers, cuBLAS
workspaces, kernels (docs/memory.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.reference.state import RankState

log = logging.getLogger("vlaunch.engine")

LOG_STEP = 64 << 20
"""A rank logs its memory line again once a figure moved this much since its last line."""
FIELDS = ("rank", "weights_shared", "weights_own", "torch_allocated", "torch_reserved",
          "kv_cache", "device_bytes")


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory, in bytes (device_bytes: None where it cannot be measured)."""

    rank: int
    weights_shared: int  # parameters that are the cache's mappings (no memory of the engine's)
    weights_own: int  # parameters in the engine's own memory (copied, or built and kept)
    torch_allocated: int  # torch's allocator: tensors alive now (own weights, activations)
    torch_reserved: int  # ... plus the cached blocks it keeps for reuse
    kv_cache: int  # the reference engine keeps none: every token runs the whole sequence
    device_bytes: int | None = None

    @property
    def other(self) -> int | None:
        """Device bytes beyond torch's reserved memory (context, NCCL, workspaces)."""
        return None if self.device_bytes is None else self.device_bytes - self.torch_reserved

    def to_dict(self) -> dict[str, Any]:
        """JSON for /stats, with `other`."""
        return {**asdict(self), "other": self.other}

    def to_row(self) -> list[float]:
        """The fields as numbers (-1: unknown), for an all-gather."""
        return [float(-1 if v is None else v) for v in (getattr(self, f) for f in FIELDS)]

    @classmethod
    def from_row(cls, row: Iterable[float]) -> RankMemory:
        """The inverse of to_row."""
        values = [int(v) for v in row]
        device = values[-1] if values[-1] >= 0 else None
        return cls(*values[:-1], device_bytes=device)  # type: ignore[arg-type]

    def line(self) -> str:
        """One log line."""
        gb = 1e9
        text = (f"rank {self.rank}: weights {self.weights_shared / gb:.2f} GB mapped from the "
                f"cache, {self.weights_own / gb:.2f} GB own; torch allocated "
                f"{self.torch_allocated / gb:.2f} GB, reserved {self.torch_reserved / gb:.2f} "
                f"GB; KV cache {self.kv_cache / gb:.2f} GB")
        if self.device_bytes is not None:
            text += (f"; process on the device {self.device_bytes / gb:.2f} GB, of which "
                     f"context and other {self.other / gb:.2f} GB")  # type: ignore[operator]
        return text


def weight_split(tensors: Iterable[torch.Tensor], device: str) -> tuple[int, int]:
    """(bytes shared, bytes own) of the tensors, each distinct memory range counted once."""
    seen: set[tuple[int, int]] = set()
    spans = [(t.data_ptr(), t.nbytes) for t in tensors]
    inside = _torch_segments(device) if device.startswith("cuda") else _slab_mappings()
    shared = own = 0
    for ptr, nbytes in spans:
        if (ptr, nbytes) in seen:  # a tied weight: one tensor under two names
            continue
        seen.add((ptr, nbytes))
        hit = any(lo <= ptr and ptr + nbytes <= hi for lo, hi in inside)
        # CUDA: inside torch's segments means own; CPU: inside a slab mapping means shared
        if hit == device.startswith("cuda"):
            own += nbytes
        else:
            shared += nbytes
    return shared, own


def rank_memory(rank: int, split: tuple[int, int], device: str,
                kv_cache: int = 0, *, fresh: bool = True) -> RankMemory:
    """The rank's memory now; `split` from weight_split (weights do not move once loaded).
    `fresh`: ask NVML now; else its figure from the sampler thread (at most SAMPLE_S old)."""
    allocated = reserved = 0
    device_bytes = None
    if device.startswith("cuda"):
        import torch

        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        if fresh:
            device_bytes = process_device_bytes(device)
            _seed(device, device_bytes)
        else:
            device_bytes = _sampled(device)
    return RankMemory(rank, split[0], split[1], allocated, reserved, kv_cache, device_bytes)


SAMPLE_S = 1.0
"""Seconds between two NVML samples of the process's device memory on the request path. NVML
waits while another process on the GPU pins or unpins host memory: 0.2-0.44 s per query while
a cache rank pinned 17 GB on an H200 (benchmarks/probe_staging_stall.py), so a request never
asks it; a thread does."""
_samplers: dict[str, _Sampler] = {}


class _Sampler:
    """A daemon thread that keeps the process's NVML device figure for one device."""

    def __init__(self, device: str, value: int | None) -> None:
        self.device, self.value, self.started = device, value, False

    def start(self) -> _Sampler:
        """Sample from now on (once)."""
        import threading

        if not self.started:
            self.started = True
            threading.Thread(target=self._run, name="vlaunch-nvml", daemon=True).start()
        return self

    def _run(self) -> None:
        import time

        while True:
            time.sleep(SAMPLE_S)
            self.value = process_device_bytes(self.device)


def _seed(device: str, value: int | None) -> None:
    """A fresh figure: the sampler's from now on (the request path reads it)."""
    sampler = _samplers.get(device)
    if sampler is None:
        _samplers[device] = _Sampler(device, value)
    else:
        sampler.value = value


def _sampled(device: str) -> int | None:
    """The device figure the sampler thread holds: seeded by the last fresh figure (the
    load's line), else taken here once."""
    sampler = _samplers.get(device)
    if sampler is None:
        sampler = _samplers[device] = _Sampler(device, process_device_bytes(device))
    return sampler.start().value


def _torch_segments(device: str) -> list[tuple[int, int]]:
    """Address ranges of torch's CUDA allocator segments on this device."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()
            if s["device"] == index]


def _slab_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's shared mappings: the cache's CPU slabs (a memfd or a
    file, mapped MAP_SHARED); torch's own memory is private."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            if perms[3] == "s":
                lo, _, hi = span.partition("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def process_device_bytes(device: str) -> int | None:
    """This process's memory on `device` per NVML (what nvidia-smi shows), or None."""
    import os

    import torch

    from vlaunch.cache.contract.nvml import NVML

    if not NVML.available:
        return None
    uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    return NVML.process_bytes(os.getpid(), f"GPU-{uuid}")


def own_memory(state: RankState, *, fresh: bool = True) -> RankMemory:
    """This rank's memory now (`fresh`: rank_memory's)."""
    if state.weights_split is None:  # where the weights are does not change once loaded
        tensors = list(state.model.weights.values())
        if state.draft is not None:
            tensors += list(state.draft.weights.values())
        state.weights_split = weight_split(tensors, state.device)
    return rank_memory(state.rank, state.weights_split, state.device, fresh=fresh)


def moved(now: RankMemory, then: RankMemory | None) -> bool:
    """Whether `now` differs from the last logged figures by LOG_STEP bytes or more, in torch's
    reserved memory or the process's device memory (a line is due)."""
    if then is None:
        return True
    pairs = [(now.torch_reserved, then.torch_reserved)]
    if now.device_bytes is not None and then.device_bytes is not None:
        pairs.append((now.device_bytes, then.device_bytes))
    return any(abs(a - b) >= LOG_STEP for a, b in pairs)


def gather_memory(state: RankState, *, log_it: bool = False) -> list[RankMemory]:
    """Every rank's memory, on every rank: each rank calls this at the same point (an
    all-gather at tp > 1). Each rank logs its own line when `log_it`, and whenever its figures
    moved by LOG_STEP since its last line (the first request's activations, for one). After a
    request (not `log_it`) the device figure is the sampler's, never a query of its own."""
    import torch
    import torch.distributed as dist

    mine = own_memory(state, fresh=log_it)
    if log_it or moved(mine, state.memory_logged):
        log.info("%s", mine.line())
        state.memory_logged = mine
    if state.tp_size == 1:
        return [mine]
    row = torch.tensor(mine.to_row(), dtype=torch.float64, device=state.comm_device)
    rows = [torch.empty_like(row) for _ in range(state.tp_size)]
    dist.all_gather(rows, row)
    return [RankMemory.from_row(r.tolist()) for r in rows]
