"""The executor's part in a swap (docs/swap.md): the control socket `vlaunch swap` asks on, the
swap steps it sends the ranks on their ready channels, and what their answers change in what
the launcher holds (the escrow) and tells new engines (the model, a published identity).

Wiring only: every decision is the core's (core/swap.py). The control socket is
SOCKET_DIR/launcher.sock (cache/contract/control.py), mode 0600 in the 0700 directory, the
peer's uid checked; never the health port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

from vlaunch.cache.contract import control, wire
from vlaunch.cache.contract.engine_env import env_name
from vlaunch.cache.contract.errors import ProtocolError, VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import check_peer
from vlaunch.cache.contract.standby import PARK_ENV

from .core import events

log = logging.getLogger("vlaunch.launcher")
FRAME_TIMEOUT = 10.0
PARK_BEFORE_WEIGHTS = {PARK_ENV: "before-weights"}
"""What tells a standby to park before it maps any weight (an in-place swap's)."""


class Swapper:
    """Swaps as the executor sees them; `ex` is the Executor (its spec, escrow and queue)."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self.channels: dict[int, socket.socket] = {}  # slot -> its ready channel
        self.requests: dict[int, socket.socket] = {}  # request -> the control connection
        self.current: dict[int, dict[str, Any]] = {}  # slot -> fingerprint served
        self.labels: dict[int, str] = {}  # slot -> published label served ("" files)
        self.next: dict[int, dict[str, Any]] = {}  # slot -> the pending swap's fingerprint
        self.next_model, self.next_label = "", ""
        self._count = 0
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------- the control socket

    async def serve(self, directory: Path) -> None:
        """Accept `vlaunch swap` connections on SOCKET_DIR/launcher.sock until cancelled."""
        path = control.control_path(directory)
        with contextlib.suppress(FileNotFoundError):  # the launcher lock makes the dir ours
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()
        listener = self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old)
        listener.listen(16)
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of fds: try again shortly
                log.warning("control socket: cannot accept a connection (%s)", exc)
                await asyncio.sleep(0.5)
                continue
            self._later(self._client(conn))

    async def _client(self, conn: socket.socket) -> None:
        """Read one swap request and hand it to the core; the connection waits for its
        outcome."""
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        try:
            check_peer(conn)
            fields = control.validate(await wire.read_frame(
                loop, conn, max_body=control.MAX_BODY, frame_timeout=FRAME_TIMEOUT))
            policy = events.SwapPolicy(
                mode=fields["mode"], on_failure=fields["on_failure"],
                standby=fields["standby"], margin=fields["margin"],
                lease_wait=fields["lease_wait_ms"] / 1000, attempts=fields["attempts"],
                ready_timeout=fields["ready_timeout_ms"] / 1000)
        except (ProtocolError, ValueError) as exc:
            log.warning("control socket: request refused: %s", exc)
            with contextlib.suppress(OSError, asyncio.TimeoutError, TimeoutError, VlaunchError):
                await wire.write_frame(loop, conn, control.answer(
                    final=True, status=int(ExitStatus.USAGE), message=str(exc), version=0),
                    timeout=FRAME_TIMEOUT)
            conn.close()
            return
        except (OSError, EOFError, asyncio.TimeoutError, TimeoutError):
            conn.close()
            return
        self._count += 1
        self.requests[self._count] = conn
        self.ex.post(events.SwapRequested(self._count, fields["model"], policy, 0.0))

    async def reply(self, action: events.SwapReply) -> None:
        """Answer a control connection (a gone client is no failure: the swap goes on)."""
        conn = self.requests.get(action.request)
        if conn is None:
            return
        frame = control.answer(final=action.final, status=action.status,
                               message=action.message, version=action.version,
                               mode=action.mode)
        with contextlib.suppress(OSError, asyncio.TimeoutError, TimeoutError, VlaunchError):
            await wire.write_frame(asyncio.get_running_loop(), conn, frame,
                                   timeout=FRAME_TIMEOUT)
        if action.final:
            self.requests.pop(action.request, None)
            conn.close()

    # ------------------------------------------------------------- the ranks' side

    async def send(self, action: events.SwapRanks) -> None:
        """Send one swap step to each rank it names, on its ready channel."""
        config = self.ex.core.config
        for slot in action.ranks or config.swap_ranks or config.ranks:
            if action.step == "commit" and action.mode == "in-place":
                # the old bytes are overwritten (or freed for new slabs): no duplicate of
                # ours may keep them; the rank's answer brings its fds to hold again
                self.ex.escrow.drop(slot)
            sock = self.channels.get(slot)
            if sock is None:
                continue  # the rank is gone: its exit is on its way to the core
            try:
                wire.send_frame(sock, _frame(action))
            except OSError as exc:
                log.warning("cache rank %d: cannot send it the swap's %s step (%s)", slot,
                            action.step, exc)
        if action.step in ("abort", "finish"):
            self.next, self.next_model, self.next_label = {}, "", ""

    def on_answer(self, slot: int, msg: dict[str, Any], fds: list[int]) -> None:
        """A rank's swap answer: hold what it serves now, then tell the core."""
        kind = msg["answer"]
        if kind in ("committed", "rolled_back"):
            served = {k: msg[k] for k in ("manifest", "fingerprint", "model", "label")
                      if k in msg}
            self.ex.escrow.keep(slot, {**served, "version": msg["version"]}, fds)
            self.current[slot] = dict(msg.get("fingerprint") or {})
            self.labels[slot] = str(msg.get("label", ""))
            model = str(msg.get("model", ""))
            if model and slot in self.ex.spec.ranks and model != self.ex.spec.model:
                self.ex.spec = replace(self.ex.spec, model=model)
            self._later(self._refresh(slot))
        else:
            wire.close_fds(fds)
        if kind in ("prepared", "published"):
            self.next[slot] = dict(msg.get("fingerprint") or {})
            self.next_model = str(msg.get("model", "")) or self.ex.spec.model
            self.next_label = str(msg.get("label", ""))
        self.ex.post(events.SwapStep(slot, kind, msg["version"], 0.0,
                                     fits=bool(msg.get("fits", False)),
                                     status=int(msg.get("status", 0)),
                                     message=str(msg.get("message", "")),
                                     label=str(msg.get("label", "")),
                                     mode=str(msg.get("mode", "")),
                                     in_place=str(msg.get("in_place", ""))))

    async def _refresh(self, slot: int) -> None:
        """The rank's own report at once (its checkpoint and bytes changed), not in 2 s."""
        with contextlib.suppress(OSError, EOFError, VlaunchError):
            self.ex.rank_detail[slot] = await self.ex.hooks.rank_status(
                self.ex.spec.slot_socket(slot))
            self.ex._publish()

    def _later(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def on_ready(self, slot: int, ready: dict[str, Any]) -> None:
        """A rank's ready report: the weights it serves."""
        self.current[slot] = dict(ready.get("fingerprint") or {})
        self.labels[slot] = str(ready.get("label", ""))

    def engine_env(self, next_weights: bool = False) -> dict[str, str]:
        """What an engine is told beyond the spec's: for the pending swap's new weights
        (next_weights), their model; for a published version, each rank's identity
        (VLAUNCH_CHECKPOINT_DATA, which only the caches can check: no files hold it)."""
        ranks = self.ex.spec.ranks
        if next_weights:
            fps, published = self.next, bool(self.next_label)
            out = {env_name("model"): self.next_model or self.ex.spec.model,
                   **PARK_BEFORE_WEIGHTS}
        else:
            fps, published = self.current, any(self.labels.get(r) for r in ranks)
            out = {}
        if published and all(r in fps for r in ranks):
            out[env_name("checkpoint_data")] = ",".join(
                str(fps[r].get("checkpoint_data", "")) for r in ranks)
        return out

    def close(self) -> None:
        """Close the control socket and every connection still waiting."""
        for task in list(self._tasks):
            task.cancel()
        for conn in self.requests.values():
            conn.close()
        self.requests.clear()
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(OSError):
                control.control_path(self.ex.directory).unlink()


def _frame(action: events.SwapRanks) -> dict[str, Any]:
    """The ready-channel frame of a swap step (protocol.EVENTS' swap_* schemas)."""
    policy = action.policy or events.SwapPolicy()
    fields: dict[str, Any] = {"version": action.version}
    if action.step == "prepare":
        fields.update(model=action.model, mode=action.mode or policy.mode,
                      margin=policy.margin, keep=policy.on_failure == "rollback")
    elif action.step == "stage":
        fields.update(mode=action.mode)
    elif action.step == "commit":
        fields.update(mode=action.mode, lease_wait_ms=round(policy.lease_wait * 1000))
    elif action.step in ("rollback", "abort"):
        fields.update(status=action.status, message=action.message[:4096])
    return {"event": f"swap_{action.step}", **fields}
