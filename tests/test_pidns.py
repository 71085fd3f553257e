"""Across PID namespaces: what a container boundary changes for the checks that use a peer's pid.

The cache rank runs in a PID namespace of its own (`unshare --pid --fork --mount-proc`), as in
the two-container layout, so every engine here (this process and its children) is pid 0 to it.
Where a process needs a /proc of another namespace, it runs one namespace further in
(`unshare --pid --fork` inside the first): whatever it does with /proc stays inside the first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CacheProc, eventually, rank_status, spawn_cache
from vlaunch.cache import hand_back, load
from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract import peers, wire
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.contract.standby import PROMOTE
from vlaunch.cache.rank.openers import Openers

NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]
NESTED = [*NAMESPACE, "unshare", "--pid", "--fork", "--kill-child=SIGTERM"]
"""A PID namespace whose /proc is its parent's (the outer namespace of NAMESPACE)."""

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0,
    reason="PID namespaces need unshare(1) and root here")


@pytest.fixture
def caches() -> Iterator[list[CacheProc]]:
    """Caches in PID namespaces of their own, stopped afterwards."""
    started: list[CacheProc] = []
    yield started
    for cache in started:
        _log(cache)


def _cache(model: Path, sockdir: Path, caches: list[CacheProc], *prefix: str) -> CacheProc:
    cache = spawn_cache(model, sockdir, prefix=[*NAMESPACE, *prefix])
    caches.append(cache)
    assert cache.ready, _log(cache)
    return cache


def _open_fds(cache: CacheProc) -> int:
    """How many fds the rank itself (unshare's child) holds."""
    [rank] = psutil.Process(cache.proc.pid).children()
    return rank.num_fds()


def _log(cache: CacheProc) -> str:
    """Stop the rank and return its log. unshare ignores SIGTERM: killing it hands the rank a
    SIGTERM (--kill-child), and its stderr ends once the rank itself has exited."""
    for fd in cache.escrow:
        os.close(fd)
    cache.escrow = []
    if cache.proc.poll() is None:
        cache.proc.kill()
    cache.proc.wait(30)
    return cache.proc.stderr.read().decode() if cache.proc.stderr else ""


def _handed_over(tensor: torch.Tensor) -> bool:
    """Whether a tensor lies in a mapping of the rank's own slab (a memfd or a file, whichever
    backing the rank chose) rather than in memory of this process's own (a copy)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return line.split()[4] != "0"  # the inode: 0 for anonymous memory
    raise AssertionError(f"no mapping holds {address:#x}")


KEEPER = ("import sys\n"
          "from vlaunch.cache import load\n"
          "w = load(sys.argv[1], socket_dir=sys.argv[2], fallback=False, device='cpu')\n"
          "w.client.close()\n"  # the lease ends; the tensors, and their mappings, stay
          "print('mapped', flush=True)\n"
          "sys.stdin.read()\n")
"""A share engine that ends its lease, keeps its tensors and runs until its stdin closes."""


def _keeper(model: Path, sockdir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", KEEPER, str(model), str(sockdir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "mapped\n"
    return proc


def test_a_lease_from_another_pid_namespace_shows_pid_0_and_is_named_so(
        llama_ckpt: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    cache = _cache(llama_ckpt, sockdir, caches)
    got = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, device="cpu")
    [lease] = eventually(lambda: rank_status(sockdir)["leases"], 30, what="the lease")
    assert lease["pid"] == peers.UNKNOWN_PID and lease["client"] == f"pid {os.getpid()}"
    assert lease["mode"] == "share" and lease["bytes"] > 0
    del got
    assert "pid 0" not in _log(cache)  # log lines name it by what it calls itself


def test_copy_release_waits_for_an_opener_in_another_namespace_to_exit(
        llama_ckpt: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    """An engine in another PID namespace that ended its lease but keeps its tensors: the rank
    follows it by the pidfd of its socket and hands the slabs over only once it has exited.
    On a kernel without SO_PEERPIDFD it cannot follow it: a copy, for the rank's life."""
    cache = _cache(llama_ckpt, sockdir, caches)
    keeper = _keeper(llama_ckpt, sockdir)
    try:
        eventually(lambda: not rank_status(sockdir)["leases"], 30, what="the keeper's lease gone")
        blocked = rank_status(sockdir)["handover_blocked"]
        if peers.peer_pidfds():
            assert blocked.endswith("which opened them before and still runs (its lease "
                                  "ended; its tensors may not have)"), blocked
        else:
            assert "another PID namespace" in blocked and "SO_PEERPIDFD" in blocked, blocked
    finally:
        keeper.communicate(timeout=30)  # stdin closed: it exits
    if peers.peer_pidfds():
        eventually(lambda: rank_status(sockdir)["handover_blocked"] == "", 30,
                   what="the rank seeing the keeper exit")
    got = load(str(llama_ckpt), socket_dir=str(sockdir), mode="copy-release", fallback=False,
               device="cpu")
    assert _handed_over(got[next(iter(got))]) == peers.peer_pidfds()
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    assert all(got[key].equal(want) for key, want in ref.items())
    del got
    log = _log(cache)
    if peers.peer_pidfds():
        assert "handing the slabs over" in log, log
    else:
        assert "a copy, not the slabs themselves" in log, log


