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
import re
from collections.abc import Mapping
from importlib import metadata

AUTO = "auto"
DISTRIBUTIONS = ("flashinfer-python", "flashinfer", "deep-gemm", "triton", "vllm", "sglang")
"""Kernel libraries whose version changes how weights are laid out or tuned."""
SELECTION = re.compile(r"^(?:VLLM_ATTENTION_BACKEND|VLLM_USE_DEEP_GEMM\w*|VLLM_USE_FLASHINFER\w*|"
                       r"VLLM_FLASHINFER\w*|VLLM_USE_TRTLLM\w*|VLLM_MXFP4\w*|VLLM_MARLIN\w*|"
                       r"SGLANG_ATTENTION_BACKEND)$")
"""The engine's kernel selection variables."""


def detect(env: Mapping[str, str] | None = None) -> str:
    """`name=version` of the kernel libraries installed and `VAR=value` of the selection
    variables set, sorted and comma-separated ("" when there are none)."""
    env = os.environ if env is None else env
    parts = [f"{dist}={version}" for dist in DISTRIBUTIONS if (version := _version(dist))]
    parts += [f"{key}={value}" for key, value in env.items() if SELECTION.match(key)]
    return ",".join(sorted(parts))


def resolve(kernel_backends: str, env: Mapping[str, str] | None = None) -> str:
    """The field's value: `auto` detected, anything else as given."""
    return detect(env) if kernel_backends.strip() == AUTO else kernel_backends


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""
