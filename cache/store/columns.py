"""The manifest's binary form, "columns": every field of every tensor as one array, so that a
manifest of 100k tensors is checked by a few numpy operations instead of a Python loop.

A rank sends it to an engine that asks for it (`manifest` with `"form": "columns"`), as the
raw tail of the reply's frame (protocol.CODEC_TAIL), and to the launcher's escrow inside its
JSON frames (base64). The JSON part says the backend, the slab sizes, the tensor count, the
dtype names the tensors use and the length of each section; the tail holds, in this order
and little-endian:

    offset  i8[N]   byte offset in its slab          nbytes  i8[N]
    checksum i8[N]  crc32, or -1 for none            dims    i8[D]   every shape, concatenated
    strides i8[D]   every stride, concatenated       slab    i8[N]
    dtype   u1[N]   index into the dtype names       ndim    u1[N]   (D = sum of ndim)
    names   UTF-8, separated by "\n" (a name is printable: it holds no newline)

`decode` checks exactly what the row form's parse checks (manifest._parse), over arrays; a
tensor's record is made only when someone asks for it (`Columns`), and `views_of` makes the
engine's tensors from the arrays. Rows stay the form for every client that does not ask.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.errors import CacheBrokenError
from vlaunch.cache.store.manifest import (
    LIMIT,
    MAX_DIMS,
    MAX_NAME,
    MAX_TENSORS,
    Manifest,
    TensorRecord,
    checked_int,
    contiguous_stride,
    tensor_name_problem,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

FORM = "columns"
_WIDE = ("offset", "nbytes", "checksum")  # i8[N] each, then dims and strides (i8[D])


class Columns(Sequence[TensorRecord]):
    """A manifest's tensors as arrays; each record is made when it is asked for."""

    def __init__(self, names: list[str], table: list[str], fields: dict[str, np.ndarray]
                 ) -> None:
        self.names, self.table, self.fields = names, table, fields
        self._shapes: list[list[int]] | None = None
        self._strides: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self._record(i, *self.shaped())

    def __iter__(self) -> Iterator[TensorRecord]:
        shapes, strides = self.shaped()
        f = self.fields
        new = tuple.__new__
        for name, code, shape, stride, slab, offset, nbytes, checksum in zip(
                self.names, f["dtype"].tolist(), shapes, strides, f["slab"].tolist(),
                f["offset"].tolist(), f["nbytes"].tolist(), f["checksum"].tolist(),
                strict=True):
            yield new(TensorRecord, (name, self.table[code], tuple(shape), tuple(stride), slab,
                                     offset, nbytes, None if checksum < 0 else checksum))

    def _record(self, i: int, shapes: list[list[int]], strides: list[list[int]]
                ) -> TensorRecord:
        f = self.fields
        checksum = int(f["checksum"][i])
        return TensorRecord(self.names[i], self.table[int(f["dtype"][i])], tuple(shapes[i]),
                            tuple(strides[i]), int(f["slab"][i]), int(f["offset"][i]),
                            int(f["nbytes"][i]), None if checksum < 0 else checksum)

    def shaped(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every tensor's shape and stride as lists (made once, in bulk)."""
        if self._shapes is None:
            import numpy as np

            ndim, n = self.fields["ndim"], len(self.names)
            if n and (ndim == ndim[0]).all():  # one rank for all (MoE experts): no loop
                k = int(ndim[0])
                self._shapes = self.fields["dims"].reshape(n, k).tolist()
                self._strides = self.fields["strides"].reshape(n, k).tolist()
            else:
                ends = np.cumsum(ndim, dtype=np.int64)
                starts = (ends - ndim).tolist()
                dims, strides = self.fields["dims"].tolist(), self.fields["strides"].tolist()
                self._shapes = [dims[a:b] for a, b in zip(starts, ends.tolist(), strict=True)]
                self._strides = [strides[a:b] for a, b in zip(starts, ends.tolist(),
                                                               strict=True)]
        assert self._strides is not None
        return self._shapes, self._strides


def encode(manifest: Manifest) -> tuple[dict[str, Any], bytes]:
    """A manifest as (the JSON part, the tail)."""
    import numpy as np

    tensors = manifest.tensors
    table = sorted({t.dtype for t in tensors})
    code = {name: i for i, name in enumerate(table)}
    dims = [d for t in tensors for d in t.shape]
    strides = [s for t in tensors for s in t.stride]
    names = "\n".join(t.name for t in tensors).encode()
    parts = [np.array([t.offset for t in tensors], dtype="<i8"),
             np.array([t.nbytes for t in tensors], dtype="<i8"),
             np.array([-1 if t.checksum is None else t.checksum for t in tensors], dtype="<i8"),
             np.array(dims, dtype="<i8"), np.array(strides, dtype="<i8"),
             np.array([t.slab for t in tensors], dtype="<i8"),
             np.array([code[t.dtype] for t in tensors], dtype="u1"),
             np.array([len(t.shape) for t in tensors], dtype="u1")]
    head = {"backend": manifest.backend, "slab_sizes": list(manifest.slab_sizes), "form": FORM,
            "count": len(tensors), "dims": len(dims), "dtypes": table, "names": len(names)}
    return head, b"".join([p.tobytes() for p in parts] + [names])


def to_json(manifest: Manifest) -> dict[str, Any]:
    """The columns form inside a JSON frame: the tail in base64 (the launcher's escrow)."""
    head, tail = encode(manifest)
    return {**head, "tail": base64.b64encode(tail).decode()}


def from_wire(obj: Any, tail: Any = None) -> Manifest:
    """A manifest from a cache in either form, validated (`tail`: the raw tail of the frame
    that brought columns, or None); CacheBrokenError when it fails a check."""
    if not (isinstance(obj, dict) and obj.get("form") == FORM):
        return Manifest.from_wire(obj)
    try:
        return decode(obj, tail)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise CacheBrokenError(f"invalid manifest from cache: {exc}") from exc


def views(manifest: Manifest, slabs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Named tensors that view the slabs, from a manifest in either form."""
    if isinstance(manifest.tensors, Columns):
        return views_of(manifest, slabs)
    from vlaunch.cache.store.manifest import views as rows_views

    return rows_views(manifest, slabs)


def decode(head: dict[str, Any], tail: Any = None) -> Manifest:
    """Check a columns manifest as manifest._parse checks rows; `tail` the frame's raw tail,
    or None when it rides in base64 in `head` (the escrow)."""
    import numpy as np

    if tail is None:
        raw = head.get("tail")
        if not isinstance(raw, str) or len(raw) > 4 * (64 << 20):
            raise ValueError("no tail")
        tail = base64.b64decode(raw, validate=True)
    sizes = tuple(checked_int(s, "slab size") for s in head["slab_sizes"])
    n, nd, table, nnames = (head["count"], head["dims"], head["dtypes"], head["names"])
    for value, what in ((n, "count"), (nd, "dims"), (nnames, "names")):
        checked_int(value, what)
    if n > MAX_TENSORS or len(sizes) > 4096 or not isinstance(table, list) or \
            len(table) > 255 or nd > n * MAX_DIMS:
        raise ValueError("too many tensors, slabs or dtypes")
    from vlaunch.cache.store.dtypes import DTYPES

    if not all(type(d) is str and d in DTYPES for d in table):
        raise ValueError(f"unknown dtype among {str(table)[:200]}")
    widths = [8 * n, 8 * n, 8 * n, 8 * nd, 8 * nd, 8 * n, n, n, nnames]
    view = memoryview(tail).cast("B")
    if len(view) != sum(widths):
        raise ValueError(f"tail of {len(view)} bytes, expected {sum(widths)}")
    arrays, at = [], 0
    for width, dtype in zip(widths[:8], ["<i8"] * 6 + ["u1", "u1"], strict=True):
        arrays.append(np.frombuffer(view[at:at + width], dtype=dtype))
        at += width
    fields = dict(zip((*_WIDE, "dims", "strides", "slab", "dtype", "ndim"), arrays, strict=True))
    names = _names(view[at:], n)
    _check(fields, sizes, table, names)
    return Manifest(str(head["backend"]), sizes, Columns(names, table, fields))  # type: ignore[arg-type]


def _names(raw: memoryview, n: int) -> list[str]:
    """The names, each checked as the row form checks one."""
    import numpy as np

    b = np.frombuffer(raw, dtype=np.uint8)
    if ((b < 0x20) & (b != 0x0A)).any() or (b == 0x7F).any():
        raise ValueError("a tensor name holds a control character")
    cuts = np.flatnonzero(b == 0x0A)
    if len(cuts) != max(n - 1, 0) or (n == 0 and len(b)):
        raise ValueError(f"{len(cuts) + 1} names for {n} tensors")
    if n:
        lengths = np.diff(np.concatenate(([-1], cuts, [len(b)])), ) - 1
        if (lengths < 1).any() or (lengths > MAX_NAME).any():
            raise ValueError(f"a tensor name is empty or over {MAX_NAME} bytes")
    text = bytes(raw).decode("utf-8")
    names = text.split("\n") if n else []
    if not text.isascii():  # printable ASCII is settled above; the rest one by one
        for name in names:
            if not name.isascii() and (problem := tensor_name_problem(name)):
                raise ValueError(f"bad tensor name {name[:80]!r}: {problem}")
    return names


def _check(f: dict[str, np.ndarray], sizes: tuple[int, ...], table: list[str],
           names: list[str]) -> None:
    """Every per-tensor check of manifest._parse, over the arrays."""
    import numpy as np

    from vlaunch.cache.store.dtypes import DTYPES

    n = len(names)
    if not n:
        return
    ndim, dims, strides = f["ndim"].astype(np.int64), f["dims"], f["strides"]
    if (f["dtype"] >= len(table)).any() or (ndim > MAX_DIMS).any() or ndim.sum() != len(dims):
        raise ValueError("a dtype index or a rank is out of range")
    for name, values, low in (("dim or stride", np.concatenate((dims, strides)), 0),
                              ("offset", f["offset"], 0), ("nbytes", f["nbytes"], 0),
                              ("checksum", f["checksum"], -1)):
        if len(values) and ((values < low).any() or (values > LIMIT).any()):
            raise ValueError(f"a {name} is not a bounded non-negative integer")
    if (f["slab"] < 0).any() or (f["slab"] >= len(sizes)).any():
        raise ValueError("a tensor names a slab that does not exist")
    bits = np.array([DTYPES[d].bits for d in table], dtype=np.int64)[f["dtype"]]
    width = int(ndim.max())
    mask = np.arange(width) < ndim[:, None]
    shape = np.ones((n, width), dtype=np.int64)
    shape[mask] = dims
    stride = np.zeros((n, width), dtype=np.int64)
    stride[mask] = strides
    # in floats first: a product or a span past 2**53 bits cannot fit a slab (<= 2**50 B)
    if (shape.astype(np.float64).prod(axis=1) * bits > 2.0 ** 55).any():
        raise ValueError("a tensor's size is out of range")
    count = shape.prod(axis=1)
    offset, nbytes = f["offset"], f["nbytes"]
    bad = (nbytes * 8 != count * bits) | (offset % np.maximum(bits >> 3, 1) != 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{names[i]}: size, slab or alignment inconsistent")
    live = nbytes > 0
    extent = ((shape[live] - 1).astype(np.float64) * stride[live]).sum(axis=1)
    if (extent * bits[live] > 2.0 ** 55).any():
        raise ValueError("a tensor extends past the end of its slab")
    span = ((shape[live] - 1) * stride[live]).sum(axis=1) + 1
    limit = np.array(sizes, dtype=np.int64)[f["slab"][live]] * 8
    past = offset[live] * 8 + span * bits[live] > limit
    if past.any():
        i = int(np.flatnonzero(live)[np.flatnonzero(past)[0]])
        raise ValueError(f"{names[i]}: extends past the end of slab {int(f['slab'][i])}")
    for i in np.flatnonzero(bits & 7).tolist():  # sub-byte dtypes: contiguous only (rare)
        k = int(ndim[i])
        if tuple(stride[i, :k].tolist()) != contiguous_stride(tuple(shape[i, :k].tolist())):
            raise ValueError(f"{names[i]}: a {table[int(f['dtype'][i])]} tensor must be laid "
                             "out contiguously")


def views_of(manifest: Manifest, slabs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Named tensors viewing the slabs, from the columns: one as_strided per tensor, every
    argument made in bulk beforehand."""
    import torch

    from vlaunch.cache.store.dtypes import DTYPES, is_plain, to_torch
    from vlaunch.cache.store.manifest import packed_view

    cols: Columns = manifest.tensors  # type: ignore[assignment]
    f = cols.fields
    shapes, strides = cols.shaped()
    plain = [is_plain(d) for d in cols.table]
    items = [DTYPES[d].bits >> 3 or 1 for d in cols.table]
    import numpy as np

    item = np.array(items, dtype=np.int64)[f["dtype"]]
    keys = (f["slab"].astype(np.int64) * 256 + f["dtype"]).tolist()
    offsets = (f["offset"] // item).tolist()
    if all(plain):  # every dtype a torch dtype: one C-level map over the columns
        typed = {k: slabs[k >> 8].view(to_torch(cols.table[k & 255])) for k in set(keys)}
        return dict(zip(cols.names, map(torch.as_strided, map(typed.__getitem__, keys),
                                        shapes, strides, offsets), strict=True))
    bases: dict[int, torch.Tensor | None] = {}
    out: dict[str, torch.Tensor] = {}
    strided = torch.as_strided
    for i, (name, key, shape, stride, offset) in enumerate(zip(
            cols.names, keys, shapes, strides, offsets, strict=True)):
        base = bases.get(key, False)
        if base is False:
            slab, code = divmod(key, 256)
            base = bases[key] = slabs[slab].view(to_torch(cols.table[code])) \
                if plain[code] else None
        if base is None:  # packed or raw-byte dtypes: contiguous by construction
            out[name] = packed_view(slabs[key >> 8], cols[i])
        else:
            out[name] = strided(base, shape, stride, offset)
    return out
