"""`vlaunch.cache.load`: a rank's weights from its cache, or from disk when there is none."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from . import fingerprint as fp
from .client import CacheClient
from .errors import CacheBrokenError, CacheUnavailableError, FingerprintMismatchError
from .plan import Layout
from .protocol import MODES
from .sockdir import default_socket_dir, socket_path

if TYPE_CHECKING:
    pass

log = logging.getLogger("vlaunch.cache")

_LEASES: list[CacheClient] = []  # share-mode leases live as long as the process


class Weights(dict):  # type: ignore[type-arg]
    """Named tensors, plus where they came from and the bytes held outside the engine."""

    source: str = "disk"
    client: CacheClient | None = None
    bytes_outside: int = 0
    reason: str = ""


def default_device() -> str:
    """$VLAUNCH_DEVICE, else cuda when torch sees a GPU, else cpu."""
    if os.environ.get("VLAUNCH_DEVICE"):
        return os.environ["VLAUNCH_DEVICE"]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def expected_fingerprint(model: str, layout: Layout, device: str, plan: str = "llama",
                         kernel_backends: str = "", loader: str = "vlaunch") -> fp.Fingerprint:
    """The fingerprint a cache must have for this engine rank."""
    from .checkpoint import open_checkpoint
    from .plan import load_plan
    from .slabs import get_backend

    backend = get_backend(device)
    return fp.build(checkpoint=open_checkpoint(model).identity, plan=load_plan(plan).identity,
                    layout=layout.as_dict(), dtype="checkpoint", backend=backend.name,
                    device=backend.device_info(), kernel_backends=kernel_backends,
                    loader=loader)


def load(model: str, *, rank: int = 0, tensor_parallel_size: int = 1,
         pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
         socket_dir: str | None = None, mode: str = "share", fallback: bool = True,
         timeout: float = 60.0, device: str | None = None, plan: str = "llama",
         kernel_backends: str = "", loader: str = "vlaunch") -> Weights:
    """The rank's shard as named tensors: from the cache, else (fallback) from disk."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    layout = Layout.from_global(rank, tensor_parallel_size, pipeline_parallel_size,
                                data_parallel_size)
    device = device or default_device()
    path = socket_path(socket_dir or default_socket_dir(), rank)
    try:
        return _from_cache(path, model, layout, device, mode, plan, kernel_backends, loader,
                           0.0 if fallback else timeout)
    except (CacheUnavailableError, FingerprintMismatchError, CacheBrokenError) as exc:
        if not fallback:
            raise
        kind = {CacheUnavailableError: "unavailable", FingerprintMismatchError: "mismatched",
                CacheBrokenError: "broken"}[type(exc)]
        log.warning("vlaunch cache for rank %d is %s (%s); loading from disk instead", rank,
                    kind, exc)
        weights = load_from_disk(model, layout, device, plan)
        weights.reason = f"{kind}: {exc}"
        return weights


def _from_cache(path: os.PathLike[str], model: str, layout: Layout, device: str, mode: str,
                plan: str, kernel_backends: str, loader: str, timeout: float) -> Weights:
    client = CacheClient(path, timeout=timeout)
    try:
        client.hello(expected_fingerprint(model, layout, device, plan, kernel_backends, loader))
        tensors = client.map(client.manifest(), mode=mode, device=device)
    except BaseException:
        client.close()
        raise
    weights = Weights(tensors)
    weights.source, weights.client, weights.bytes_outside = "cache", client, client.bytes_mapped
    if mode == "share":
        _LEASES.append(client)
    else:
        client.close()
    return weights


def load_from_disk(model: str, layout: Layout, device: str, plan: str = "llama") -> Weights:
    """Read the same shard from the checkpoint into the engine's own memory."""
    from .shard import PlainBackend, load_shard

    shard = load_shard(model, plan, layout, PlainBackend(device),
                       label=f"rank {layout.global_rank} loading from disk")
    return Weights(shard.named())

