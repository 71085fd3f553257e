"""The engine's warm-up: a first generation on a dummy prompt, before it reports ready or parked.

A fresh process's first forward pass pays for what no later one does: CUDA loads each kernel's
module when it is first launched, cuBLAS creates its handle and workspace, the allocator
reserves its first blocks, and on the CPU the weights' pages fault in. The warm-up runs the
path of a first real request, on every rank in lock step: a prefill of `n` dummy tokens and one
decode step (the reference engine recomputes the sequence for each token, so both are
`TPLlama.forward` with `last_only`, at lengths n and n + 1). It writes nothing into the
weights: in share mode they are the cache's read-only mappings.

A standby that parks before its weights (an in-place swap's: the slabs are overwritten
between its park and its promotion) warms up before it parks on **scratch tensors** of the
served shapes (`scratch_weights`): zeros, one tensor per distinct shape, which every layer
shares, so it costs one layer, the embedding and nothing per layer more (about 1.5 GB for a
Llama-3-8B rank). The kernels, handles and allocator blocks a first pass pays for are the
same whatever the bytes, so once promoted it maps the new weights and serves with no second
warm-up on CUDA (on the CPU it still runs one: there the pass faults the mapped pages in).

A parked standby then gives back what it need not keep: the blocks torch's caching allocator
kept after the passes (`torch.cuda.empty_cache`; on the CPU, glibc's free heap with
`malloc_trim`), since that memory sits idle beside the serving engine until the promotion.
The reference engine keeps no KV cache, so there is none to size or free.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from vlaunch.cache.client.layout import release_cached
from vlaunch.cache.reference.memory import RankMemory, own_memory

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.reference.config import ModelConfig
    from vlaunch.cache.reference.state import RankState

Decode = Callable[["RankState", list[int], int], list[int]]
"""This rank's part of a generation (workers.decode): the path a real request takes."""

log = logging.getLogger("vlaunch.engine")

NEW_TOKENS = 2
"""Tokens the warm-up generates: the prefill's and one decode step's."""


@dataclass(frozen=True)
class WarmupReport:
    """One rank's warm-up: how long it took and its memory before, after and once freed
    (each as RankMemory and as the process's private host memory, USS)."""

    rank: int
    tokens: int
    ms: float
    before: RankMemory
    warm: RankMemory  # right after the passes, before anything was freed
    kept: RankMemory  # what the rank holds from now on
    freed: bool
    uss: tuple[int, int, int] = (0, 0, 0)  # bytes: before, warm, kept

    def to_dict(self) -> dict[str, Any]:
        """JSON for /stats."""
        return {"rank": self.rank, "tokens": self.tokens, "ms": round(self.ms, 3),
                "freed": self.freed, "before": self.before.to_dict(),
                "warm": self.warm.to_dict(), "kept": self.kept.to_dict(),
                "uss": dict(zip(("before", "warm", "kept"), self.uss, strict=True))}

    def line(self) -> str:
        """One log line."""
        then = "freed to" if self.freed else "kept"
        text = (f"rank {self.rank}: warm-up (prefill {self.tokens} tokens + 1 decode step) in "
                f"{self.ms:.1f} ms; host USS " + _steps(self.uss, then))
        if self.before.device_bytes is None and not self.warm.torch_reserved:
            return text  # the CPU: torch's CUDA figures say nothing
        text += "; torch reserved " + _steps(
            (self.before.torch_reserved, self.warm.torch_reserved, self.kept.torch_reserved), then)
        figures = (self.before.device_bytes, self.warm.device_bytes, self.kept.device_bytes)
        if None not in figures:
            text += "; process on the device " + _steps(figures, then)  # type: ignore[arg-type]
        return text


def _steps(figures: tuple[int, int, int], then: str) -> str:
    """'a -> b GB, freed to c GB' of three byte counts."""
    a, b, c = (f / 1e9 for f in figures)
    return f"{a:.2f} -> {b:.2f} GB, {then} {c:.2f} GB"


def dummy_prompt(n_tokens: int, vocab_size: int) -> list[int]:
    """A fixed prompt of `n_tokens` ids, none of them 0 (often a padding or special id)."""
    return [1 + i % max(1, vocab_size - 1) for i in range(n_tokens)]


def warm_up(state: RankState, n_tokens: int, decode: Decode, *, free: bool) -> WarmupReport:
    """Run this rank's part of the warm-up through `decode` (every rank at once at tp > 1);
    logs one line."""
    me = psutil.Process()
    uss_before, before = me.memory_full_info().uss, own_memory(state)
    start = time.perf_counter()
    decode(state, dummy_prompt(n_tokens, state.model.cfg.vocab_size), NEW_TOKENS)
    _synchronize(state.device)
    ms = (time.perf_counter() - start) * 1000
    uss_warm, warm = me.memory_full_info().uss, own_memory(state)
    if free:
        give_back(state.device)
    report = WarmupReport(state.rank, n_tokens, ms, before, warm, own_memory(state), free,
                          (uss_before, uss_warm, me.memory_full_info().uss))
    log.info("%s", report.line())
    return report


def scratch_weights(cfg: ModelConfig, tp_size: int, device: str, dtype: torch.dtype
                    ) -> dict[str, torch.Tensor]:
    """The engine layout's tensors of one rank, as zeros of `dtype`, every tensor of a shape
    the same one (layers share them): what a warm-up needs, at one layer's cost."""
    import torch

    from vlaunch.cache.reference.refmodel import engine_shapes

    lm_head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    shared: dict[tuple[int, ...], torch.Tensor] = {}
    out = {}
    for name, shape in engine_shapes(cfg, tp_size, lm_head).items():
        if shape not in shared:
            shared[shape] = torch.zeros(shape, dtype=dtype, device=device)
        out[name] = shared[shape]
    return out


def served_dtype(model: str) -> torch.dtype:
    """The dtype of the checkpoint's embedding (the served shard's: a swap keeps dtypes), read
    from its safetensors header."""
    import torch

    from vlaunch.cache.store.checkpoint import open_checkpoint
    from vlaunch.cache.store.dtypes import is_plain, to_torch

    tensors = open_checkpoint(model).tensors
    entry = tensors.get("model.embed_tokens.weight") or next(iter(tensors.values()))
    return to_torch(entry.dtype) if is_plain(entry.dtype) else torch.float32


def give_back(device: str) -> None:
    """Give the allocator's unused cached memory back: to the driver on CUDA
    (client.layout.release_cached), glibc's free heap to the OS on the CPU (elsewhere
    nothing)."""
    if device.startswith("cuda"):
        release_cached(device)
        return
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
