"""vlaunch.cache: per-rank weight caches and the engine-side loader.

Importing this package is light (no torch): the launcher imports its protocol, fingerprint
and exit-status modules. `load` and `CacheClient` are imported on first use.
"""

from __future__ import annotations

from typing import Any

from vlaunch.cache.contract.version import __version__

__all__ = ["CacheClient", "Published", "Weights", "__version__", "hand_back", "load",
           "publish"]


def __getattr__(name: str) -> Any:
    if name in ("load", "Weights"):
        from vlaunch.cache.client import loader

        return getattr(loader, name)
    if name == "hand_back":
        from vlaunch.cache.client.layout import hand_back

        return hand_back
    if name in ("publish", "Published", "PublishError"):
        from vlaunch.cache.client import publish

        return getattr(publish, name)
    if name == "CacheClient":
        from vlaunch.cache.client.connection import CacheClient

        return CacheClient
    raise AttributeError(name)
