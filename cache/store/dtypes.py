"""The safetensors dtypes vlaunch knows: their sizes and their torch names.

Importing this module does not import torch; only `to_torch` and `from_torch` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """A safetensors dtype: its name in headers, its element size and its torch name."""

    name: str
    itemsize: int
    torch_name: str


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("F64", 8, "float64"),
    DType("F32", 4, "float32"),
    DType("F16", 2, "float16"),
    DType("BF16", 2, "bfloat16"),
    DType("F8_E4M3", 1, "float8_e4m3fn"),
    DType("F8_E5M2", 1, "float8_e5m2"),
    DType("I64", 8, "int64"),
    DType("I32", 4, "int32"),
    DType("I16", 2, "int16"),
    DType("I8", 1, "int8"),
    DType("U64", 8, "uint64"),  # torch.uint16/32/64 exist since torch 2.3; vlaunch needs 2.4
    DType("U32", 4, "uint32"),
    DType("U16", 2, "uint16"),
    DType("U8", 1, "uint8"),
    DType("BOOL", 1, "bool"),
)}

_BY_TORCH_NAME: dict[str, str] = {d.torch_name: d.name for d in DTYPES.values()}


def dtype_info(name: str) -> DType:
    """Return the dtype named `name` in a safetensors header; KeyError if unknown."""
    return DTYPES[name]


def to_torch(name: str) -> torch.dtype:
    """Return the torch dtype of the safetensors dtype `name`; KeyError if unknown."""
    import torch

    info = DTYPES[name]
    dtype = getattr(torch, info.torch_name, None)
    if not isinstance(dtype, torch.dtype):
        raise KeyError(f"this torch build has no torch.{info.torch_name} for dtype {name}")
    return dtype


def from_torch(torch_dtype: torch.dtype) -> str:
    """Return the safetensors dtype name of `torch_dtype`; KeyError if it has none."""
    return _BY_TORCH_NAME[str(torch_dtype).removeprefix("torch.")]
