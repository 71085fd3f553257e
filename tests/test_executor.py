"""The executor's wiring over fake process hooks: histories in milliseconds, no real children.

The fake ranks are real in the one place that matters: they report on the ready channel the
executor hands them (real socketpairs, real memfds as slabs), so escrow, adoption and release
go through the real frames. Real processes are in test_launcher.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.launch import EngineEnv, RankArgs
from vlaunch.cache.contract.notify import parse_fields
from vlaunch.launcher.core import events
from vlaunch.launcher.executor import Executor
from vlaunch.launcher.probes import HttpProbe
from vlaunch.launcher.spec import RunSpec

from .conftest import eventually


class FakeChild:
    """A child whose exit the test (or a signal) decides."""

    def __init__(self, pid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pid = pid
        self.exited: asyncio.Future[int] = loop.create_future()

    def exit(self, status: int) -> None:
        if not self.exited.done():
            self.exited.set_result(status)

    async def wait(self) -> int:
        return await self.exited


class FakeHooks:
    """Scripted process operations: ranks report ready on their channel with one memfd slab."""

    def __init__(self, *, rank_ready: bool = True, missing: Sequence[str] = (),
                 engine_exits: Sequence[int] = (), stubborn: bool = False) -> None:
        self.rank_ready = rank_ready
        self.missing = set(missing)
        self.engine_exits = list(engine_exits)  # successive engines exit at once with these
        self.stubborn = stubborn  # engines ignore SIGTERM
        self.engines: list[int] = []
        self.children: dict[int, FakeChild] = {}
        self.spawned: list[tuple[list[str], dict[str, str]]] = []
        self.signals: list[tuple[int, int]] = []
        self.channels: dict[int, socket.socket] = {}  # rank -> its end of the ready channel
        self.adopted: dict[int, tuple[dict[str, Any], list[int]]] = {}
        self.slabs: dict[int, int] = {}  # rank -> its memfd (the rank's own copy)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.probes: list[Any] = []  # every HTTP probe sent, in order
        self.probe_failures: list[str] = []  # how the next probes fail ("": they pass)
        self.settled: list[int] = []  # kept children whose process group was waited for
        self._next = 1000

    def prepare(self, post: Any) -> None:
        self.loop = asyncio.get_running_loop()

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str],
                    pass_fds: Sequence[int] = (), kept: bool = False) -> FakeChild:
        if argv[0] in self.missing:
            raise FileNotFoundError(2, "No such file or directory", argv[0])
        assert self.loop is not None
        self._next += 1
        child = self.children[self._next] = FakeChild(self._next, self.loop)
        self.spawned.append((list(argv), dict(env)))
        if argv[1:3] == ["-m", "vlaunch.cache"]:
            self._rank(RankArgs.parse(argv[3:]), child)
        else:
            self.engines.append(child.pid)
            if self.engine_exits:
                self.loop.call_soon(child.exit, self.engine_exits.pop(0))
        return child

    def _rank(self, args: RankArgs, child: FakeChild) -> None:
        """Take the rank's channels (the executor closes its copies once spawn returns); it
        adopts and reports right after, as a real rank would."""
        channel = socket.socket(fileno=os.dup(args.ready_fd))
        self.channels[args.rank] = channel
        adopt = socket.socket(fileno=os.dup(args.adopt_fd)) if args.adopt_fd >= 0 else None
        assert self.loop is not None
        self.loop.call_soon(self._run_rank, args.rank, child, channel, adopt)

    def _run_rank(self, rank: int, child: FakeChild, channel: socket.socket,
                  adopt: socket.socket | None) -> None:
        if adopt is not None:
            with adopt:
                self.adopted[rank] = wire.recv_frame(adopt)
        if self.rank_ready:
            fd = self.slabs[rank] = os.memfd_create("vlaunch-test-slab")
            os.ftruncate(fd, 4096)
            wire.send_frame(channel, protocol.event(
                "ready", rank=rank, pid=child.pid, socket="/x", at=0.0, bytes=4096,
                device="cpu", manifest={"slab_sizes": [4096]}, fingerprint={"backend": "cpu"}),
                [fd])

    def signal(self, pid: int, sig: int) -> None:
        self.signals.append((pid, sig))
        if self.stubborn and sig == signal.SIGTERM and pid in self.engines:
            return
        if sig in (signal.SIGTERM, signal.SIGKILL) and pid in self.children:
            self.children[pid].exit(-sig)

    def signal_command(self, pid: int, sig: int) -> None:
        self.signal(pid, sig)  # the fake child is its command

    def sweep(self, pids: Any) -> list[str]:
        return []

    async def settle(self, pid: int) -> None:
        self.settled.append(pid)

    def reap_orphans(self, pids: Any) -> None:
        list(pids)

    async def http_probe(self, probe: Any) -> str:
        self.probes.append(probe)
        return self.probe_failures.pop(0) if self.probe_failures else ""

    async def rank_status(self, path: Path) -> dict[str, Any]:
        raise OSError("the fake ranks answer no status")

    def close(self) -> None:
        for sock in self.channels.values():
            sock.close()
        for fd in self.slabs.values():
            os.close(fd)


class Running:
    """An executor on its own loop in a thread; the test drives it from outside."""

    def __init__(self, spec: RunSpec, hooks: FakeHooks, env: dict[str, str]) -> None:
        self.executor = Executor(spec, env=env, hooks=hooks)
        self.hooks = hooks
        self.status: int | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.status = self.loop.run_until_complete(self.executor.run())

    def post(self, event: events.Event) -> None:
        self.loop.call_soon_threadsafe(self.executor.post, event)

    def exit(self, pid: int, status: int) -> None:
        self.loop.call_soon_threadsafe(self.hooks.children[pid].exit, status)

    def wait(self) -> int:
        self.thread.join(10)
        assert not self.thread.is_alive(), "the executor did not finish"
        assert self.status is not None
        return self.status

    def pid(self, role: str) -> int:
        core = self.executor.core
        pid = core.engine.pid if role == "engine" else core.ranks[int(role)].pid
        assert pid is not None
        return pid


@pytest.fixture
def notify(notify_reader: socket.socket) -> socket.socket:
    return notify_reader


@pytest.fixture
def start(tmp_path: Path, notify: socket.socket) -> Iterator[Any]:
    runs: list[Running] = []

    def start(engine: tuple[str, ...] = ("engine-cmd",), hooks: FakeHooks | None = None,
              liveness: HttpProbe | None = None, **config: Any) -> Running:
        ranks = (0, 1)
        spec = RunSpec(model="/models/m", socket_dir=tmp_path / "s", ranks=ranks,
                       devices=dict.fromkeys(ranks, "cpu"), tensor_parallel_size=2,
                       plan="replicate",
                       engine=engine, health_port=None, liveness=liveness,
                       liveness_interval=0.02,
                       supervisor=events.SupervisorConfig(ranks=ranks, has_engine=bool(engine),
                                                          backoff_initial=0.0, **config))
        run = Running(spec, hooks or FakeHooks(), {"NOTIFY_SOCKET": notify.getsockname(),
                                                   "WATCHDOG_USEC": "30000000"})
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.thread.is_alive():
            run.post(events.SignalReceived(signal.SIGTERM, 0.0))
            run.post(events.SignalReceived(signal.SIGTERM, 0.0))
            run.thread.join(10)
        run.hooks.close()


def notified(sock: socket.socket) -> list[dict[str, str]]:
    out = []
    while True:
        try:
            out.append(parse_fields(sock.recv(4096)))
        except BlockingIOError:
            return out


def memfd_inodes(fd: int) -> set[int]:
    """Fds of this process open on the same memfd as `fd` (other than `fd` itself)."""
    ino = os.fstat(fd).st_ino
    out = set()
    for name in os.listdir("/proc/self/fd"):
        if int(name) != fd:
            try:
                if os.stat(f"/proc/self/fd/{name}").st_ino == ino and \
                        "memfd:" in os.readlink(f"/proc/self/fd/{name}"):
                    out.add(int(name))
            except OSError:
                pass
    return out


def test_every_action_has_a_handler() -> None:
    spec = RunSpec(model="m", socket_dir=Path("/nonexistent"), ranks=(0,), devices={0: "cpu"},
                   supervisor=events.SupervisorConfig(ranks=(0,), has_engine=False))
    handlers = Executor(spec, env={}, hooks=FakeHooks()).handlers
    assert set(handlers) == set(typing.get_args(events.Action))


def test_ranks_and_engine_are_told_the_contract_and_sigterm_stops_all(
        start: Any, notify: socket.socket) -> None:
    run = start()
    eventually(lambda: run.executor.core.engine.state.value == "ready", 10, what="engine ready")
    cache_cmds = [argv for argv, _ in run.hooks.spawned if argv[1:3] == ["-m", "vlaunch.cache"]]
    args = sorted((RankArgs.parse(argv[3:]) for argv in cache_cmds), key=lambda a: a.rank)
    assert [(a.rank, a.tensor_parallel_size, a.plan, a.model) for a in args] == \
        [(0, 2, "replicate", "/models/m"), (1, 2, "replicate", "/models/m")]
    argv, env = run.hooks.spawned[-1]
    assert argv == ["engine-cmd"]
    assert EngineEnv.from_env(env) == run.executor.spec.engine_env(1, {})
    assert "NOTIFY_SOCKET" not in env  # systemd's socket is the launcher's alone
    assert "WATCHDOG_USEC" not in env  # and so is systemd's watchdog
    assert run.executor.escrow.fd_count() == 2
    run.post(events.SignalReceived(signal.SIGTERM, 0.0))
    assert run.wait() == 0
    engine_pid = run.hooks.signals[0][0]
    assert run.hooks.signals[0] == (engine_pid, signal.SIGTERM)
    assert run.executor.escrow.fd_count() == 0
    messages = notified(notify)
    assert {"READY": "1", "STATUS": "serving"} in messages
    assert any(m.get("STOPPING") == "1" for m in messages)


def test_a_release_frame_closes_the_escrowed_fds(start: Any) -> None:
    run = start(engine=())
    eventually(lambda: run.executor.core.caches_ready, 10, what="caches ready")
    slab = run.hooks.slabs[0]
    assert memfd_inodes(slab), "the launcher escrows a duplicate of the rank's slab"
    wire.send_frame(run.hooks.channels[0], protocol.event("release", layout="raw"))
    eventually(lambda: not memfd_inodes(slab), 10, what="escrowed duplicate closed")
    assert run.executor.rank_detail[0]["bytes_held"] == {"cpu": 0}
    assert 0 not in run.executor.escrow and 1 in run.executor.escrow


def test_a_respawned_rank_adopts_the_escrow(start: Any) -> None:
    run = start(on_rank_exit="respawn")
    eventually(lambda: run.executor.core.engine.state.value == "ready", 10, what="serving")
    victim = run.pid("1")
    run.exit(victim, -9)
    eventually(lambda: 1 in run.hooks.adopted, 10, what="adoption")
    frame, fds = run.hooks.adopted[1]
    assert frame["event"] == "escrow" and len(fds) == 1
    assert os.fstat(fds[0]).st_size == 4096  # the very slab, from the launcher's escrow
    for fd in fds:
        os.close(fd)
    eventually(lambda: run.executor.core.ranks[1].state.value == "ready", 10, what="ready")
    assert run.executor.core.engine.state.value == "ready"


def test_a_rank_that_released_respawns_from_the_disk(start: Any) -> None:
    run = start(on_rank_exit="respawn")
    eventually(lambda: run.executor.core.caches_ready, 10, what="caches ready")
    wire.send_frame(run.hooks.channels[0], protocol.event("release", layout="raw"))
    eventually(lambda: 0 not in run.executor.escrow, 10, what="escrow released")
    spawned = len(run.hooks.spawned)
    run.exit(run.pid("0"), -9)
    eventually(lambda: len(run.hooks.spawned) > spawned, 10, what="respawn")
    assert RankArgs.parse(run.hooks.spawned[-1][0][3:]).adopt_fd == -1
    assert 0 not in run.hooks.adopted


def test_a_bad_report_kills_the_rank(start: Any) -> None:
    hooks = FakeHooks(rank_ready=False)
    run = start(hooks=hooks)
    eventually(lambda: 0 in hooks.channels and 1 in hooks.channels, 10, what="spawned")
    wire.send_frame(hooks.channels[0], {"event": "ready", "rank": "zero"})
    assert run.wait() == 68  # killed before ready: its start failed


def test_an_engine_that_cannot_start_is_a_configuration_error(start: Any) -> None:
    run = start(hooks=FakeHooks(missing=["engine-cmd"]),
                engine_config_error_statuses=frozenset({127}))
    assert run.wait() == 81


def engine_ready(run: Running) -> bool:
    engine = run.executor.core.engine
    return engine is not None and engine.state.value == "ready"


def test_an_engine_crash_is_restarted_against_the_same_caches(start: Any,
                                                              notify: socket.socket) -> None:
    run = start(hooks=FakeHooks(engine_exits=[3]))
    eventually(lambda: engine_ready(run) and run.executor.core.engine.restarts == 1, 10,
               what="the engine restarted and ready")
    assert run.executor.core.engine.last_exit == 3
    assert len(run.hooks.spawned) == 4  # two ranks, two engines: the caches stayed
    run.post(events.SignalReceived(signal.SIGTERM, 0.0))
    assert run.wait() == 0
    assert [m for m in notified(notify) if m.get("READY") == "1"]


def test_an_exhausted_restart_budget_exits_80(start: Any) -> None:
    run = start(hooks=FakeHooks(engine_exits=[1, 1, 1]), restart_max=2)
    assert run.wait() == 80
    assert len(run.hooks.engines) == 3


def test_an_engine_configuration_error_exits_81(start: Any) -> None:
    run = start(hooks=FakeHooks(engine_exits=[78]))
    assert run.wait() == 81
    assert len(run.hooks.engines) == 1  # not restarted


def test_a_stop_that_times_out_kills_everything_and_exits_82(start: Any) -> None:
    run = start(hooks=FakeHooks(stubborn=True), stop_timeout=0.3)
    eventually(lambda: engine_ready(run), 10, what="serving")
    engine = run.pid("engine")
    run.post(events.SignalReceived(signal.SIGTERM, 0.0))
    assert run.wait() == 82
    assert (engine, signal.SIGTERM) in run.hooks.signals
    assert (engine, signal.SIGKILL) in run.hooks.signals


def test_sighup_restarts_the_engine_with_reloading(start: Any, notify: socket.socket) -> None:
    run = start()
    eventually(lambda: engine_ready(run), 10, what="serving")
    first = run.pid("engine")
    run.post(events.SignalReceived(signal.SIGHUP, 0.0))
    eventually(lambda: engine_ready(run) and run.pid("engine") != first, 10,
               what="a new engine ready")
    assert any(m.get("RELOADING") == "1" for m in notified(notify))
    run.post(events.SignalReceived(signal.SIGINT, 0.0))
    assert run.wait() == 0


def test_a_signal_repeated_within_the_coalescing_window_is_posted_once() -> None:
    from vlaunch.launcher.hooks import COALESCE_S, Coalesced

    now = [100.0]
    posted: list[events.Event] = []
    deliver = Coalesced(posted.append, clock=lambda: now[0])
    deliver(signal.SIGHUP)
    deliver(signal.SIGTERM)
    deliver(signal.SIGTERM)  # uvloop's double dispatch: same tick
    now[0] += 2 * COALESCE_S
    deliver(signal.SIGTERM)  # a real second SIGTERM
    assert [e.sig for e in posted] == [signal.SIGHUP, signal.SIGTERM, signal.SIGTERM]


UVLOOP_DOUBLE = r"""
import asyncio, os, signal, subprocess, uvloop
from vlaunch.launcher.hooks import Coalesced
async def main():
    loop = asyncio.get_running_loop()
    got = []
    deliver = Coalesced(lambda e: got.append(signal.Signals(e.sig).name))
    for s in (signal.SIGHUP, signal.SIGTERM):
        loop.add_signal_handler(s, deliver, s)
    inner = signal.getsignal(signal.SIGHUP)
    def hup(signum, frame):  # SIGTERM lands while the loop handles SIGHUP
        inner(signum, frame)
        os.kill(os.getpid(), signal.SIGTERM)
    signal.signal(signal.SIGHUP, hup)
    # from outside, while the loop waits in epoll
    subprocess.Popen(["sh", "-c", f"sleep 0.05; kill -HUP {os.getpid()}"])
    for _ in range(3000):  # both signals handled (30 s at most on a loaded machine)
        if len(got) >= 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # a duplicate comes in the same loop turn; leave it time
    print(got)
