"""Engines that rewrite their weights in place (EPLB moving experts): copy mode only.

Share-mode weights are the cache's own memory, mapped read-only: on CPU a write faults
(SIGSEGV), on CUDA it is an illegal memory access. Either kills the engine, and a supervisor
that restarts it would loop. So an engine that says it will rewrite its weights is refused
share mode before anything is mapped, with an exit status (78, a configuration error) that
`vlaunch run` does not restart; and share mode turns on Python's faulthandler, so that a write
nobody announced names the Python line that made it before the process dies.
"""

from __future__ import annotations

import faulthandler
import logging

from vlaunch.cache.contract.errors import VlaunchError, exit_status

log = logging.getLogger("vlaunch.cache")


class ShareModeRewriteError(VlaunchError):
    """The engine will rewrite its weights in place, which share mode cannot allow."""

    status = exit_status("BAD_PLAN")  # 78: a configuration error; vlaunch run does not restart it


def check_rewrites(mode: str, rewrites: str | None) -> None:
    """Refuse share mode for an engine that rewrites weights in place (`rewrites`: what does)."""
    if mode != "share":
        return
    if rewrites:
        raise ShareModeRewriteError(
            f"{rewrites} rewrites weights in place, but share-mode weights are the cache's, "
            "mapped read-only; load with mode copy (load(mode='copy'); vLLM: \"mode\": "
            f"\"copy\" in --model-loader-extra-config), or turn {rewrites} off")
    if not faulthandler.is_enabled():
        faulthandler.enable()  # a stray write into a read-only mapping names its Python line
