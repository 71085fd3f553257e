"""Faults at one cache rank: leases that must end, a stalled rank, a bad socket path, slow
and malicious clients, running out of file descriptors."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.client.loader import load
from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.errors import CacheUnavailableError
from vlaunch.cache.contract.exitcodes import ExitStatus

from ..conftest import eventually
from .harness import (
    Rank,
    assert_bit_exact,
    assert_gone,
    fd_kinds,
    open_fds,
    start_rank,
    threads,
)


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    """Ranks a test started; stopped (and checked gone) afterwards."""
    started: list[Rank] = []
    yield started
    for r in started:
        r.stop()
        assert_gone([r.pid], r.sockdir)


@pytest.fixture(scope="module")
def rank(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rank]:
    """One serving rank for every fault that must leave it serving (it is checked after)."""
    sockdir = tmp_path_factory.mktemp("rank") / "s"
    sockdir.mkdir(mode=0o700)
    r = start_rank(llama_ckpt, sockdir)
    assert r.ready, r.text()
    yield r
    assert r.proc.poll() is None, r.text()  # every fault harmed only its own client
    r.stop()
    assert_gone([r.pid], sockdir)


def _load(model: Path, rank: Rank, **kw: object) -> dict:
    return load(str(model), socket_dir=str(rank.sockdir), fallback=False, **kw)


def _leases(rank: Rank) -> int:
    client = CacheClient(rank.socket)
    try:
        return len(client.status()["leases"])
    finally:
        client.close()


# ---------------------------------------------------------------------- leases


def test_share_loads_that_drop_their_tensors_leak_nothing(llama_ckpt: Path, rank: Rank) -> None:
    """Repeated share loads: client fds and threads, rank fds and leases all stay flat."""
    first = _load(llama_ckpt, rank)
    del first
    gc.collect()
    eventually(lambda: _leases(rank) == 0, what="the first lease to end")
    mine, tasks, theirs = open_fds(), threads(), open_fds(rank.pid)
    for _ in range(100):
        w = _load(llama_ckpt, rank)
        t = w["model.norm.weight"]
        del w, t
    gc.collect()
    eventually(lambda: _leases(rank) == 0, what="every lease to end")
    assert open_fds() <= mine + 1 and threads() <= tasks
    eventually(lambda: open_fds(rank.pid) <= theirs, what="the rank's fds to come back")
    assert_bit_exact(_load(llama_ckpt, rank), llama_ckpt)


def test_a_lease_lasts_while_any_tensor_of_it_lives(llama_ckpt: Path, rank: Rank) -> None:
    w = _load(llama_ckpt, rank)
    kept = w["lm_head.weight"][3:5]  # a view of a view keeps the mapping, and so the lease
    del w
    gc.collect()
    assert _leases(rank) == 1
    del kept
    gc.collect()
    eventually(lambda: _leases(rank) == 0, what="the lease to end")


# ---------------------------------------------------------------------- stalls


@pytest.mark.parametrize("when", ["serving", "mid-handoff"])
def test_a_stopped_rank_fails_load_within_the_deadline(llama_ckpt: Path, rank: Rank,
                                                       monkeypatch, when: str) -> None:
    """SIGSTOP: load() fails with the documented error, or falls back to disk; SIGCONT: the
    next load is bit-exact."""
    monkeypatch.setenv("VLAUNCH_IO_TIMEOUT", "1")
    if when == "mid-handoff":  # the rank stops after it accepted us, before it answers
        client = CacheClient(rank.socket)
        rank.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(CacheUnavailableError, match="did not answer within 1 s"):
            client.manifest()
        client.close()
    else:
        rank.proc.send_signal(signal.SIGSTOP)
    with pytest.raises(CacheUnavailableError, match="did not answer within 1 s"):
        _load(llama_ckpt, rank)
    disk = load(str(llama_ckpt), socket_dir=str(rank.sockdir), fallback=True)
    assert disk.source == "disk" and "did not answer" in disk.reason
    assert_bit_exact(disk, llama_ckpt)
    rank.proc.send_signal(signal.SIGCONT)
    again = _load(llama_ckpt, rank)
    assert again.source == "cache"
    assert_bit_exact(again, llama_ckpt)


# ---------------------------------------------------------------------- environment


@pytest.mark.parametrize("stray", ["file", "symlink", "dangling symlink", "directory"])
def test_a_stray_path_at_the_socket_is_refused_before_ready(llama_ckpt: Path, sockdir: Path,
                                                            tmp_path: Path, stray: str) -> None:
    path = sockdir / "rank-0.sock"
    if stray == "file":
        path.write_text("")
    elif stray == "directory":
        path.mkdir()
    else:
        target = tmp_path / "elsewhere"
        if stray == "symlink":
            target.write_text("")
        path.symlink_to(target)
    r = start_rank(llama_ckpt, sockdir)
    assert not r.ready
    assert r.proc.wait(30) == ExitStatus.SOCKET_DIR
    assert str(path) in r.text() and f"rm {path}" in r.text()
    assert os.path.lexists(path)  # not ours to remove
    assert_gone([r.pid])


@pytest.mark.parametrize("stray", ["symlink", "dangling symlink", "directory", "fifo"])
def test_a_stray_path_at_the_lock_is_refused_with_73(llama_ckpt: Path, sockdir: Path,
                                                     tmp_path: Path, stray: str) -> None:
    """The exit-status table's 73 (SOCKET_DIR) for whatever is not a lock file of ours, not an
    I/O error (74): the lock is opened O_NOFOLLOW, a symlink there fails with ELOOP."""
    path = sockdir / "rank-0.lock"
    if stray == "directory":
        path.mkdir()
    elif stray == "fifo":
        os.mkfifo(path)
    else:
        target = tmp_path / "elsewhere"
        if stray == "symlink":
            target.write_text("")
        path.symlink_to(target)
    r = start_rank(llama_ckpt, sockdir)
    assert not r.ready
    assert r.proc.wait(30) == ExitStatus.SOCKET_DIR
    assert f"lock path {path} is a symlink or not a file of ours" in r.text()
    assert os.path.lexists(path) and not (tmp_path / "elsewhere").is_dir()  # left alone
    assert_gone([r.pid])


# ---------------------------------------------------------------------- clients


def _raw(rank: Rank) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(rank.socket))
    return s


def _header(length: int, nfds: int = 0, magic: bytes = protocol.MAGIC) -> bytes:
    return protocol.HEADER.pack(magic, protocol.VERSION, 0, 0, nfds, 0, length)


BAD_CLIENTS = {
    "partial header": lambda s: s.sendall(_header(10)[:7]),
    "partial body": lambda s: s.sendall(_header(100) + b'{"op": '),
    "bad magic": lambda s: s.sendall(_header(2, magic=b"HTTP") + b"{}"),
    "oversized frame": lambda s: s.sendall(_header(protocol.MAX_REQUEST_BODY + 1)),
    "fds on a request": lambda s: wire.send_frame(s, {"op": "status"}, [s.fileno()]),
    "unknown op": lambda s: wire.send_frame(s, {"op": "format_disk"}),
    "flood, never reads": lambda s: s.sendall(protocol.encode({"op": "manifest"}) * 2000),
    "garbage": lambda s: s.sendall(os.urandom(4096)),
    "length overflow": lambda s: s.sendall(struct.pack("!4sHBBHHI", protocol.MAGIC, 1, 0, 0,
                                                       0, 0, 2**32 - 1)),
}


@pytest.mark.parametrize("bad", sorted(BAD_CLIENTS))
def test_a_bad_client_harms_only_itself(llama_ckpt: Path, rank: Rank, bad: str) -> None:
    base = open_fds(rank.pid)
    evil = _raw(rank)
    evil.setblocking(False)
    with contextlib.suppress(BlockingIOError):  # a flood fills the socket: the rank stopped
        BAD_CLIENTS[bad](evil)                   # reading it while its replies wait
    evil.setblocking(True)
    assert_bit_exact(_load(llama_ckpt, rank, mode="copy"), llama_ckpt)
    evil.close()
    eventually(lambda: open_fds(rank.pid) <= base, what="the rank to drop the bad client")
    assert rank.proc.poll() is None


ENGINE_DIES = r"""
import os, signal, socket, sys
from vlaunch.cache.contract import wire
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
wire.send_frame(s, {"op": "manifest"})
wire.send_frame(s, {"op": "open", "mode": "share"})
if sys.argv[2] == "holding the slabs":
    wire.recv_frame(s)
    _, fds = wire.recv_frame(s)
    assert fds
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("when", ["before the replies", "holding the slabs"])
def test_an_engine_killed_mid_handoff_leaves_nothing_in_the_rank(llama_ckpt: Path, rank: Rank,
                                                                 when: str) -> None:
    base = open_fds(rank.pid)
    engine = subprocess.run([sys.executable, "-c", ENGINE_DIES, str(rank.socket), when])
    assert engine.returncode == -signal.SIGKILL
    eventually(lambda: open_fds(rank.pid) <= base and _leases(rank) == 0,
               what="the rank to forget the dead engine")
    assert_bit_exact(_load(llama_ckpt, rank, mode="copy"), llama_ckpt)


