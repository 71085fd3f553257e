"""FlashInfer autotune tables as cache artifacts, through FlashInfer's own autotuner API.

FlashInfer (flashinfer-python, the `flashinfer` extra) keeps its tuning results in the
process-wide `flashinfer.autotuner.AutoTuner.get()`: `profiling_cache` holds what this process
tuned, and `save_configs(path)` / `load_configs(path)` write and read them as a JSON file
stamped with the environment (`_collect_metadata()`: FlashInfer, CUDA, cuBLAS, cuDNN and
CuTe-DSL versions, GPU name); `load_configs` refuses a file from another environment. That
JSON file, written and read by those two methods, is the artifact: vlaunch never parses or
writes the format itself.

    from vlaunch.cache.integrations.flashinfer_adapter import tuned

    with tuned(socket_path, rank=rank, ops=["fused_moe"], shapes=[(8192, 4096)]) as hit:
        if not hit:
            warm_up_the_model()  # runs under flashinfer.autotune(True); handed back after
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from vlaunch.cache.client.artifacts import fetch, hand_back
from vlaunch.cache.contract.errors import ArtifactError
from vlaunch.cache.store.artifacts import artifact_key

log = logging.getLogger("vlaunch.cache.flashinfer")
KIND = "flashinfer-autotune"


def _autotuner() -> Any:
    try:
        from flashinfer import autotuner
    except ImportError as exc:
        raise ArtifactError(f"flashinfer is not importable ({exc}); install the extra: pip "
                            "install 'vlaunch[flashinfer]'") from None
    return autotuner


def table_key(*, rank: int, ops: Iterable[str], shapes: Iterable[Any] = (),
              extra: dict[str, Any] | None = None) -> str:
    """The key of a table: FlashInfer's environment stamp, the tuned ops and shapes, the rank."""
    autotuner = _autotuner()
    return artifact_key({"environment": autotuner._collect_metadata(), "rank": rank,
                         "ops": sorted(ops), "shapes": [list(s) for s in shapes],
                         **(extra or {})})


def export_table(tuner: Any = None) -> bytes:
    """The tuner's results as FlashInfer's own config file (`AutoTuner.save_configs`)."""
    tuner = tuner or _autotuner().AutoTuner.get()
    with tempfile.TemporaryDirectory(prefix="vlaunch-fi-") as tmp:
        path = Path(tmp) / "autotune.json"
        tuner.save_configs(str(path))
        return path.read_bytes()


def adopt_table(data: bytes, tuner: Any = None) -> None:
    """Load a table into the tuner (`AutoTuner.load_configs`); a refused one raises."""
    tuner = tuner or _autotuner().AutoTuner.get()
    with tempfile.TemporaryDirectory(prefix="vlaunch-fi-") as tmp:
        path = os.path.join(tmp, "autotune.json")
        with open(path, "wb") as f:
            f.write(data)
        try:
            loaded = tuner.load_configs(path)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ArtifactError(f"flashinfer could not read the cached table: {exc}") from None
    if not loaded:
        raise ArtifactError("flashinfer refused the cached table: it was tuned in another "
                            "environment")


@contextlib.contextmanager
def tuned(socket: Path | str, *, rank: int, ops: Iterable[str], shapes: Iterable[Any] = (),
          extra: dict[str, Any] | None = None) -> Iterator[bool]:
    """Yield True when the cache held the table (adopted: skip the tuning pass); else run the
    body under `flashinfer.autotune(True)` and hand the new table back. Never raises for an
    artifact failure: that is a miss with one warning."""
    try:
        autotuner = _autotuner()
        key = table_key(rank=rank, ops=ops, shapes=shapes, extra=extra)
    except ArtifactError as exc:
        log.warning("autotune table not cached: %s", exc)
        yield False
        return
    data = fetch(socket, KIND, key)
    if data is not None:
        try:
            adopt_table(data)
        except ArtifactError as exc:
            log.warning("cached autotune table not used (%s); tuning instead", exc)
        else:
            log.info("adopted the cached FlashInfer autotune table (%d bytes)", len(data))
            yield True
            return
    with autotuner.autotune(True):
        yield False
    try:
        table = export_table()
    except (OSError, ValueError) as exc:
        log.warning("autotune table not exported (%s); the next engine tunes again", exc)
        return
    hand_back(socket, KIND, key, table)
