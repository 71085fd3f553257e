"""A rank's new weights beside its old ones (docs/swap.md): the checks a swap makes before it
touches anything, the memory it may use, and the buffers it stages into and copies from.

Double-buffered staging reads the new shard into new slabs of the rank's own backend (a second
copy on the device, while the old one serves); in-place staging reads it into host memory
(pinned on a GPU rank) and copies it into the served slabs once no engine maps them. Nothing
here touches the served slabs except `copy_bytes` into them.
"""

from __future__ import annotations

import contextlib
import json
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlaunch.cache.store.manifest import Manifest
from vlaunch.cache.store.slabs import SlabBytes, on_device

if TYPE_CHECKING:
    from vlaunch.cache.store.slabs import Backend

COPY_CHUNK = 256 << 20
"""Bytes per copy of `copy_bytes` (a pinned host-to-device copy of this size runs near PCIe's
rate; the host copies are numpy's)."""
ARCHITECTURE = ("architectures", "model_type", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings")
"""config.json keys that a swap keeps: the engine runs the same model with other values."""


def manifest_difference(served: Manifest, new: Manifest) -> str:
    """The first way `new` does not sit where `served` does, in words, naming the first
    tensor that differs (its name, dtype and shape on both sides): a tensor missing or added,
    another dtype or shape; then strides, offsets and slab sizes (checksums aside). "" when
    it does."""
    theirs = {t.name: t for t in new.tensors}
    for a in served.tensors:
        b = theirs.get(a.name)
        if b is None:
            return (f"tensor {a.name!r} ({a.dtype}{list(a.shape)}) is served, the new "
                    "checkpoint has none")
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return (f"tensor {a.name!r} is {a.dtype}{list(a.shape)} in the served weights, "
                    f"{b.dtype}{list(b.shape)} in the new one")
    ours = {t.name for t in served.tensors}
    extra = next((b for b in new.tensors if b.name not in ours), None)
    if extra is not None:
        return (f"the new checkpoint has tensor {extra.name!r} ({extra.dtype}"
                f"{list(extra.shape)}), the served weights have none")
    for a in served.tensors:
        b = theirs[a.name]
        if (a.stride, a.slab, a.offset) != (b.stride, b.slab, b.offset):
            return (f"tensor {a.name!r} sits at slab {a.slab} offset {a.offset} in the served "
                    f"weights, at slab {b.slab} offset {b.offset} in the new ones")
    if new.slab_sizes != served.slab_sizes:
        return (f"its shard's slabs are {list(new.slab_sizes)[:4]} bytes, the served one's "
                f"{list(served.slab_sizes)[:4]}")
    return ""


def config_difference(served: str, new: str) -> str:
    """The first architecture key of config.json that differs between two checkpoints (a
    directory each; a file or no config.json: nothing to compare), in words."""
    a, b = _config(served), _config(new)
    if a is None or b is None:
        return ""
    for key in ARCHITECTURE:
        if a.get(key) != b.get(key):
            return f"config.json {key} is {a.get(key)!r} served, {b.get(key)!r} in the new one"
    return ""


def _config(model: str) -> dict[str, Any] | None:
    path = Path(model) / "config.json"
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def free_device_bytes(backend: Backend) -> int:
    """Bytes free on the rank's device now (host memory for the CPU backend)."""
    if backend.name != "cuda":
        return available_host_bytes()
    import torch

    free, _ = torch.cuda.mem_get_info(backend.index)
    return int(free)


def available_host_bytes() -> int:
    """Host memory this process may still use: MemAvailable, capped by its cgroup's limit."""
    available = _meminfo("MemAvailable:")
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup v2 (None: no limit, or v1)."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        group = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError, IndexError):
        return None


def host_buffers(sizes: tuple[int, ...], *, pinned: bool
                 ) -> tuple[list[SlabBytes], Callable[[], None]]:
    """Host buffers of `sizes` bytes (pinned torch tensors on a GPU rank, else numpy arrays
    over anonymous mappings) and the call that frees them."""
    if pinned:
        import torch

        tensors = [torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True)[:n]
                   for n in sizes]

        def free_pinned() -> None:
            tensors.clear()
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:  # torch keeps freed pinned blocks cached otherwise
                empty()

        return list(tensors), free_pinned
    import numpy as np

    maps = [mmap.mmap(-1, max(n, 1)) for n in sizes]
    arrays = [np.frombuffer(m, dtype=np.uint8, count=max(n, 1))[:n]
              for m, n in zip(maps, sizes, strict=True)]

    def free_host() -> None:
        arrays.clear()
        for m in maps:
            with contextlib.suppress(BufferError):  # a view lives on: the mapping goes with it
                m.close()

    return list(arrays), free_host


def copy_bytes(dst: list[SlabBytes], src: list[SlabBytes]) -> None:
    """Copy every byte of `src` into `dst`, slab by slab, in COPY_CHUNK pieces; waits for a
    device copy to finish."""
    device = next((b for b in (*dst, *src) if on_device(b)), None)
    for d, s in zip(dst, src, strict=True):
        if len(d) != len(s):
            raise ValueError(f"copy of {len(s)} bytes into a slab of {len(d)}")
        if device is None:
            import numpy as np

            for at in range(0, len(d), COPY_CHUNK):
                np.copyto(_host(d)[at:at + COPY_CHUNK], _host(s)[at:at + COPY_CHUNK])
            continue
        for at in range(0, len(d), COPY_CHUNK):
            _torch(d)[at:at + COPY_CHUNK].copy_(_torch(s)[at:at + COPY_CHUNK], non_blocking=True)
    if device is not None:
        import torch

        torch.cuda.synchronize(device.device)


def _host(b: SlabBytes) -> Any:
    """Host bytes as a numpy array (a CPU tensor is wrapped)."""
    return b.numpy() if hasattr(b, "numpy") else b


def _torch(b: SlabBytes) -> Any:
    """Slab bytes as a torch tensor (a numpy array is wrapped, zero-copy)."""
    if hasattr(b, "data_ptr"):
        return b
    import torch

    return torch.from_numpy(b)


def slab_fds(slabs: list[Any]) -> list[int]:
    """A new descriptor of each slab (the caller closes them)."""
    return [s.export_fd() for s in slabs]


