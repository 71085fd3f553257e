"""Engine-shaped layouts, engine side: hand post-processed parameters back, map them later.

    target = vlaunch.cache.Target.resolve(model, rank=r, ...)
    weights = vlaunch.cache.load(target, layout=fields)
    if not weights.layout:                        # first start: raw (checkpoint) tensors
        params = my_post_processing(weights)      # fuse, pad, quantize, repack ...
        weights = vlaunch.cache.hand_back(params, target, fields=fields,
                                          copy=names_the_engine_rewrites_later)
    # weights: the engine layout (read-only mappings; the `copy` names as private copies)

See docs/engine-layout.md for the fields, what is copied, and when the raw layout goes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract import engine_layout as el
from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import (
    CacheBrokenError,
    CacheUnavailableError,
    CheckpointError,
    FingerprintMismatchError,
    ModelNotFoundError,
    VlaunchError,
)
from vlaunch.cache.store import collector
from vlaunch.cache.store.fingerprints import fingerprint
from vlaunch.cache.store.identity import CheckpointIdentity
from vlaunch.cache.store.manifest import Manifest, TensorRecord, pack, views
from vlaunch.cache.store.slabs import backend_for
from vlaunch.cache.store.target import Target, as_target

if TYPE_CHECKING:
    from typing import Unpack

    import torch

    from vlaunch.cache.client.weights import Weights
    from vlaunch.cache.store.slabs import Backend
    from vlaunch.cache.store.target import TargetArgs

log = logging.getLogger("vlaunch.cache")

MAX_SLAB = 64 << 30


class LayoutMissError(VlaunchError):
    """The rank holds no engine layout with these fields (the first start hands one back)."""


def load_layout(target: Target, fields: Mapping[str, Any], *, mode: str = "share",
                timeout: float = 0.0) -> Weights:
    """The engine layout with these fields from the rank's cache; the `copy` names private."""
    from vlaunch.cache.client.weights import Outcome, Weights

    if mode not in ("share", "copy"):
        raise ValueError(f"an engine layout is mapped in share or copy mode, not {mode!r}")
    checked = el.check_fields(fields)
    client = CacheClient(target.socket, timeout=timeout)
    try:
        with collector.paused():  # as for the raw layout (loader._from_cache)
            copy, tensors = _handoff(client, target, checked, mode)
    except BaseException:
        client.close()
        raise
    if mode == "share":
        for name in copy:  # the engine rewrites these: never in shared memory
            tensors[name] = tensors[name].clone()
    weights = Weights(tensors)
    weights.source, weights.client, weights.bytes_outside = "cache", client, client.bytes_mapped
    weights.layout, weights.copied = el.layout_key(checked), frozenset(copy)
    weights.outcome = Outcome.SERVED
    if mode != "share":  # a share lease lasts while the engine holds the mapped tensors
        client.close()
    return weights


def layout_nbytes(target: Target, fields: Mapping[str, Any]) -> int:
    """Bytes a share-mode load of this engine layout would map (its copied tensors are the
    engine's own); 0 when the rank holds no matching layout. Maps nothing."""
    checked = el.check_fields(fields)
    try:
        client = CacheClient(target.socket)
    except CacheUnavailableError:
        return 0
    try:
        manifest, copy = _checked_manifest(client, target, checked)
    except (LayoutMissError, CacheUnavailableError, FingerprintMismatchError, CacheBrokenError):
        return 0
    finally:
        client.close()
    copied = set(copy)
    return manifest.nbytes - sum(t.nbytes for t in manifest.tensors if t.name in copied)


