"""Wire protocol v1: framing and message validation as pure functions over bytes.

A frame is a 16-byte header followed by a JSON body:

    magic  b"VLCH" | version u16 | codec u8 (0 = JSON) | flags u8 | nfds u16 | reserved u16
    | length u32                                                       (network byte order)

Codec 1 (CODEC_TAIL) is a reply with raw bytes after its JSON: the body is the JSON part's
length (u32), the JSON object, then the tail, which the decoded object carries as "tail" (a
memoryview). Only a rank's replies use it (the columns form of a manifest, for a client that
asked for it: store/columns.py); a request may not.

One flag exists: FLAG_LARGE marks a request that may exceed MAX_REQUEST_BODY (up to
MAX_ARTIFACT_BODY); only an artifact_put or a layout_commit may carry it, which the reader
checks once the body is parsed. Any other request over MAX_REQUEST_BODY is refused from its
header alone.

File descriptors ride on the frame whose header announces how many it carries (`nfds`);
they are attached with SCM_RIGHTS to the header's bytes. Nothing here touches a socket, and
nothing is ever unpickled: a body is a JSON object whose fields are checked against the
request's schema, with every length, count and string bounded.
"""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

from vlaunch.cache.contract.errors import ProtocolError

MAGIC = b"VLCH"
VERSION = 1
CODEC_JSON = 0
CODEC_TAIL = 1
FLAG_LARGE = 0x01
HEADER = struct.Struct("!4sHBBHHI")
HEADER_SIZE = HEADER.size
MAX_BODY = 64 << 20  # a manifest of a million tensors fits; nothing legitimate is larger
MAX_STRING = 4096
MAX_REQUEST_BODY = 1 << 20  # requests are small; artifacts are capped separately
MAX_ARTIFACT = 16 << 20  # one artifact's raw bytes
MAX_ARTIFACT_DATA = -(-MAX_ARTIFACT // 3) * 4  # the same, base64-encoded
MAX_ARTIFACT_BODY = MAX_ARTIFACT_DATA + MAX_STRING * 4  # an artifact_put frame, fields included
MAX_FDS = 64


class Header(NamedTuple):
    """A decoded, validated frame header (a NamedTuple: cheaper to define than a frozen
    dataclass, and this module is imported by every engine start)."""

    nfds: int
    length: int
    large: bool = False
    codec: int = CODEC_JSON


def encode(message: dict[str, Any], nfds: int = 0, tail: bytes = b"") -> bytes:
    """Serialise one message into a frame (header + JSON body, then `tail`: codec 1)."""
    body = _ENCODE(message).encode()
    codec = CODEC_JSON
    if tail:
        if "tail" in message:
            raise ProtocolError("a message with a tail may not have a tail field")
        body, codec = struct.pack("!I", len(body)) + body + tail, CODEC_TAIL
    if len(body) > MAX_BODY or not 0 <= nfds <= MAX_FDS:
        raise ProtocolError(f"frame too large: {len(body)} bytes, {nfds} fds")
    flags = FLAG_LARGE if message.get("op") in LARGE_OPS else 0
    return HEADER.pack(MAGIC, VERSION, codec, flags, nfds, 0, len(body)) + body


def decode_header(data: bytes, *, max_body: int = MAX_BODY, large_body: int = 0,
                  tails: bool = False) -> Header:
    """Parse and bound-check a frame header; a FLAG_LARGE frame may use up to `large_body`;
    a codec 1 frame is refused unless `tails` (a client reading a reply)."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"short header: {len(data)} of {HEADER_SIZE} bytes")
    magic, version, codec, flags, nfds, reserved, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError("bad magic: the peer does not speak the vlaunch protocol")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this is "
                            f"version {VERSION}); run the same vlaunch version on both sides")
    large = flags == FLAG_LARGE and large_body > 0
    if codec not in ((CODEC_JSON, CODEC_TAIL) if tails else (CODEC_JSON,)) or \
            (flags and not large) or reserved:
        raise ProtocolError(f"unknown codec {codec} or flags {flags}/{reserved}")
    if large:
        max_body = max(max_body, large_body)
    if nfds > MAX_FDS or length > max_body:
        raise ProtocolError(f"frame too large: {length} bytes (limit {max_body}), {nfds} fds")
    return Header(nfds, length, large, codec)


def decode_body(data: bytes | bytearray, codec: int = CODEC_JSON) -> dict[str, Any]:
    """Parse a body: a JSON object (codec 1: then the tail, as its "tail" field)."""
    tail = None
    if codec == CODEC_TAIL:
        (n,) = struct.unpack_from("!I", data) if len(data) >= 4 else (-1,)
        if not 0 <= n <= len(data) - 4:
            raise ProtocolError("a frame's JSON part runs past its body")
        tail, data = memoryview(data)[4 + n:], data[4:4 + n]
    obj = _decode_json(data)
    if tail is not None:
        if "tail" in obj:
            raise ProtocolError("a frame with a tail has a tail field too")
        obj["tail"] = tail
    return obj


def _decode_json(data: bytes | bytearray) -> dict[str, Any]:
    try:
        obj = _DECODE(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("body is not a JSON object")
    return obj


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


# Made once: json.dumps/json.loads with any option build a new coder per call, and every
# frame of a handoff goes through these.
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_DECODE = json.JSONDecoder(parse_constant=_reject_constant).decode


# Request schemas: field -> (type, required). Unknown fields are refused.
_STR, _INT, _BOOL, _DICT, _LIST = str, int, bool, dict, list
REQUESTS: dict[str, dict[str, tuple[type, bool]]] = {
    "hello": {"fingerprint": (_DICT, True), "client": (_STR, False), "pid": (_INT, False),
              "layout": (_STR, False)},
    "manifest": {"layout": (_STR, False), "form": (_STR, False)},  # form: rows or columns
    "open": {"mode": (_STR, True), "layout": (_STR, False)},
    "copied": {},  # after an open whose reply said "copying": answered once the copy is done
    "mapped": {"bytes": (_INT, True), "mode": (_STR, True)},
    "drop": {},
    "release": {},
    "status": {},
    "memory": {},
    "artifact_get": {"kind": (_STR, True), "key": (_STR, True)},
    "artifact_put": {"kind": (_STR, True), "key": (_STR, True), "data": (_STR, True)},
    "artifact_list": {},
    "digest": {"start": (_INT, True), "count": (_INT, True)},  # vlaunch verify, a page a time
    # seeding over TCP: the token comes first on every connection, then the manifest, then
    # byte ranges of the slabs (or, for seeding ranks of earlier versions, whole slabs), each
    # answered by a header and the raw bytes
    "seed_auth": {"token": (_STR, True)},
    "seed_manifest": {},
    "seed_range": {"slab": (_INT, True), "offset": (_INT, True), "nbytes": (_INT, True)},
    "seed_slab": {"slab": (_INT, True)},
    # engine-shaped layouts (docs/engine-layout.md; `layout` above names one by its key):
    # list them, allocate slabs for one (fds back), commit its manifest rows
    "layouts": {},
    "layout_alloc": {"fingerprint": (_DICT, True), "fields": (_DICT, True),
                     "sizes": (_LIST, True)},
    "layout_commit": {"fields": (_DICT, True), "tensors": (_LIST, True),
                      "copy": (_LIST, True), "release_raw": (_BOOL, True)},
    # a trainer publishes a version (docs/swap.md): staging slabs (fds back, writable), then
    # the [name, dtype, shape] of every tensor it wrote; the commit's reply comes once the
    # launcher's cutover ended
    "publish_begin": {"label": (_STR, True), "mode": (_STR, False), "margin": (_INT, False)},
    "publish_commit": {"label": (_STR, True), "tensors": (_LIST, True)},
    "publish_abort": {},
    "published_digests": {"start": (_INT, True), "count": (_INT, True)},  # vlaunch verify
}
LARGE_OPS = frozenset({"artifact_put", "layout_commit", "publish_commit"})
"""Requests whose body may exceed MAX_REQUEST_BODY (up to MAX_ARTIFACT_BODY)."""
MODES = ("share", "copy", "copy-release")


def validate_request(msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Check a request against its schema; returns (op, fields)."""
    op = msg.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise ProtocolError(f"unknown request {str(op)[:64]!r}")
    schema = REQUESTS[op]
    fields = {k: v for k, v in msg.items() if k != "op"}
    for key, value in fields.items():
        if key not in schema:
            raise ProtocolError(f"{op}: unknown field {key[:64]!r}")
        _check_value(f"{op}.{key}", value, schema[key][0])
    missing = [k for k, (_, required) in schema.items() if required and k not in fields]
    if missing:
        raise ProtocolError(f"{op}: missing field(s) {', '.join(missing)}")
    if op in ("open", "mapped") and fields["mode"] not in MODES:
        raise ProtocolError(f"{op}: mode must be one of {', '.join(MODES)}")
    return op, fields


def check_large(op: str, header: Header) -> None:
    """Only LARGE_OPS may carry FLAG_LARGE (the frame was capped from its header already)."""
    if header.large and op not in LARGE_OPS:
        raise ProtocolError(f"{op[:64]}: only {', '.join(sorted(LARGE_OPS))} may be a large "
                            "frame")


def _check_value(where: str, value: Any, kind: type) -> None:
    if type(value) is not kind:
        raise ProtocolError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    if kind is str and len(value) > (MAX_ARTIFACT_DATA if where == "artifact_put.data"
                                     else MAX_STRING):
        raise ProtocolError(f"{where}: string too long")
    if kind is int and not 0 <= value < 1 << 62:
        raise ProtocolError(f"{where}: integer out of range")
    if kind is dict:
        if len(value) > 256:
            raise ProtocolError(f"{where}: too many fields")
        for k, v in value.items():
            if len(k) > 128 or not isinstance(v, (str, int, float, bool, type(None))):
                raise ProtocolError(f"{where}: field {k[:64]!r} must be a short scalar")
            if isinstance(v, str) and len(v) > MAX_STRING:
                raise ProtocolError(f"{where}.{k[:64]}: string too long")


def error(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """An error reply."""
    return {"ok": False, "error": code, "message": message, **extra}


# Launcher <-> rank frames. A rank reports on its ready channel (a socketpair from the launcher,
# kept open while it lives): "progress" while it loads (contract/progress.py), "ready" once
# serving, with duplicates of its slab fds for the launcher's escrow; "layout" for each engine
# layout it adopts (docs/engine-layout.md), with its fds; "release" when it dropped a layout
# ("raw": the checkpoint's, after a copy-release or once an engine layout replaced it), so that
# the launcher closes its duplicates: held fds would keep the memory allocated. "artifact" carries
# an artifact (base64, at most MAX_ARTIFACT_DATA) the rank holds, once when it is ready and again
# whenever one is handed back, so that a respawned rank gets its artifacts back as it gets its
# slabs. A respawned rank gets "escrow" (then its "layout" and "artifact" frames) on its adopt
# channel. Field -> (type, required); "layout" frames are checked by the rank that adopts them.
EVENTS: dict[str, dict[str, tuple[type, bool]] | None] = {
    "ready": {"rank": (_INT, True), "pid": (_INT, True), "socket": (_STR, True),
              "at": (float, True), "bytes": (_INT, True), "device": (_STR, True),
              "manifest": (_DICT, True), "fingerprint": (_DICT, True),
              "version": (_INT, False), "model": (_STR, False), "label": (_STR, False)},
    "escrow": {"manifest": (_DICT, True), "fingerprint": (_DICT, True),
               "released": (_BOOL, False), "version": (_INT, False), "model": (_STR, False),
               "label": (_STR, False), "incomplete": (_BOOL, False),
               "opened": (_LIST, False)},
    # who opened the rank's raw slabs (pid, start time), or that not everyone can be named:
    # a respawn that adopts them follows those (rank/openers.py)
    "openers": {"pid": (_INT, False), "started": (float, False),
                "incomplete": (_BOOL, False)},
    # a client's raw hello and how the rank answered it ("" why: its fingerprint matched):
    # the launcher tells from it whether its engine maps the weights from the caches
    "hello": {"pid": (_INT, True), "ok": (_BOOL, True), "why": (_STR, True)},
    "layout": None,
    "release": {"layout": (_STR, True)},
    "progress": {"rank": (_INT, True), "loaded": (_INT, True), "total": (_INT, True)},
    "artifact": {"kind": (_STR, True), "key": (_STR, True), "data": (_STR, True)},
    # a swap (docs/swap.md): the launcher's steps, on the same channel the other way, and the
    # rank's answer to each (committed and rolled_back carry the raw slab fds to escrow, with
    # the manifest and fingerprint they are served under; then the layout frames again)
    "swap_prepare": {"version": (_INT, True), "model": (_STR, True), "mode": (_STR, True),
                     "margin": (_INT, True), "keep": (_BOOL, True)},
    "swap_stage": {"version": (_INT, True), "mode": (_STR, True)},
    "swap_commit": {"version": (_INT, True), "mode": (_STR, True),
                    "lease_wait_ms": (_INT, True)},
    "swap_finish": {"version": (_INT, True)},
    "swap_rollback": {"version": (_INT, True), "status": (_INT, True),
                      "message": (_STR, True)},
    "swap_abort": {"version": (_INT, True), "status": (_INT, True), "message": (_STR, True)},
    "swap_answer": {"answer": (_STR, True), "version": (_INT, True), "fits": (_BOOL, False),
                    "status": (_INT, False), "message": (_STR, False), "label": (_STR, False),
                    "mode": (_STR, False), "model": (_STR, False),
                    "manifest": (_DICT, False), "fingerprint": (_DICT, False),
                    "in_place": (_STR, False)},
}
SWAP_STEPS = ("swap_prepare", "swap_stage", "swap_commit", "swap_finish", "swap_rollback",
              "swap_abort")
"""The launcher's swap frames to a rank."""


def event(name: str, **fields: Any) -> dict[str, Any]:
    """A launcher <-> rank frame body, checked against EVENTS."""
    return validate_event({"event": name, **fields}, name)


def validate_event(msg: dict[str, Any], *expected: str) -> dict[str, Any]:
    """Check a launcher <-> rank frame: one of `expected`, with every field of its type."""
    name = msg.get("event")
    if name not in expected or name not in EVENTS:
        raise ProtocolError(f"expected a {' or '.join(expected)} frame, got {str(name)[:64]!r}")
    schema = EVENTS[name]
    if schema is None:
        return msg
    unknown = set(msg) - {"event", *schema}
    missing = [k for k, (_, required) in schema.items() if required and k not in msg]
    if unknown or missing:
        raise ProtocolError(f"{name} frame: unknown field(s) {sorted(unknown)[:8]}, missing "
                            f"{missing}")
    for key, (kind, _) in schema.items():
        if key in msg and not _is(msg[key], kind):
            raise ProtocolError(f"{name}.{key}: expected {kind.__name__}")
    return msg


def _is(value: Any, kind: type) -> bool:
    """A JSON value of `kind` (float accepts an int; no bool is a number)."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return type(value) is kind
