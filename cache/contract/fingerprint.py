"""The fingerprint: every field that must match before an engine reuses a cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlaunch.cache.contract import kernels
from vlaunch.cache.contract.protocol import VERSION
from vlaunch.cache.contract.version import __version__

FIELDS = (
    "protocol", "vlaunch", "checkpoint", "checkpoint_data", "plan", "tp_size", "tp_rank",
    "pp_size", "pp_rank", "dp_size", "dp_rank", "dtype", "backend", "device_uuid",
    "compute_capability", "driver", "torch", "cuda", "kernel_backends", "loader",
    "quantization_config", "quantization", "role",
)
"""Field order as reported; a mismatch lists every differing field."""

Fingerprint = dict[str, str]


def build(*, checkpoint: str, checkpoint_data: str, plan: str, layout: Mapping[str, int],
          dtype: str, backend: str, device: Mapping[str, str], kernel_backends: str = "",
          loader: str = "vlaunch", torch_version: str | None = None,
          quantization: Mapping[str, str] | None = None, role: str = "target") -> Fingerprint:
    """Assemble a fingerprint from its parts (all values as strings)."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    fields: dict[str, Any] = {
        "protocol": VERSION, "vlaunch": __version__, "checkpoint": checkpoint,
        "checkpoint_data": checkpoint_data, "plan": plan,
        **{k: layout[k] for k in ("tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size",
                                  "dp_rank")},
        "dtype": dtype, "backend": backend, "device_uuid": device.get("device_uuid", ""),
        "compute_capability": device.get("compute_capability", ""),
        "driver": device.get("driver", ""), "torch": torch_version,
        "cuda": device.get("cuda", ""), "kernel_backends": kernels.resolve(kernel_backends),
        "loader": loader,
        # the hash of config.json's quantization_config and the engine's method (store/quant.py)
        "quantization_config": (quantization or {}).get("quantization_config", "none"),
        "quantization": (quantization or {}).get("quantization", "none"),
        "role": role,  # target, or draft: a speculative-decoding draft group (roles.py)
    }
    return {k: str(fields[k]) for k in FIELDS}


def compare(cache: Mapping[str, Any], engine: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every field whose values differ, as (field, cache value, engine value)."""
    keys = list(FIELDS) + sorted((set(cache) | set(engine)) - set(FIELDS))
    return [(k, cache.get(k), engine.get(k)) for k in keys if cache.get(k) != engine.get(k)]
