"""Build a model with its parameters on the meta device, then give them their tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Move every parameter registered inside the block to the meta device; buffers stay real.

    A parameter is created where the module asks (`torch.empty` only reserves memory) and is
    moved to meta as it is registered, before the module's own initialisation writes to it.
    The Parameter object (its class and attributes, such as an engine's weight loader) stays.
    """
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            set_data(param, param.detach().to("meta"))

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def set_data(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Make `data` the tensor of `param` in place (no copy), across devices, meta included."""
    import torch

    cls, attrs = type(param), dict(param.__dict__)
    torch.utils.swap_tensors(param, torch.nn.Parameter(data, requires_grad=param.requires_grad))
    param.__class__ = cls
    param.__dict__.update(attrs)