def _handoff(client: CacheClient, target: Target, checked: dict[str, str], mode: str
             ) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The layout's copied names and its tensors, in one round trip: the listing, the hello,
    the manifest and the open go out at once (benchmarks/results/cpu.md has the figures).
    Where the checkpoint cannot be read here, the hello needs the identity the listing
    recorded: one request at a time."""
    key = el.layout_key(checked)
    try:
        base = fingerprint(target)
    except (ModelNotFoundError, CheckpointError, OSError):
        manifest, copy = _checked_manifest(client, target, checked)
        return copy, client.map(manifest, mode=mode, device=target.device, layout=key)
    replies = client.exchange([
        {"op": "layouts"},
        # a layout with other fields answers a mismatch that lists every differing field
        {**client.hello_request(el.extend(base, checked)), "layout": key},
        {"op": "manifest", "layout": key},
        {"op": "open", "mode": mode, "layout": key}])
    for _, fds in replies[:3]:  # none expected: never keep what a broken cache sends
        wire.close_fds(fds)
    opened, fds = replies[3]
    try:
        if not _listing_in(client, replies[0][0]):
            raise LayoutMissError(f"the cache at {client.path} holds no engine layout yet")
        client.checked(replies[1][0], [])
        reply, _ = client.checked(replies[2][0], [])
        manifest = Manifest.from_wire(reply["manifest"])
        copy = _copy_names(reply.get("copy"), manifest)
    except BaseException:
        wire.close_fds(fds)
        raise
    opened, fds = client.checked(opened, fds)  # an error reply's fds are closed
    return copy, client.map_reply(opened, fds, manifest, mode=mode, device=target.device)


def _checked_manifest(client: CacheClient, target: Target, checked: dict[str, str]
                      ) -> tuple[Manifest, list[str]]:
    """After a fingerprint check, the layout's manifest and the names of its copied tensors."""
    key = el.layout_key(checked)
    held = _listing(client)
    if not held:
        raise LayoutMissError(f"the cache at {client.path} holds no engine layout yet")
    recorded = next((x.get("fingerprint") for x in held if x.get("key") == key), None)
    base = _raw_fingerprint(client, target, recorded)
    # a layout with other fields answers a mismatch that lists every differing field
    client.request({**client.hello_request(el.extend(base, checked)), "layout": key})
    reply, _ = client.request({"op": "manifest", "layout": key})
    manifest = Manifest.from_wire(reply["manifest"])
    return manifest, _copy_names(reply.get("copy"), manifest)


def hand_back(tensors: Mapping[str, torch.Tensor], target: Target | None = None, *,
              fields: Mapping[str, Any], copy: Iterable[str] = (), release_raw: bool = True,
              timeout: float = 0.0, **given: Unpack[TargetArgs]) -> Weights:
    """Give the rank's cache these (post-processed) parameters as its engine layout.

    `target` (or `given`, as load() takes it): the rank whose cache takes them. One device
    copy per tensor into slabs the cache allocates; then the cache serves them under the raw
    fingerprint extended by `fields`, and (release_raw) drops its raw layout. Returns the
    engine layout as `load(target, layout=fields)` would: rebind the parameters to these
    tensors, drop every reference to the originals, then `release_cached(device)`: one copy
    on the device. `copy` names tensors the engine writes into later: they come back (now and
    on every later start) as private copies.
    """
    import torch

    target = as_target(target, given)
    checked = el.check_fields(fields)
    copied = list(dict.fromkeys(copy))
    unknown = [n for n in copied if n not in tensors]
    if unknown:
        raise ValueError(f"copy names tensors that are not handed back: {unknown[:5]}")
    backend = backend_for(target.device)
    manifest = _pack(tensors, backend)
    client = CacheClient(target.socket, timeout=timeout)
    try:
        base = _raw_fingerprint(client, target, None)
        _, fds = client.request({"op": "layout_alloc", "fingerprint": base, "fields": checked,
                                 "sizes": list(manifest.slab_sizes)})
        _fill(fds, manifest, tensors, backend)
        if target.device.startswith("cuda"):
            torch.cuda.synchronize(target.device)
        client.request({"op": "layout_commit", "fields": checked,
                        "tensors": manifest.to_wire()["tensors"], "copy": copied,
                        "release_raw": release_raw})
    finally:
        client.close()
    log.info("rank %d: handed %d tensors (%.2f GB) back to the cache as engine layout %s; "
             "%d shared, %d copied", target.rank, len(manifest.tensors), manifest.nbytes / 1e9,
             el.layout_key(checked), len(manifest.tensors) - len(copied), len(copied))
    return load_layout(target, checked)


