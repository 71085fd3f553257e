"""The asyncio layer: feeds the supervisor's core with events and executes its actions.

Everything that touches a process, a socket, a signal or the clock is here; every decision
is in `core`. Child exits, ready reports, signals and ticks all become events on one queue,
handled one at a time, so the core sees a single ordered history.
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
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import RankLock, ensure_socket_dir, socket_path

from . import core, events
from .children import (
    become_subreaper,
    child_env,
    die_with_parent,
    reap_orphans,
    signal_group,
    sweep,
)
from .health import HealthServer
from .notify import EngineNotifySocket, Notifier

log = logging.getLogger("vlaunch.launcher")
TICK = 0.1
STATUS_EVERY = 2.0


@dataclass(frozen=True)
class RunSpec:
    """What `vlaunch run` starts: the ranks of this node, the engine, and the surfaces."""

    model: str
    socket_dir: Path
    ranks: tuple[int, ...]
    devices: Mapping[int, str]
    tp: int = 1
    pp: int = 1
    dp: int = 1
    plan: str = "llama"
    threads: int = 8
    engine: tuple[str, ...] = ()
    engine_health_url: str = ""
    health_host: str = "127.0.0.1"
    health_port: int | None = 0
    kernel_backends: str = ""
    supervisor: events.SupervisorConfig | None = None
    artifact_dir: str = ""
    seed: str = ""
    seed_token: str = ""
    seed_fallback: bool = False
    seed_listen_host: str = "127.0.0.1"
    seed_listen_port: int = 0
    preload: tuple[str, ...] = ()
    preload_timeout: float = 600.0


@dataclass
class _Child:
    pid: int
    proc: asyncio.subprocess.Process
    info: dict[str, Any] = field(default_factory=dict)


class Executor:
    """Runs a `RunSpec` until the core says exit; returns the exit status."""

    def __init__(self, spec: RunSpec, env: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.env = dict(os.environ if env is None else env)
        assert spec.supervisor is not None
        self.core = core.Supervisor(spec.supervisor)
        self.notifier = Notifier(self.env)
        self.queue: asyncio.Queue[events.Event] = asyncio.Queue()
        self.ranks: dict[int, _Child] = {}
        self.engine: _Child | None = None
        self.escrow: dict[int, tuple[dict[str, Any], list[int]]] = {}
        self.rank_status: dict[int, dict[str, Any]] = {}
        self.engine_devices: dict[int, str] = {}
        self.health: HealthServer | None = None
        self.engine_notify: EngineNotifySocket | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.preload: _Child | None = None

    # ----------------------------------------------------------------------- main loop

    async def run(self) -> int:
        """Start everything, handle events until Exit, sweep, return the status."""
        loop = asyncio.get_running_loop()
        become_subreaper()
        directory = ensure_socket_dir(self.spec.socket_dir)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._post, events.SignalReceived(sig, 0.0))
        self._start_surfaces(directory, loop)
        self._post(events.Started(0.0))
        self._spawn_task(self._ticker())
        self._spawn_task(self._poll_caches())
        status = int(ExitStatus.INTERNAL)
        try:
            status = await self._loop()
        finally:
            await self._shutdown(directory)
        return status

    def _start_surfaces(self, directory: Path, loop: asyncio.AbstractEventLoop) -> None:
        if self.spec.supervisor and self.spec.supervisor.engine_readiness == "notify":
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
            event = await self.queue.get()
            event = _stamp(event)
            for action in self.core.handle(event):
                if isinstance(action, events.Exit):
                    self._publish()
                    return action.status
                await self._execute(action)
            self._publish()

    def _post(self, event: events.Event) -> None:
        self.queue.put_nowait(event)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            self._post(events.Tick(0.0))

    # ------------------------------------------------------------------------ actions

    async def _execute(self, action: events.Action) -> None:
        if isinstance(action, events.SpawnCache):
            await self._spawn_cache(action.rank, action.adopt)
        elif isinstance(action, events.SpawnEngine):
            await self._spawn_engine(action.attempt)
        elif isinstance(action, events.SignalChild):
            child = self.engine if action.role == "engine" else self.ranks.get(action.rank or 0)
            if child is not None:
                signal_group(child.pid, action.sig)
        elif isinstance(action, events.KillAll):
            for child in self._children():
                signal_group(child.pid, signal.SIGKILL)
        elif isinstance(action, events.RunPreload):
            self._spawn_task(self._run_preload())
        elif isinstance(action, events.Notify):
            self.notifier.send(action.fields)
        elif isinstance(action, events.Log):
            log.log(logging.getLevelName(action.level), "%s", action.message)

    def _children(self) -> list[_Child]:
        return [*self.ranks.values(), *([self.engine] if self.engine else []),
                *([self.preload] if self.preload else [])]

    async def _spawn(self, cmd: list[str], env: dict[str, str], pass_fds: tuple[int, ...],
                     role: events.Role, rank: int | None) -> _Child | None:
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, pass_fds=pass_fds, start_new_session=True,
                preexec_fn=die_with_parent)
        except OSError as exc:
            log.error("cannot start %s: %s; check the command and PATH", cmd[0], exc)
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            self._post(events.ChildExited(role, rank, 0, code, 0.0))
            return None
        child = _Child(proc.pid, proc)
        self._post(events.Spawned(role, rank, proc.pid, 0.0))
        self._spawn_task(self._reap(child, role, rank))
        return child

    async def _reap(self, child: _Child, role: events.Role, rank: int | None) -> None:
        status = await child.proc.wait()
        signal_group(child.pid, signal.SIGKILL)  # its group dies with it: no orphaned workers
        if role == "cache" and rank is not None:
            _clear_stale(self.spec.socket_dir, rank)
        self._post(events.ChildExited(role, rank, child.pid, status, 0.0))

    async def _spawn_cache(self, rank: int, adopt: bool) -> None:
        spec = self.spec
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "vlaunch.cache", "--model", spec.model, "--rank", str(rank),
               "--tensor-parallel-size", str(spec.tp), "--pipeline-parallel-size", str(spec.pp),
               "--data-parallel-size", str(spec.dp), "--device", spec.devices[rank],
               "--socket-dir", str(spec.socket_dir), "--plan", spec.plan,
               "--threads", str(spec.threads), "--kernel-backends", spec.kernel_backends,
               "--ready-fd", str(theirs.fileno())]
        cmd += _seed_args(spec)
        fds = [theirs.fileno()]
        adopt_ours = None
        if adopt and rank in self.escrow:
            adopt_ours, adopt_theirs = socket.socketpair()
            cmd += ["--adopt-fd", str(adopt_theirs.fileno())]
            fds.append(adopt_theirs.fileno())
        # the token travels in the environment, never on a command line that ps shows
        env = child_env(self.env, {"VLAUNCH_SEED_TOKEN": spec.seed_token}
                        if spec.seed_token else {}, None)
        child = await self._spawn(cmd, env, tuple(fds), "cache", rank)
        for fd in fds:
            os.close(fd)
        if child is None:
            ours.close()
            return
        self.ranks[rank] = child
        if adopt_ours is not None:
            ready, slab_fds = self.escrow[rank]
            with adopt_ours:
                wire.send_frame(adopt_ours, {"event": "escrow", "manifest": ready["manifest"],
                                             "fingerprint": ready["fingerprint"]}, slab_fds)
        self._spawn_task(self._await_ready(ours, rank, child))

    async def _await_ready(self, sock: socket.socket, rank: int, child: _Child) -> None:
        loop = asyncio.get_running_loop()
        try:
            ready, fds = await loop.run_in_executor(None, wire.recv_frame, sock)
        except (EOFError, ConnectionError):
            return  # it died first: its ChildExited tells the core
        except (OSError, ValueError) as exc:  # a malformed report: the rank has failed
            log.error("cache rank %d sent a bad ready report (%s): killing it", rank, exc)
            signal_group(child.pid, signal.SIGKILL)
            return
        finally:
            sock.close()
        old = self.escrow.pop(rank, None)
        if old is not None:
            for fd in old[1]:
                os.close(fd)
        self.escrow[rank] = (ready, fds)  # duplicates of the slab fds: no CUDA context needed
        child.info = {k: ready.get(k) for k in ("socket", "device", "bytes")}
        uuid = str(ready.get("fingerprint", {}).get("device_uuid", ""))
        if uuid.startswith("GPU-"):  # the engine pairs its ranks with these GPUs by UUID
            self.engine_devices[rank] = f"cuda:{uuid}"
        self._post(events.CacheReady(rank, 0.0))

    async def _spawn_engine(self, attempt: int) -> None:
        spec = self.spec
        notify = str(self.engine_notify.path) if self.engine_notify else None
        self.engine = await self._spawn(list(spec.engine),
                                        child_env(self.env, self._engine_env(attempt), notify),
                                        (), "engine", None)
        if self.engine and spec.supervisor and spec.supervisor.engine_readiness == "http":
            self._spawn_task(self._probe_engine(self.engine))

    async def _run_preload(self) -> None:
        """Run the preload command once (the engine's environment, no notify socket), bounded by
        its timeout; its outcome goes to the core as PreloadDone."""
        spec = self.spec
        env = child_env(self.env, {**self._engine_env(0), "VLAUNCH_PRELOAD": "1"}, None)
        try:
            proc = await asyncio.create_subprocess_exec(
                *spec.preload, env=env, start_new_session=True, preexec_fn=die_with_parent)
        except OSError as exc:
            self._post(events.PreloadDone(False, f"could not start: {exc}", 0.0))
            return
        self.preload = _Child(proc.pid, proc)
        try:
            status = await asyncio.wait_for(proc.wait(), spec.preload_timeout)
        except asyncio.TimeoutError:
            signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
            self._post(events.PreloadDone(False, f"ran past --preload-timeout "
                                               f"({spec.preload_timeout:g} s)", 0.0))
            return
        finally:
            signal_group(proc.pid, signal.SIGKILL)  # nothing it started outlives it
            self.preload = None
        self._post(events.PreloadDone(status == 0, f"exited with status {status}", 0.0))

    def _engine_env(self, attempt: int) -> dict[str, str]:
        spec = self.spec
        return {"VLAUNCH_SOCKET_DIR": str(spec.socket_dir), "VLAUNCH_MODEL": spec.model,
                 "VLAUNCH_TENSOR_PARALLEL_SIZE": str(spec.tp),
                 "VLAUNCH_PIPELINE_PARALLEL_SIZE": str(spec.pp),
                 "VLAUNCH_DATA_PARALLEL_SIZE": str(spec.dp),
                 "VLAUNCH_RANKS": ",".join(map(str, spec.ranks)),
                 "VLAUNCH_DEVICE": _device_kind(spec.devices),
                 "VLAUNCH_ENGINE_DEVICES": ",".join(self.engine_devices.get(r, spec.devices[r])
                                                    for r in spec.ranks),
                 "VLAUNCH_PLAN": spec.plan, "VLAUNCH_ATTEMPT": str(attempt)}

    # ---------------------------------------------------------------------- readiness

    def _engine_notified(self) -> None:
        assert self.engine_notify is not None
        for fields in self.engine_notify.read():
            if fields.get("READY") == "1":
                self._post(events.EngineReady(0.0))

    async def _probe_engine(self, engine: _Child) -> None:
        """Poll the engine's health URL while this engine process lives."""
        loop = asyncio.get_running_loop()
        while engine.proc.returncode is None and self.engine is engine:
            ok = await loop.run_in_executor(None, _http_ok, self.spec.engine_health_url)
            if engine.proc.returncode is None and self.engine is engine:
                self._post(events.EngineHealth(ok, 0.0) if self.core.engine_ready or not ok
                           else events.EngineReady(0.0))
            await asyncio.sleep(1.0)

    async def _poll_caches(self) -> None:
        """Refresh per-rank detail (bytes, leases) for the status surface."""
        from vlaunch.cache.client.connection import CacheClient

        loop = asyncio.get_running_loop()

        def query(rank: int) -> dict[str, Any]:
            client = CacheClient(socket_path(self.spec.socket_dir, rank))
            try:
                return client.status()
            finally:
                client.close()

        while True:
            reap_orphans(c.pid for c in self._children())
            for rank in list(self.ranks):
                if self.core.ranks[rank].state is core.RankState.READY:
                    with contextlib.suppress(Exception):
                        self.rank_status[rank] = await loop.run_in_executor(None, query, rank)
            await asyncio.sleep(STATUS_EVERY)

    # ------------------------------------------------------------------------- status

    def _publish(self) -> None:
        if self.health is None:
            return
        snap = self.core.snapshot()
        ranks = {}
        for r in snap["ranks"]:
            rank = r["rank"]
            detail = self.rank_status.get(rank, {})
            child = self.ranks.get(rank)
            ranks[rank] = {**r, "device": self.spec.devices.get(rank),
                           "bytes": sum(detail.get("bytes_held", {}).values())
                           if detail else (child.info.get("bytes", 0) if child else 0),
                           "leases": detail.get("leases", []),
                           "socket": str(socket_path(self.spec.socket_dir, rank))}
        snap["ranks"] = ranks
        snap["launcher"] = {"pid": os.getpid(), "model": self.spec.model,
                            "engine_command": list(self.spec.engine)}
        self.health.publish(snap)

    # ----------------------------------------------------------------------- shutdown

    async def _shutdown(self, directory: Path) -> None:
        for task in list(self._tasks):
            task.cancel()
        killed = sweep(c.pid for c in self._children())
        if killed:
            log.warning("swept %d leftover process(es): %s", len(killed), killed)
        for rank in self.spec.ranks:
            _clear_stale(self.spec.socket_dir, rank)
        for _, fds in self.escrow.values():
            for fd in fds:
                os.close(fd)
        self.escrow.clear()
        if self.engine_notify:
            self.engine_notify.close()
        if self.health:
            self.health.close()
        with contextlib.suppress(FileNotFoundError):
            (directory / "launcher.json").unlink()


def _clear_stale(directory: Path, rank: int) -> None:
    """Remove the socket and lock a killed rank left behind (only if nobody holds the lock)."""
    lock = RankLock(directory, rank)
    with contextlib.suppress(VlaunchError, OSError):
        lock.acquire()
        lock.release()


def _stamp(event: events.Event) -> events.Event:
    """Give an event the current monotonic time (events are queued with a placeholder)."""
    from dataclasses import replace

    return replace(event, now=time.monotonic())


def _seed_args(spec: RunSpec) -> list[str]:
    """The cache rank's artifact and seeding options (the token goes by environment)."""
    args = ["--artifact-dir", spec.artifact_dir] if spec.artifact_dir else []
    if spec.seed:
        args += ["--seed", spec.seed] + (["--seed-fallback"] if spec.seed_fallback else [])
    if spec.seed_listen_port:
        args += ["--seed-listen-host", spec.seed_listen_host,
                 "--seed-listen-port", str(spec.seed_listen_port)]
    return args


def _device_kind(devices: Mapping[int, str]) -> str:
    return "cuda" if any(d.startswith("cuda") for d in devices.values()) else "cpu"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except OSError:
        return False


def run(spec: RunSpec) -> int:
    """Run the launcher on uvloop; returns its exit status."""
    import uvloop

    return uvloop.run(Executor(spec).run())
