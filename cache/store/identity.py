"""Checkpoint identity beyond the headers: file stats, sampled tensor bytes, full digests.

Three checks, cheapest first (docs/integrity.md states the rule for operators):

- **Stats.** (device, inode, size, mtime_ns) of every file. A cache records them before it
  reads, compares them after the read (a file that changed meanwhile is not served) and every
  few seconds while it serves (a checkpoint rewritten under it is reported and no longer
  matches a new engine). An engine whose files have the stats a cache recorded (plus ctime,
  and the directory's own) reuses the cache's identities from its memo file instead of
  reading samples: the common restart costs a few `stat` calls.
- **The sampled identity** (`sample_identity`, the fingerprint's `checkpoint_data` field):
  blake2b over each file's relative name and size, then over sampled regions of every
  tensor: its first bytes, its last bytes and a region at a position derived from a hash of
  the header identity and the tensor's name. At most MAX_REGIONS regions and SAMPLE_BUDGET
  bytes, whatever the checkpoint's size. Two fine-tunes of one base model differ in almost
  every value, so they differ in the samples; a change confined to bytes no region covers,
  with the stats kept, is not seen: that is what `vlaunch verify` is for.
- **Full digests** (`expected_digests`): blake2b of every byte of each tensor slice a rank
  holds, read from the files, in the order the rank's slab holds them.

Nothing here imports torch: the launcher's `vlaunch verify` uses this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat as stat_mod
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from vlaunch.cache.contract.errors import VerifyError
from vlaunch.cache.contract.sockdir import memo_name

if TYPE_CHECKING:
    from vlaunch.cache.store.checkpoint import Checkpoint

# The checkpoint and reader modules are imported where samples or digests are read: an
# engine whose files match the rank's memo (the common restart) needs neither.

SAMPLE_BUDGET = 1 << 20
"""Most bytes the sampled identity reads, whatever the checkpoint's size."""
MAX_REGIONS = 8192
"""Most regions it reads (each a pread; on a cold page cache, each a disk read)."""
MAX_REGION = 1024
"""Largest region (a page is read either way; hashing costs per byte)."""
MEMO_MAX = 1 << 20
"""Largest memo file an engine reads."""
DIGEST_CHUNK = 16 << 20
_PERSON = b"vlaunch-sample1"


class FileStat(NamedTuple):
    """What a stat says about one file: enough to notice it was rewritten or replaced (a
    NamedTuple: see vlaunch.cache; `stat_key` hashes its repr)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: os.PathLike[str] | str) -> FileStat:
        """Stat `path` (following links: a Hugging Face snapshot links to its blobs)."""
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def same_file(self, other: FileStat | None) -> bool:
        """Same device, inode, size and modification time (ctime also moves on chmod)."""
        return other is not None and (self.dev, self.ino, self.size, self.mtime_ns) == (
            other.dev, other.ino, other.size, other.mtime_ns)


class Record(NamedTuple):
    """The identity of a checkpoint as a cache read it: its files' stats and its two hashes."""

    model: str  # absolute path as given (a file or a directory)
    root: Path
    names: tuple[str, ...]  # files relative to root, the index file (if any) last
    stats: dict[str, FileStat]
    header: str  # Checkpoint.identity: names, dtypes, shapes, offsets
    data: str  # sample_identity
    root_stat: FileStat | None = None

    def restat(self) -> list[str]:
        """Files whose stats differ from the recorded ones now (a missing file counts)."""
        out = []
        for name in self.names:
            try:
                now: FileStat | None = FileStat.of(self.root / name)
            except OSError:
                now = None
            if now is None or not now.same_file(self.stats[name]):
                out.append(name)
        return out

    def memo(self) -> dict[str, Any]:
        """What an engine needs to reuse these identities without reading samples."""
        return {"version": 1, "single": Path(self.model).is_file(), "names": list(self.names),
                "stat": stat_key(self.root, self.names, self.stats, self.root_stat),
                "checkpoint": self.header, "checkpoint_data": self.data}


