"""The engine side of artifacts: fetch one from the rank's cache, hand one back, or both.

Every failure is one warning and a miss, never an exception: an engine never fails because
of an artifact (it tunes again instead). The store, names and encoding are in
`vlaunch.cache.store.artifacts`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract.errors import VlaunchError

log = logging.getLogger("vlaunch.cache.client.artifacts")


def fetch(socket: Path | str, kind: str, key: str, *, timeout: float = 5.0) -> bytes | None:
    """The artifact from the cache at `socket`, or None on a miss or on any failure (warned)."""
    try:
        client = CacheClient(socket, timeout=timeout, client="artifacts")
        try:
            return client.artifact_get(kind, key)
        finally:
            client.close()
    except VlaunchError as exc:
        log.warning("artifact %s not fetched from the cache (%s); tuning instead", kind, exc)
        return None


def hand_back(socket: Path | str, kind: str, key: str, data: bytes, *,
              timeout: float = 5.0) -> bool:
    """Give a freshly produced artifact to the cache; any failure is one warning, never raised."""
    try:
        client = CacheClient(socket, timeout=timeout, client="artifacts")
        try:
            client.artifact_put(kind, key, data)
        finally:
            client.close()
        return True
    except VlaunchError as exc:
        log.warning("artifact %s not handed back to the cache (%s); the next engine tunes "
                    "again", kind, exc)
        return False


def adopt_or_produce(socket: Path | str, kind: str, key: str, *,
                     adopt: Callable[[bytes], None], produce: Callable[[], bytes],
                     timeout: float = 5.0) -> str:
    """Hit: adopt the cached artifact and skip producing it. Miss: produce, then hand back.

    Returns "hit" or "miss". An artifact failure (no cache, a bad table that `adopt` refuses)
    degrades to a miss with one warning: the engine never fails because of an artifact.
    `timeout`: how long each of fetch and hand-back waits for a cache that is not up yet.
    """
    data = fetch(socket, kind, key, timeout=timeout)
    if data is not None:
        try:
            adopt(data)
            return "hit"
        except Exception as exc:  # a table the library refuses: tune instead
            log.warning("cached artifact %s was refused (%s); tuning instead", kind, exc)
    table = produce()
    hand_back(socket, kind, key, table, timeout=timeout)
    return "miss"
