"""The manifest's columns form: the same records and views as rows, the same refusals, and a
real rank that serves both forms."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlaunch.cache import CacheClient
from vlaunch.cache.contract import protocol
from vlaunch.cache.contract.errors import CacheBrokenError, ProtocolError
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.store import columns
from vlaunch.cache.store.manifest import Manifest, TensorRecord, pack, views

from .conftest import spawn_cache

ITEMS = [("model.embed_tokens.weight", "BF16", (16, 8)), ("scalar", "F32", ()),
         ("model.layers.0.experts.3.w1.weight", "F4", (4, 6)), ("int", "I64", (3,)),
         ("nom·é", "F16", (2, 3, 4)), ("empty", "F32", (0, 5)), ("f6", "F6_E2M3", (2, 8)),
         ("bool", "BOOL", (7,))]


def _manifest(checksums: bool = True) -> Manifest:
    m = pack(ITEMS, backend="cpu", alignment=256, max_slab=512)
    if checksums:
        m = m._replace(tensors=tuple(t._replace(checksum=i * 7 if i % 2 else None)
                                     for i, t in enumerate(m.tensors)))
    return m


def _round_trip(m: Manifest) -> Manifest:
    head, tail = columns.encode(m)
    return columns.from_wire(head, tail)


def test_records_and_views_are_those_of_the_rows() -> None:
    m = _manifest()
    got = _round_trip(m)
    assert got.backend == m.backend and got.slab_sizes == m.slab_sizes and len(m.slab_sizes) > 1
    assert list(got.tensors) == list(m.tensors)
    assert [got.tensors[i] for i in range(len(m.tensors))] == list(m.tensors)
    assert Manifest.from_wire(m.to_wire()) == m  # rows, for comparison
    slabs = [torch.arange(n, dtype=torch.int64).to(torch.uint8) for n in m.slab_sizes]
    want, have = views(m, slabs), columns.views(got, slabs)
    assert list(have) == list(want)
    for name, ref in want.items():
        t = have[name]
        assert (t.dtype, t.shape, t.stride(), t.data_ptr()) == \
            (ref.dtype, ref.shape, ref.stride(), ref.data_ptr()), name


def test_the_escrow_carries_it_in_json() -> None:
    m = _manifest()
    obj = protocol.decode_body(protocol.encode({"manifest": columns.to_json(m)})[16:])
    assert list(columns.from_wire(obj["manifest"]).tensors) == list(m.tensors)


def _broken(head_change: dict | None = None, at: int | None = None, value: bytes = b"",
            tail_cut: int = 0) -> str:
    head, tail = columns.encode(_manifest())
    head = {**head, **(head_change or {})}
    if at is not None:
        tail = tail[:at] + value + tail[at + len(value):]
    if tail_cut:
        tail = tail[:-tail_cut]
    with pytest.raises(CacheBrokenError) as err:
        columns.from_wire(head, tail)
    return str(err.value)


def _at(section: str, index: int = 0) -> int:
    """Byte offset of entry `index` of a section of _manifest()'s tail."""
    n = len(ITEMS)
    d = sum(len(s) for _, _, s in ITEMS)
    starts = {"offset": 0, "nbytes": 8 * n, "checksum": 16 * n, "dims": 24 * n,
              "strides": 24 * n + 8 * d, "slab": 24 * n + 16 * d, "dtype": 32 * n + 16 * d,
              "ndim": 33 * n + 16 * d, "names": 34 * n + 16 * d}
    width = 8 if section in ("offset", "nbytes", "checksum", "dims", "strides", "slab") else 1
    return starts[section] + index * width


def le(value: int, width: int = 8) -> bytes:
    return value.to_bytes(width, "little", signed=True)


@pytest.mark.parametrize(("case", "words"), [
    ({"tail_cut": 1}, "tail of"),
    ({"head_change": {"dtypes": ["BF16", "NOPE"]}}, "unknown dtype"),
    ({"head_change": {"count": 2_000_000}}, "too many"),
    ({"head_change": {"slab_sizes": [-1, 5]}}, "slab size"),
    ({"at": _at("dtype"), "value": b"\x63"}, "dtype index"),
    ({"at": _at("ndim"), "value": b"\x11"}, "rank"),
    ({"at": _at("slab"), "value": le(9)}, "slab that does not exist"),
    ({"at": _at("offset"), "value": le(1)}, "alignment"),
    ({"at": _at("offset", 3), "value": le(1 << 40)}, "past the end"),
    ({"at": _at("nbytes"), "value": le(3)}, "inconsistent"),
    ({"at": _at("dims"), "value": le(-4)}, "bounded"),
    ({"at": _at("dims"), "value": le(1 << 49)}, "out of range"),
    ({"at": _at("strides"), "value": le(1 << 40)}, "past the end"),
    ({"at": _at("checksum"), "value": le(-2)}, "bounded"),
    ({"at": _at("names"), "value": b"\x07"}, "control character"),
    ({"at": _at("names"), "value": b"\n"}, "names for"),
    ({"at": _at("names"), "value": b"\xff"}, "utf-8"),
])
def test_bad_columns_are_refused_with_their_reason(case: dict, words: str) -> None:
    assert words in _broken(**case)


