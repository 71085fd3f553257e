"""Engine-shaped layouts: the names, keys and fingerprints both sides agree on (no torch).

An engine that post-processes its weights (fuses, pads, quantizes, repacks) hands its per-rank
parameters back to its rank's cache, which keeps them as a second layout beside the raw,
checkpoint-shaped one. The engine describes what shaped them with a small dict of fields
(engine name and version, model-config hash, quantization, dtype, kernel backends, ...). The
layout's key is a hash of those fields; its fingerprint is the raw fingerprint extended by
them, so a later start maps the layout only when every field matches.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract.errors import UsageError

MAX_FIELDS = 64
MAX_VALUE = 1024
FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}\Z")
OVERRIDABLE = frozenset({"dtype", "kernel_backends", "loader", "quantization",
                         "quantization_config"})
"""Raw fingerprint fields an engine layout may restate: the dtype, quantization and kernel
backends the engine applied (the checkpoint's own stay in the raw fingerprint)."""
RESERVED = (frozenset(fp.FIELDS) - OVERRIDABLE) | {"layout"}
KEY_FIELD = "layout"
"""The fingerprint field that holds the layout's key (absent from the raw fingerprint)."""


class LayoutFieldsError(UsageError):
    """The fields that describe an engine layout are malformed."""


def check_fields(fields: Mapping[str, Any]) -> dict[str, str]:
    """The fields as strings, checked: short names, scalar values, no raw identity field."""
    if not isinstance(fields, Mapping) or not 0 < len(fields) <= MAX_FIELDS:
        raise LayoutFieldsError(f"engine layout fields must be a mapping of 1..{MAX_FIELDS} "
                                "entries; pass e.g. {'engine': 'name', 'engine_version': '1'}")
    out: dict[str, str] = {}
    for name, value in fields.items():
        if not isinstance(name, str) or not FIELD_NAME.match(name) or name in RESERVED:
            raise LayoutFieldsError(f"engine layout field {str(name)[:64]!r} is not allowed: "
                                    "use a letter, then letters, digits, '_', '.', '-' (64 at "
                                    f"most), and none of {', '.join(sorted(RESERVED))}")
        if not isinstance(value, (str, int, float, bool)) or len(str(value)) > MAX_VALUE:
            raise LayoutFieldsError(f"engine layout field {name!r} must be a string or number "
                                    f"of at most {MAX_VALUE} characters")
        out[name] = str(value)
    return out


def layout_key(fields: Mapping[str, str]) -> str:
    """The layout's key: a short hash of its (checked) fields."""
    blob = json.dumps(dict(sorted(fields.items())), separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def extend(raw: Mapping[str, str], fields: Mapping[str, str]) -> fp.Fingerprint:
    """The layout's fingerprint: the raw fingerprint, its fields, and its key."""
    return {**raw, **fields, KEY_FIELD: layout_key(fields)}


def nearest(layouts: Iterable[Mapping[str, Any]], theirs: Mapping[str, Any]
            ) -> list[tuple[str, Any, Any]]:
    """The differences to the held layout fingerprint closest to `theirs` ([] if none held)."""
    diffs = [fp.compare(ours, theirs) for ours in layouts]
    return min(diffs, key=len) if diffs else []
