"""Finding checkpoint files, validating their headers, and the checkpoint identity."""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from vlaunch.cache.contract.errors import CheckpointError, ModelNotFoundError
from vlaunch.cache.store.checkpoint import Checkpoint, checkpoint_identity, open_checkpoint
from vlaunch.cache.store.dtypes import DTYPES, dtype_info, from_torch, is_plain, to_torch


def write_raw(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    """Write a safetensors file by hand: 8-byte LE header length, header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def read(entry_file: Path, begin: int, nbytes: int) -> bytes:
    fd = os.open(entry_file, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, begin)
    finally:
        os.close(fd)


def assert_matches_file(ckpt: Checkpoint) -> None:
    """Every entry's bytes equal what safetensors loads for that tensor."""
    loaded: dict[str, torch.Tensor] = {}
    for file in ckpt.files:
        loaded.update(load_file(file))
    assert set(loaded) == set(ckpt.tensors)
    for name, entry in ckpt.tensors.items():
        t = loaded[name]
        assert entry.shape == tuple(t.shape)
        assert entry.dtype == from_torch(t.dtype)
        expected = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert read(entry.file, entry.begin, entry.nbytes) == expected


def shards(tmp_path: Path) -> Path:
    """A two-shard checkpoint with an index file."""
    save_file({"b.weight": torch.randn(4, 3), "a.weight": torch.randn(2)},
              tmp_path / "model-00001-of-00002.safetensors")
    save_file({"c.weight": torch.ones(5, dtype=torch.bfloat16)},
              tmp_path / "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 64},
             "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00001-of-00002.safetensors",
                            "c.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


# --- finding files -------------------------------------------------------------------------

def test_single_file(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    save_file({"x": torch.randn(3, 4), "y": torch.arange(7)}, f, metadata={"format": "pt"})
    ckpt = open_checkpoint(f)
    assert ckpt.files == (f,) and ckpt.root == tmp_path and ckpt.index_file is None
    assert ckpt.metadata == {f: {"format": "pt"}}
    assert ckpt.tensors["x"].nbytes == 48 and ckpt.tensors["y"].dtype == "I64"
    assert ckpt.nbytes == 48 + 56
    assert_matches_file(ckpt)


def test_directory_without_index(tmp_path: Path) -> None:
    save_file({"z": torch.randn(2)}, tmp_path / "b.safetensors")
    save_file({"q": torch.randn(2), "p": torch.randn(3)}, tmp_path / "a.safetensors")
    (tmp_path / "notes.txt").write_text("not a shard")
    ckpt = open_checkpoint(str(tmp_path))
    assert [f.name for f in ckpt.files] == ["a.safetensors", "b.safetensors"]
    files_then_offsets = [(ckpt.files.index(e.file), e.begin) for e in ckpt.tensors.values()]
    assert files_then_offsets == sorted(files_then_offsets)
    assert list(ckpt.tensors)[-1] == "z"
    assert_matches_file(ckpt)


def test_sharded_with_index(tmp_path: Path) -> None:
    ckpt = open_checkpoint(shards(tmp_path))
    assert ckpt.index_file == tmp_path / "model.safetensors.index.json"
    assert [f.name for f in ckpt.files] == ["model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors"]
    assert ckpt.tensors["c.weight"].file.name == "model-00002-of-00002.safetensors"
    assert_matches_file(ckpt)


def test_index_only_files_it_names_are_read(tmp_path: Path) -> None:
    shards(tmp_path)
    save_file({"a.weight": torch.randn(2)}, tmp_path / "consolidated.safetensors")
    assert "a.weight" in open_checkpoint(tmp_path).tensors  # no duplicate-name error


def test_index_naming_a_missing_file(tmp_path: Path) -> None:
    shards(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors, which does "
                       "not exist") as e:
        open_checkpoint(tmp_path)
    assert e.value.file.endswith("model.safetensors.index.json") and e.value.tensor == "c.weight"


def test_index_putting_a_tensor_in_the_wrong_file(tmp_path: Path) -> None:
    shards(tmp_path)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["b.weight"] = "model-00002-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="but it is in model-00001") as e:
        open_checkpoint(tmp_path)
    assert e.value.tensor == "b.weight"


def test_index_naming_a_tensor_no_file_holds(tmp_path: Path) -> None:
    shards(tmp_path)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="no file holds it"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("value", ["../outside.safetensors", "/etc/x.safetensors", "a.bin", 3])
def test_index_with_bad_file_names(tmp_path: Path, value: object) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map":
                                                                       {"t": value}}))
    with pytest.raises(CheckpointError, match="weight_map value"):
        open_checkpoint(tmp_path)


def test_index_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{nope")
    with pytest.raises(CheckpointError, match="index is not valid JSON"):
        open_checkpoint(tmp_path)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=f"{tmp_path / 'nope'} does not exist"):
        open_checkpoint(tmp_path / "nope")


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"holds no \.safetensors file"):
        open_checkpoint(tmp_path)


def test_file_that_is_not_safetensors(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"is not a \.safetensors file"):
        open_checkpoint(tmp_path / "model.bin")


def test_broken_link(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blob-that-is-gone")
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path)