def test_a_killed_engine_in_another_namespace_leaves_no_fd_in_the_rank(
        llama_ckpt: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    """The pidfd that follows an engine is closed once its connection ends with its life."""
    cache = _cache(llama_ckpt, sockdir, caches)
    base = _open_fds(cache)
    engine = subprocess.Popen([sys.executable, "-c", KEEPER.replace("w.client.close()\n", ""),
                               str(llama_ckpt), str(sockdir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert engine.stdout is not None and engine.stdout.readline() == "mapped\n"
    assert _open_fds(cache) > base  # its connection (and its pidfd, where the kernel has them)
    engine.kill()
    engine.communicate(timeout=30)
    eventually(lambda: _open_fds(cache) <= base, 30, what="the rank's fds back")


def test_copy_release_next_to_a_live_opener_in_another_namespace_copies(
        llama_ckpt: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    """Whatever the kernel: the copy-release engine's writes never reach the keeper's
    tensors (on a GPU they would land in that engine's weights)."""
    cache = _cache(llama_ckpt, sockdir, caches)
    keeper = _keeper(llama_ckpt, sockdir)
    try:
        eventually(lambda: not rank_status(sockdir)["leases"], 30, what="the keeper's lease gone")
        got = load(str(llama_ckpt), socket_dir=str(sockdir), mode="copy-release",
                   fallback=False, device="cpu")
        assert not _handed_over(got[next(iter(got))])  # a copy of its own
        del got
    finally:
        keeper.communicate(timeout=30)
    assert "a copy, not the slabs themselves" in _log(cache)


def test_without_pidfds_an_opener_in_another_namespace_is_unknown_for_good(
        llama_ckpt: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    """A kernel before 6.5 (SO_PEERPIDFD unknown to it): pid 0 names no process, so the rank
    never learns that the opener exited; copy-release gets a copy even after it has."""
    old_kernel = ("import runpy, sys, vlaunch.cache.contract.peers as p\n"
                  "p.SO_PEERPIDFD = -1\n"  # getsockopt: ENOPROTOOPT, as on Linux 6.1
                  "sys.argv = sys.argv[sys.argv.index('vlaunch.cache'):]\n"
                  "runpy.run_module('vlaunch.cache', run_name='__main__')\n")
    # the rank's own command line follows: python -m vlaunch.cache ...
    cache = _cache(llama_ckpt, sockdir, caches, sys.executable, "-c", old_kernel)
    keeper = _keeper(llama_ckpt, sockdir)
    keeper.communicate(timeout=30)
    blocked = rank_status(sockdir)["handover_blocked"]
    assert "another PID namespace" in blocked and "SO_PEERPIDFD" in blocked, blocked
    got = load(str(llama_ckpt), socket_dir=str(sockdir), mode="copy-release", fallback=False,
               device="cpu")
    assert not _handed_over(got[next(iter(got))])
    del got
    assert "copy-release engines get a copy from now on" in _log(cache)


def test_engine_layouts_from_another_namespace_are_kept_apart_by_connection(
        llama_ckpt: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    """Two engines that are both pid 0 to the rank build layouts at once: each commit takes
    its own connection's slabs (keyed by pid, the second allocation would have replaced the
    first), and a later engine maps a layout by its key."""
    cache = _cache(llama_ckpt, sockdir, caches)
    raw = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, device="cpu")
    tensors = {name: t.clone() for name, t in raw.items()}
    del raw
    other = CacheClient(socket_path(sockdir, 0))
    raw_fingerprint = rank_status(sockdir)["fingerprint"]
    reply, fds = other.request({"op": "layout_alloc", "fields": {"engine": "other"},
                                "sizes": [4096], "fingerprint": raw_fingerprint})
    wire.close_fds(fds)  # its slab stays allocated on its connection
    fields = {"engine": "test", "fused": "none"}
    back = hand_back(tensors, model=str(llama_ckpt), fields=fields, socket_dir=str(sockdir),
                     device="cpu")
    assert set(back) == set(tensors)
    [layout] = rank_status(sockdir)["layouts"]
    assert layout["fields"] == fields and layout["from_pid"] == peers.UNKNOWN_PID
    again = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, device="cpu",
                 layout=fields)
    assert again.source == "cache" and all(again[n].equal(t) for n, t in tensors.items())
    row = ["w", "F32", [1024], [1], 0, 0, 4096, None]  # fills the other's 4096-byte slab
    reply, _ = other.request({"op": "layout_commit", "fields": {"engine": "other"},
                              "tensors": [row], "copy": [], "release_raw": False})
    assert reply["ok"]
    [layout] = rank_status(sockdir)["layouts"]  # one engine layout a rank: the newer replaces it
    assert layout["fields"] == {"engine": "other"} and layout["tensors"] == 1
    other.close()
    del back, again
    assert "adopted from a process in another PID namespace" in _log(cache)


def test_the_launcher_refuses_a_proc_of_another_pid_namespace(tmp_path: Path) -> None:
    """`unshare --pid --fork` without --mount-proc: /proc/<pid> names other processes, and
    the launcher's final sweep would kill the children of /proc's pid 1. Refused, status 64."""
    r = subprocess.run([*NESTED, sys.executable, "-m", "vlaunch.launcher.cli", "run",
                        "--model", str(tmp_path), "--socket-dir", str(tmp_path / "s"),
                        "--", "sleep", "60"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == ExitStatus.USAGE, r.stderr
    assert "/proc is another PID namespace's than the launcher's: it is pid 1 here" in r.stderr
    assert not (tmp_path / "s").exists()  # nothing started, nothing left


HOLDER = ("import os, subprocess, sys\n"
          "from vlaunch.cache.contract.standby import PROMOTE, standby_env\n"
          "from vlaunch.cache.integrations.standby import PROMOTE_PIPE_ENV, "
          "export_promote_pipe\n"
          "r, w = os.pipe()\n"
          "env = {**os.environ, **standby_env(r)}\n"
          "export_promote_pipe(env)\n"
          "print(os.getpid(), env[PROMOTE_PIPE_ENV], flush=True)\n"
          "worker = subprocess.Popen([sys.executable, '-c', sys.argv[1]], env=env)\n"
          "os.write(w, PROMOTE)\n"
          "os.close(w)\n"
          "sys.exit(worker.wait())\n")
WORKER = ("import os, sys\n"
          "from vlaunch.cache.integrations.standby import open_pipe\n"
          "sys.stdout.write(os.read(open_pipe(), 64).decode())\n")


def test_a_standby_worker_reopens_the_pipe_in_a_pid_namespace_without_its_proc() -> None:
    """vLLM's first process is pid 1 in its namespace and another pid in /proc's: the name of
    the pipe carries /proc's pid, which is what its spawned workers open."""
    r = subprocess.run([*NESTED, sys.executable, "-c", HOLDER, WORKER], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, promoted = r.stdout.split("\n", 1)
    mine, name = first.split()
    assert mine == "1" and not name.startswith("1:")
    assert promoted == PROMOTE.decode()


def test_openers_follow_a_pidfd_and_forget_the_exited(caplog: pytest.LogCaptureFixture) -> None:
    """The bookkeeping alone, in an event loop: one pidfd per opener of unknown pid, watched
    and closed once its process has exited."""
    if not peers.peer_pidfds():
        pytest.skip("this kernel gives no socket peer's pidfd (SO_PEERPIDFD: Linux 6.5)")
    asyncio.run(_follow_one_opener())
    openers = Openers(0)
    with caplog.at_level(logging.INFO, "vlaunch.cache"):
        openers.give_up("a test")
    assert openers.alive() and "copy-release engines get a copy from now on" in caplog.text


async def _follow_one_opener() -> None:
    openers = Openers(0)
    listener = socket.socket(socket.AF_UNIX)
    path = f"\0vlaunch-test-openers-{os.getpid()}"
    listener.bind(path)
    listener.listen()
    child = subprocess.Popen([sys.executable, "-c", "import socket, sys\n"
                              f"s = socket.socket(socket.AF_UNIX); s.connect({path!r})\n"
                              "sys.stdin.read()\n"], stdin=subprocess.PIPE)
    conn, _ = listener.accept()
    with listener, conn:
        assert openers.note(conn, peers.UNKNOWN_PID) and len(openers) == 1
        assert openers.alive()
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        for _ in range(100):  # the loop runs the pidfd's reader: no alive() call needed
            if not len(openers):
                break
            await asyncio.sleep(0.05)
        assert len(openers) == 0