# ---------------------------------------------------------------------- resources


def _flood(rank: Rank, n: int, *, share: bool = False) -> list[socket.socket]:
    """n connections; `share`: each holds the slabs open (a lease that must not be shed)."""
    conns = []
    for _ in range(n):
        try:
            s = _raw(rank)
        except OSError:
            break
        if share:
            wire.send_frame(s, {"op": "open", "mode": "share"})
            s.settimeout(5)
            try:
                _, fds = wire.recv_frame(s)
            except (OSError, EOFError):
                s.close()
                continue
            for fd in fds:
                os.close(fd)
        conns.append(s)
    return conns


@pytest.mark.parametrize("bound", ["default", "past the fd limit"])
def test_an_idle_connection_flood_is_shed(llama_ckpt: Path, sockdir: Path, ranks: list[Rank],
                                          bound: str) -> None:
    """RLIMIT_NOFILE 96: 160 idle connections; the rank sheds (or survives EMFILE) and serves."""
    env = {"VLAUNCH_MAX_CONNECTIONS": "100000"} if bound != "default" else {}
    r = start_rank(llama_ckpt, sockdir, env=env, limits={resource.RLIMIT_NOFILE: 96})
    ranks.append(r)
    assert r.ready, r.text()
    base = open_fds(r.pid)
    conns = _flood(r, 160)
    try:
        eventually(lambda: _try_load(llama_ckpt, r), 30, what="a load during the flood")
    finally:
        for s in conns:
            s.close()
    eventually(lambda: open_fds(r.pid) <= base, what="the rank's fds to come back")
    assert r.proc.poll() is None
    text = r.text()
    assert "shed" in text
    if bound != "default":
        assert text.count("cannot accept clients") >= 1