# --- dtypes and shapes ---------------------------------------------------------------------

def test_every_dtype_parses_with_its_size(tmp_path: Path) -> None:
    plain = [name for name in DTYPES if is_plain(name)]  # F4/F6: tests/test_formats.py
    tensors = {name: torch.zeros(2, 3).to(to_torch(name)) for name in plain}
    save_file(tensors, tmp_path / "m.safetensors")
    ckpt = open_checkpoint(tmp_path)
    for name, info in ((n, DTYPES[n]) for n in plain):
        entry = ckpt.tensors[name]
        assert entry.dtype == name and entry.nbytes == 6 * info.itemsize
        assert to_torch(name).itemsize == info.itemsize == dtype_info(name).itemsize
        assert from_torch(to_torch(name)) == name
    assert_matches_file(ckpt)


def test_unknown_dtype_names() -> None:
    with pytest.raises(KeyError):
        dtype_info("F2_E1M0")
    with pytest.raises(KeyError):
        to_torch("F2_E1M0")
    with pytest.raises(KeyError):
        from_torch(torch.complex128)


def test_zero_dim_and_empty_tensors(tmp_path: Path) -> None:
    save_file({"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "after": torch.ones(3)}, tmp_path / "m.safetensors")
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.tensors["scalar"].shape == () and ckpt.tensors["scalar"].nbytes == 4
    assert ckpt.tensors["empty"].shape == (0, 4) and ckpt.tensors["empty"].nbytes == 0
    assert_matches_file(ckpt)


def test_empty_tensor_inside_another_is_no_overlap(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}, bytes(8))
    assert open_checkpoint(f).tensors["e"].nbytes == 0


def test_many_tensors_is_fast(tmp_path: Path) -> None:
    save_file({f"model.layers.{i}.w{j}": torch.zeros(4) for i in range(100) for j in range(10)},
              tmp_path / "m.safetensors")
    assert len(open_checkpoint(tmp_path).tensors) == 1000


# --- identity ------------------------------------------------------------------------------

def test_identity_is_stable(tmp_path: Path) -> None:
    shards(tmp_path)
    first = open_checkpoint(tmp_path).identity
    assert open_checkpoint(tmp_path).identity == first and len(first) == 64


def test_identity_ignores_where_the_checkpoint_lies(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    shards(tmp_path / "one")
    for f in (tmp_path / "one").iterdir():  # same bytes, other directory
        (tmp_path / "two" / f.name).write_bytes(f.read_bytes())
    assert open_checkpoint(tmp_path / "one").identity == open_checkpoint(tmp_path / "two").identity


def test_identity_changes_with_a_header_byte(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file({"x": torch.zeros(4)}, f, metadata={"k": "a"})
    before = open_checkpoint(f).identity
    f.write_bytes(f.read_bytes().replace(b'"k":"a"', b'"k":"b"'))
    assert open_checkpoint(f).identity != before


def test_identity_ignores_tensor_data(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file({"x": torch.zeros(4)}, f)
    before = open_checkpoint(f).identity
    save_file({"x": torch.ones(4)}, f)
    assert open_checkpoint(f).identity == before


def test_identity_changes_with_the_index(tmp_path: Path) -> None:
    shards(tmp_path)
    before = open_checkpoint(tmp_path).identity
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["metadata"]["total_size"] = 65
    index_file.write_text(json.dumps(index))
    assert open_checkpoint(tmp_path).identity != before


# --- bad checkpoints -----------------------------------------------------------------------

def entry(dtype: str = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


def rejects(path: Path, match: str, tensor: str | None = "t") -> CheckpointError:
    with pytest.raises(CheckpointError, match=match) as e:
        open_checkpoint(path)
    assert path.name in str(e.value) and e.value.file == str(path)
    assert e.value.tensor == tensor
    if tensor:
        assert repr(tensor) in str(e.value)
    return e.value


def test_truncated_data_section(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4), "t": torch.zeros(8)}, f)
    f.write_bytes(f.read_bytes()[:-5])
    rejects(f, r"data_offsets \[\d+, \d+\] end past the end of the file \(size \d+\)")


def test_header_length_larger_than_the_file(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    f.write_bytes(struct.pack("<Q", 12345) + b"{}")
    rejects(f, "file is truncated: header length 12345 exceeds file size 10", tensor=None)


def test_absurd_header_length(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    f.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    rejects(f, "exceeds the limit", tensor=None)


def test_file_shorter_than_the_length_prefix(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"\x02\x00")
    rejects(f, "file is truncated: 2 bytes", tensor=None)


def test_data_offsets_past_the_end(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"t": entry(offsets=(8, 16))}, bytes(12))
    rejects(f, r"data_offsets \[8, 16\] end past the end of the file \(size")


def test_overlapping_tensors(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"s": entry(offsets=(0, 8)),
                                               "t": entry(offsets=(4, 12))}, bytes(12))
    rejects(f, "overlaps tensor 's'")


def test_tensor_inside_a_longer_one(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"big": entry(shape=(4,), offsets=(0, 16)),
                                               "mid": entry(shape=(1,), offsets=(4, 8)),
                                               "t": entry(shape=(1,), offsets=(12, 16))},
                  bytes(16))
    err = rejects(f, "overlaps tensor 'big'", tensor="mid")
    assert err.reason.startswith("overlaps")


def test_wrong_dtype_size(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"t": entry(shape=(2, 3), offsets=(0, 20))},
                  bytes(24))
    rejects(f, r"F32 tensor of shape \[2,3\] needs 24 bytes, data_offsets give 20")


def test_header_that_is_not_json(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", b'{"t": {"dtype": ', bytes(8))
    rejects(f, "header is not valid JSON", tensor=None)


def test_header_that_is_not_utf8(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", b'{"\xff": 1}')
    rejects(f, "header is not valid UTF-8", tensor=None)


def test_header_that_is_deeply_nested(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", b"[" * 100_000)
    rejects(f, "header is not valid JSON", tensor=None)


def test_header_that_is_a_list(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", b"[1, 2]")
    rejects(f, "not a JSON object", tensor=None)


def test_duplicate_names_in_one_header(tmp_path: Path) -> None:
    raw = f'{{"t": {json.dumps(entry())}, "t": {json.dumps(entry(offsets=(8, 16)))}}}'
    f = write_raw(tmp_path / "m.safetensors", raw.encode(), bytes(16))
    rejects(f, "key 't' appears twice", tensor=None)


def test_duplicate_names_across_files(tmp_path: Path) -> None:
    save_file({"t": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"t": torch.zeros(2)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"also in a\.safetensors") as e:
        open_checkpoint(tmp_path)
    assert e.value.file == str(tmp_path / "b.safetensors") and e.value.tensor == "t"


def test_unknown_dtype(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"t": entry(dtype="F2_E1M0")}, bytes(8))
    rejects(f, "unknown dtype 'F2_E1M0'")


@pytest.mark.parametrize("shape", [[-1], [2.0], ["2"], [True, 2], 2, [1] * 17, None])
def test_bad_shape(tmp_path: Path, shape: object) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"t": entry(shape=shape)}, bytes(8))
    rejects(f, "is not a list of at most 16 non-negative integers")


@pytest.mark.parametrize("offsets", [[8, 0], [-8, 0], [0], [0, 8.0], "0,8", None])
def test_bad_data_offsets(tmp_path: Path, offsets: object) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"t": entry(offsets=offsets)}, bytes(8))
    rejects(f, "is not \\[begin, end\\]")


@pytest.mark.parametrize("meta", [[], {"k": 1}, "x"])
def test_bad_metadata(tmp_path: Path, meta: object) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"__metadata__": meta, "t": entry()}, bytes(8))
    rejects(f, "__metadata__", tensor=None)


