"""A checkpoint's quantization: its `quantization_config` (config.json), hashed for the fingerprint.

Hugging Face checkpoints describe their quantization in config.json, under
`quantization_config` (older compressed-tensors checkpoints: `compression_config`). The
fingerprint carries a hash of that object and the quantization method the engine runs, so a
cache built for one quantization is never handed to an engine that expects another.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from vlaunch.cache.contract.errors import CheckpointError

CONFIG_KEYS = ("quantization_config", "compression_config")
MAX_CONFIG_BYTES = 16 << 20


def quantization_config(model: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The model's quantization config from config.json; None when it has none."""
    where = os.fspath(model)  # plain strings: every engine start's fingerprint reads this
    path = os.path.join(where if os.path.isdir(where) else os.path.dirname(where), "config.json")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointError(path, f"config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(path, f"config.json is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(path, "config.json is not a JSON object")
    for key in CONFIG_KEYS:
        if isinstance(obj.get(key), dict):
            return obj[key]  # type: ignore[no-any-return]
    return None


def config_digest(config: dict[str, Any] | None) -> str:
    """A short, order-independent hash of a quantization config; "none" without one."""
    if config is None:
        return "none"
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def method(config: dict[str, Any] | None) -> str:
    """The config's quantization method (`quant_method`, lower case); "none" without one."""
    if config is None:
        return "none"
    return str(config.get("quant_method", "unknown")).lower()


def act_order(config: dict[str, Any] | None) -> bool:
    """True for GPTQ with activation order (desc_act): its scales and zeros stay whole."""
    return bool(config and method(config) == "gptq" and config.get("desc_act"))


def fingerprint_fields(model: str | os.PathLike[str], engine_method: str | None = None
                       ) -> dict[str, str]:
    """The fingerprint's quantization fields: the config's hash and the engine's method."""
    config = quantization_config(model)
    return {"quantization_config": config_digest(config),
            "quantization": (engine_method or method(config)).lower()}
