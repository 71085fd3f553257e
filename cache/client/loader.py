"""`vlaunch.cache.load`: a rank's weights from its cache, or from disk when there is none."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from vlaunch.cache.client import collector
from vlaunch.cache.client.connection import TRACE, CacheClient
from vlaunch.cache.client.rewrites import check_rewrites
from vlaunch.cache.client.weights import (
    Weights,
    default_device,
    engine_args,
    expected_fingerprint,
    group_role,
)
from vlaunch.cache.contract.engine_env import DEFAULT_PLAN, EngineEnv
from vlaunch.cache.contract.errors import (
    CacheBrokenError,
    CacheUnavailableError,
    FingerprintMismatchError,
)
from vlaunch.cache.contract.protocol import MODES
from vlaunch.cache.contract.sockdir import default_socket_dir, socket_path
from vlaunch.cache.store.ranks import Layout

log = logging.getLogger("vlaunch.cache")

# What this module imports is paid by every engine start (benchmarks/bench_import.py measures
# it; tests/test_import_cost.py keeps it small): the shard plans, the checkpoint reader and the
# CUDA slab backend are imported where they are used. CUDA driver calls go through ctypes
# (store/cudadrv.py): nothing to import for them, and cuInit runs on first use.


def load(model: str | None = None, *, rank: int = 0, tensor_parallel_size: int | None = None,
         pipeline_parallel_size: int | None = None, data_parallel_size: int | None = None,
         socket_dir: str | None = None, mode: str = "share", fallback: bool = True,
         timeout: float = 60.0, device: str | None = None, plan: str | None = None,
         kernel_backends: str | None = None, loader: str = "vlaunch",
         layout: Mapping[str, Any] | None = None, quantization: str | None = None,
         rewrites: str | None = None, role: str = "target") -> Weights:
    """The rank's shard as named tensors: from the cache, else (fallback) from disk.

    Model, sizes, socket directory, device, plan and kernel backends left out come from the
    environment `vlaunch run` gives its engine (contract.launch.EngineEnv); explicit win.

    `quantization`: the engine's quantization method (fingerprint field; default:
    $VLAUNCH_QUANTIZATION, else config.json's quant_method). `rewrites`: what will rewrite
    the weights in place (e.g. "EPLB"); share mode then refuses (client/rewrites.py).
    `role`: "draft" maps a speculative-decoding draft model from its own cache group
    (docs/speculative-decoding.md).

    `layout`: the fields of the engine layout to map first (docs/engine-layout.md); when the
    cache holds none that matches, the raw tensors come back with `layout_miss` set.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    check_rewrites(mode, rewrites)
    model, tensor_parallel_size, pipeline_parallel_size, data_parallel_size, plan, \
        kernel_backends = engine_args(model, tensor_parallel_size, pipeline_parallel_size,
                                      data_parallel_size, plan, kernel_backends, role)
    role = group_role(model, role)
    fields, layout = layout, Layout.from_global(rank, tensor_parallel_size,
                                                pipeline_parallel_size, data_parallel_size)
    device = device or default_device()
    path = socket_path(socket_dir or default_socket_dir(), rank, role)
    if not fallback and timeout > 0 and not os.path.exists(path):
        log.warning("rank %d: no cache at %s yet; waiting up to %g s for it (fallback=False)",
                    rank, path, timeout)
    miss = ""
    if fields is not None and mode != "copy-release":
        from vlaunch.cache.client import layout as engine_layout

        try:
            return engine_layout.load_layout(path, model, layout, device, fields, mode=mode,
                                             plan=plan, kernel_backends=kernel_backends,
                                             loader=loader, quantization=quantization,
                                             timeout=0.0 if fallback else timeout)
        except (engine_layout.LayoutMissError, CacheUnavailableError,
                FingerprintMismatchError, CacheBrokenError) as exc:
            miss = str(exc)
            log.info("rank %d: no engine layout to map (%s); taking the raw layout", rank, exc)
    try:
        weights = _from_cache(path, model, layout, device, mode, plan, kernel_backends, loader,
                              0.0 if fallback else timeout, quantization, role)
        weights.layout_miss = miss
        return weights
    except (CacheUnavailableError, FingerprintMismatchError, CacheBrokenError) as exc:
        if not fallback and isinstance(exc, CacheUnavailableError):
            raise CacheUnavailableError(f"{exc}; to wait longer than the {timeout:g} s it "
                                        "waited, pass a larger timeout to load() (the engine's "
                                        "--timeout)") from None
        if not fallback:
            raise
        published = EngineEnv.from_env().published_identity(rank) if role == "target" else ""
        if published:  # no files hold these weights: a disk load would serve others
            raise CacheUnavailableError(
                f"rank {rank}'s weights are a published version ({published[:80]}) that only "
                f"its cache holds, and the cache cannot be used ({exc}); it cannot be loaded "
                "from disk: fix the cache, or swap to a checkpoint (vlaunch swap)") from exc
        kind = {CacheUnavailableError: "unavailable", FingerprintMismatchError: "mismatched",
                CacheBrokenError: "broken"}[type(exc)]
        log.warning("vlaunch cache for rank %d is %s (%s); loading from disk instead", rank,
                    kind, exc)
        weights = load_from_disk(model, layout, device, plan)
        weights.reason, weights.layout_miss = f"{kind}: {exc}", miss
        return weights