def test_entry_that_is_not_an_object(tmp_path: Path) -> None:
    f = write_raw(tmp_path / "m.safetensors", {"t": [1, 2]}, bytes(8))
    rejects(f, "entry is not a JSON object")


# --- random damage -------------------------------------------------------------------------

def _valid_file_bytes() -> bytes:
    header = {"__metadata__": {"format": "pt"},
              "a": entry("F32", (2, 3), (0, 24)), "b": entry("BF16", (4,), (24, 32)),
              "c": entry("I8", (0, 5), (32, 32)), "d": entry("F8_E4M3", (), (32, 33))}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(range(33))


VALID = _valid_file_bytes()
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]
BYTES = st.one_of(st.integers(0, 255), st.sampled_from(b'0123456789-.,:[]{}" e'))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, HEADER_END - 1), BYTES),
                min_size=1, max_size=4),
       st.integers(0, len(VALID)))
def test_damaged_header_is_rejected_or_in_bounds(tmp_path: Path,
                                                 edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(VALID)
    for at, byte in edits:
        data[at] = byte
    f = tmp_path / "m.safetensors"
    f.write_bytes(bytes(data[:max(cut, len(data) - 40)]))
    try:
        ckpt = open_checkpoint(f)
    except CheckpointError:
        return
    size = f.stat().st_size
    hlen = struct.unpack("<Q", f.read_bytes()[:8])[0]
    spans = sorted((e.begin, e.end) for e in ckpt.tensors.values() if e.nbytes)
    for e in ckpt.tensors.values():
        assert 8 + hlen <= e.begin <= e.end <= size
        assert e.dtype in DTYPES and all(d >= 0 for d in e.shape)
    for (_, end), (begin, _) in itertools.pairwise(spans):
        assert end <= begin


def test_header_only_identity_equals_the_validated_one(tmp_path: Path) -> None:
    """checkpoint_identity (the engine's fast path) hashes exactly what open_checkpoint does."""
    t = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    single = tmp_path / "one.safetensors"
    save_file(t, str(single))
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"a": t["a"]}, str(plain / "x.safetensors"))
    save_file({"b": t["b"]}, str(plain / "y.safetensors"))
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    save_file({"a": t["a"]}, str(indexed / "m-1.safetensors"))
    save_file({"b": t["b"]}, str(indexed / "m-2.safetensors"))
    (indexed / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}))
    for path in (single, plain, indexed):
        assert checkpoint_identity(path) == open_checkpoint(path).identity
