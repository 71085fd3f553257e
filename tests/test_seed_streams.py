"""Seeding on several TCP streams: bit-exact at TP 2 x PP 2 across two launchers, and each
failure (a wrong token, other weights, a stalled source, a source that dies mid-stream)
refused or fallen back as documented, with nothing partial ever served."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vlaunch.cache import CacheClient, load
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import socket_path

from .conftest import CacheProc, free_port, spawn_cache
from .test_launcher import Launcher

TOKEN = "s" * 32
ENV = {**os.environ, "VLAUNCH_SEED_TOKEN": TOKEN}


def _dir(tmp: Path, name: str) -> Path:
    d = tmp / name
    d.mkdir(mode=0o700)
    return d


def held(sockdir: Path, model: Path, rank: int, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """A rank's tensors as its cache serves them (copied out)."""
    return dict(load(str(model), rank=rank, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     socket_dir=str(sockdir), mode="copy", fallback=False, timeout=10,
                     device="cpu"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit."""
    return set(a) == set(b) and all(
        a[k].view(-1).view(torch.uint8).equal(b[k].view(-1).view(torch.uint8)) for k in a)


@pytest.mark.slow
def test_a_tp2_pp2_replica_seeded_across_two_launchers_is_bit_exact(
        llama_ckpt: Path, tmp_path: Path) -> None:
    port = free_port()
    sizes = ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    os.environ["VLAUNCH_SEED_TOKEN"] = TOKEN  # the Launcher passes os.environ on
    try:
        source = Launcher(tmp_path / "a", llama_ckpt, *sizes, "--seed-listen-port", str(port))
        source.wait_for(lambda s: s["phase"] == "serving")
        new = Launcher(tmp_path / "b", llama_ckpt, *sizes, "--seed",
                       f"tcp://127.0.0.1:{port}", "--seed-streams", "3")
        new.wait_for(lambda s: s["phase"] == "serving")
    finally:
        os.environ.pop("VLAUNCH_SEED_TOKEN")
    try:
        want = {r: held(source.sockdir, llama_ckpt, r, 2, 2) for r in range(4)}
        source.proc.send_signal(signal.SIGTERM)  # the new replica serves on its own
        assert source.wait_exit() == 0
        for rank in range(4):
            assert same(held(new.sockdir, llama_ckpt, rank, 2, 2), want[rank]), rank
        text = new.text()
        assert text.count("seeded ") == 4 and "streams); serving on our own" in text
    finally:
        source.close()
        new.close()


@pytest.mark.slow
def test_a_wrong_token_or_other_weights_end_the_new_replica_with_76(
        llama_ckpt: Path, tmp_path: Path) -> None:
    port = free_port()
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    os.environ["VLAUNCH_SEED_TOKEN"] = TOKEN
    source = Launcher(tmp_path / "a", llama_ckpt, "--seed-listen-port", str(port))
    try:
        source.wait_for(lambda s: s["phase"] == "serving")
        os.environ["VLAUNCH_SEED_TOKEN"] = "w" * 32
        wrong = Launcher(tmp_path / "b", llama_ckpt, "--seed", f"tcp://127.0.0.1:{port}")
        assert wrong.wait_exit(120) == ExitStatus.SEED_FAILED
        assert "wrong or missing seed token" in wrong.text()
        os.environ["VLAUNCH_SEED_TOKEN"] = TOKEN
        other = Launcher(tmp_path / "c", llama_ckpt, "--seed", f"tcp://127.0.0.1:{port}",
                         "--kernel-backends", "fi-9")
        assert other.wait_exit(120) == ExitStatus.SEED_FAILED
        assert "seed source holds different weights" in other.text()
        for failed in (wrong, other):  # never served: no socket was bound
            assert not list(failed.sockdir.glob("*.sock"))
        assert source.status()["phase"] == "serving"
    finally:
        os.environ.pop("VLAUNCH_SEED_TOKEN", None)
        for la in (source, locals().get("wrong"), locals().get("other")):
            if la is not None:
                la.close()


# A seed source that speaks the protocol but misbehaves once bytes flow: it serves the real
# fingerprint and manifest (from a file), then sends the first half of every range and
# stalls ("stall") or waits to be killed ("die"), saying "streaming" when it got there.
FAKE = r"""
import json, socket, sys, threading, time
from vlaunch.cache.contract import wire
mode, info = sys.argv[1], json.load(open(sys.argv[2]))
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)

def serve(conn):
    while True:
        msg, _ = wire.recv_frame(conn)
        if msg["op"] == "seed_auth":
            wire.send_frame(conn, {"ok": True})
        elif msg["op"] == "seed_manifest":
            wire.send_frame(conn, {"ok": True, "fingerprint": info["fingerprint"],
                                   "manifest": info["manifest"], "artifacts": [],
                                   "ranges": True, "streams": 16})
        else:
            wire.send_frame(conn, {"ok": True, "slab": msg["slab"], "offset": msg["offset"],
                                   "nbytes": msg["nbytes"]})
            conn.sendall(b"\1" * (msg["nbytes"] // 2))
            print("streaming", flush=True)
            time.sleep(600)

while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


@pytest.fixture(scope="module")
def real(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real rank's fingerprint and manifest, for the fake sources to serve."""
    src = spawn_cache(llama_ckpt, _dir(tmp_path_factory.mktemp("real"), "s"))
    client = CacheClient(socket_path(src.socket_dir, 0))
    try:
        info = {"fingerprint": client.status()["fingerprint"],
                "manifest": client.manifest().to_wire()}
    finally:
        client.close()
        src.stop()
    return info


def fake_source(tmp: Path, mode: str, info: dict[str, Any]) -> tuple[subprocess.Popen[str],
                                                                     int]:
    path = tmp / "info.json"
    path.write_text(json.dumps(info))
    proc = subprocess.Popen([sys.executable, "-c", FAKE, mode, str(path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def seeding(llama_ckpt: Path, tmp: Path, port: int, *args: str, timeout: str = "1",
            wait: bool = False) -> CacheProc:
    return spawn_cache(llama_ckpt, _dir(tmp, "new"), "--seed", f"tcp://127.0.0.1:{port}",
                       "--seed-timeout", timeout, *args, env=ENV, wait=wait)


def stderr(c: CacheProc) -> str:
    return c.proc.stderr.read().decode() if c.proc.stderr else ""


def test_a_stalled_source_fails_the_seed_and_nothing_partial_is_served(
        llama_ckpt: Path, tmp_path: Path, real: dict[str, Any], caches) -> None:
    fake, port = fake_source(tmp_path, "stall", real)
    try:
        new = seeding(llama_ckpt, tmp_path, port)
        caches.append(new)
        assert new.proc.wait(60) == ExitStatus.SEED_FAILED
        assert "stalled: no byte in time" in stderr(new)
        assert not list(new.socket_dir.glob("*.sock"))
    finally:
        fake.kill()
        fake.wait()


def test_with_fallback_a_stalled_seed_loads_from_disk_instead(
        llama_ckpt: Path, tmp_path: Path, real: dict[str, Any], caches) -> None:
    from safetensors.torch import load_file

    fake, port = fake_source(tmp_path, "stall", real)
    try:
        new = seeding(llama_ckpt, tmp_path, port, "--seed-fallback", wait=True)
        caches.append(new)
        assert new.ready, stderr(new)
        want: dict[str, torch.Tensor] = {}
        for f in sorted(llama_ckpt.glob("*.safetensors")):
            want.update(load_file(str(f)))
        assert same(held(new.socket_dir, llama_ckpt, 0, 1, 1), want)  # none of the halves
        new.stop()
        assert "loading from disk instead (--seed-fallback)" in stderr(new)
    finally:
        fake.kill()
        fake.wait()


def test_a_source_that_dies_mid_stream_fails_the_seed(
        llama_ckpt: Path, tmp_path: Path, real: dict[str, Any], caches) -> None:
    fake, port = fake_source(tmp_path, "die", real)
    new = seeding(llama_ckpt, tmp_path, port, timeout="60")
    caches.append(new)
    assert fake.stdout is not None and fake.stdout.readline().strip() == "streaming"
    fake.send_signal(signal.SIGKILL)  # mid-range: half of it sent
    fake.wait()
    assert new.proc.wait(60) == ExitStatus.SEED_FAILED
    log = stderr(new)
    assert "truncated" in log or "reset" in log, log
    assert not list(new.socket_dir.glob("*.sock"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_slabs_seed_bit_exact_on_several_streams(tmp_path: Path, caches) -> None:
    """A shard of several ranges, each through the pinned buffers of both sides (device to
    host to socket, socket to host to device), on three connections at once."""
    from safetensors.torch import save_file

    model = tmp_path / "m"
    model.mkdir()
    g = torch.Generator().manual_seed(1)
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(4096, 4096, generator=g)
               .to(torch.bfloat16) for i in range(9)}, str(model / "model.safetensors"))
    port = free_port()
    src = spawn_cache(model, _dir(tmp_path, "src"), "--device", "cuda:0", "--plan", "replicate",
                      "--seed-listen-port", str(port), env=ENV)
    caches.append(src)
    new = spawn_cache(model, _dir(tmp_path, "new"), "--device", "cuda:0", "--plan", "replicate",
                      "--seed", f"tcp://127.0.0.1:{port}", "--seed-streams", "3", env=ENV)
    caches.append(new)
    assert new.ready, stderr(new)

    def on(proc: CacheProc) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in load(str(model), socket_dir=str(proc.socket_dir),
                                            mode="copy", fallback=False, timeout=10,
                                            device="cuda:0", plan="replicate").items()}

    want = on(src)
    src.stop()
    assert same(on(new), want)


def test_the_source_serves_ranges_and_whole_slabs_only_after_the_token(
        llama_ckpt: Path, tmp_path: Path, caches) -> None:
    """The source's side of the wire: nothing before the token; a range's exact bytes; a
    whole slab for a seeding rank of an earlier version; a range outside its slab dropped."""
    import socket

    from vlaunch.cache.contract import wire

    port = free_port()
    src = spawn_cache(llama_ckpt, _dir(tmp_path, "src"), "--seed-listen-port", str(port),
                      env=ENV)
    caches.append(src)
    client = CacheClient(socket_path(src.socket_dir, 0))
    manifest = client.manifest()
    slab = client.map(manifest, mode="copy")  # the slab's bytes, through the Unix socket
    client.close()
    whole = bytearray(manifest.slab_sizes[0])
    for t in manifest.tensors:
        whole[t.offset:t.offset + t.nbytes] = slab[t.name].contiguous().view(-1).view(
            torch.uint8).numpy().tobytes()

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.settimeout(10)
        return sock

    def read(sock: socket.socket, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            out += sock.recv(n - len(out))
        return bytes(out)

    with connect() as early:  # a range before the token: refused, the connection dropped
        wire.send_frame(early, {"op": "seed_range", "slab": 0, "offset": 0, "nbytes": 8})
        assert "wrong or missing seed token" in wire.recv_frame(early)[0]["message"]
    with connect() as sock:
        wire.send_frame(sock, {"op": "seed_auth", "token": TOKEN})
        assert wire.recv_frame(sock)[0]["ok"] is True
        one = [t for t in manifest.tensors if t.nbytes][1]  # one tensor's bytes, exactly
        wire.send_frame(sock, {"op": "seed_range", "slab": one.slab, "offset": one.offset,
                               "nbytes": one.nbytes})
        assert wire.recv_frame(sock)[0]["nbytes"] == one.nbytes
        assert read(sock, one.nbytes) == whole[one.offset:one.offset + one.nbytes]
        wire.send_frame(sock, {"op": "seed_slab", "slab": 0})  # an earlier version's request
        assert wire.recv_frame(sock)[0]["nbytes"] == len(whole)
        everything = read(sock, len(whole))
        wire.send_frame(sock, {"op": "seed_range", "slab": 0, "offset": len(whole) - 8,
                               "nbytes": 16})
        assert "is outside slab" in wire.recv_frame(sock)[0]["message"]
    live = [t for t in manifest.tensors if t.nbytes]
    for t in live:  # the tensors' bytes: padding between them may be anything
        assert everything[t.offset:t.offset + t.nbytes] == whole[t.offset:t.offset + t.nbytes]
