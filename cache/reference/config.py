"""The reference model's hyper-parameters, read from a Hugging Face config.json (no torch).

Kept apart from the model so that the engine's rank 0 can check its configuration and start
its tensor-parallel workers before it imports torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

log = logging.getLogger("vlaunch.cache.reference.refmodel")

CONFIG_NAME = "config.json"


class ModelConfigError(ValueError):
    """config.json is missing or invalid, or does not fit the tensor-parallel size or weights."""


@dataclass(frozen=True)
class ModelConfig:
    """The Llama hyper-parameters the reference model needs, from a Hugging Face config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value, low = getattr(self, f.name), 0 if f.name == "head_dim" else 1
            if f.type == "int" and (type(value) is not int or value < low):
                raise ModelConfigError(f"config.json: {f.name} must be a positive integer, got "
                                       f"{value!r}; fix the model's config.json")
        if type(self.tie_word_embeddings) is not bool:
            raise ModelConfigError("config.json: tie_word_embeddings must be true or false, got "
                                   f"{self.tie_word_embeddings!r}; fix the model's config.json")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"config.json: {name} must be a positive number, got "
                                       f"{value!r}; fix the model's config.json")
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ModelConfigError(
                    f"config.json: hidden_size {self.hidden_size} does not divide by "
                    f"num_attention_heads {self.num_attention_heads}; set head_dim or fix them")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"config.json: num_attention_heads {self.num_attention_heads} does not divide "
                f"by num_key_value_heads {self.num_key_value_heads}; fix the model's config.json")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed config.json (unknown keys are ignored)."""
        required = ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "vocab_size")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ModelConfigError(f"config.json has no {', '.join(missing)}; the reference "
                                   "engine needs a Llama-style config.json")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        values.setdefault("num_key_value_heads", raw["num_attention_heads"])
        if raw.get("rope_scaling"):
            log.warning("config.json sets rope_scaling %r, which the reference model ignores; "
                        "its outputs will differ from the original model's",
                        raw["rope_scaling"])
        return cls(**values)

    @classmethod
    def from_dir(cls, model: str | os.PathLike[str]) -> ModelConfig:
        """Read config.json from the model directory (or the directory of a .safetensors file)."""
        path = Path(model)
        if path.is_file():
            path = path.parent
        file = path / CONFIG_NAME
        try:
            raw = json.loads(file.read_bytes())
        except FileNotFoundError:
            raise ModelConfigError(f"{file} does not exist; pass --model the directory that "
                                   "holds config.json and the .safetensors files") from None
        except (OSError, ValueError, RecursionError) as exc:
            raise ModelConfigError(f"{file} cannot be read as JSON ({exc}); fix or "
                                   "re-download it") from None
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{file} is not a JSON object; fix or re-download it")
        return cls.from_dict(raw)

    def check_tp(self, tp_size: int) -> None:
        """Raise ModelConfigError unless every split dimension divides by `tp_size`."""
        if type(tp_size) is not int or tp_size < 1:
            raise ModelConfigError(f"tensor-parallel size must be an integer >= 1, got "
                                   f"{tp_size!r}")
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size",
                     "intermediate_size"):
            value = getattr(self, name)
            if value % tp_size:
                fits = [n for n in range(1, self.num_key_value_heads + 1) if self._fits(n)]
                raise ModelConfigError(f"{name} {value} does not divide by tensor-parallel size "
                                       f"{tp_size}; use a tensor-parallel size that divides "
                                       f"it (this model fits {', '.join(map(str, fits))})")

    def _fits(self, tp_size: int) -> bool:
        return not (self.num_attention_heads % tp_size or self.num_key_value_heads % tp_size
                    or self.vocab_size % tp_size or self.intermediate_size % tp_size)

    def digest(self) -> str:
        """A short hash of every hyper-parameter (a field of the engine layout's fingerprint)."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_hf(self, dtype: Any) -> dict[str, Any]:
        """The Hugging Face config.json contents (`dtype`: a torch dtype)."""
        out: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                               "hidden_act": "silu",
                               "torch_dtype": str(dtype).removeprefix("torch.")}
        out.update(asdict(self))
        return out
