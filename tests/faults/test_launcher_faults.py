"""Faults around `vlaunch run`: SIGQUIT, a start that never finishes, the launcher itself
killed, a rank killed while an engine maps its slabs."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.test_launcher import Launcher, engine, serving
from vlaunch.cache.contract.exitcodes import ExitStatus

from ..conftest import eventually
from .harness import assert_gone, descendants

STUBBORN = [sys.executable, "-c", """
import os, signal, socket, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.connect(os.environ["NOTIFY_SOCKET"])
s.send(b"READY=1")
time.sleep(600)
"""]
NEVER_READY = [sys.executable, "-c", "import time; time.sleep(600)"]
# An engine that starts a worker of its own, which daemonizes out of the engine's process
# group (as some engines' workers do): the worst orphan there is.
WITH_WORKER = [sys.executable, "-c", """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)"])
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.connect(os.environ["NOTIFY_SOCKET"])
s.send(b"READY=1")
time.sleep(600)
"""]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[list[Launcher]]:
    started: list[Launcher] = []
    yield started
    for la in started:
        la.close()


def _start(started: list[Launcher], tmp: Path, model: Path, *args: str,
           engine_cmd: list[str]) -> Launcher:
    sub = tmp / f"l{len(started)}"
    sub.mkdir()
    la = Launcher(sub, model, "--engine-ready", "notify", *args, engine=engine_cmd, tp=1)
    started.append(la)
    return la


def test_sigquit_kills_everything_at_once_and_exits_131(launch, tmp_path: Path,
                                                         llama_ckpt: Path) -> None:
    la = _start(launch, tmp_path, llama_ckpt, "--stop-timeout", "30",
                engine_cmd=STUBBORN)  # it ignores SIGTERM: only SIGKILL ends it
    snap = la.wait_for(serving)
    pids = la.pids(snap) + descendants(la.proc.pid)
    la.proc.send_signal(signal.SIGQUIT)
    assert la.wait_exit(20) == ExitStatus.QUIT
    assert "SIGQUIT received: killing" in la.text()
    assert_gone(pids, la.sockdir)
    assert not (la.sockdir / "launcher.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_a_rank_frozen_or_killed_in_its_first_load(launch, tmp_path: Path, llama_ckpt: Path,
                                                   sig: int) -> None:
    """SIGSTOP of a loading rank: the start-up deadline stops the launcher (the frozen rank
    ignores SIGTERM, so the stop times out into SIGKILL) with 83. SIGKILL: 68. Either way
    nothing is left."""
    deadline = ["--start-timeout", "2"] if sig == signal.SIGSTOP else []
    la = _start(launch, tmp_path, llama_ckpt, *deadline, engine_cmd=NEVER_READY)
    ranks = eventually(lambda: [p for p in descendants(la.proc.pid) if _is_rank(p)],
                       what="the rank to start")
    for pid in ranks:
        os.kill(pid, sig)
    text = la.text
    if sig == signal.SIGSTOP:
        assert la.wait_exit(60) == ExitStatus.START_TIMEOUT
        assert "not serving within --start-timeout (2 s): cache rank(s) 0 still loading" \
            in text()
        assert "killing" in text()  # the stop timed out: SIGKILL
    else:
        assert la.wait_exit(60) == ExitStatus.RANK_START_FAILED
        assert "exited before ready: killed by signal 9" in text()
    assert_gone(ranks, la.sockdir)


def _is_rank(pid: int) -> bool:
    """Whether `pid` is a cache rank (not another helper the launcher runs)."""
    try:
        return "vlaunch.cache" in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


def test_a_killed_launcher_leaves_no_child(launch, tmp_path: Path, llama_ckpt: Path) -> None:
    """SIGKILL of the launcher: ranks and the engine's keeper die with it (parent-death
    signal), and the keeper kills the engine and a worker that left the engine's process group
    (docs/lifecycle.md), with or without a cgroup to find it in."""
    la = _start(launch, tmp_path, llama_ckpt, engine_cmd=WITH_WORKER)
    snap = la.wait_for(serving)
    children = la.pids(snap)
    # the keeper, the engine and its worker
    eventually(lambda: len(descendants(snap["engine"]["pid"])) == 2, what="the worker")
    everything = descendants(la.proc.pid)
    assert len(everything) == len(children) + 2
    la.proc.kill()
    la.proc.wait(10)
    assert_gone(everything)


@pytest.mark.parametrize("policy,status", [("shutdown", ExitStatus.RANK_EXITED),
                                           ("respawn", None)])
def test_a_rank_killed_under_a_serving_engine(launch, tmp_path: Path, llama_ckpt: Path,
                                              policy: str, status: int | None) -> None:
    la = _start(launch, tmp_path, llama_ckpt, "--on-rank-exit", policy,
                engine_cmd=engine())
    snap = la.wait_for(serving)
    pids = la.pids(snap)
    rank_pid = snap["ranks"]["0"]["pid"]
    os.kill(rank_pid, signal.SIGKILL)
    if status is None:
        la.wait_for(lambda s: s["ranks"]["0"]["pid"] not in (None, rank_pid)
                    and s["ranks"]["0"]["state"] == "ready" and serving(s))
        la.proc.terminate()
        assert la.wait_exit(30) == ExitStatus.OK
    else:
        assert la.wait_exit(30) == status
    assert_gone(pids, la.sockdir)


def _left_in(sockdir: Path) -> list[str]:
    """What is left in the socket directory (the launcher removes it when it made it and it
    is empty)."""
    return sorted(p.name for p in sockdir.iterdir()) if sockdir.exists() else []


@pytest.mark.parametrize("fault", ["rank SIGKILL", "SIGQUIT", "stubborn engine"])
def test_fault_paths_leave_nothing_in_the_socket_directory(launch, tmp_path: Path,
                                                           llama_ckpt: Path, fault: str) -> None:
    """A rank killed with SIGKILL, a SIGQUIT, a stop that ends in SIGKILL: no socket, lock or
    identity memo is left (the launcher clears what its dead ranks leave)."""
    la = _start(launch, tmp_path, llama_ckpt, "--stop-timeout", "1",
                engine_cmd=STUBBORN if fault == "stubborn engine" else engine())
    snap = la.wait_for(serving)
    assert "rank-0.identity.json" in _left_in(la.sockdir)  # the rank wrote its memo
    pids = la.pids(snap) + descendants(la.proc.pid)
    if fault == "rank SIGKILL":
        os.kill(snap["ranks"]["0"]["pid"], signal.SIGKILL)
        expected = ExitStatus.RANK_EXITED
    elif fault == "SIGQUIT":
        la.proc.send_signal(signal.SIGQUIT)
        expected = ExitStatus.QUIT
    else:
        la.proc.send_signal(signal.SIGTERM)
        expected = ExitStatus.STOP_TIMEOUT
    assert la.wait_exit(30) == expected
    assert_gone(pids)
    assert _left_in(la.sockdir) == []
