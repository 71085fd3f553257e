"""vlaunch.cache: per-rank weight caches and the engine-side loader.

Importing this package is light (no torch): the launcher imports its protocol, fingerprint
and exit-status modules. The names in `__all__` are imported on first use.

Value types that an engine's start or a process's import defines (the manifest's records,
`Target`, `Position`, `EngineEnv`, dtypes, file stats, exit-table rows) are NamedTuples, not
frozen dataclasses: defining a frozen dataclass costs several times more, for the same
fields, repr, equality and immutability (tests/test_import_cost.py checks that the share path
defines none). Where even a NamedTuple's definition shows (settings.Setting, mapping.Opened),
a plain class with __slots__. Elsewhere, dataclasses.
"""

from __future__ import annotations

from typing import Any

from vlaunch.cache.contract.version import __version__

# Equal to the table in docs/integrations.md ("The Python API"); tests/test_docs_python.py
# keeps the two the same.
__all__ = ["CacheClient", "Outcome", "PublishError", "Published", "Target", "Weights",
           "__version__", "cached_nbytes", "fingerprint", "hand_back", "layout_nbytes", "load",
           "publish", "release_cached"]


def __getattr__(name: str) -> Any:
    if name in ("load", "Weights", "cached_nbytes"):
        from vlaunch.cache.client import loader

        return getattr(loader, name)
    if name == "Outcome":
        from vlaunch.cache.client.weights import Outcome

        return Outcome
    if name == "Target":
        from vlaunch.cache.store.target import Target

        return Target
    if name == "fingerprint":
        from vlaunch.cache.store.fingerprints import fingerprint

        return fingerprint
    if name in ("hand_back", "layout_nbytes", "release_cached"):
        from vlaunch.cache.client import layout

        return getattr(layout, name)
    if name in ("publish", "Published", "PublishError"):
        from vlaunch.cache.client import publish

        return getattr(publish, name)
    if name == "CacheClient":
        from vlaunch.cache.client.connection import CacheClient

        return CacheClient
    raise AttributeError(name)
