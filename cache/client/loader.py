"""`vlaunch.cache.load`: a rank's weights from its cache, or from disk when there is none."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vlaunch.cache.client import connection
from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.client.rewrites import check_rewrites
from vlaunch.cache.client.weights import Outcome, Weights
from vlaunch.cache.contract.errors import (
    CacheBrokenError,
    CacheUnavailableError,
    FingerprintMismatchError,
)
from vlaunch.cache.contract.protocol import MODES
from vlaunch.cache.store import collector, fingerprints
from vlaunch.cache.store.target import Target, as_target

if TYPE_CHECKING:
    from typing import Unpack

    from vlaunch.cache.store.target import TargetArgs

log = logging.getLogger("vlaunch.cache")

# What this module imports is paid by every engine start (benchmarks/bench_import.py measures
# it; tests/test_import_cost.py keeps it small): the shard plans, the checkpoint reader and the
# CUDA slab backend are imported where they are used. CUDA driver calls go through ctypes
# (store/cudadrv.py): nothing to import for them, and cuInit runs on first use.

__all__ = ["Target", "Weights", "cached_nbytes", "load", "load_from_disk"]


def load(target: Target | str | None = None, *, mode: str = "share", fallback: bool = True,
         timeout: float = 60.0, layout: Mapping[str, Any] | None = None,
         rewrites: str | None = None, **given: Unpack[TargetArgs]) -> Weights:
    """The rank's shard as named tensors: from the cache, else (fallback) from disk.

    `target`: a Target, or its model; `given`: the rest of it (TargetArgs: rank, sizes,
    socket directory, device, plan, kernel backends, loader, quantization, role), what is
    left out coming from the environment `vlaunch run` gives its engine (Target.resolve).
    `rewrites`: what will rewrite the weights in place (e.g. "EPLB"); share mode then refuses
    (client/rewrites.py). `layout`: the fields of the engine layout to map first
    (docs/engine-layout.md); when the cache holds none that matches, the raw tensors come back
    with `layout_miss` set.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    check_rewrites(mode, rewrites)
    target = as_target(target, given)
    wait = 0.0 if fallback else timeout
    if wait > 0 and not os.path.exists(target.socket):
        log.warning("rank %d: no cache at %s yet; waiting up to %g s for it (fallback=False)",
                    target.rank, target.socket, timeout)
    miss = ""
    if layout is not None and mode != "copy-release":
        from vlaunch.cache.client import layout as engine_layout

        try:
            return engine_layout.load_layout(target, layout, mode=mode, timeout=wait)
        except (engine_layout.LayoutMissError, CacheUnavailableError,
                FingerprintMismatchError, CacheBrokenError) as exc:
            miss = str(exc)
            log.info("rank %d: no engine layout to map (%s); taking the raw layout",
                     target.rank, exc)
    try:
        weights = _from_cache(target, mode, wait)
        weights.layout_miss = miss
        return weights
    except (CacheUnavailableError, FingerprintMismatchError, CacheBrokenError) as exc:
        if not fallback and isinstance(exc, CacheUnavailableError):
            raise CacheUnavailableError(f"{exc}; to wait longer than the {timeout:g} s it "
                                        "waited, pass a larger timeout to load() (the engine's "
                                        "--timeout)") from None
        if not fallback:
            raise
        if target.published:  # no files hold these weights: a disk load would serve others
            raise CacheUnavailableError(
                f"rank {target.rank}'s weights are a published version "
                f"({target.published[:80]}) that only its cache holds, and the cache cannot be "
                f"used ({exc}); it cannot be loaded from disk: fix the cache, or swap to a "
                "checkpoint (vlaunch swap)") from exc
        kind = {CacheUnavailableError: "unavailable", FingerprintMismatchError: "mismatched",
                CacheBrokenError: "broken"}[type(exc)]
        log.warning("vlaunch cache for rank %d is %s (%s); loading from disk instead",
                    target.rank, kind, exc)
        weights = load_from_disk(target)
        weights.reason, weights.layout_miss = f"{kind}: {exc}", miss
        weights.outcome = outcome_of(exc)
        return weights


def outcome_of(exc: CacheUnavailableError | FingerprintMismatchError | CacheBrokenError
               ) -> Outcome:
    """What the rank answered, from the error its reply was raised as (its code, not text)."""
    if isinstance(exc, FingerprintMismatchError):
        return Outcome.MISMATCH
    if isinstance(exc, CacheUnavailableError):
        return Outcome.BUSY if exc.code == "busy" else Outcome.UNAVAILABLE
    return {"released": Outcome.RELEASED, "changed": Outcome.CHANGED}.get(exc.code,
                                                                          Outcome.BROKEN)


def cached_nbytes(target: Target | str | None = None, **given: Unpack[TargetArgs]) -> int:
    """Bytes a share-mode `load` would map from the rank's cache; 0 when it would not.

    For an engine that sizes its memory budget before it loads (vLLM asks its loader first):
    the answer comes from the cache's manifest after a fingerprint check, without mapping.
    """
    target = as_target(target, given)
    try:
        client = CacheClient(target.socket)
    except CacheUnavailableError:
        return 0
    try:
        client.hello(fingerprints.fingerprint(target))
        return client.manifest().nbytes
    except (CacheUnavailableError, FingerprintMismatchError, CacheBrokenError):
        return 0
    finally:
        client.close()


def _from_cache(target: Target, mode: str, timeout: float) -> Weights:
    client = CacheClient(target.socket, timeout=timeout)  # may wait for the cache: GC stays on
    try:
        with collector.paused():  # a collection pass would cost more than the handoff
            tensors = client.handoff(lambda: fingerprints.fingerprint(target), mode=mode,
                                     device=target.device)
            connection.trace("handed")
    except BaseException:
        client.close()
        raise
    connection.trace("collector")
    weights = Weights(tensors)
    connection.trace("weights")
    weights.source, weights.client, weights.bytes_outside = "cache", client, client.bytes_mapped
    weights.outcome = Outcome.SERVED
    if mode != "share":  # a share lease ends when the engine drops the last mapped tensor
        client.close()
    connection.trace("closed")
    return weights


def load_from_disk(target: Target) -> Weights:
    """Read the target's shard from the checkpoint into the engine's own memory."""
    from vlaunch.cache.store.shard import PlainBackend, load_shard

    shard = load_shard(target.model, target.plan, target.position, PlainBackend(target.device),
                       label=f"rank {target.rank} loading from disk")
    return Weights(shard.named())
