"""The fault harness: real cache ranks (with resource limits), faults injected from outside,
and the checks every case ends with: documented status, nothing left, nothing leaked, the
next load bit-exact."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import load_file

from vlaunch.cache.contract.progress import recv_ready
from vlaunch.cache.contract.sockdir import socket_path

from ..conftest import eventually


def open_fds(pid: int | str = "self") -> int:
    """File descriptors a process holds."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int | str = "self") -> dict[str, int]:
    """Counts of a process's memfds and sockets."""
    kinds = {"memfd": 0, "socket": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:"):
            kinds["memfd"] += 1
        elif target.startswith("socket:"):
            kinds["socket"] += 1
    return kinds


def threads(pid: int | str = "self") -> int:
    """Threads of a process (every thread, not only those threading knows)."""
    return len(os.listdir(f"/proc/{pid}/task"))


def limits_preexec(limits: Mapping[int, int]) -> Callable[[], None]:
    """A preexec_fn that sets soft and hard RLIMIT_* values in the child."""
    def apply() -> None:
        for res, value in limits.items():
            resource.setrlimit(res, (value, value))
    return apply


@dataclass
class Rank:
    """A cache rank started by the harness."""

    proc: subprocess.Popen[bytes]
    sockdir: Path
    ready: dict[str, Any] = field(default_factory=dict)
    escrow: list[int] = field(default_factory=list)
    log: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def socket(self) -> Path:
        return socket_path(self.sockdir, 0)

    def text(self) -> str:
        """What the rank logged."""
        return self.log.read_text() if self.log else ""

    def stop(self) -> int:
        """SIGCONT + SIGTERM and wait; closes the escrow; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(18)  # SIGCONT: a stopped rank cannot handle SIGTERM
            self.proc.terminate()
        for fd in self.escrow:
            os.close(fd)
        self.escrow = []
        return self.proc.wait(30)


def start_rank(model: Path | str, sockdir: Path, *args: str, env: Mapping[str, str] = (),
               limits: Mapping[int, int] | None = None, wait: bool = True,
               log: Path | None = None) -> Rank:
    """Start `python -m vlaunch.cache` for rank 0 and wait for its ready report."""
    ours, theirs = socket.socketpair()
    log = log or sockdir.parent / f"rank-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "vlaunch.cache", "--model", str(model), "--socket-dir",
           str(sockdir), "--rank", "0", "--ready-fd", str(theirs.fileno()), *args]
    proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stderr=log.open("wb"),
                            env={**os.environ, **dict(env)},
                            preexec_fn=limits_preexec(limits) if limits else None)
    theirs.close()
    rank = Rank(proc, sockdir, log=log)
    if wait:
        ours.settimeout(60)
        try:
            rank.ready, rank.escrow = recv_ready(ours)  # progress reports come first
        except EOFError:
            proc.wait(30)
    rank._channel = ours  # type: ignore[attr-defined]  # kept open: the rank may report later
    return rank


def reference(model: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read with safetensors."""
    out: dict[str, torch.Tensor] = {}
    files = [model] if model.is_file() else sorted(model.glob("*.safetensors"))
    for f in files:
        out.update(load_file(str(f)))
    return out


def assert_bit_exact(got: Mapping[str, torch.Tensor], model: Path) -> None:
    """`got` holds every tensor of `model` with the same bits."""
    ref = reference(model)
    assert set(got) == set(ref)
    for name, t in ref.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(g.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), \
            name


def assert_gone(pids: list[int], sockdir: Path | None = None) -> None:
    """No process of `pids` is left (zombies reaped or not), and the socket dir is clean."""
    def gone() -> bool:
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True
    eventually(gone, 20, what=f"processes {pids} to go")
    if sockdir is not None and sockdir.exists():
        left = [p.name for p in sockdir.iterdir() if p.name.endswith((".sock", ".lock"))]
        assert not left, left


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
