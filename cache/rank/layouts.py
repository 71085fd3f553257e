"""A rank's engine-shaped layouts: slabs an engine filled with its post-processed parameters.

The engine asks for slabs (`layout_alloc`: sizes, its fields, its raw fingerprint), maps them
writable, copies its parameters in, and commits their manifest rows (`layout_commit`). The
rank then seals the slabs and serves them like the raw layout, under the raw fingerprint
extended by the engine's fields. One engine layout is kept per rank: a commit replaces an
older one (an engine upgrade), so steady state holds one copy of the weights.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract import engine_layout as el
from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.store.manifest import MAX_NAME, MAX_TENSORS, Manifest

if TYPE_CHECKING:
    from vlaunch.cache.store.slabs import Backend, Slab

log = logging.getLogger("vlaunch.cache")

MAX_SLABS = 4096
MIN_LIMIT = 64 << 20
SHOWN_COPIED = 64  # names of copied tensors listed in the status (the count is always there)


class LayoutError(Exception):
    """A layout request the rank refuses; the message names the cause and the fix."""


@dataclass
class EngineLayout:
    """A committed engine layout: its fields, fingerprint, manifest, slab fds and owners."""

    key: str
    fields: dict[str, str]
    fingerprint: fp.Fingerprint
    manifest: Manifest
    copy: tuple[str, ...]
    fds: list[int]
    slabs: list[Slab] = field(default_factory=list)
    pid: int = 0
    at: float = field(default_factory=time.time)

    def summary(self) -> dict[str, Any]:
        """What the status reports: size, and which tensors are shared and which copied."""
        return {"key": self.key, "fields": self.fields, "bytes": self.manifest.nbytes,
                "tensors": len(self.manifest.tensors),
                "shared": len(self.manifest.tensors) - len(self.copy),
                "copied": len(self.copy), "copied_names": list(self.copy[:SHOWN_COPIED]),
                "from_pid": self.pid, "at": self.at, "fingerprint": self.fingerprint}

    @functools.cached_property
    def manifest_frame(self) -> bytes:
        """The reply to `manifest`, encoded once: every engine start that maps this layout
        waits for it."""
        return protocol.encode({"ok": True, "manifest": self.manifest.to_wire(),
                                "copy": list(self.copy)})

    def escrow(self) -> dict[str, Any]:
        """The frame that lets the launcher hold (and a respawned rank adopt) this layout."""
        return {"event": "layout", "key": self.key, "fields": self.fields,
                "fingerprint": self.fingerprint, "manifest": self.manifest.to_wire(),
                "copy": list(self.copy)}

    def close(self) -> None:
        """Close our fds and drop our slabs; mapped clients keep the memory."""
        wire.close_fds(self.fds)
        self.fds = []
        for slab in self.slabs:
            slab.release()
        self.slabs = []


@dataclass
class _Pending:
    fields: dict[str, str]
    slabs: list[Slab]
    fds: list[int]


class LayoutStore:
    """Allocations in progress (per connection) and the committed engine layout(s)."""

    def __init__(self, backend: Backend, raw_bytes: int) -> None:
        self.backend = backend
        self.limit = max(2 * raw_bytes, MIN_LIMIT)
        self.layouts: dict[str, EngineLayout] = {}
        self._pending: dict[int, _Pending] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held in committed layouts."""
        return sum(x.manifest.nbytes for x in self.layouts.values())

    def get(self, key: str) -> EngineLayout | None:
        """The committed layout with this key, if held."""
        return self.layouts.get(key)

    def listing(self) -> list[dict[str, Any]]:
        """A summary of every committed layout."""
        return [x.summary() for x in self.layouts.values()]

    def alloc(self, owner: int, fields: dict[str, Any], sizes: list[Any]) -> list[int]:
        """Allocate slabs of `sizes` bytes for `owner` (a connection); returns fds to send."""
        self.forget(owner)
        if self.backend is None:
            raise LayoutError("this rank cannot allocate engine layouts (no slab backend)")
        checked = _fields(fields)
        if not isinstance(sizes, list) or not 0 < len(sizes) <= MAX_SLABS or not all(
                type(s) is int and 0 < s < 1 << 50 for s in sizes):
            raise LayoutError(f"layout_alloc: sizes must be 1..{MAX_SLABS} positive integers")
        if sum(sizes) > self.limit:
            raise LayoutError(f"layout_alloc: {sum(sizes)} bytes exceed this rank's limit of "
                              f"{self.limit} (twice its raw layout); hand back only the "
                              "rank's parameters")
        slabs: list[Slab] = []
        try:
            for size in sizes:
                slabs.append(self.backend.allocate(size))
            fds = [s.export_fd() for s in slabs]
        except BaseException:
            for slab in slabs:
                slab.release()
            raise
        self._pending[owner] = _Pending(checked, slabs, fds)
        return list(fds)

    def commit(self, owner: int, pid: int, raw: fp.Fingerprint, fields: dict[str, Any],
               rows: list[Any], copy: list[Any]) -> EngineLayout:
        """Validate the rows against `owner`'s slabs, seal them and keep them as a layout."""
        pending = self._pending.pop(owner, None)
        if pending is None:
            raise LayoutError("layout_commit without a layout_alloc on this connection; "
                              "allocate first (vlaunch.cache.hand_back does both)")
        try:
            layout = self._checked(pending, pid, raw, fields, rows, copy)
        except BaseException:
            _drop(pending)
            raise
        for slab in pending.slabs:
            slab.seal()
        self.add(layout)
        return layout

    def _checked(self, pending: _Pending, pid: int, raw: fp.Fingerprint, fields: dict[str, Any],
                 rows: list[Any], copy: list[Any]) -> EngineLayout:
        if _fields(fields) != pending.fields:
            raise LayoutError("layout_commit: fields differ from those of the layout_alloc")
        sizes = tuple(s.size for s in pending.slabs)
        manifest = Manifest.from_wire({"backend": self.backend.name, "slab_sizes": list(sizes),
                                       "tensors": rows})
        names = {t.name for t in manifest.tensors}
        if len(names) != len(manifest.tensors) or not manifest.tensors:
            raise LayoutError("layout_commit: tensor names must be unique, and at least one")
        if not isinstance(copy, list) or len(copy) > MAX_TENSORS or not all(
                isinstance(n, str) and len(n) <= MAX_NAME and n in names for n in copy):
            raise LayoutError("layout_commit: copy must list names of committed tensors")
        key = el.layout_key(pending.fields)
        return EngineLayout(key, pending.fields, el.extend(raw, pending.fields), manifest,
                            tuple(dict.fromkeys(copy)), pending.fds, pending.slabs, pid)

    def add(self, layout: EngineLayout) -> None:
        """Keep `layout`, replacing any other (one engine layout per rank)."""
        for old in list(self.layouts.values()):
            log.info("engine layout %s replaced by %s; dropping it", old.key, layout.key)
            self.layouts.pop(old.key).close()
        self.layouts[layout.key] = layout

    def forget(self, owner: int) -> None:
        """Drop `owner`'s uncommitted allocation (its connection closed or it allocated anew)."""
        pending = self._pending.pop(owner, None)
        if pending is not None:
            _drop(pending)

    def close(self) -> None:
        """Drop everything (the rank stops)."""
        for owner in list(self._pending):
            self.forget(owner)
        for layout in self.layouts.values():
            layout.close()
        self.layouts.clear()


def _fields(fields: dict[str, Any]) -> dict[str, str]:
    try:
        return el.check_fields(fields)
    except el.LayoutFieldsError as exc:
        raise LayoutError(str(exc)) from None


def _drop(pending: _Pending) -> None:
    wire.close_fds(pending.fds)
    for slab in pending.slabs:
        slab.release()


def adopt(frame: dict[str, Any], fds: list[int]) -> EngineLayout:
    """An escrowed layout frame (from the launcher) back into a layout that holds only fds."""
    manifest = Manifest.from_wire(frame["manifest"])
    if len(fds) != len(manifest.slab_sizes):
        raise LayoutError(f"escrowed layout carries {len(fds)} fds for "
                          f"{len(manifest.slab_sizes)} slabs")
    fields = _fields(frame["fields"])
    fingerprint = {str(k): str(v) for k, v in frame["fingerprint"].items()}
    if frame.get("key") != el.layout_key(fields) or fingerprint.get(el.KEY_FIELD) != frame["key"]:
        raise LayoutError("escrowed layout's key does not match its fields")
    copy = tuple(str(n) for n in frame.get("copy", []))
    return EngineLayout(str(frame["key"]), fields, fingerprint, manifest, copy, fds)
