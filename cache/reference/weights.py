"""A rank's weights in the engine's own layout: mapped from the cache, or built once and
handed back to it (docs/engine-layout.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

# imported with this module (before the engine times its load), not inside load_weights
from vlaunch.cache.client.layout import hand_back, release_cached
from vlaunch.cache.client.loader import load
from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.reference.config import ModelConfig
from vlaunch.cache.reference.layout import engine_layout, layout_fields
from vlaunch.cache.reference.options import EngineOptions

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vlaunch.engine")


@dataclass
class Loaded:
    """The rank's tensors (engine layout), where they came from and how."""

    tensors: dict[str, torch.Tensor]
    source: str  # cache or disk
    layout: str  # engine: mapped as handed back before; handed-back: now; own: not in a cache


def load_weights(opts: EngineOptions, rank: int, device: str, cfg: ModelConfig) -> Loaded:
    """Map the engine layout; else load the raw shard, fuse and pad it, and hand it back."""
    fields = layout_fields(cfg, "as-checkpoint")
    use_layout = opts.engine_layout and opts.mode in ("share", "copy")
    where = {"rank": rank, "tensor_parallel_size": opts.tp_size, "device": device,
             "socket_dir": opts.socket_dir or None}
    weights = load(opts.model, mode=opts.mode, fallback=opts.fallback, timeout=opts.timeout,
                   layout=fields if use_layout else None, **where)
    if weights.layout:
        return Loaded(dict(weights), weights.source, "engine")
    params = engine_layout(weights, cfg, opts.tp_size)  # the post-processing, once
    cached = weights.source == "cache" or "released" in weights.reason
    if not (use_layout and opts.mode == "share" and cached):
        return Loaded(params, weights.source, "own")
    source = weights.source
    del weights  # the raw mapping goes with the last view of it
    try:
        back = hand_back(params, model=opts.model, fields=fields, **where)
    except (VlaunchError, ValueError) as exc:
        log.warning("rank %d: could not hand the engine layout back to the cache (%s); "
                    "serving from the engine's own copy", rank, exc)
        return Loaded(params, source, "own")
    # one copy: the engine's fused, padded tensors go, and on CUDA torch's allocator gives
    # their memory back instead of keeping it reserved (docs/engine-layout.md)
    params.clear()
    del params
    release_cached(device)
    return Loaded(dict(back), source, "handed-back")