uvloop.run(main())
"""


def test_uvloops_double_dispatch_of_a_signal_reaches_the_core_once() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", UVLOOP_DOUBLE], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "['SIGHUP', 'SIGTERM']"


def test_the_orphan_sweep_leaves_a_child_that_exits_during_its_spawn_to_asyncio(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank killed right after its fork is a zombie before the spawn returns; the sweep for
    re-parented orphans runs then (another task) and again before the caller knows the pid.
    Its exit must still reach asyncio, or the launcher waits for it forever (seen under load:
    a SIGKILLed loading rank hung the launcher)."""
    import asyncio
    import os
    import sys
    import time

    import psutil
    import uvloop

    from vlaunch.launcher import hooks as hooks_mod

    real = asyncio.create_subprocess_exec
    os_hooks = hooks_mod.OsHooks()

    async def spawn_then_sweep(*args, **kwargs):  # type: ignore[no-untyped-def]
        proc = await real(*args, **kwargs)
        # the child exits before the loop runs again (so before asyncio could reap it) ...
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.005)
        os_hooks.reap_orphans([])  # ... and the sweep runs while this spawn is in flight
        return proc

    monkeypatch.setattr(hooks_mod.asyncio, "create_subprocess_exec", spawn_then_sweep)

    async def main() -> int:
        child = await os_hooks.spawn([sys.executable, "-c", "pass"], os.environ)
        os_hooks.reap_orphans([])  # spawned, not yet registered by the caller
        return await asyncio.wait_for(child.wait(), 10)

    assert uvloop.run(main()) == 0


