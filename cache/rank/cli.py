"""The cache rank's command line: `python -m vlaunch.cache` (the launcher spawns it)."""

from __future__ import annotations

import sys

from vlaunch.cache.contract.launch import RankArgs, rank_command


def _run(args: RankArgs) -> None:
    """Run one cache rank: load its shard, then serve it on its socket until SIGTERM."""
    from vlaunch.cache.rank.process import main

    sys.exit(main(args))


cache_command = rank_command("cache", _run)
