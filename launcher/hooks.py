"""The process operations the executor needs, behind one interface (the torch elastic shape).

`OsHooks` does them for real: asyncio subprocesses in their own process groups that die with
the launcher, process-group signals, the psutil sweep, HTTP probes (probes.py), rank status
queries.
Tests hand the executor a fake with scripted results instead (tests/test_executor.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from vlaunch.cache.contract.lifetime import become_subreaper

from .children import (
    contain_children,
    die_with_parent,
    group_running,
    reap_orphans,
    signal_command,
    signal_group,
    sweep,
)
from .core import events
from .probes import HttpProbe
from .statusview import query_rank

log = logging.getLogger("vlaunch.launcher")
SETTLE_TIMEOUT = 10.0
"""Seconds a stopped engine's process group may take to be gone after SIGKILL."""
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Signals the launcher handles (as SignalReceived events); any other keeps its default."""


class Child(Protocol):
    """A started child process."""

    pid: int

    async def wait(self) -> int:
        """Its exit status once it has exited (negative: killed by that signal)."""


class ProcessHooks(Protocol):
    """Everything the executor does to processes and the network."""

    def prepare(self, post: Callable[[events.Event], None]) -> None:
        """Once, in the running loop, before anything starts: become the subreaper of our
        descendants, and have the signals the core handles `post` a SignalReceived."""

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str],
                    pass_fds: Sequence[int] = (), kept: bool = False) -> Child:
        """Start argv in its own process group, dying with us; OSError if it cannot start.
        `kept`: under a keeper (keeper.py), which takes whatever argv starts down with it."""

    def signal(self, pid: int, sig: int) -> None:
        """Signal a child's process group (a vanished one is fine)."""

    def signal_command(self, pid: int, sig: int) -> None:
        """Signal the command a kept child runs, alone: not its group (keeper.py)."""

    def sweep(self, pids: Iterable[int]) -> list[str]:
        """SIGKILL these groups and every descendant left; names of what was killed."""

    async def settle(self, pid: int) -> None:
        """After a kept child `pid` was reaped: SIGKILL its process group and wait until none
        of it runs any more (its port and device memory are free then)."""

    def reap_orphans(self, pids: Iterable[int]) -> None:
        """Collect exited descendants that are not our own children."""

    async def http_probe(self, probe: HttpProbe) -> str:
        """Send the probe: "" if the engine answered 2xx within its deadline, else how it
        failed."""

    async def rank_status(self, path: Path) -> dict[str, Any]:
        """A rank's status report from its socket; OSError (or a VlaunchError) if none."""


class _Proc:
    """An asyncio subprocess as a Child; `ours` holds its pid until asyncio has reaped it."""

    def __init__(self, proc: asyncio.subprocess.Process, ours: set[int]) -> None:
        self.proc, self.ours = proc, ours
        self.pid = proc.pid
        ours.add(self.pid)

    async def wait(self) -> int:
        try:
            return await self.proc.wait()
        finally:
            self.ours.discard(self.pid)


COALESCE_S = 0.005
"""A signal repeated within this many seconds is one delivery. Standard signals do not queue
(two SIGTERMs sent at once may arrive as one), and uvloop can dispatch one signal twice when it
lands while the loop is running the handler of another (SIGHUP then SIGTERM became SIGHUP,
SIGTERM, SIGTERM: a "second SIGTERM", exit 82)."""


class Coalesced:
    """Posts each signal's event, dropping a repeat of the same signal within COALESCE_S."""

    def __init__(self, post: Callable[[events.Event], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.post, self.clock = post, clock
        self.last: dict[int, float] = {}

    def __call__(self, sig: int) -> None:
        now = self.clock()
        if now - self.last.get(sig, -COALESCE_S) < COALESCE_S:
            return
        self.last[sig] = now
        self.post(events.SignalReceived(sig, 0.0))


class OsHooks:
    """The real process operations.

    asyncio reaps the children it started; `reap_orphans` collects only the others (exited
    descendants re-parented to us). A child it started is never taken from asyncio: its pid is
    kept from the moment the spawn returns until asyncio has reaped it, and while a spawn is in
    flight (the child exists but its pid is not known yet) no orphan is collected at all. A
    rank killed right after it was forked was otherwise reaped here, its exit never reached
    asyncio and the launcher waited for it forever.
    """

    def __init__(self) -> None:
        self._ours: set[int] = set()
        self._spawning = 0

    def prepare(self, post: Callable[[events.Event], None]) -> None:
        become_subreaper()
        contain_children()
        loop = asyncio.get_running_loop()
        deliver = Coalesced(post)
        for sig in SIGNALS:  # the handler only posts the event: the core decides
            loop.add_signal_handler(sig, deliver, sig)

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str],
                    pass_fds: Sequence[int] = (), kept: bool = False) -> Child:
        if kept:
            if shutil.which(argv[0], path=env.get("PATH", os.defpath)) is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
            argv = [sys.executable, "-m", "vlaunch.launcher.keeper", "--", *argv]
        self._spawning += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=dict(env), pass_fds=tuple(pass_fds), start_new_session=True,
                preexec_fn=die_with_parent)
        finally:
            self._spawning -= 1
        return _Proc(proc, self._ours)

    def signal(self, pid: int, sig: int) -> None:
        signal_group(pid, sig)

    def signal_command(self, pid: int, sig: int) -> None:
        signal_command(pid, sig)

    def sweep(self, pids: Iterable[int]) -> list[str]:
        return sweep(pids)

    async def settle(self, pid: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT
        while True:
            signal_group(pid, signal.SIGKILL)
            left = await loop.run_in_executor(None, group_running, pid)
            if not left:
                return
            if loop.time() > deadline:
                log.error("process(es) %s of a stopped engine survived SIGKILL for %g s "
                          "(uninterruptible sleep in a driver call?)", left, SETTLE_TIMEOUT)
                return
            await asyncio.sleep(0.01)

    def reap_orphans(self, pids: Iterable[int]) -> None:
        if not self._spawning:
            reap_orphans([*pids, *self._ours])

    async def http_probe(self, probe: HttpProbe) -> str:
        pending = asyncio.get_running_loop().run_in_executor(None, probe.run)
        try:  # urllib bounds each socket operation; this bounds the whole exchange
            return await asyncio.wait_for(pending, probe.timeout + 0.5)
        except asyncio.TimeoutError:
            return f"timed out after {probe.timeout:g} s"

    async def rank_status(self, path: Path) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(None, query_rank, path)