def record(model: str | os.PathLike[str]) -> tuple[Record, Checkpoint]:
    """Open the checkpoint, stat its files, then read its samples.

    A file replaced between the header read and the stat shows later as a header identity
    that differs from the one the loader reads (`rank.integrity.checked_load` compares them);
    one replaced after the stat shows in a re-stat.
    """
    from vlaunch.cache.store.checkpoint import open_checkpoint

    path = Path(model).absolute()
    ckpt = open_checkpoint(path)
    names = _names(ckpt)
    stats = {n: FileStat.of(ckpt.root / n) for n in names}
    rec = Record(str(path), ckpt.root, names, stats, ckpt.identity, sample_identity(ckpt),
                 FileStat.of(ckpt.root))
    return rec, ckpt


def _names(ckpt: Checkpoint) -> tuple[str, ...]:
    files = [*ckpt.files, *([ckpt.index_file] if ckpt.index_file else [])]
    return tuple(f.relative_to(ckpt.root).as_posix() for f in files)


def stat_key(root: os.PathLike[str] | str, names: Iterable[str], stats: dict[str, FileStat],
             root_stat: FileStat | None) -> str:
    """A digest of the directory's and every file's full stats (ctime included)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(root_stat).encode())
    for name in names:
        h.update(name.encode() + b"\0" + repr(stats[name]).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------ sampled identity


def sample_regions(ckpt: Checkpoint) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of every sampled region, in file then offset order."""
    live = [t for t in ckpt.tensors.values() if t.nbytes]
    if not live:
        return []
    seed = bytes.fromhex(ckpt.identity)
    keyed = hashlib.blake2b(digest_size=16, key=seed[:64])  # copied per name: the same hash
    keys = {t.name: _h(keyed, t.name) for t in live}  # (order, position) per tensor
    order = sorted(live, key=lambda t: keys[t.name][0])
    count = min(3 * len(order), MAX_REGIONS)
    size = min(MAX_REGION, SAMPLE_BUDGET // count)
    out = []
    for slot in range(count):
        t = order[slot % len(order)]
        n = min(size, t.nbytes)
        kind = slot // len(order)  # 0: head, 1: tail, 2: a position from the hash
        offset = (t.begin if kind == 0 else t.end - n if kind == 1
                  else t.begin + keys[t.name][1] % (t.nbytes - n + 1))
        out.append((t.file, offset, n))
    rank = {f: i for i, f in enumerate(ckpt.files)}
    out.sort(key=lambda r: (rank[r[0]], r[1], r[2]))
    return out


def _h(keyed: Any, name: str) -> tuple[bytes, int]:
    """A tensor's place in the sampling order and its hashed position: blake2b of the name,
    keyed with the checkpoint's identity (`keyed`: that hasher before any name, copied)."""
    h = keyed.copy()
    h.update(name.encode())
    digest = h.digest()
    return digest[:8], int.from_bytes(digest[8:], "little")


def sample_identity(ckpt: Checkpoint) -> str:
    """The fingerprint's `checkpoint_data`: file names and sizes, then the sampled regions."""
    from vlaunch.cache.store.reader import pread_into

    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for f in ckpt.files:
        h.update(f.relative_to(ckpt.root).as_posix().encode() + b"\0"
                 + os.stat(f).st_size.to_bytes(8, "little"))
    regions = sample_regions(ckpt)
    fds: dict[Path, int] = {}
    try:
        for file, offset, n in regions:
            fd = fds.get(file)
            if fd is None:
                fd = fds[file] = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead per sample
            buf = memoryview(bytearray(n))
            pread_into(fd, buf, offset, str(file))
            h.update(buf)
    finally:
        for fd in fds.values():
            os.close(fd)
    return h.hexdigest()


# ------------------------------------------------------------------- the engine's side

_SEEN: dict[str, dict[str, Any]] = {}  # model path -> memo of a checkpoint this process hashed


def memo_path(socket: os.PathLike[str] | str) -> Path:
    """Where the rank serving `socket` (…/rank-N.sock) keeps its memo: …/rank-N.identity.json."""
    return Path(memo_name(os.fspath(socket)))


def write_memo(path: Path, rec: Record) -> None:
    """Write a rank's memo atomically (mode 0600; the directory is the 0700 socket directory)."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec.memo(), f)
    os.replace(tmp, path)


class CheckpointIdentity(NamedTuple):
    """A checkpoint's two fingerprint fields: its headers' identity and its data's."""

    header: str  # the fingerprint's `checkpoint`
    data: str  # its `checkpoint_data`


def identities(model: str | os.PathLike[str], memo: os.PathLike[str] | str | None = None,
               *, socket: os.PathLike[str] | str | None = None) -> CheckpointIdentity:
    """The identity of the files at `model`, as an engine checks them.

    From a memo (this process's, then the rank's file: `memo`, or the one of the rank serving
    `socket`) when every stat still matches it; otherwise read: open and validate the
    headers, then the samples.

    This is on every engine start's path, so the memo's check works on plain strings: pathlib
    made up a third of it (benchmarks/results/figures.md).
    """
    path = _absolute(os.fspath(model))
    if memo is None and socket is not None:
        memo = memo_name(os.fspath(socket))
    for candidate in (_SEEN.get(path), _read_memo(memo)):
        hit = _memo_hit(path, candidate)
        if hit is not None:
            return hit
    rec, _ = record(path)
    _SEEN[path] = rec.memo()
    return CheckpointIdentity(rec.header, rec.data)


def _absolute(path: str) -> str:
    """`path` made absolute as `Path.absolute()` does (no `..` resolved), without its trailing
    slashes."""
    if not os.path.isabs(path):
        path = os.path.join(os.getcwd(), path)
    return path.rstrip("/") or "/"


def _read_memo(path: os.PathLike[str] | str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MEMO_MAX:
            return None
        memo = json.loads(os.read(fd, MEMO_MAX))
        return memo if isinstance(memo, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _memo_hit(path: str, memo: dict[str, Any] | None) -> CheckpointIdentity | None:
    """The memo's identities if `path` (absolute) names the same, unchanged files; else
    None."""
    try:
        if memo is None or memo.get("version") != 1:
            return None
        names = memo["names"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return None
        root, name = os.path.split(path)
        if memo["single"]:
            if names != [name]:
                return None
        else:
            root = path
        if any(os.path.isabs(n) or ".." in n.split("/") for n in names):
            return None
        stats = {n: FileStat.of(os.path.join(root, n)) for n in names}
        if stat_key(root, names, stats, FileStat.of(root)) != memo["stat"]:
            return None
        header, data = memo["checkpoint"], memo["checkpoint_data"]
        if isinstance(header, str) and isinstance(data, str):
            return CheckpointIdentity(header, data)
        return None
    except (OSError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------- full digests


def expected_digests(model: str, plan_spec: str, position: Any, *, threads: int = 8
                     ) -> dict[str, str]:
    """blake2b of each tensor slice a rank with `position` holds, read from the files."""
    from vlaunch.cache.store.checkpoint import open_checkpoint
    from vlaunch.cache.store.plan import HookPlan, load_plan, plan_rank
    from vlaunch.cache.store.reader import pread_into

    ckpt = open_checkpoint(model)
    plan = load_plan(plan_spec)
    if isinstance(plan, HookPlan):
        raise VerifyError(f"plan {plan_spec} builds its tensors in a hook, so its bytes cannot be "
                          "compared with the files; vlaunch verify checks plain shard plans only")
    specs = plan_rank(ckpt, plan, position)
    files = {str(s.source.file) for s in specs}
    fds = {f: os.open(f, os.O_RDONLY | os.O_CLOEXEC) for f in files}
    local = threading.local()
    try:
        def one(spec: Any) -> tuple[str, str]:
            if not hasattr(local, "buf"):
                local.buf = memoryview(bytearray(DIGEST_CHUNK))
            h = digest()
            fd, file = fds[str(spec.source.file)], spec.source.file
            for offset, length in spec.runs():
                while length:
                    n = min(length, DIGEST_CHUNK)
                    pread_into(fd, local.buf[:n], offset, str(file))
                    h.update(local.buf[:n])
                    offset, length = offset + n, length - n
            return spec.name, h.hexdigest()

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="vlaunch-digest") as pool:
            return dict(pool.map(one, specs))
    finally:
        for fd in fds.values():
            os.close(fd)


def digest() -> Any:
    """The hash of a full per-tensor digest (the rank and `vlaunch verify` must agree)."""
    return hashlib.blake2b(digest_size=16)


def compare_digests(held: dict[str, str], expected: dict[str, str]) -> list[str]:
    """One line per tensor whose digests differ, or that only one side has."""
    out = []
    for name in sorted(set(held) | set(expected)):
        a, b = held.get(name), expected.get(name)
        if a != b:
            out.append(f"tensor {name!r}: cache {a or 'missing'}, files {b or 'missing'}")
    return out
