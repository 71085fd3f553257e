"""The fingerprint: every field that must match before an engine reuses a cache."""

from __future__ import annotations

import functools
import sys
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


def build(*, checkpoint: str, checkpoint_data: str, plan: str, position: Mapping[str, int],
          dtype: str, backend: str, device: Mapping[str, str], kernel_backends: str = "",
          loader: str = "vlaunch", torch_version: str | None = None,
          quantization: Mapping[str, str] | None = None, role: str = "target") -> Fingerprint:
    """Assemble a fingerprint from its parts (all values as strings)."""
    if torch_version is None:
        torch_version = installed_torch_version()
    fields: dict[str, Any] = {
        "protocol": VERSION, "vlaunch": __version__, "checkpoint": checkpoint,
        "checkpoint_data": checkpoint_data, "plan": plan_field(plan, position),
        **{k: position[k] for k in ("tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size",
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


WHOLE = "whole"
"""The plan field of a rank that a rule plan splits nothing for (every tensor whole)."""


def plan_field(plan: str, position: Mapping[str, int]) -> str:
    """The fingerprint's plan: a rule plan (built-in, `builtin:...`, or a plan file, `file:...`)
    that splits nothing at this position is `whole`, so that two such plans, which hold the same
    bytes, do not disagree (one tensor-parallel rank; one data-parallel rank too if experts are
    placed whole, `ep:`). A hook plan builds its own tensors and keeps its identity."""
    if not plan.startswith(("builtin:", "file:")) or position["tp_size"] != 1:
        return plan
    if ":ep:" in plan and position["dp_size"] != 1:
        return plan
    return WHOLE


def compare(cache: Mapping[str, Any], engine: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every field whose values differ, as (field, cache value, engine value)."""
    keys = list(FIELDS) + sorted((set(cache) | set(engine)) - set(FIELDS))
    return [(k, cache.get(k), engine.get(k)) for k in keys if cache.get(k) != engine.get(k)]


def installed_torch_version() -> str:
    """torch.__version__, without importing torch where no one has (a CPU cache rank never
    does: the import costs it seconds and hundreds of MB): read from torch's own version.py."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    return _version_file() or str(__import__("torch").__version__)


@functools.cache
def _version_file() -> str:
    """The `__version__ = '...'` literal of the installed torch/version.py ("" if none)."""
    import ast
    import importlib.util
    import os

    spec = importlib.util.find_spec("torch")  # finds the package; runs none of it
    for root in (spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(root, "version.py"), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and [
                    getattr(t, "id", "") for t in node.targets] == ["__version__"]:
                return str(node.value.value)
    return ""
