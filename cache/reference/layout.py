"""The reference engine's own weight layout, as production engines keep theirs.

Per tensor-parallel rank, from the checkpoint-shaped shard (the "llama" plan's slices):

- q, k and v projections fused into one `qkv_proj` (rows: this rank's q, then k, then v);
- gate and up projections fused into one `gate_up_proj` (gate rows, then up rows);
- the vocabulary padded: each rank's slice of `embed_tokens` and `lm_head` (vocab / tp rows)
  grows to a multiple of VOCAB_ALIGN rows with zeros, so the padded vocabulary is a multiple
  of VOCAB_ALIGN * tp (padding rows are never looked up, and their logits are dropped).

Everything else is kept as is. The engine hands this layout back to its rank's cache once
(`vlaunch.cache.hand_back`), and later starts map it under `layout_fields(...)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from vlaunch.cache.contract.version import __version__
from vlaunch.cache.reference.config import ModelConfig

if TYPE_CHECKING:
    import torch

ENGINE = "vlaunch-reference"
LAYOUT_VERSION = "1"  # bump whenever `engine_layout` changes what it produces
VOCAB_ALIGN = 64
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def padded_part(cfg: ModelConfig, tp_size: int) -> int:
    """Rows of a rank's padded vocabulary slice."""
    part = cfg.vocab_size // tp_size
    return -(-part // VOCAB_ALIGN) * VOCAB_ALIGN


def is_engine_layout(weights: Mapping[str, object]) -> bool:
    """True for weights already in this layout (fused projections)."""
    return any(name.endswith("qkv_proj.weight") for name in weights)


def engine_layout(raw: Mapping[str, torch.Tensor], cfg: ModelConfig,
                  tp_size: int) -> dict[str, torch.Tensor]:
    """Fuse and pad one rank's checkpoint-shaped tensors (any pipeline stage's subset)."""
    import torch

    parts: dict[str, list[torch.Tensor | None]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        module, _, leaf = name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        if proj in _FUSED:
            fused, index = _FUSED[proj]
            slots = parts.setdefault(f"{prefix}.{fused}.{leaf}", [None] * (3 if fused ==
                                                                          "qkv_proj" else 2))
            slots[index] = tensor
        elif name in _VOCAB:
            out[name] = _pad_rows(tensor, padded_part(cfg, tp_size))
        else:
            out[name] = tensor
    for name, slots in parts.items():
        if any(t is None for t in slots):
            raise ValueError(f"cannot fuse {name}: the shard lacks some of its projections")
        out[name] = torch.cat(slots, dim=0)  # type: ignore[arg-type]
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    import torch

    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat((t, pad), dim=0)


def layout_fields(cfg: ModelConfig, dtype: str, quantization: str = "none") -> dict[str, str]:
    """The fields that name this layout in the cache (the rank layout is already in the
    raw fingerprint): engine, its version, the model configuration, quantization, dtype."""
    return {"engine": ENGINE, "engine_version": f"{__version__}+layout{LAYOUT_VERSION}",
            "model_config": cfg.digest(), "quantization": quantization, "dtype": dtype,
            "vocab_align": str(VOCAB_ALIGN)}
