"""Detect the kernel backends that shape an engine's weights or tuning tables (`auto`).

The fingerprint's `kernel_backends` field is free text. The value `auto` is replaced, on the
cache's side and on the engine's alike, by what this process can see without importing the
engine: the versions of the kernel libraries installed (FlashInfer, DeepGEMM, Triton, vLLM)
and the engine's own kernel selection variables (`VLLM_ATTENTION_BACKEND`,
`VLLM_USE_DEEP_GEMM`, `VLLM_USE_FLASHINFER_*`, ...). A cache and its engine started from one
image and one environment detect the same string; a changed library or selection variable is
a fingerprint mismatch on `kernel_backends`. Light: no torch, no engine import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import metadata

AUTO = "auto"
DISTRIBUTIONS = ("flashinfer-python", "flashinfer", "deep-gemm", "triton", "vllm", "sglang")
"""Kernel libraries whose version changes how weights are laid out or tuned."""
SELECTED = ("VLLM_ATTENTION_BACKEND", "SGLANG_ATTENTION_BACKEND")
"""The engine's kernel selection variables named in full..."""
SELECTED_PREFIXES = ("VLLM_USE_DEEP_GEMM", "VLLM_USE_FLASHINFER", "VLLM_FLASHINFER",
                     "VLLM_USE_TRTLLM", "VLLM_MXFP4", "VLLM_MARLIN")
"""...and by prefix (string tests: a regular expression compiled on an engine's import path
cost 0.3 ms there)."""


def selects(key: str) -> bool:
    """Whether variable `key` selects the engine's kernels."""
    return key in SELECTED or (key.startswith(SELECTED_PREFIXES) and key.isidentifier())


def detect(env: Mapping[str, str] | None = None) -> str:
    """`name=version` of the kernel libraries installed and `VAR=value` of the selection
    variables set, sorted and comma-separated ("" when there are none)."""
    env = os.environ if env is None else env
    parts = [f"{dist}={version}" for dist in DISTRIBUTIONS if (version := _version(dist))]
    parts += [f"{key}={value}" for key, value in env.items() if selects(key)]
    return ",".join(sorted(parts))


def resolve(kernel_backends: str, env: Mapping[str, str] | None = None) -> str:
    """The field's value: `auto` detected, anything else as given."""
    return detect(env) if kernel_backends.strip() == AUTO else kernel_backends


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""
