"""Artifacts: small files (kernel autotune tables) a cache rank holds beside its weights.

An artifact is named by its kind (`flashinfer-autotune`) and a key: a hash over everything that
makes its content valid (library version, GPU, the tuned ops and shapes, the rank), so a table
tuned for something else is never found. A rank holds at most MAX_COUNT of them, each at most
protocol.MAX_ARTIFACT bytes; the oldest goes first when a new one does not fit. With an
artifact directory (a volume), each one is also written to disk atomically and read back at the
rank's next start, with its size and sha256 checked; a corrupt file is ignored with a warning.

On disk, one file per artifact: a header line `VLART1 <kind> <key> <size> <sha256>` and the
raw bytes.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from vlaunch.cache.contract.errors import ArtifactError
from vlaunch.cache.contract.protocol import MAX_ARTIFACT

log = logging.getLogger("vlaunch.cache.store.artifacts")
MAX_COUNT = 64
MAGIC = b"VLART1"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_KEY = re.compile(r"^[0-9a-f]{16,128}$")


def artifact_key(fields: Mapping[str, Any]) -> str:
    """A content hash over everything that makes an artifact valid (JSON, sorted keys)."""
    blob = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_name(kind: str, key: str) -> None:
    """Refuse a kind or key that is not a short safe name / hex hash (they name files)."""
    if not _NAME.match(kind) or not _KEY.match(key):
        raise ArtifactError(f"bad artifact name {kind[:64]!r}/{key[:64]!r}: the kind must be a "
                            "short lowercase name and the key a hex hash (use artifact_key)")


def check_size(kind: str, size: int) -> None:
    """Refuse an artifact larger than protocol.MAX_ARTIFACT."""
    if size > MAX_ARTIFACT:
        raise ArtifactError(f"artifact {kind} is {size} bytes, over the limit of "
                            f"{MAX_ARTIFACT} bytes; it is not kept (the engine tunes again "
                            "next time)")


class Artifact(NamedTuple):
    """One artifact's name and bytes."""

    kind: str
    key: str
    data: bytes


class Held(NamedTuple):
    """One artifact a rank holds, as its listing names it."""

    kind: str
    key: str
    size: int


class ArtifactStore:
    """A rank's artifacts in memory, mirrored to `directory` when one is given."""

    def __init__(self, directory: Path | str | None = None, *, max_count: int = MAX_COUNT
                 ) -> None:
        self.directory = Path(directory) if directory else None
        self.max_count = max_count
        self._items: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        if self.directory is not None:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._load_dir()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, kind: str, key: str) -> bytes | None:
        """The artifact's bytes, or None."""
        return self._items.get((kind, key))

    def listing(self) -> list[list[Any]]:
        """[kind, key, size] of every artifact, oldest first."""
        return [[k, h, len(v)] for (k, h), v in self._items.items()]

    def put(self, kind: str, key: str, data: bytes) -> None:
        """Keep an artifact (replacing one of the same name); evict the oldest beyond the cap."""
        check_name(kind, key)
        check_size(kind, len(data))
        self._items.pop((kind, key), None)
        self._items[(kind, key)] = data
        while len(self._items) > self.max_count:
            (old_kind, old_key), _ = self._items.popitem(last=False)
            self._unlink(old_kind, old_key)
        if self.directory is not None:
            try:
                self._write(kind, key, data)
            except OSError as exc:
                log.warning("cannot write artifact %s to %s: %s; it is kept in memory only",
                            kind, self.directory, exc)

    def _path(self, kind: str, key: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{kind}.{key}.art"

    def _write(self, kind: str, key: str, data: bytes) -> None:
        """tmp file + fsync + rename + fsync of the directory: a crash leaves old or new."""
        assert self.directory is not None
        header = b"%s %s %s %d %s\n" % (MAGIC, kind.encode(), key.encode(), len(data),
                                        hashlib.sha256(data).hexdigest().encode())
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".art")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(kind, key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _unlink(self, kind: str, key: str) -> None:
        if self.directory is not None:
            with contextlib.suppress(OSError):
                self._path(kind, key).unlink()

    def _load_dir(self) -> None:
        """Read back every artifact file, oldest first; ignore (and warn about) corrupt ones."""
        assert self.directory is not None
        files = sorted(self.directory.glob("*.art"), key=lambda p: p.stat().st_mtime)
        for path in files[-4 * self.max_count:]:  # bounded: a stray directory is not read whole
            try:
                kind, key, data = read_file(path)
            except (ArtifactError, OSError) as exc:
                log.warning("ignoring artifact file %s: %s", path, exc)
                continue
            self._items[(kind, key)] = data
            if len(self._items) > self.max_count:
                self._items.popitem(last=False)
        if self._items:
            log.info("loaded %d artifact(s) from %s", len(self._items), self.directory)


def read_file(path: Path) -> tuple[str, str, bytes]:
    """Read and validate one artifact file: header, name, size and sha256."""
    if path.stat().st_size > MAX_ARTIFACT + 512:
        raise ArtifactError("file is larger than any artifact may be")
    raw = path.read_bytes()
    head, sep, data = raw.partition(b"\n")
    parts = head.decode("ascii", "replace").split(" ")
    if not sep or len(parts) != 5 or parts[0] != MAGIC.decode():
        raise ArtifactError("not an artifact file (bad header)")
    _, kind, key, size, digest = parts
    check_name(kind, key)
    if path.name != f"{kind}.{key}.art":
        raise ArtifactError("file name does not match its header")
    if not size.isdigit() or int(size) != len(data):
        raise ArtifactError(f"size mismatch: header says {size}, file holds {len(data)} bytes "
                            "(truncated?)")
    if hashlib.sha256(data).hexdigest() != digest:
        raise ArtifactError("sha256 mismatch: the file is corrupt")
    return kind, key, data


# ------------------------------------------------------------------------ on the wire


def encode(data: bytes) -> str:
    """Artifact bytes as they travel in a JSON body."""
    return base64.b64encode(data).decode("ascii")


def decode(text: str) -> bytes:
    """The inverse of encode(); bad base64 raises ArtifactError."""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise ArtifactError(f"artifact data is not valid base64: {exc}") from None
