"""The asyncio layer: feeds the supervisor's core with events and executes its actions.

Wiring only. Every decision is in `core`; every process operation goes through `hooks`
(`OsHooks` for real, a fake in the tests); the escrow and the status view are their own
modules. Child exits, ready reports, signals and ticks all become events on one queue,
handled one at a time, so the core sees a single ordered history. Each action type has one
handler in `Executor.handlers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import RankLock, ensure_socket_dir

from . import core, statusview
from .children import child_env
from .core import events
from .escrow import Escrow
from .health import HealthServer
from .hooks import Child, OsHooks, ProcessHooks
from .inflight import held_connections, tcp_ports
from .keeper import NAMES_ENV, PASS_ENV
from .listen import Listeners
from .memory import MEMORY_EVERY, Key, MemorySampler
from .notify import EngineNotifySocket, Notifier
from .probes import HttpProbe
from .progress import LoadDisplay, recv_ready
from .spec import RunSpec
from .standby import StandbyChannel
from .swapper import Swapper

__all__ = ["Executor", "RunSpec", "run"]

log = logging.getLogger("vlaunch.launcher")
TICK = 0.1
STATUS_EVERY = 2.0
HELD_EVERY = 0.5
PROBE_EVERY = 1.0
CHANNEL_DRAIN = 5.0
"""Seconds an exited rank's report channel may take to be read to its end (what it reported
before it died: artifacts, layouts, releases) before the core hears of the exit."""


@dataclass
class _Running:
    """A child the executor started, by role."""

    child: Child
    role: events.Role
    rank: int | None
    exited: bool = False
    channel: asyncio.Future[None] | None = None  # a rank's report reader, until its EOF


class Executor:
    """Runs a `RunSpec` until the core says exit; returns the exit status."""

    def __init__(self, spec: RunSpec, env: Mapping[str, str] | None = None,
                 hooks: ProcessHooks | None = None, listeners: Listeners | None = None) -> None:
        self.spec = spec
        self.listeners = listeners  # the engine's sockets (--listen): every engine gets them
        self._ports = tcp_ports(listeners) if listeners else {}
        self.draining: dict[int, _Running] = {}  # engines retired for their standby, by pid
        self.held: dict[int, int] = {}  # accepted connections each engine held, last sampled
        self.lost = 0  # connections engines held when they died (their requests failed)
        self.env = dict(os.environ if env is None else env)
        self.hooks: ProcessHooks = hooks or OsHooks()
        assert spec.supervisor is not None
        self.core = core.Supervisor(spec.supervisor)
        self.notifier = Notifier(self.env)
        self.queue: asyncio.Queue[events.Event] = asyncio.Queue()
        self.ranks: dict[int, _Running] = {}
        self.engine: _Running | None = None
        self.preload: _Running | None = None
        self.escrow = Escrow()
        self.rank_detail: dict[int, dict[str, Any]] = {}  # each rank's own last report
        self.engine_devices: dict[int, str] = {}
        self.health: HealthServer | None = None
        self.engine_notify: EngineNotifySocket | None = None
        self.standby: _Running | None = None
        self.standby_channel: StandbyChannel | None = None  # the standby not yet promoted
        self.engine_channel: StandbyChannel | None = None  # the promoted standby's, now engine's
        self.directory = spec.socket_dir
        self.memory: dict[str, Any] | None = None  # the children's last memory sample
        self.sampler = MemorySampler(any(d.startswith("cuda") for d in spec.devices.values()))
        # a thread of its own: the default pool's threads block in the ranks' channels
        self._memory_pool = ThreadPoolExecutor(1, thread_name_prefix="vlaunch-memory")
        self.display = LoadDisplay()
        self.swapper = Swapper(self)  # swaps: the control socket, the ranks' swap steps
        self._tasks: set[asyncio.Task[Any]] = set()
        self.handlers: dict[type, Callable[[Any], Awaitable[None]]] = {
            events.SpawnCache: self._spawn_cache, events.SpawnEngine: self._spawn_engine,
            events.SignalChild: self._signal_child, events.KillAll: self._kill_all,
            events.RunPreload: self._start_preload, events.Notify: self._notify,
            events.Log: self._log, events.Exit: self._exit,
            events.SpawnStandby: self._spawn_standby, events.PromoteStandby: self._promote_standby,
            events.SwapRanks: self.swapper.send, events.SwapReply: self.swapper.reply,
            events.RetireEngine: self._retire_engine, events.SignalDraining: self._signal_draining,
        }
        self._channel_handlers: dict[str, Callable[[int, dict[str, Any], list[int]], None]] = {
            "ready": self._rank_ready, "layout": self._rank_layout,
            "release": self._rank_release, "artifact": self._rank_artifact,
            "openers": self._rank_openers, "hello": self._rank_hello,
            "swap_answer": self.swapper.on_answer,
        }

    # ----------------------------------------------------------------------- main loop

    async def run(self) -> int:
        """Start everything, handle events until Exit, sweep, return the status."""
        self.hooks.prepare(self.post)
        directory = self.directory = ensure_socket_dir(self.spec.socket_dir)
        self._start_surfaces(directory, asyncio.get_running_loop())
        self.post(events.Started(0.0))
        self._spawn_task(self.swapper.serve(directory))
        self._spawn_task(self._ticker())
        self._spawn_task(self._poll_ranks())
        self._spawn_task(self._poll_memory())
        if self.listeners is not None:
            self._spawn_task(self._poll_held())
        status = int(ExitStatus.INTERNAL)
        try:
            status = await self._loop()
        finally:
            await self._shutdown(directory)
        return status

    def _start_surfaces(self, directory: Path, loop: asyncio.AbstractEventLoop) -> None:
        config = self.spec.supervisor
        if config and (config.engine_readiness == "notify" or config.engine_watchdog):
            self.engine_notify = EngineNotifySocket(directory)
            loop.add_reader(self.engine_notify.sock.fileno(), self._engine_notified)
        if self.spec.health_port is not None:
            self.health = HealthServer(self.spec.health_host, self.spec.health_port)
            self.health.start()
            url = f"http://{self.spec.health_host}:{self.health.port}"
            log.info("health and status on %s (/livez /startupz /readyz /status /metrics)", url)
            (directory / "launcher.json").write_text(json.dumps({"pid": os.getpid(),
                                                                 "url": url}))
        self._publish()

    async def _loop(self) -> int:
        while True:
            event = replace(await self.queue.get(), now=time.monotonic())
            for action in self.core.handle(event):
                await self.handlers[type(action)](action)
                if isinstance(action, events.Exit):
                    return action.status
            self._publish()

    def post(self, event: events.Event) -> None:
        """Queue an event for the core (its `now` is stamped when it is taken)."""
        self.queue.put_nowait(event)

    def _spawn_task(self, coro: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            self.post(events.Tick(0.0))

    # ------------------------------------------------------------------------ actions

    async def _signal_child(self, action: events.SignalChild) -> None:
        """Signal the engine's or a rank's process group."""
        running = {"engine": self.engine, "standby": self.standby}.get(
            action.role, self.ranks.get(action.rank or 0))
        if running is not None:
            if action.sig == signal.SIGKILL and action.role != "cache":
                self._sample_held(running)  # what the kill takes, counted at its exit
            if action.command_only:
                self.hooks.signal_command(running.child.pid, action.sig)
            else:
                self.hooks.signal(running.child.pid, action.sig)

    async def _retire_engine(self, action: events.RetireEngine) -> None:
        """The engine gives way to its standby: it drains now (its exit is a draining one)."""
        running = self.engine
        if running is not None and running.child.pid == action.pid:
            self.engine = None
            running.role = "draining"
            self.draining[action.pid] = running
            self._drop_channel("engine_channel")

    async def _signal_draining(self, action: events.SignalDraining) -> None:
        """SIGTERM a draining engine's command, SIGKILL its process group."""
        running = self.draining.get(action.pid)
        if running is not None and not running.exited:
            if action.sig == signal.SIGKILL:
                self._sample_held(running)
                self.hooks.signal(action.pid, action.sig)
            else:
                self.hooks.signal_command(action.pid, action.sig)

    async def _kill_all(self, action: events.KillAll) -> None:
        """SIGKILL every child's process group."""
        for running in self._children():
            self.hooks.signal(running.child.pid, signal.SIGKILL)

    async def _notify(self, action: events.Notify) -> None:
        """One sd_notify message to systemd (never blocks)."""
        self.notifier.send(action.fields)

    async def _log(self, action: events.Log) -> None:
        """One log line at the core's level."""
        log.log(logging.getLevelName(action.level), "%s", action.message)

    async def _exit(self, action: events.Exit) -> None:
        """The last action: publish the final status (the loop returns it)."""
        self._publish()

    def _children(self) -> list[_Running]:
        return [*self.ranks.values(), *([self.engine] if self.engine else []),
                *([self.preload] if self.preload else []),
                *([self.standby] if self.standby else []), *self.draining.values()]

    async def _spawn(self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...],
                     role: events.Role, rank: int | None) -> _Running | None:
        """Start a child and watch for its exit; a failed start is its exit (126/127). An
        engine or a standby runs under a keeper (keeper.py); a cache rank is one process."""
        try:
            child = await self.hooks.spawn(argv, env, pass_fds, kept=role != "cache")
        except OSError as exc:
            log.error("cannot start %s: %s; check the command and PATH", argv[0], exc)
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            self.post(events.ChildExited(role, rank, 0, code, 0.0))
            return None
        running = _Running(child, role, rank)
        self.post(events.Spawned(role, rank, child.pid, 0.0))
        self._spawn_task(self._reap(running))
        return running

    async def _reap(self, running: _Running) -> None:
        status = await running.child.wait()
        running.exited = True
        held = self.held.pop(running.child.pid, 0)
        if status != 0 and held:  # a clean exit answered what it held (it drained)
            self.lost += held
            log.warning("engine (pid %d) exited holding %d connection(s) of the launcher's "
                        "socket: their requests are lost", running.child.pid, held)
        self.hooks.signal(running.child.pid, signal.SIGKILL)  # no orphaned workers
        if running.role != "cache":  # the keeper is gone; what ran under it must be too
            await self.hooks.settle(running.child.pid)
        self.draining.pop(running.child.pid, None)
        if running.role == "cache" and running.rank is not None:
            _clear_stale(self.spec, running.rank)
            if running.channel is not None:  # what it sent before it died, escrowed first
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(running.channel), CHANNEL_DRAIN)
        self.post(events.ChildExited(running.role, running.rank, running.child.pid, status,
                                     0.0))

    async def _spawn_cache(self, action: events.SpawnCache) -> None:
        """Start a rank; with `adopt`, hand it the escrowed slabs instead of the disk."""
        rank = action.rank
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno()]
        adopt_ours = adopt_theirs = None
        if action.adopt and rank in self.escrow:
            adopt_ours, adopt_theirs = socket.socketpair()
            fds.append(adopt_theirs.fileno())
        args = self.spec.rank_args(rank, theirs.fileno(),
                                   adopt_theirs.fileno() if adopt_theirs else -1)
        # the token travels in the environment, never on a command line that ps shows
        env = child_env(self.env, args.secret_env(), None)
        running = await self._spawn([sys.executable, "-m", "vlaunch.cache", *args.to_argv()],
                                    env, tuple(fds), "cache", rank)
        theirs.close()
        if adopt_theirs is not None:
            adopt_theirs.close()
        if running is None:
            ours.close()
            if adopt_ours is not None:
                adopt_ours.close()
            return
        self.ranks[rank] = running
        if adopt_ours is not None:
            with adopt_ours:
                self.escrow.hand_over(rank, adopt_ours)
        running.channel = self._spawn_task(self._rank_channel(ours, running))

    async def _rank_channel(self, sock: socket.socket, running: _Running) -> None:
        """Read a rank's reports until it exits: ready, then engine layouts and releases."""
        loop = asyncio.get_running_loop()
        rank = running.rank
        assert rank is not None

        def progress(loaded: int, total: int) -> None:  # a loading rank's bytes (reader thread)
            loop.call_soon_threadsafe(self.post, events.CacheProgress(rank, loaded, total, 0.0))

        expect: tuple[str, ...] = ("ready",)
        self.swapper.channels[rank] = sock  # the launcher's swap steps go the other way
        with sock:
            while True:
                try:
                    msg, fds = await loop.run_in_executor(None, recv_ready, sock, progress)
                except (EOFError, ConnectionError):
                    return  # it exited: its ChildExited tells the core
                except (OSError, VlaunchError) as exc:
                    self._bad_report(running, str(exc))
                    return
                try:
                    protocol.validate_event(msg, *expect)
                except VlaunchError as exc:
                    wire.close_fds(fds)
                    self._bad_report(running, str(exc))
                    return
                self._channel_handlers[msg["event"]](rank, msg, fds)
                expect = ("layout", "release", "artifact", "swap_answer", "openers", "hello")

    def _bad_report(self, running: _Running, why: str) -> None:
        log.error("cache rank %s sent a bad report (%s): killing it", running.rank, why)
        self.hooks.signal(running.child.pid, signal.SIGKILL)

    def _rank_ready(self, rank: int, ready: dict[str, Any], fds: list[int]) -> None:
        """Escrow the slab fds (no CUDA context needed) and tell the core."""
        self.escrow.keep(rank, ready, fds)
        self.swapper.on_ready(rank, ready)
        self.rank_detail[rank] = {"bytes_held": {ready["device"]: ready["bytes"]}}
        uuid = str(ready["fingerprint"].get("device_uuid", ""))
        if uuid.startswith("GPU-"):  # the engine pairs its ranks with these GPUs by UUID
            self.engine_devices[rank] = f"cuda:{uuid}"
        self.post(events.CacheReady(rank, 0.0))

    def _rank_layout(self, rank: int, frame: dict[str, Any], fds: list[int]) -> None:
        """The rank adopted an engine layout: escrow its fds too."""
        self.escrow.keep_layout(rank, frame, fds)

    def _rank_artifact(self, rank: int, msg: dict[str, Any], fds: list[int]) -> None:
        """The rank holds an artifact: escrow it, so that a respawn gets it back."""
        wire.close_fds(fds)
        self.escrow.keep_artifact(rank, msg)

    def _rank_hello(self, rank: int, msg: dict[str, Any], fds: list[int]) -> None:
        """A client's hello and the rank's answer: the core hears it when the client is one
        of the engine's or the standby's processes (whether it maps its weights from the
        caches)."""
        wire.close_fds(fds)
        owner = self._engine_process(msg["pid"])
        if owner is not None:
            self.post(events.EngineWeights(rank, owner, msg["ok"], msg["why"], 0.0))

    def _engine_process(self, pid: int) -> int | None:
        """The pid of the engine or standby (as started: its keeper) that `pid` is, or runs
        under; None for any other process."""
        import psutil

        ours = {r.child.pid for r in (self.engine, self.standby) if r is not None}
        try:
            chain = [pid, *(p.pid for p in psutil.Process(pid).parents())]
        except psutil.Error:
            return None
        return next((p for p in chain if p in ours), None)

    def _rank_openers(self, rank: int, msg: dict[str, Any], fds: list[int]) -> None:
        """Who opened the rank's slabs (or that not all can be named): a respawn is told."""
        wire.close_fds(fds)
        self.escrow.keep_opener(rank, msg)

    def _rank_release(self, rank: int, msg: dict[str, Any], fds: list[int]) -> None:
        """The rank dropped its raw copy (copy-release, or an engine layout replaced it): drop
        our duplicates, or the memory stays allocated."""
        wire.close_fds(fds)
        if msg["layout"] != "raw":
            return
        closed = self.escrow.release_raw(rank)
        detail = self.rank_detail.get(rank, {})
        self.rank_detail[rank] = {**detail, "bytes_held": dict.fromkeys(
            detail.get("bytes_held", {}), 0)}
        log.info("cache rank %d released its checkpoint slabs: closed %d escrowed fd(s)%s",
                 rank, closed, "" if rank in self.escrow else "; a respawn reads the disk")
        self._publish()

    async def _spawn_engine(self, action: events.SpawnEngine) -> None:
        """Start the engine command with the contract's environment."""
        notify = str(self.engine_notify.path) if self.engine_notify else None
        env = child_env(self.env, {**self._engine_env(action.attempt), **self._listen_env()},
                        notify)
        self.engine = await self._spawn(list(self.spec.engine), env, self._listen_fds(),
                                        "engine", None)
        self._watch_engine()

    async def _spawn_standby(self, action: events.SpawnStandby) -> None:
        """Start the engine command as a standby, with its promote fd and notify socket."""
        self._drop_channel("standby_channel")
        channel = self.standby_channel = StandbyChannel(self.directory, action.number)
        asyncio.get_running_loop().add_reader(channel.notify.sock.fileno(),
                                              self._standby_notified, channel)
        engine = self.core.engine
        attempt = (engine.attempt if engine else 0) + 1
        env = child_env(self.env, {**self._engine_env(attempt),
                                   **self.swapper.engine_env(action.next_weights),
                                   **channel.env(), **self._listen_env()},
                        str(channel.notify.path))
        try:
            self.standby = await self._spawn(list(self.spec.engine), env,
                                             (channel.read_fd, *self._listen_fds()), "standby",
                                             None)
        finally:
            channel.spawned()

    async def _promote_standby(self, action: events.PromoteStandby) -> None:
        """The parked standby becomes the engine: write PROMOTE on its pipe."""
        channel, self.standby_channel = self.standby_channel, None
        self._drop_channel("engine_channel")
        self.engine_channel = channel
        self.engine, self.standby = self.standby, None
        if channel is not None:
            channel.promote()
        self._watch_engine()

    def _standby_notified(self, channel: StandbyChannel) -> None:
        """PARKED=1 and WATCHDOG=1 from the standby; READY=1 (readiness notify) and WATCHDOG=1
        from a promoted standby."""
        parked, ready, watchdog = channel.read()
        if channel is self.standby_channel:
            if parked:
                self.post(events.StandbyParked(0.0))
            if watchdog:
                self.post(events.EngineWatchdog("standby", 0.0))
        elif channel is self.engine_channel:
            if ready and self.core.config.engine_readiness == "notify":
                self.post(events.EngineReady(0.0))
            if watchdog:
                self.post(events.EngineWatchdog("engine", 0.0))

    def _drop_channel(self, name: str) -> None:
        """Close a standby channel no longer needed (the standby exited or was replaced)."""
        channel = getattr(self, name)
        if channel is not None:
            asyncio.get_running_loop().remove_reader(channel.notify.sock.fileno())
            channel.close()
            setattr(self, name, None)

    def _listen_fds(self) -> tuple[int, ...]:
        """The engine's listening sockets, for pass_fds (none without --listen)."""
        return self.listeners.fds() if self.listeners else ()

    def _listen_env(self) -> dict[str, str]:
        """What tells the keeper to place them at fds 3.. with LISTEN_* (keeper.py)."""
        if not self.listeners:
            return {}
        return {PASS_ENV: ",".join(map(str, self.listeners.fds())),
                NAMES_ENV: ":".join(self.listeners.names)}

    def _engine_env(self, attempt: int, preload: bool = False) -> dict[str, str]:
        env = {**self.spec.engine_env(attempt, self.engine_devices, preload).to_env(),
               **self.swapper.engine_env()}
        watchdog = self.core.config.engine_watchdog
        if watchdog and not preload:  # sd_watchdog_enabled(3)'s variable, on our socket
            env["WATCHDOG_USEC"] = str(round(watchdog * 1_000_000))
        return env

    async def _start_preload(self, action: events.RunPreload) -> None:
        """Run the preload command in the background; it answers PreloadDone."""
        self._spawn_task(self._run_preload())

    async def _run_preload(self) -> None:
        """Run the preload command once (the engine's environment, no notify socket), bounded
        by its timeout; its outcome goes to the core as PreloadDone."""
        spec = self.spec
        env = child_env(self.env, self._engine_env(0, preload=True), None)
        try:
            child = await self.hooks.spawn(list(spec.preload), env, kept=True)
        except OSError as exc:
            self.post(events.PreloadDone(False, f"could not start: {exc}", 0.0))
            return
        self.preload = _Running(child, "engine", None)
        try:
            status = await asyncio.wait_for(child.wait(), spec.preload_timeout)
        except asyncio.TimeoutError:
            self.hooks.signal(child.pid, signal.SIGKILL)
            await child.wait()
            self.post(events.PreloadDone(False, f"ran past --preload-timeout "
                                               f"({spec.preload_timeout:g} s)", 0.0))
            return
        finally:
            self.hooks.signal(child.pid, signal.SIGKILL)  # nothing it started outlives it
            self.preload = None
        self.post(events.PreloadDone(status == 0, f"exited with status {status}", 0.0))

    # ---------------------------------------------------------------------- readiness

    def _engine_notified(self) -> None:
        """The engine's sd_notify: READY=1 (readiness notify) and WATCHDOG=1."""
        assert self.engine_notify is not None
        for fields in self.engine_notify.read():
            if fields.get("READY") == "1" and self.core.config.engine_readiness == "notify":
                self.post(events.EngineReady(0.0))
            if fields.get("WATCHDOG") == "1":
                self.post(events.EngineWatchdog("engine", 0.0))

    def _watch_engine(self) -> None:
        """Start the probes of the engine just spawned or promoted: its health URL, its
        liveness request."""
        if self.engine is None:
            return
        if self.core.config.engine_readiness == "http":
            self._spawn_task(self._probe_health(self.engine))
        if self.spec.liveness is not None:
            self._spawn_task(self._probe_liveness(self.engine, self.spec.liveness))

    def _alive(self, engine: _Running) -> bool:
        return self.engine is engine and not engine.exited

    async def _probe_health(self, engine: _Running) -> None:
        """Poll the engine's health URL while this engine process lives: its first 2xx is
        EngineReady, every later answer EngineHealth."""
        probe = HttpProbe("GET", self.spec.engine_health_url)
        while self._alive(engine):
            failed = await self.hooks.http_probe(probe)
            if self._alive(engine):
                self.post(events.EngineHealth(not failed, 0.0, "health", failed)
                          if self.core.engine_ready or failed else events.EngineReady(0.0))
            await asyncio.sleep(PROBE_EVERY)

    async def _probe_liveness(self, engine: _Running, probe: HttpProbe) -> None:
        """Send the liveness request every liveness_interval while this engine is ready."""
        while self._alive(engine):
            await asyncio.sleep(self.spec.liveness_interval)
            state = self.core.engine.state if self.core.engine else None
            if not self._alive(engine) or state is not core.EngineState.READY:
                continue
            failed = await self.hooks.http_probe(probe)
            if self._alive(engine):
                self.post(events.EngineHealth(not failed, 0.0, "liveness", failed))

    async def _poll_ranks(self) -> None:
        """Refresh each ready rank's own report (bytes, leases) for the status surface."""
        while True:
            self.hooks.reap_orphans(r.child.pid for r in self._children())
            for rank in list(self.ranks):
                if self.core.ranks[rank].state is core.RankState.READY:
                    path = self.spec.slot_socket(rank)
                    with contextlib.suppress(OSError, EOFError, VlaunchError):
                        self.rank_detail[rank] = await self.hooks.rank_status(path)
            await asyncio.sleep(STATUS_EVERY)

    async def _poll_held(self) -> None:
        """Sample the connections each engine holds on the launcher's sockets (inflight.py):
        what an engine that dies loses."""
        loop = asyncio.get_running_loop()
        while True:
            for running in [r for r in (self.engine, *self.draining.values()) if r]:
                if not running.exited:
                    pid = running.child.pid
                    self.held[pid] = await loop.run_in_executor(None, held_connections, pid,
                                                                self._ports)
            await asyncio.sleep(HELD_EVERY)

    def _sample_held(self, running: _Running) -> None:
        """Count what `running` holds now (before a SIGKILL)."""
        if self.listeners is not None and not running.exited:
            self.held[running.child.pid] = held_connections(running.child.pid, self._ports)

    async def _poll_memory(self) -> None:
        """Sample every child's host and device memory (memory.py) for the status surface."""
        loop = asyncio.get_running_loop()
        while True:
            if self.health is not None:
                self.memory = await loop.run_in_executor(self._memory_pool, self.sampler.sample,
                                                         self._memory_roots())
                self._publish()
            await asyncio.sleep(MEMORY_EVERY)

    def _memory_roots(self) -> dict[Key, int]:
        """The root pid of each live child whose memory /status reports."""
        roots: dict[Key, int] = {("cache", slot): r.child.pid for slot, r in self.ranks.items()
                                 if not r.exited}
        for role, running in (("engine", self.engine), ("standby", self.standby)):
            if running is not None and not running.exited:
                roots[(role, None)] = running.child.pid
        return roots

    # ------------------------------------------------------------------------- status

    def _publish(self) -> None:
        snapshot = self.core.snapshot()
        self.display.show(snapshot)
        if self.health is None:
            return
        status = statusview.merge(
            snapshot, socket_dir=self.spec.socket_dir, devices=self.spec.slot_devices,
            details=self.rank_detail, world=self.spec.world if self.spec.draft_group else 0,
            launcher={"pid": os.getpid(), "model": self.spec.model,
                      "engine_command": list(self.spec.engine),
                      **({"listen": self.listeners.describe()} if self.listeners else {})})
        if "drain" in status:
            status["drain"] = {**status["drain"], "lost_connections": self.lost}
        self.health.publish({**status, "memory": self.memory})

    # ----------------------------------------------------------------------- shutdown

    async def _shutdown(self, directory: Path) -> None:
        for task in list(self._tasks):
            task.cancel()
        killed = self.hooks.sweep(r.child.pid for r in self._children())
        if killed:
            log.warning("swept %d leftover process(es): %s", len(killed), killed)
        for rank in self.spec.slots:
            _clear_stale(self.spec, rank)
        self.swapper.close()
        self.escrow.close()
        if self.listeners is not None:
            self.listeners.close()
        self._memory_pool.shutdown(wait=False)
        self._drop_channel("standby_channel")
        self._drop_channel("engine_channel")
        self.notifier.close()
        if self.engine_notify:
            self.engine_notify.close()
        if self.health:
            self.health.close()
        with contextlib.suppress(FileNotFoundError):
            (directory / "launcher.json").unlink()


def _clear_stale(spec: RunSpec, slot: int) -> None:
    """Remove the socket and lock a killed rank left behind (only if nobody holds the lock)."""
    role, rank = spec.slot_role(slot)
    lock = RankLock(spec.socket_dir, rank, role)
    with contextlib.suppress(VlaunchError, OSError):
        lock.acquire()
        lock.release()


def run(spec: RunSpec, listeners: Listeners | None = None) -> int:
    """Run the launcher on uvloop; returns its exit status."""
    import uvloop

    return uvloop.run(Executor(spec, listeners=listeners).run())
