"""A cache rank that cannot get memory or threads: status 84, one clear line, no traceback.

RLIMIT_AS bounds the rank's address space (what `ulimit -v` sets). The limits below were read
off these machines (numpy 2, OMP_NUM_THREADS=1: each further OpenMP thread takes its own stack
and malloc arena): a CPU rank (no torch) with a 0.3 GB shard serves in 1.5 GB of address space,
and in its order of steps too little for the slab, then for numpy's libraries (mapped after
the slab, the window is narrow: 0.36-0.44 GB), then for the reader threads' stacks and malloc
arenas each fail at a different step.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from vlaunch.cache.contract.exitcodes import ExitStatus

from .harness import start_rank

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def shard_300mb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 0.3 GB reference checkpoint (the slab is what a tight limit cannot fit)."""
    path = tmp_path_factory.mktemp("mem") / "m"
    subprocess.run([sys.executable, "-m", "vlaunch.cache.reference.refmodel", str(path),
                    "--target-gib", "0.3"], check=True, capture_output=True, timeout=120)
    return path


# The threads case: glibc gives each reader thread a stack of RLIMIT_STACK and, when threads
# contend, a 64 MiB malloc arena, but how many arenas appear depends on the scheduling (under
# load the rank sometimes fitted in 1.1 GB and served). One arena (MALLOC_ARENA_MAX=1) and
# 64 MiB stacks make the stacks what runs out: a rank that peaks at ~0.8 GB with one reader
# thread needs ~1.5 GB with twelve.
THREADS_CASE = {resource.RLIMIT_STACK: 64 << 20}


@pytest.mark.parametrize(("limit", "cause"), [(250_000_000, "Cannot allocate memory"),
                                              (400_000_000, "failed to map segment"),
                                              (1_100_000_000, "can't start new thread")],
                         ids=["slab", "libraries", "threads"])
def test_a_rank_out_of_memory_exits_84_naming_the_fix(shard_300mb: Path, sockdir: Path,
                                                     limit: int, cause: str) -> None:
    threads = "thread" in cause
    rank = start_rank(shard_300mb, sockdir, "--threads", "12",
                      limits={resource.RLIMIT_AS: limit, **(THREADS_CASE if threads else {})},
                      wait=False, env={"OMP_NUM_THREADS": "1",
                                       **({"MALLOC_ARENA_MAX": "1"} if threads else {})})
    assert rank.proc.wait(timeout=120) == ExitStatus.OUT_OF_MEMORY
    log = rank.log.read_text() if rank.log else ""
    assert "out of memory:" in log and "raise the memory limit" in log, log[-2000:]
    (line,) = [line for line in log.splitlines() if "out of memory:" in line]
    assert cause in line, line  # the step this limit stops
    assert "Traceback" not in log, log[-2000:]
    assert not list(sockdir.glob("rank-0.sock")), "a socket left behind"
