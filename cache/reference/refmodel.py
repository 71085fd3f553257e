"""A small Llama-shaped model with Megatron-style tensor parallelism, and checkpoints for it.

The model reads the tensors of one tensor-parallel rank, as `vlaunch.cache.load` returns them
under the "llama" shard plan: embed_tokens, lm_head, q/k/v, gate and up split along dim 0,
o_proj and down_proj along dim 1, norms whole. Each rank computes its heads and its part of
the MLP; o_proj and down_proj partial sums are all-reduced, the embedding is vocab-split and
all-reduced, and the vocab-split logits are all-gathered. Everything is computed in float32,
whatever the checkpoint's dtype, so that tp 1 and tp 2 agree closely. There is no KV cache:
each new token runs the whole sequence again, which is fine for the reference engine.

`make_checkpoint` writes a random Hugging Face style Llama checkpoint (config.json, sharded
safetensors, index) with a fixed seed; the same arguments on the same device write the same
bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from vlaunch.cache.contract.logs import setup_logging
from vlaunch.cache.reference.config import CONFIG_NAME, ModelConfig, ModelConfigError
from vlaunch.cache.store.checkpoint import INDEX_NAME

__all__ = ["CONFIG_NAME", "INDEX_NAME", "ModelConfig", "ModelConfigError", "TPLlama", "greedy",
           "make_checkpoint", "tensor_shapes"]

log = logging.getLogger("vlaunch.cache.reference.refmodel")

MARKER_NAME = "vlaunch-refmodel.json"  # the arguments that wrote a checkpoint
INIT_STD = 0.02

LLAMA_8B_SHAPES: dict[str, int] = {"hidden": 4096, "intermediate": 14336, "heads": 32,
                                   "kv_heads": 8, "vocab": 128256}
"""Llama-3-8B's shapes, for `make_checkpoint(..., **LLAMA_8B_SHAPES, target_bytes=...)`."""


