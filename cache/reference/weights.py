"""A rank's weights in the engine's own layout: mapped from the cache, or built once and
handed back to it (docs/engine-layout.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

# the kit imports the client with this module (before the engine times its load)
from vlaunch.cache.integrations import kit
from vlaunch.cache.reference.config import ModelConfig
from vlaunch.cache.reference.layout import engine_layout, layout_fields
from vlaunch.cache.reference.options import EngineOptions
from vlaunch.cache.store.target import Target

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
    """Map the engine layout; else load the raw shard, fuse and pad it, and hand it back (the
    integration kit's steps, docs/add-an-engine.md)."""
    options = kit.LoaderOptions(mode=opts.mode, fallback=opts.fallback, timeout=opts.timeout,
                                socket_dir=opts.socket_dir, engine_layout=opts.engine_layout)
    fields = layout_fields(cfg, "as-checkpoint") if options.layout() else None
    target = Target.resolve(opts.model, rank=rank, tensor_parallel_size=opts.tp_size,
                            device=device, socket_dir=opts.socket_dir or None)
    weights = kit.fetch(target, options, fields)
    if weights.layout:
        return Loaded(dict(weights), weights.source, "engine")
    params = engine_layout(weights, cfg, opts.tp_size)  # the post-processing, once
    source = weights.source
    if fields is None or not kit.may_hand_back(weights, options, fields):
        return Loaded(params, source, "own")
    del weights  # the raw mapping goes with the last view of it
    # one copy: the engine's fused, padded tensors go once the cache holds them
    back = kit.hand_back_tensors(params, fields, target, logger=log)
    if back is None:
        return Loaded(params, source, "own")
    return Loaded(dict(back), source, "handed-back")
