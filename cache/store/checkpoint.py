"""Open a safetensors checkpoint: find its files, validate every header, list its tensors.

Only headers are read (with os.pread); no tensor byte is touched here. A header is trusted only
after every entry passed validation: a known dtype, a sane shape, data_offsets whose length
matches shape and dtype, that lie inside the file and that overlap no other tensor. Each
failure raises CheckpointError naming the file, the tensor and what is wrong.

The identity of a checkpoint is a sha256 over, in file order, each file's name (relative to
the root), a NUL byte and the file's first 8 + N bytes (the header length and the header),
then, if there is one, "index" NUL and the index file's bytes. It covers names, dtypes, shapes
and offsets but not the tensor data, and it does not depend on where the checkpoint lies.

With an index file only the files its weight_map names are read (a stray consolidated file
beside the shards is ignored); a tensor in those files that the map does not name is still
listed. OSErrors other than a missing file (permissions, EIO) propagate unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from vlaunch.cache.contract.errors import CheckpointError, ModelNotFoundError
from vlaunch.cache.store.dtypes import DTYPES, nbytes, shape_problem, unknown_dtype_message
from vlaunch.cache.store.manifest import MAX_NAME, tensor_name_problem

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1000 * 1000
MAX_RANK = 16


class TensorEntry(NamedTuple):
    """One tensor of a checkpoint: where its bytes lie in which file (a NamedTuple: a
    checkpoint of 100k tensors makes 100k of them at every rank start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offset in `file`: 8 + header length + data_offsets[0]
    nbytes: int

    @property
    def end(self) -> int:
        """Absolute byte offset just past the tensor's data."""
        return self.begin + self.nbytes


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: its files in order and its tensors in file-then-offset order."""

    root: Path  # the directory holding the files (a single file's parent)
    files: tuple[Path, ...]
    tensors: dict[str, TensorEntry]
    index_file: Path | None
    identity: str
    metadata: dict[Path, dict[str, str]]  # every file's __metadata__, {} where it has none

    @property
    def nbytes(self) -> int:
        """Total size of all tensors' data."""
        return sum(t.nbytes for t in self.tensors.values())


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Find and validate the checkpoint at `path` (a directory or a .safetensors file)."""
    root, files, index_file = _locate(Path(path).absolute())
    weight_map: dict[str, str] = {}
    paths: dict[str, Path] = {}
    index_bytes = b""
    if index_file is not None:
        index_bytes = index_file.read_bytes()
        weight_map = _parse_index(index_file, index_bytes)
        paths = _index_paths(index_file, weight_map)
        files = tuple(sorted(paths.values()))
    tensors: dict[str, TensorEntry] = {}
    metadata: dict[Path, dict[str, str]] = {}
    headers: list[bytes] = []
    for file in files:
        raw, entries, meta = _read_file(file)
        headers.append(raw)
        metadata[file] = meta
        for entry in entries:
            if entry.name in tensors:
                other = tensors[entry.name].file.name
                raise CheckpointError(file, f"tensor is also in {other}", tensor=entry.name)
            tensors[entry.name] = entry
    if index_file is not None:
        _check_index(index_file, weight_map, paths, tensors)
    return Checkpoint(root=root, files=files, tensors=tensors, index_file=index_file,
                      identity=_identity(root, files, headers, index_file, index_bytes),
                      metadata=metadata)


def _identity(root: Path, files: tuple[Path, ...], headers: list[bytes],
              index_file: Path | None, index_bytes: bytes) -> str:
    """The sha256 described in the module docstring."""
    digest = hashlib.sha256()
    for file, raw in zip(files, headers, strict=True):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0" + raw)
    if index_file is not None:
        digest.update(b"index\0" + index_bytes)
    return digest.hexdigest()


def checkpoint_identity(path: str | os.PathLike[str]) -> str:
    """`open_checkpoint(path).identity` from the raw headers alone (the engine's fast path).

    The per-tensor validation costs milliseconds for a few hundred tensors on every handoff;
    the cache validated every header when it loaded them, and this side only compares.
    Anything unusual goes the validating way, which raises the precise error.
    """
    root, files, index_file = _locate(Path(path).absolute())
    try:
        index_bytes = b""
        if index_file is not None:
            index_bytes = index_file.read_bytes()
            names = set(json.loads(index_bytes)["weight_map"].values())
            if not names or not all(isinstance(n, str) and n.endswith(".safetensors")
                                    and not os.path.isabs(n) and ".." not in Path(n).parts
                                    for n in names):
                raise ValueError("index needs validation")
            files = tuple(sorted({root / n for n in names}))  # as _index_paths
        headers = [_raw_header(file) for file in files]
        return _identity(root, files, headers, index_file, index_bytes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        return open_checkpoint(path).identity


def _raw_header(file: Path) -> bytes:
    """The 8-byte length and the header of a file, unvalidated."""
    with open(file, "rb") as fh:
        head = fh.read(8)
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER_BYTES:
            raise ValueError("header too large")
        raw = head + fh.read(hlen)
    if len(raw) != 8 + hlen:
        raise ValueError("short header")
    return raw


def _locate(path: Path) -> tuple[Path, tuple[Path, ...], Path | None]:
    """Return the root, the files (unless an index names them) and the index file of `path`."""
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist; pass the directory that "
                                 "holds the model's .safetensors files, or one such file")
    if path.is_file():
        if not path.name.endswith(".safetensors"):
            raise ModelNotFoundError(f"model path {path} is not a .safetensors file; pass the "
                                     "directory that holds the model's .safetensors files")
        return path.parent, (path,), None
    if (path / INDEX_NAME).is_file():
        return path, (), path / INDEX_NAME
    files = tuple(sorted(p for p in path.iterdir()
                         if p.name.endswith(".safetensors") and not p.is_dir()))
    if not files:
        raise ModelNotFoundError(f"model path {path} holds no .safetensors file; download the "
                                 "model's safetensors weights there, or pass the directory "
                                 "that holds them (for a Hugging Face cache: snapshots/<rev>)")
    return path, files, None


def _index_paths(index_file: Path, weight_map: dict[str, str]) -> dict[str, Path]:
    """The path of each file a weight map names (its value -> the path); each must exist."""
    root = index_file.parent
    paths = {file: root / file for file in set(weight_map.values())}
    for file, path in sorted(paths.items()):
        if not path.is_file():
            tensor = next(t for t, f in weight_map.items() if f == file)
            raise CheckpointError(index_file, f"weight_map names {file}, which does not exist "
                                  "(an incomplete download?)", tensor=tensor)
    return paths


def _parse_index(index_file: Path, data: bytes) -> dict[str, str]:
    """Return the weight_map of an index file: tensor name -> relative file name."""
    try:
        index = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(index_file, f"index is not valid JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index_file, "index has no weight_map object")
    checked: set[str] = set()  # a few files for hundreds of tensors: each path parsed once
    for tensor, file in weight_map.items():
        if type(file) is str and file in checked:
            continue
        if not isinstance(file, str) or not file.endswith(".safetensors"):
            raise CheckpointError(index_file, f"weight_map value {file!r} is not a .safetensors "
                                  "file name", tensor=tensor)
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(index_file, f"weight_map value {file!r} points outside the "
                                  "model directory", tensor=tensor)
        checked.add(file)
    return weight_map


def _check_index(index_file: Path, weight_map: dict[str, str], paths: dict[str, Path],
                 tensors: dict[str, TensorEntry]) -> None:
    """Check that every tensor of the weight map lies in the file the map names (`paths`:
    each named file's path, from _index_paths)."""
    root = index_file.parent
    for tensor, file in weight_map.items():
        entry = tensors.get(tensor)
        if entry is None:
            raise CheckpointError(index_file, f"weight_map puts the tensor in {file}, but no "
                                  "file holds it", tensor=tensor)
        if entry.file != paths[file]:
            raise CheckpointError(index_file, f"weight_map puts the tensor in {file}, but it is "
                                  f"in {entry.file.relative_to(root).as_posix()}", tensor=tensor)


_PARSED: dict[tuple[Path, int], tuple[bytes, list[TensorEntry], dict[str, str]]] = {}
"""The last checkpoint's parsed headers, by (file, size): a rank opens its checkpoint twice
(its identity, then its load) and the second open parses only what changed."""


def _read_file(file: Path) -> tuple[bytes, list[TensorEntry], dict[str, str]]:
    """Read and validate one file's header; return its raw bytes, entries and metadata.
    A header whose bytes (and file size) are those parsed last time is not parsed again."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(file, "file does not exist (a broken link?)") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CheckpointError(file, f"file is truncated: {size} bytes, fewer than the 8 of "
                                  "the header length")
        (hlen,) = struct.unpack("<Q", _pread(fd, 8, 0))
        if hlen > MAX_HEADER_BYTES:
            raise CheckpointError(file, f"header length {hlen} exceeds the limit of "
                                  f"{MAX_HEADER_BYTES} bytes")
        if hlen > size - 8:
            raise CheckpointError(file, f"file is truncated: header length {hlen} exceeds file "
                                  f"size {size}")
        header = _pread(fd, hlen, 8)
    finally:
        os.close(fd)
    raw = struct.pack("<Q", hlen) + header
    known = _PARSED.get((file, size))
    if known is not None and known[0] == raw:
        return raw, list(known[1]), dict(known[2])
    entries, meta = _parse_header(file, header, size)
    if len(_PARSED) > 256:  # a checkpoint of many files, or many checkpoints: keep one's
        _PARSED.clear()
    _PARSED[(file, size)] = (raw, entries, meta)
    return raw, list(entries), dict(meta)


def _pread(fd: int, n: int, offset: int) -> bytes:
    """Read exactly `n` bytes at `offset`."""
    parts = []
    while n > 0:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            raise OSError(f"unexpected end of file at offset {offset}")
        parts.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Build a JSON object, refusing duplicate keys (json.loads would keep the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {key!r} appears twice")
            seen.add(key)
    return out


def _parse_header(file: Path, header: bytes, size: int
                  ) -> tuple[list[TensorEntry], dict[str, str]]:
    """Validate a header's JSON; return its entries in offset order and its metadata."""
    try:
        obj = json.loads(header.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise CheckpointError(file, f"header is not valid UTF-8: {e}") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(file, f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(file, "header is not a JSON object")
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(file, "__metadata__ is not an object of strings")
    data_start = 8 + len(header)
    entries = _entries(file, obj, data_start, size)
    entries.sort(key=_by_place)
    _check_overlaps(file, entries)
    return entries, meta


def _by_place(e: TensorEntry) -> tuple[int, int]:
    return e.begin, e.nbytes


def _entries(file: Path, obj: dict[str, Any], data_start: int, size: int
             ) -> list[TensorEntry]:
    """Every entry of a header, each checked as `_entry` does: inline for the usual one (a
    printable ASCII name, a dtype of whole bytes, a shape of a few dims), by `_entry` itself
    for the rest, which also words any refusal."""
    out = []
    append, new = out.append, tuple.__new__
    bits_of = {name: d.bits for name, d in DTYPES.items() if d.bits % 8 == 0}
    for name, info in obj.items():
        shape = dtype = offsets = None
        if type(info) is dict:
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        bits = bits_of.get(dtype) if type(dtype) is str else None
        if bits is None or type(shape) is not list or type(offsets) is not list or \
                len(offsets) != 2 or len(shape) > MAX_RANK or not (
                    name.isascii() and 0 < len(name) <= MAX_NAME and name.isprintable()):
            append(_entry(file, name, info, data_start, size))
            continue
        begin, end = offsets
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                count = -1
                break
            count *= d
        if count < 0 or type(begin) is not int or type(end) is not int or \
                not 0 <= begin <= end or end - begin != count * bits // 8 or \
                data_start + end > size:
            append(_entry(file, name, info, data_start, size))  # raises, naming the cause
            continue
        append(new(TensorEntry, (name, dtype, tuple(shape), file, data_start + begin,
                                 end - begin)))
    return out


def _entry(file: Path, name: str, info: object, data_start: int, size: int) -> TensorEntry:
    """Validate one header entry and return it as a TensorEntry."""
    problem = tensor_name_problem(name)
    if problem:
        raise CheckpointError(file, f"{problem}; rename the tensor", tensor=name[:80])
    if not isinstance(info, dict):
        raise CheckpointError(file, "entry is not a JSON object", tensor=name)
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(file, unknown_dtype_message(dtype), tensor=name)
    shape = info.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(file, f"shape {shape!r} is not a list of at most {MAX_RANK} "
                              "non-negative integers", tensor=name)
    offsets = info.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(file, f"data_offsets {offsets!r} is not [begin, end] with "
                              "0 <= begin <= end", tensor=name)
    begin, end = offsets
    try:
        need = nbytes(dtype, shape)
    except ValueError as e:
        raise CheckpointError(file, str(e), tensor=name) from None
    if problem := shape_problem(dtype, shape):
        raise CheckpointError(file, problem, tensor=name)
    if end - begin != need:
        dims = ",".join(map(str, shape))
        raise CheckpointError(file, f"{dtype} tensor of shape [{dims}] needs {need} bytes, "
                              f"data_offsets give {end - begin}", tensor=name)
    if data_start + end > size:
        raise CheckpointError(file, f"data_offsets [{begin}, {end}] end past the end of the "
                              f"file (size {size})", tensor=name)
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), file=file,
                       begin=data_start + begin, nbytes=need)


def _check_overlaps(file: Path, entries: list[TensorEntry]) -> None:
    """Raise if two non-empty tensors share a byte; `entries` is sorted by begin."""
    last: TensorEntry | None = None  # the non-empty tensor that ends furthest
    furthest = -1  # where it ends
    for entry in entries:
        if entry.nbytes == 0:
            continue
        end = entry.begin + entry.nbytes
        if last is not None and entry.begin < furthest:
            raise CheckpointError(file, f"overlaps tensor {last.name!r} (bytes {entry.begin}.."
                                  f"{entry.end} and {last.begin}..{last.end} of the file)",
                                  tensor=entry.name)
        if last is None or end > furthest:
            last, furthest = entry, end