class Collectives(Protocol):
    """The two collectives tensor parallelism needs, over the ranks of one model replica."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns `t`."""

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` along the last dimension, in rank order."""


class SingleRank:
    """tp size 1: no collectives."""

    rank = 0
    size = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Return `t`."""
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Return `t`."""
        return t


class TorchDistributed:
    """Collectives over a torch.distributed process group (gloo or nccl)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place."""
        self._dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather and concatenate along the last dimension."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=-1)


def tensor_shapes(cfg: ModelConfig, tp_size: int = 1,
                  lm_head: str = "lm_head.weight") -> dict[str, tuple[int, ...]]:
    """Every tensor a rank of `tp_size` ranks holds, with its shape, in checkpoint order."""
    h, n = cfg.hidden_size, tp_size
    q = cfg.num_attention_heads // n * cfg.head_dim
    kv = cfg.num_key_value_heads // n * cfg.head_dim
    inter = cfg.intermediate_size // n
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size // n, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes.setdefault(lm_head, (cfg.vocab_size // n, h))
    return shapes


def engine_shapes(cfg: ModelConfig, tp_size: int = 1,
                  lm_head: str = "lm_head.weight") -> dict[str, tuple[int, ...]]:
    """Every tensor a rank holds in the engine's own layout (fused, vocabulary padded)."""
    from vlaunch.cache.reference.layout import padded_part

    h, n, vocab = cfg.hidden_size, tp_size, padded_part(cfg, tp_size)
    q = cfg.num_attention_heads // n * cfg.head_dim
    kv = cfg.num_key_value_heads // n * cfg.head_dim
    inter = cfg.intermediate_size // n
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_up_proj.weight": (2 * inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes.setdefault(lm_head, (vocab, h))
    return shapes


class TPLlama:
    """One tensor-parallel rank of a Llama model; holds the weights dict without copying it.

    The weights are the rank's checkpoint-shaped shard, which the model fuses and pads into
    its own layout (cache/reference/layout.py), or that layout already (from the cache).
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], cfg: ModelConfig,
                 comm: Collectives | None = None) -> None:
        from vlaunch.cache.reference.layout import engine_layout, is_engine_layout, padded_part

        self.cfg = cfg
        self.comm: Collectives = comm or SingleRank()
        cfg.check_tp(self.comm.size)
        n = self.comm.size
        self.heads = cfg.num_attention_heads // n
        self.kv_heads = cfg.num_key_value_heads // n
        self.vocab_part = cfg.vocab_size // n
        self.vocab_padded = padded_part(cfg, n)
        self._lm_head = ("lm_head.weight" if "lm_head.weight" in weights or
                         not cfg.tie_word_embeddings else "model.embed_tokens.weight")
        self.weights = weights
        if is_engine_layout(weights):
            self._check_shapes(engine_shapes(cfg, n, self._lm_head))
        else:
            self._check_shapes(tensor_shapes(cfg, n, self._lm_head))
            self.weights = engine_layout(weights, cfg, n)
        self.device = weights["model.embed_tokens.weight"].device

    def _check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        for name, shape in shapes.items():
            if name not in self.weights:
                raise ModelConfigError(f"the weights have no tensor {name!r}; the checkpoint "
                                       "does not fit its config.json")
            got = tuple(self.weights[name].shape)
            if got != shape:
                raise ModelConfigError(f"tensor {name!r} has shape {list(got)} on rank "
                                       f"{self.comm.rank} of {self.comm.size}, config.json "
                                       f"implies {list(shape)}; the checkpoint does not fit its "
                                       "config.json, the llama shard plan or the engine "
                                       "layout")

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name].float()  # no copy for float32 weights; never written to

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        bias = self.weights.get(prefix + ".bias")
        return F.linear(x, self._w(prefix + ".weight"), None if bias is None else bias.float())

    def _rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return x * scale * self._w(name)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        start = self.comm.rank * self.vocab_part
        local = tokens - start
        inside = (local >= 0) & (local < self.vocab_part)  # padding rows are never looked up
        x = F.embedding(local.clamp(0, self.vocab_part - 1), self._w("model.embed_tokens.weight"))
        return self.comm.all_reduce(x * inside.unsqueeze(-1))

    def _rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.head_dim
        inv_freq = 1.0 / self.cfg.rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d)
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=self.device),
                            inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _attention(self, x: torch.Tensor, prefix: str, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.cfg.head_dim
        qkv = self._linear(x, prefix + "qkv_proj")
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = q.reshape(t, self.heads, d).transpose(0, 1)
        k = k.reshape(t, self.kv_heads, d).transpose(0, 1)
        v = v.reshape(t, self.kv_heads, d).transpose(0, 1)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = F.linear(out.transpose(0, 1).reshape(t, self.heads * d),
                       self._w(prefix + "o_proj.weight"))
        return self.comm.all_reduce(out)

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate, up = self._linear(x, prefix + "gate_up_proj").chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        return self.comm.all_reduce(F.linear(hidden, self._w(prefix + "down_proj.weight")))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        """Float32 logits [seq, vocab] (or [1, vocab] with last_only) for a 1-D token tensor."""
        tokens = tokens.to(self.device, torch.int64)
        x = self._embed(tokens)
        cos, sin = self._rope(tokens.shape[0])
        for i in range(self.cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = x + self._attention(self._rms_norm(x, p + "input_layernorm.weight"),
                                    p + "self_attn.", cos, sin)
            x = x + self._mlp(self._rms_norm(x, p + "post_attention_layernorm.weight"),
                              p + "mlp.")
        if last_only:
            x = x[-1:]
        x = self._rms_norm(x, "model.norm.weight")
        logits = F.linear(x, self._w(self._lm_head))[..., :self.vocab_part]  # drop padding
        return self.comm.all_gather(logits)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def forward(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor,
            tp_size: int = 1, group: Any = None) -> torch.Tensor:
    """Float32 logits [seq, vocab] of one sequence; tp_size > 1 needs the process group."""
    comm: Collectives = SingleRank() if tp_size == 1 else TorchDistributed(group)
    if comm.size != tp_size:
        raise ValueError(f"tp_size {tp_size} does not match the process group's size "
                         f"{comm.size}")
    return TPLlama(weights, cfg, comm).forward(tokens)


def greedy(model: TPLlama, prompt_tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """The `max_new_tokens` tokens that greedy decoding appends to the prompt."""
    if not prompt_tokens:
        raise ValueError("the prompt needs at least one token")
    tokens = torch.tensor(list(prompt_tokens), dtype=torch.int64, device=model.device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        # every rank sees the same all-gathered logits, so all ranks pick the same token
        token = int(model.forward(tokens, last_only=True)[0].argmax())
        new.append(token)
        tokens = torch.cat((tokens, tokens.new_tensor([token])))
    return new


def make_checkpoint(path: str | os.PathLike[str], *, hidden: int = 256, layers: int = 4,
                    heads: int = 8, kv_heads: int = 4, intermediate: int = 512,
                    vocab: int = 1024, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    shards: int = 2, target_bytes: int | None = None,
                    device: str = "cpu") -> Path:
    """Write a random Llama checkpoint at `path` (kept if the same arguments wrote it)."""
    from safetensors.torch import save_file

    itemsize = torch.empty((), dtype=dtype).element_size()
    if target_bytes is not None:
        layers = _layers_for(target_bytes, hidden, heads, kv_heads, intermediate, vocab,
                             itemsize)
    cfg = ModelConfig(hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab)
    shapes = tensor_shapes(cfg)
    if not 1 <= shards <= len(shapes):
        raise ValueError(f"shards must be in 1..{len(shapes)}, got {shards}")
    path = Path(path)
    marker = {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
              "intermediate": intermediate, "vocab": vocab, "dtype": str(dtype), "seed": seed,
              "shards": shards, "device": torch.device(device).type}
    if path.exists():
        return _existing(path, marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        files = _split(shapes, shards, itemsize)
        weight_map: dict[str, str] = {}
        generator = torch.Generator(device=device).manual_seed(seed)
        for file, names in files.items():
            tensors = {name: _random(shapes[name], name, generator, dtype, device)
                       for name in names}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
            del tensors
        total = sum(math.prod(s) for s in shapes.values()) * itemsize
        _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total},
                                       "weight_map": weight_map})
        _write_json(tmp / CONFIG_NAME, cfg.to_hf(dtype))
        _write_json(tmp / MARKER_NAME, marker)
        tmp.chmod(0o755)
        # a rename is atomic: a crash leaves only the hidden temporary directory behind
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if path.exists():  # another process wrote it meanwhile
            return _existing(path, marker)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote a %d-layer checkpoint of %.2f GB in %d file(s) to %s", layers, total / 1e9,
             shards, path)
    return path


def _existing(path: Path, marker: dict[str, Any]) -> Path:
    """Return `path` if `make_checkpoint` wrote it with the same arguments; else raise."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads((path / MARKER_NAME).read_bytes()) == marker:
            return path
    raise FileExistsError(f"{path} exists and was not written by make_checkpoint with these "
                          "arguments; remove it or choose another path")


def _layers_for(target_bytes: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                vocab: int, itemsize: int) -> int:
    """The layer count whose checkpoint comes closest to `target_bytes`."""
    d = hidden // heads
    per_layer = itemsize * (2 * hidden * heads * d + 2 * hidden * kv_heads * d
                            + 3 * hidden * intermediate + 2 * hidden)
    fixed = itemsize * (2 * vocab * hidden + hidden)
    if target_bytes < fixed + per_layer:
        raise ValueError(f"target_bytes {target_bytes} is below the size of the embeddings plus "
                         f"one layer ({fixed + per_layer} bytes); pick smaller shapes")
    return max(1, round((target_bytes - fixed) / per_layer))


def _split(shapes: Mapping[str, tuple[int, ...]], shards: int,
           itemsize: int) -> dict[str, list[str]]:
    """Assign tensors, in order, to `shards` files of about equal size; none left empty."""
    names = list(shapes)
    sizes = [math.prod(shapes[n]) * itemsize for n in names]
    total = sum(sizes)
    files: list[list[str]] = [[] for _ in range(shards)]
    k = done = 0
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        still_empty = shards - 1 - k
        if files[k] and k < shards - 1 and (done * shards >= (k + 1) * total
                                            or len(names) - i <= still_empty):
            k += 1
        files[k].append(name)
        done += size
    return {f"model-{k + 1:05d}-of-{shards:05d}.safetensors": f for k, f in enumerate(files)}


def _random(shape: tuple[int, ...], name: str, generator: torch.Generator, dtype: torch.dtype,
            device: str) -> torch.Tensor:
    """A random CPU tensor: std INIT_STD for matrices, 1 + noise for norm scales."""
    t = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    t.mul_(INIT_STD)
    if name.endswith("norm.weight"):
        t.add_(1.0)
    return t.to(dtype).cpu()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Write a random checkpoint (`python -m vlaunch.cache.reference.refmodel PATH`)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m vlaunch.cache.reference.refmodel",
                                description="Write a random Llama checkpoint for the vlaunch "
                                            "reference engine.")
    p.add_argument("path")
    p.add_argument("--llama-8b", action="store_true",
                   help="Llama-3-8B shapes instead of the small default ones")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--target-gib", type=float, default=None,
                   help="choose the layer count for a checkpoint of about this size")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="where to draw the random numbers; cuda is far faster for large sizes")
    args = p.parse_args(argv)
    setup_logging("vlaunch-refmodel", "INFO")
    target = None if args.target_gib is None else int(args.target_gib * (1 << 30))
    shapes: dict[str, Any] = dict(LLAMA_8B_SHAPES) if args.llama_8b else {}
    path = make_checkpoint(args.path, **shapes, layers=args.layers, shards=args.shards,
                           seed=args.seed, target_bytes=target, device=args.device)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