def test_a_packed_tensor_must_stay_contiguous() -> None:
    m = _manifest(checksums=False)
    i = next(k for k, t in enumerate(m.tensors) if t.dtype == "F4")
    bent = m._replace(tensors=tuple(t._replace(stride=(1, 4)) if k == i else t
                                    for k, t in enumerate(m.tensors)))
    with pytest.raises(CacheBrokenError, match="contiguously"):
        _round_trip(bent)
    with pytest.raises(CacheBrokenError, match="contiguously"):
        Manifest.from_wire(bent.to_wire())


FIELDS = ("shape", "stride", "slab", "offset", "nbytes", "checksum")


@settings(max_examples=150)
@given(st.data())
def test_columns_refuse_exactly_what_rows_refuse(data: st.DataObject) -> None:
    """One field of one tensor mutated: the two forms agree on whether it is served."""
    m = _manifest()
    i = data.draw(st.integers(0, len(m.tensors) - 1))
    field = data.draw(st.sampled_from(FIELDS))
    t = m.tensors[i]
    big = st.integers(0, 1 << 51)
    if field in ("shape", "stride"):
        value: object = tuple(data.draw(st.lists(st.integers(0, 1 << 20) | big,
                                                 min_size=len(t.shape), max_size=len(t.shape))))
    elif field == "checksum":
        value = data.draw(st.none() | big)
    else:
        value = data.draw(st.integers(0, 4096) | big)
    bent = m._replace(tensors=(*m.tensors[:i], t._replace(**{field: value}),
                               *m.tensors[i + 1:]))
    try:
        rows: Manifest | None = Manifest.from_wire(bent.to_wire())
    except CacheBrokenError:
        rows = None
    try:
        cols: Manifest | None = _round_trip(bent)
    except CacheBrokenError:
        cols = None
    assert (rows is None) == (cols is None), (field, value)
    if rows is not None and cols is not None:
        assert list(cols.tensors) == list(rows.tensors)


def test_only_replies_may_carry_a_tail() -> None:
    frame = protocol.encode({"ok": True}, tail=b"\1\2\3")
    header = protocol.decode_header(frame[:16], tails=True)
    body = protocol.decode_body(frame[16:], header.codec)
    assert body["ok"] is True and bytes(body["tail"]) == b"\1\2\3"
    with pytest.raises(ProtocolError, match="codec"):
        protocol.decode_header(frame[:16])  # a rank reading a request
    with pytest.raises(ProtocolError, match="tail field"):
        protocol.encode({"tail": 1}, tail=b"x")


def test_a_rank_serves_rows_unless_asked_for_columns(llama_ckpt: Path, sockdir: Path,
                                                     caches) -> None:
    cache = spawn_cache(llama_ckpt, sockdir)
    caches.append(cache)
    client = CacheClient(socket_path(sockdir, 0))
    try:
        old, _ = client.request({"op": "manifest"})  # a client of an earlier version
        assert "tensors" in old["manifest"] and "tail" not in old
        new, _ = client.request({"op": "manifest", "form": "columns"})
        assert new["manifest"]["form"] == "columns" and len(new["tail"]) > 0
        rows = Manifest.from_wire(old["manifest"])
        cols = columns.from_wire(new["manifest"], new["tail"])
        assert list(cols.tensors) == list(rows.tensors)
        assert client.manifest().slab_sizes == rows.slab_sizes
        escrowed = columns.from_wire(cache.ready["manifest"])  # the launcher's copy
        assert list(escrowed.tensors) == list(rows.tensors)
    finally:
        client.close()


def test_base64_that_is_not_is_refused() -> None:
    obj = columns.to_json(_manifest())
    obj["tail"] = "!!" + obj["tail"][2:]
    with pytest.raises(CacheBrokenError):
        columns.from_wire(obj)
    obj["tail"] = base64.b64encode(b"short").decode()
    with pytest.raises(CacheBrokenError, match="tail of"):
        columns.from_wire(obj)


def test_records_are_records() -> None:
    got = _round_trip(_manifest())
    assert isinstance(got.tensors[0], TensorRecord) and got.tensors[1:3] == \
        list(_manifest().tensors[1:3])