def cached_nbytes(model: str | None = None, *, rank: int = 0,
                  tensor_parallel_size: int | None = None,
                  pipeline_parallel_size: int | None = None,
                  data_parallel_size: int | None = None, socket_dir: str | None = None,
                  device: str | None = None, plan: str | None = None,
                  kernel_backends: str | None = None, loader: str = "vlaunch",
                  role: str = "target") -> int:
    """Bytes a share-mode `load` would map from the rank's cache; 0 when it would not.

    For an engine that sizes its memory budget before it loads (vLLM asks its loader first):
    the answer comes from the cache's manifest after a fingerprint check, without mapping.
    """
    model, tensor_parallel_size, pipeline_parallel_size, data_parallel_size, plan, \
        kernel_backends = engine_args(model, tensor_parallel_size, pipeline_parallel_size,
                                      data_parallel_size, plan, kernel_backends, role)
    role = group_role(model, role)
    layout = Layout.from_global(rank, tensor_parallel_size, pipeline_parallel_size,
                                data_parallel_size)
    device = device or default_device()
    path = socket_path(socket_dir or default_socket_dir(), rank, role)
    try:
        client = CacheClient(path)
    except CacheUnavailableError:
        return 0
    try:
        client.hello(expected_fingerprint(model, layout, device, plan, kernel_backends, loader,
                                          path, role=role))
        return client.manifest().nbytes
    except (CacheUnavailableError, FingerprintMismatchError, CacheBrokenError):
        return 0
    finally:
        client.close()


def _from_cache(path: os.PathLike[str], model: str, layout: Layout, device: str, mode: str,
                plan: str, kernel_backends: str, loader: str, timeout: float,
                quantization: str | None = None, role: str = "target") -> Weights:
    client = CacheClient(path, timeout=timeout)  # may wait for the cache: GC stays on
    try:
        with collector.paused():  # a collection pass would cost more than the handoff
            tensors = client.handoff(lambda: expected_fingerprint(
                model, layout, device, plan, kernel_backends, loader, path,
                quantization=quantization, role=role), mode=mode,
                device=device)
            TRACE["handed"] = time.perf_counter()
    except BaseException:
        client.close()
        raise
    TRACE["collector"] = time.perf_counter()
    weights = Weights(tensors)
    TRACE["weights"] = time.perf_counter()
    weights.source, weights.client, weights.bytes_outside = "cache", client, client.bytes_mapped
    if mode != "share":  # a share lease ends when the engine drops the last mapped tensor
        client.close()
    TRACE["closed"] = time.perf_counter()
    return weights


def load_from_disk(model: str, layout: Layout, device: str, plan: str = DEFAULT_PLAN) -> Weights:
    """Read the same shard from the checkpoint into the engine's own memory."""
    from vlaunch.cache.store.shard import PlainBackend, load_shard

    shard = load_shard(model, plan, layout, PlainBackend(device),
                       label=f"rank {layout.global_rank} loading from disk")
    return Weights(shard.named())