def release_cached(device: str) -> None:
    """Give the device memory that torch's caching allocator keeps for freed tensors back to
    the driver. Call it once the engine holds hand_back's tensors and no reference to its own
    former copies is left (parameters rebound, the dict it handed back dropped): until then
    a freed copy stays reserved by the engine and counts in nvidia-smi. Nothing on CPU, where
    freed tensors of this size go back to the system at once."""
    if not device.startswith("cuda"):
        return
    import gc

    import torch

    gc.collect()  # a reference cycle (a traceback, a closure) may hold a former copy
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _raw_fingerprint(client: CacheClient, target: Target, recorded: Any) -> fp.Fingerprint:
    """This engine rank's raw fingerprint. When the checkpoint cannot be read here (moved away
    once the engine layout exists), its identity as recorded in the layout's fingerprint
    (`recorded`), which was built from what the cache read; else the error stands."""
    try:
        return fingerprint(target)
    except (ModelNotFoundError, CheckpointError, OSError) as exc:
        if not isinstance(recorded, dict):
            raise LayoutMissError(f"the cache at {client.path} holds no engine layout with "
                                  f"these fields, and the checkpoint cannot be read ({exc})"
                                  ) from None
        log.warning("checkpoint %s cannot be read (%s); matching the engine layout on the "
                    "checkpoint identity the cache recorded when it read it", target.model, exc)
        return fingerprint(target, CheckpointIdentity(str(recorded.get("checkpoint", "")),
                                                     str(recorded.get("checkpoint_data", ""))))


def _listing(client: CacheClient) -> list[dict[str, Any]]:
    """A summary of each engine layout the rank holds."""
    return _listing_in(client, client.request({"op": "layouts"})[0])


def _listing_in(client: CacheClient, reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The summaries of a `layouts` reply, checked."""
    listing = client.checked(reply, [])[0].get("layouts")
    if not isinstance(listing, list) or not all(isinstance(x, dict) for x in listing):
        raise CacheBrokenError(f"the cache at {client.path} sent a bad list of layouts")
    return listing


def _copy_names(names: Any, manifest: Manifest) -> list[str]:
    """The cache's list of copied tensors, checked against the manifest."""
    known = {t.name for t in manifest.tensors}
    if not isinstance(names, list) or not all(isinstance(n, str) and n in known for n in names):
        raise CacheBrokenError("the cache sent a bad list of copied tensors for its layout")
    return names


def _pack(tensors: Mapping[str, torch.Tensor], backend: Backend) -> Manifest:
    """Lay the tensors out in slabs; a dense tensor keeps its strides (a transposed weight
    stays transposed), anything else is stored contiguous."""
    from vlaunch.cache.store.dtypes import from_torch, header_shape, is_plain

    items, strides = [], {}
    for name, t in tensors.items():
        try:
            dtype = from_torch(t.dtype)
        except KeyError:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which vlaunch cannot "
                             "hold; convert it or leave it out of the hand-back") from None
        items.append((name, dtype, header_shape(t.dtype, tuple(t.shape))))
        if is_plain(dtype) and not t.is_contiguous() and _dense(t):
            strides[name] = tuple(t.stride())
    manifest = pack(items, backend=backend.name, alignment=backend.alignment, max_slab=MAX_SLAB)
    records = tuple(TensorRecord(r.name, r.dtype, r.shape, strides.get(r.name, r.stride),
                                 r.slab, r.offset, r.nbytes) for r in manifest.tensors)
    return Manifest(manifest.backend, manifest.slab_sizes, records)


def _dense(t: torch.Tensor) -> bool:
    """True when `t` covers exactly numel elements in some dimension order (no gaps)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda x: x[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _fill(fds: list[int], manifest: Manifest, tensors: Mapping[str, torch.Tensor],
          backend: Backend) -> None:
    """Map the new slabs writable, copy each tensor in (one device copy each), unmap."""
    try:
        if len(fds) != len(manifest.slab_sizes):
            raise CacheBrokenError(f"cache sent {len(fds)} fds for "
                                   f"{len(manifest.slab_sizes)} layout slabs")
        slabs = [backend.import_fd(fd, size, readonly=False)
                 for fd, size in zip(fds, manifest.slab_sizes, strict=True)]
    finally:
        wire.close_fds(fds)
    for name, view in views(manifest, slabs).items():
        view.copy_(tensors[name])
