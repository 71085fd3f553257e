"""The safetensors dtypes vlaunch knows: their sizes in bits and the torch dtype that holds them.

Every dtype of the safetensors format is accepted. Sizes follow safetensors' own rule: a
tensor takes numel * bits / 8 bytes, which must be a whole number (an F4 tensor of 3 elements
is invalid). Each dtype is served as its torch dtype where the installed torch has one;
otherwise as raw bytes: a uint8 tensor whose last dimension counts bytes instead of elements
(an F6_E2M3 tensor of shape [8, 32] is served as uint8 [8, 24]). Packed torch dtypes hold
several elements each: F4 is served as torch.float4_e2m1fn_x2 with the last dimension halved,
exactly as safetensors' own torch loader returns it. Sub-byte tensors are therefore served
only when their last dimension packs into whole bytes (F4: even; F6: a multiple of 4).

Importing this module does not import torch; only the functions that return torch dtypes do.
"""

from __future__ import annotations

import functools
import math
from importlib import metadata
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class DType(NamedTuple):
    """A safetensors dtype: its name in headers, its size in bits and its torch dtype's name
    (a NamedTuple: see vlaunch.cache)."""

    name: str
    bits: int
    torch_name: str  # "" where torch has no such dtype: served as raw bytes
    per_torch: int = 1  # elements one torch element holds (2 for float4_e2m1fn_x2)

    @property
    def itemsize(self) -> int:
        """Bytes per element; ValueError for sub-byte dtypes (use `nbytes`)."""
        if self.bits % 8:
            raise ValueError(f"{self.name} elements are {self.bits} bits, not whole bytes")
        return self.bits // 8

    @property
    def unit(self) -> tuple[int, int]:
        """(elements, bytes) of the smallest run of elements that fills whole bytes."""
        elements = 8 // math.gcd(self.bits, 8)
        return elements, elements * self.bits // 8


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("F64", 64, "float64"),
    DType("F32", 32, "float32"),
    DType("F16", 16, "float16"),
    DType("BF16", 16, "bfloat16"),
    DType("F8_E4M3", 8, "float8_e4m3fn"),
    DType("F8_E5M2", 8, "float8_e5m2"),
    DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    DType("F8_E8M0", 8, "float8_e8m0fnu"),  # MX block scales
    DType("F6_E2M3", 6, ""),  # MXFP6: torch has no 6-bit dtype
    DType("F6_E3M2", 6, ""),
    DType("F4", 4, "float4_e2m1fn_x2", per_torch=2),  # MXFP4/NVFP4: two values a byte
    DType("C64", 64, "complex64"),
    DType("I64", 64, "int64"),
    DType("I32", 32, "int32"),
    DType("I16", 16, "int16"),
    DType("I8", 8, "int8"),
    DType("U64", 64, "uint64"),  # torch.uint16/32/64 exist since torch 2.3
    DType("U32", 32, "uint32"),
    DType("U16", 16, "uint16"),
    DType("U8", 8, "uint8"),
    DType("BOOL", 8, "bool"),
)}

_BY_TORCH_NAME: dict[str, str] = {d.torch_name: d.name for d in DTYPES.values() if d.torch_name}


def dtype_info(name: str) -> DType:
    """Return the dtype named `name` in a safetensors header; KeyError if unknown."""
    return DTYPES[name]


def unknown_dtype_message(name: object) -> str:
    """Why dtype `name` is refused, naming the installed safetensors and torch versions."""
    return (f"unknown dtype {name!r}: neither vlaunch nor the installed safetensors "
            f"{_version('safetensors')} and torch {_version('torch')} know it (known: "
            f"{', '.join(DTYPES)})")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def nbytes(name: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a tensor of dtype `name` and `shape` takes; ValueError if not whole bytes."""
    bits = math.prod(shape) * DTYPES[name].bits
    if bits % 8:
        dims = ",".join(map(str, shape))
        raise ValueError(f"{name} tensor of shape [{dims}] holds {bits} bits, not whole bytes")
    return bits // 8


def shape_problem(name: str, shape: tuple[int, ...] | list[int]) -> str:
    """Why a tensor of this dtype and shape cannot be served as a torch tensor; "" if it can."""
    elements, _ = DTYPES[name].unit
    last = shape[-1] if shape else 1
    if last % elements:
        dims = ",".join(map(str, shape))
        return (f"{name} packs {elements} elements into whole bytes, so the last dimension of "
                f"shape [{dims}] must be a multiple of {elements}")
    return ""


@functools.cache
def is_plain(name: str) -> bool:
    """True when the installed torch holds dtype `name` one element per torch element."""
    info = DTYPES[name]
    return info.bits % 8 == 0 and info.per_torch == 1 and _torch_dtype(info) is not None


def to_torch(name: str) -> torch.dtype:
    """Return the torch dtype tensors of dtype `name` are served as (uint8: raw bytes)."""
    import torch

    return _torch_dtype(DTYPES[name]) or torch.uint8


def served_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the torch tensor that serves a tensor of dtype `name` and `shape`."""
    info = DTYPES[name]
    if is_plain(name):
        return tuple(shape)
    elements, unit_bytes = info.unit
    torch_dtype = _torch_dtype(info)
    per_elem = 1 if torch_dtype is None else torch_dtype.itemsize  # bytes per torch element
    last = shape[-1] if shape else 1
    size = last // elements * unit_bytes // per_elem
    if not shape:
        return () if size == 1 else (size,)
    return (*shape[:-1], size)


def from_torch(torch_dtype: torch.dtype) -> str:
    """Return the safetensors dtype name of `torch_dtype`; KeyError if it has none."""
    return _BY_TORCH_NAME[str(torch_dtype).removeprefix("torch.")]


def header_shape(torch_dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The safetensors (element) shape of a torch tensor's shape: packed dims unfold."""
    per = DTYPES[from_torch(torch_dtype)].per_torch
    if per == 1 or not shape:
        return tuple(shape)
    return (*shape[:-1], shape[-1] * per)


def _torch_dtype(info: DType) -> torch.dtype | None:
    """The installed torch's dtype named `info.torch_name`, or None."""
    if not info.torch_name:
        return None
    import torch

    dtype = getattr(torch, info.torch_name, None)
    return dtype if isinstance(dtype, torch.dtype) else None