def _try_load(model: Path, rank: Rank) -> bool:
    try:
        got = _load(model, rank, mode="copy")
    except CacheUnavailableError:
        return False
    assert_bit_exact(got, model)
    return True


def test_a_rank_that_cannot_accept_exits_72(llama_ckpt: Path, sockdir: Path,
                                            ranks: list[Rank]) -> None:
    """Connections that all hold leases, past the fd limit: the rank says so and exits 72."""
    env = {"VLAUNCH_MAX_CONNECTIONS": "100000", "VLAUNCH_STARVED_AFTER": "1"}
    memfds = fd_kinds()["memfd"]
    r = start_rank(llama_ckpt, sockdir, env=env, limits={resource.RLIMIT_NOFILE: 64})
    ranks.append(r)
    assert r.ready, r.text()
    conns = _flood(r, 100, share=True)
    try:
        extra = []
        for _ in range(8):  # knock while it is full: it must not wait for us
            try:
                extra.append(_raw(r))
            except OSError:
                break
        assert r.proc.wait(30) == ExitStatus.RANK_STARVED
    finally:
        for s in conns + extra:
            s.close()
    assert "could accept no client" in r.text() and "LimitNOFILE" in r.text()
    r.stop()
    assert fd_kinds()["memfd"] == memfds  # its escrow was the last reference we held