def test_the_engine_gets_a_watchdog_and_an_engine_that_stops_pinging_is_restarted(
        start: Any) -> None:
    run = start(engine_watchdog=0.3, unhealthy_after=0.3)
    eventually(lambda: run.executor.core.engine.state.value == "ready", 10, what="ready")
    _, env = run.hooks.spawned[-1]
    assert env["WATCHDOG_USEC"] == "300000"
    assert env["NOTIFY_SOCKET"] == str(run.executor.engine_notify.path)  # ours, not systemd's
    first = run.pid("engine")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ping:
        for _ in range(10):  # 1 s of pings every 0.1 s: never hung
            ping.sendto(b"WATCHDOG=1", env["NOTIFY_SOCKET"])
            threading.Event().wait(0.1)
        assert run.executor.core.engine.pid == first and not run.executor.core.engine.hangs
    eventually(lambda: (first, signal.SIGTERM) in run.hooks.signals, 10, what="SIGTERM")
    eventually(lambda: run.executor.core.engine.attempt == 2, 10, what="the restart")
    assert run.executor.core.engine.hangs == 1
    assert run.hooks.settled == [first]  # its process group was gone before the restart


def test_a_liveness_request_that_fails_gets_the_engine_restarted(start: Any) -> None:
    hooks = FakeHooks()
    hooks.probe_failures = ["timed out after 1 s"] * 1000
    probe = HttpProbe("POST", "http://127.0.0.1:1/v1/completions", b"{}", 1.0)
    run = start(hooks=hooks, liveness=probe, unhealthy_after=0.2)
    eventually(lambda: run.executor.core.engine.state.value == "ready", 10, what="ready")
    first = run.pid("engine")
    eventually(lambda: (first, signal.SIGTERM) in hooks.signals, 10, what="SIGTERM")
    assert hooks.probes[0] is probe
    assert run.executor.engine_notify is None  # no watchdog, readiness none: no socket
    eventually(lambda: run.executor.core.engine.attempt == 2, 10, what="the restart")
