"""Seeding a new replica's caches from a running one, on CPU with real processes: same host
over the slab fds, over TCP on 127.0.0.1, and every refusal while the source keeps serving."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vlaunch.cache import CacheClient, load
from vlaunch.cache.client import artifacts as E
from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.store import artifacts as A

from .conftest import CacheProc, eventually, free_port, spawn_cache

TOKEN = "t" * 32
KEY = A.artifact_key({"seed": "test"})


def _dir(tmp: Path, name: str) -> Path:
    d = tmp / name
    d.mkdir(mode=0o700)
    return d


def _env(token: str = TOKEN) -> dict[str, str]:
    return {**os.environ, "VLAUNCH_SEED_TOKEN": token}


def _source(llama_ckpt: Path, tmp: Path) -> tuple[CacheProc, int]:
    """A running replica (rank 0 of tp 1) that serves seeding on a TCP port, with an artifact."""
    port = free_port()
    src = spawn_cache(llama_ckpt, _dir(tmp, "src"), "--seed-listen-port", str(port),
                      "--seed-timeout", "1", env=_env())
    assert src.proc.poll() is None
    assert E.hand_back(socket_path(src.socket_dir, 0), "flashinfer-autotune", KEY, b"tab")
    return src, port


@pytest.fixture(scope="module")
def source(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[CacheProc, int]]:
    """One source for the tests that only refuse or drop peers: it must keep serving."""
    src, port = _source(llama_ckpt, tmp_path_factory.mktemp("source"))
    yield src, port
    src.stop()


def _tensors(model: Path, sockdir: Path) -> dict:
    return dict(load(str(model), socket_dir=str(sockdir), mode="copy", fallback=False,
                     timeout=10))


def _serving(src: CacheProc) -> bool:
    client = CacheClient(socket_path(src.socket_dir, 0))
    try:
        return client.status()["state"] == "serving"
    finally:
        client.close()


def test_seeded_replicas_are_bit_exact_and_independent(llama_ckpt: Path, tmp_path: Path,
                                                       caches) -> None:
    """One replica seeded over the slab fds (unix:), one over TCP, from one source."""
    src, port = _source(llama_ckpt, tmp_path)
    caches.append(src)
    new = {}
    for how, spec in (("unix", f"unix:{src.socket_dir}"), ("tcp", f"tcp://127.0.0.1:{port}")):
        new[how] = spawn_cache(llama_ckpt, _dir(tmp_path, how), "--seed", spec, env=_env())
        caches.append(new[how])
        assert new[how].proc.poll() is None, (
            how, new[how].proc.stderr.read().decode() if new[how].proc.stderr else "")
    want = _tensors(llama_ckpt, src.socket_dir)
    src.stop()  # the new replicas no longer depend on the source
    for how, replica in new.items():
        got = _tensors(llama_ckpt, replica.socket_dir)
        assert set(got) == set(want), how
        for name, ref in want.items():
            assert got[name].view(-1).view(dtype=ref.dtype).equal(ref.view(-1)), (how, name)
        assert E.fetch(socket_path(replica.socket_dir, 0), "flashinfer-autotune", KEY) == b"tab"


def _refused(llama_ckpt: Path, tmp_path: Path, caches, *args: str, token: str = TOKEN
             ) -> str:
    new = spawn_cache(llama_ckpt, _dir(tmp_path, f"n{len(caches)}"), *args, env=_env(token))
    caches.append(new)
    assert new.proc.wait(30) == ExitStatus.SEED_FAILED
    return new.proc.stderr.read().decode() if new.proc.stderr else ""


def test_wrong_token_and_wrong_fingerprint_are_refused(llama_ckpt: Path, tmp_path: Path,
                                                       caches, source) -> None:
    src, port = source
    tcp = f"tcp://127.0.0.1:{port}"
    log = _refused(llama_ckpt, tmp_path, caches, "--seed", tcp, token="x" * 32)
    assert "wrong or missing seed token" in log
    log = _refused(llama_ckpt, tmp_path, caches, "--seed", tcp, "--kernel-backends", "fi-9")
    assert "seed source holds different weights" in log and "kernel_backends" in log
    log = _refused(llama_ckpt, tmp_path, caches, "--seed", f"unix:{src.socket_dir}",
                   "--kernel-backends", "fi-9")
    assert "kernel_backends" in log
    assert _serving(src)
    fallback = spawn_cache(llama_ckpt, _dir(tmp_path, "fb"), "--seed", tcp, "--seed-fallback",
                           env=_env("y" * 32))
    caches.append(fallback)
    assert fallback.proc.poll() is None and fallback.ready  # loaded from disk instead


def test_stalled_and_oversized_peers_are_dropped(source) -> None:
    src, port = source
    staller = socket.create_connection(("127.0.0.1", port), timeout=10)
    staller.settimeout(10)
    reply, _ = wire.recv_frame(staller)  # the source gives up on it after --seed-timeout
    assert reply["error"] == "forbidden" and "stalled" in reply["message"]
    staller.close()
    big = socket.create_connection(("127.0.0.1", port), timeout=10)
    big.sendall(protocol.HEADER.pack(b"VLCH", 1, 0, 0, 0, 0, protocol.MAX_REQUEST_BODY + 1))
    reply, _ = wire.recv_frame(big)
    assert "frame too large" in reply["message"]
    big.close()
    assert _serving(src)


def _seed_peer(port: int) -> socket.socket:
    peer = socket.create_connection(("127.0.0.1", port), timeout=10)
    wire.send_frame(peer, {"op": "seed_auth", "token": TOKEN})
    assert wire.recv_frame(peer)[0]["ok"] is True
    return peer


def test_seeding_and_a_copy_release_handover_exclude_each_other(
        llama_ckpt: Path, tmp_path: Path, caches) -> None:
    """A slab handed over to a copy-release engine is written by it: no seed stream may read
    it. While a handover is pending seeding is refused; while a stream runs, a copy-release
    engine gets a copy instead of the slabs."""
    from safetensors.torch import save_file

    big = tmp_path / "big"
    big.mkdir()  # a slab larger than two sockets buffer, so that a stream can stay in flight
    save_file({"lm_head.weight": torch.ones(4096, 4096, dtype=torch.bfloat16)},
              str(big / "model.safetensors"))
    port = free_port()  # a stream stalled by its peer stays in flight for the whole test
    src = spawn_cache(big, _dir(tmp_path, "src"), "--seed-listen-port", str(port),
                      "--seed-timeout", "60", env=_env())
    caches.append(src)
    taker = CacheClient(socket_path(src.socket_dir, 0))
    reply, fds = taker.request({"op": "open", "mode": "copy-release"})
    wire.close_fds(fds)
    assert reply.get("handover") is True
    peer = _seed_peer(port)
    wire.send_frame(peer, {"op": "seed_manifest"})
    refused, _ = wire.recv_frame(peer)
    assert refused.get("ok") is not True and "handing its slabs over" in refused["message"]
    peer.close()
    taker.close()  # left without `drop`: the slabs are the rank's again

    def seeding() -> bool:
        with _seed_peer(port) as p:
            wire.send_frame(p, {"op": "seed_manifest"})
            return wire.recv_frame(p)[0].get("ok") is True

    eventually(seeding, 30, what="seeding served again")
    # a stream that the peer does not read stays in flight
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.settimeout(10)
    slow.connect(("127.0.0.1", port))
    wire.send_frame(slow, {"op": "seed_auth", "token": TOKEN})
    assert wire.recv_frame(slow)[0]["ok"] is True
    wire.send_frame(slow, {"op": "seed_slab", "slab": 0})
    assert wire.recv_frame(slow)[0]["ok"] is True  # the stream has begun
    copier = CacheClient(socket_path(src.socket_dir, 0))
    reply, fds = copier.request({"op": "open", "mode": "copy-release"})
    wire.close_fds(fds)
    assert reply.get("ok") is True and "handover" not in reply
    copier.close()
    slow.close()


def test_truncated_stream_fails_the_seed(llama_ckpt: Path, tmp_path: Path, caches,
                                         source) -> None:
    """A fake source that cuts the slab stream in half: the new rank exits 76."""
    src, _ = source
    client = CacheClient(socket_path(src.socket_dir, 0))
    fingerprint, manifest = client.status()["fingerprint"], client.manifest()
    client.close()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(3):
                msg, _ = wire.recv_frame(conn)
                if msg["op"] == "seed_auth":
                    wire.send_frame(conn, {"ok": True})
                elif msg["op"] == "seed_manifest":
                    wire.send_frame(conn, {"ok": True, "fingerprint": fingerprint,
                                           "manifest": manifest.to_wire(), "artifacts": []})
                else:
                    size = manifest.slab_sizes[0]
                    wire.send_frame(conn, {"ok": True, "slab": 0, "nbytes": size})
                    conn.sendall(b"\0" * (size // 2))

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    log = _refused(llama_ckpt, tmp_path, caches, "--seed", f"tcp://127.0.0.1:{port}")
    assert "truncated" in log
    listener.close()
    assert _serving(src)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("how", ["unix", "tcp"])
def test_cuda_seeding_is_bit_exact(llama_ckpt: Path, tmp_path: Path, caches, how: str) -> None:
    """On a GPU: a rank seeded from a CUDA source (device to device over the slab fds, or
    through pinned buffers over TCP) holds the source's bytes, after the source is gone."""
    port = free_port()
    src = spawn_cache(llama_ckpt, _dir(tmp_path, "src"), "--device", "cuda:0",
                      "--seed-listen-port", str(port), env=_env())
    caches.append(src)
    spec = f"unix:{src.socket_dir}" if how == "unix" else f"tcp://127.0.0.1:{port}"
    new = spawn_cache(llama_ckpt, _dir(tmp_path, "new"), "--device", "cuda:0", "--seed", spec,
                      env=_env())
    caches.append(new)
    assert new.ready, new.proc.stderr.read().decode() if new.proc.stderr else ""

    def held(proc: CacheProc) -> dict[str, torch.Tensor]:
        client = CacheClient(socket_path(proc.socket_dir, 0))
        try:
            return {k: v.cpu() for k, v in client.map(client.manifest(), mode="copy",
                                                       device="cuda:0").items()}
        finally:
            client.close()

    want = held(src)
    src.stop()
    got = held(new)
    assert set(got) == set(want)
    for name, ref in want.items():
        assert got[name].equal(ref), name
