"""The requests a client of a rank sends besides the handoff: its manifest and its artifacts.

Each one is a function of a protocol connection (contract/connection.py), so that an engine's
CacheClient and a rank seeding from a peer (rank/seed.py) ask the same way. The forms they
carry are the store's (store/columns.py, store/artifacts.py); only the asking is here. The
artifacts' module is imported on first use: an engine's share handoff does not need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlaunch.cache.contract.errors import CacheBrokenError
from vlaunch.cache.store import columns

if TYPE_CHECKING:
    from vlaunch.cache.contract.connection import Connection
    from vlaunch.cache.store.artifacts import Held
    from vlaunch.cache.store.manifest import Manifest

MANIFEST = {"op": "manifest", "form": columns.FORM}
"""The manifest request in the columns form: checked and viewed in bulk."""
MAX_LISTED = 4096
"""The most artifacts a listing may name (a rank holds at most artifacts.MAX_COUNT)."""


def manifest(conn: Connection) -> Manifest:
    """The validated manifest of the rank at the other end of `conn`."""
    reply = conn.request(MANIFEST)[0]
    return columns.from_wire(reply["manifest"], reply.get("tail"))


def artifact_get(conn: Connection, kind: str, key: str) -> bytes | None:
    """The artifact's bytes from the rank at the other end of `conn`; None when it does not
    hold it."""
    from vlaunch.cache.store import artifacts

    ((reply, fds),) = conn.exchange([{"op": "artifact_get", "kind": kind, "key": key}])
    if reply.get("error") == "miss":
        return None
    reply, _ = conn.checked(reply, fds)
    if not isinstance(reply.get("data"), str):
        raise CacheBrokenError(f"cache at {conn.path} sent an artifact without data")
    return artifacts.decode(reply["data"])


def artifact_put(conn: Connection, kind: str, key: str, data: bytes) -> None:
    """Hand an artifact to the rank at the other end of `conn` (checked here first: its name
    and size)."""
    from vlaunch.cache.store import artifacts

    artifacts.check_name(kind, key)
    artifacts.check_size(kind, len(data))
    conn.request({"op": "artifact_put", "kind": kind, "key": key,
                  "data": artifacts.encode(data)})


def artifact_list(conn: Connection) -> list[Held]:
    """Every artifact the rank at the other end of `conn` holds: (kind, key, size)."""
    from vlaunch.cache.store import artifacts

    rows = conn.request({"op": "artifact_list"})[0].get("artifacts")
    if not isinstance(rows, list) or len(rows) > MAX_LISTED:
        raise CacheBrokenError(f"cache at {conn.path} sent a bad artifact list")
    try:
        return [artifacts.Held(str(k), str(h), int(n)) for k, h, n in rows]
    except (TypeError, ValueError) as exc:
        raise CacheBrokenError(f"cache at {conn.path} sent a bad artifact list ({exc})") from None
