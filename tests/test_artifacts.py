"""Artifacts end to end on CPU: hit, miss, hand-back, oversize, corrupt files, persistence
across a full launcher restart, the preload command, and FlashInfer's own table format."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from vlaunch.cache.client import artifacts as E
from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract.errors import ArtifactError, CacheBrokenError
from vlaunch.cache.contract.protocol import MAX_ARTIFACT
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.store import artifacts as A

from .conftest import spawn_cache

KIND = "flashinfer-autotune"
KEY = A.artifact_key({"flashinfer": "0.0", "gpu": "cpu", "ops": ["moe"], "rank": 0})


def test_miss_hand_back_hit_and_oversize(llama_ckpt: Path, sockdir: Path, caches,
                                         caplog: pytest.LogCaptureFixture) -> None:
    caches.append(spawn_cache(llama_ckpt, sockdir, "--plan", "replicate"))
    sock = socket_path(sockdir, 0)
    produced: list[bytes] = []
    adopted: list[bytes] = []

    def produce() -> bytes:
        produced.append(b"table" * 100)
        return produced[-1]

    assert E.adopt_or_produce(sock, KIND, KEY, adopt=adopted.append, produce=produce) == "miss"
    assert E.adopt_or_produce(sock, KIND, KEY, adopt=adopted.append, produce=produce) == "hit"
    assert adopted == produced and len(produced) == 1
    client = CacheClient(sock)
    with pytest.raises(ArtifactError, match="over the limit"):
        client.artifact_put(KIND, KEY, b"\0" * (MAX_ARTIFACT + 1))
    with pytest.raises(CacheBrokenError, match="too_large"):  # the server checks it too
        client.request({"op": "artifact_put", "kind": KIND, "key": KEY,
                        "data": A.encode(b"\0" * (MAX_ARTIFACT + 1))})
    client.artifact_put(KIND, KEY, b"\1" * MAX_ARTIFACT)  # exactly the limit is fine
    assert client.artifact_get(KIND, KEY) == b"\1" * MAX_ARTIFACT
    assert client.status()["state"] == "serving"
    client.close()
    # no cache at all: a miss with one warning, the engine tunes and carries on
    with caplog.at_level(logging.WARNING):
        got = E.adopt_or_produce(sockdir / "nope.sock", KIND, KEY, adopt=adopted.append,
                                 produce=lambda: b"x", timeout=0)  # a miss: do not wait
    assert got == "miss"
    assert [r.message for r in caplog.records if "not fetched" in r.message]


def test_store_bounds_and_corrupt_files(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                        ) -> None:
    store = A.ArtifactStore(tmp_path / "a", max_count=3)
    keys = [A.artifact_key({"i": i}) for i in range(5)]
    for i, key in enumerate(keys):
        store.put(KIND, key, bytes([i]) * 10)
    assert len(store) == 3 and store.get(KIND, keys[0]) is None  # the oldest went first
    assert len(list((tmp_path / "a").glob("*.art"))) == 3
    with pytest.raises(ArtifactError, match="bad artifact name"):
        store.put("../x", keys[0], b"")
    files = sorted((tmp_path / "a").glob("*.art"))
    files[0].write_bytes(files[0].read_bytes()[:-1])  # truncated
    raw = bytearray(files[1].read_bytes())
    raw[-1] ^= 0xFF
    files[1].write_bytes(bytes(raw))  # flipped a bit
    (tmp_path / "a" / f"{KIND}.{keys[0]}.art").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        again = A.ArtifactStore(tmp_path / "a", max_count=3)
    assert len(again) == 1 and again.get(KIND, keys[4]) == bytes([4]) * 10
    text = caplog.text
    assert "size mismatch" in text and "sha256 mismatch" in text and "bad header" in text


ENGINE = r"""
import os, sys
from vlaunch.cache.client import artifacts as E
from vlaunch.cache.store import artifacts as A
from vlaunch.cache.contract.sockdir import socket_path
sock = socket_path(os.environ["VLAUNCH_SOCKET_DIR"], 0)
key = A.artifact_key({"test": "launcher"})
got = E.adopt_or_produce(sock, "flashinfer-autotune", key, adopt=lambda d: None,
                         produce=lambda: b"T" * 1000)
who = "preload" if os.environ.get("VLAUNCH_PRELOAD") else "engine"
with open(sys.argv[1], "a") as f:
    f.write(f"{who} {got}\n")
"""


def _run(tmp: Path, model: Path, artifacts: Path, out: Path, *extra: str) -> int:
    sock = tmp / f"sock{len(list(tmp.glob('sock*')))}"
    cmd = [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(model),
           "--plan", "replicate", "--socket-dir", str(sock), "--health-port", "-1",
           "--artifact-dir", str(artifacts), "--stop-on-engine-success", *extra,
           "--", sys.executable, "-c", ENGINE, str(out)]
    return subprocess.run(cmd, capture_output=True, timeout=120).returncode


def test_persistence_across_a_launcher_restart_and_preload(tmp_path: Path, llama_ckpt: Path
                                                           ) -> None:
    out = tmp_path / "out.txt"
    assert _run(tmp_path, llama_ckpt, tmp_path / "art", out) == 0
    assert _run(tmp_path, llama_ckpt, tmp_path / "art", out) == 0  # a whole new launcher
    assert out.read_text().split("\n")[:2] == ["engine miss", "engine hit"]
    assert len(list((tmp_path / "art" / "rank-0").glob("*.art"))) == 1
    out2 = tmp_path / "out2.txt"
    preload = f"{sys.executable} -c '{ENGINE}' {out2}"
    assert _run(tmp_path, llama_ckpt, tmp_path / "art2", out2, "--preload-autotune",
                preload) == 0
    assert out2.read_text().split("\n")[:2] == ["preload miss", "engine hit"]
    out3 = tmp_path / "out3.txt"  # a failing preload is one warning; the engine still runs
    assert _run(tmp_path, llama_ckpt, tmp_path / "art3", out3, "--preload-autotune",
                f"{sys.executable} -c 'raise SystemExit(3)'") == 0
    assert out3.read_text() == "engine miss\n"


needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="flashinfer is not installed (the extra)")


@needs_flashinfer
def test_flashinfer_table_adopted_through_the_cache(llama_ckpt: Path, sockdir: Path,
                                                    caches) -> None:
    """A table made by FlashInfer's own AutoTuner (its profiling cache, filled the way its
    `_cache_profile_result` does: tuning itself needs a GPU) goes through the cache and is
    adopted by a fresh AutoTuner, as a restarted engine would."""
    from flashinfer.autotuner import AutoTuner, ProfilingCacheKey

    from vlaunch.cache.integrations import flashinfer_adapter as fa

    caches.append(spawn_cache(llama_ckpt, sockdir, "--plan", "replicate"))
    sock = socket_path(sockdir, 0)
    tuner = AutoTuner()
    key = ProfilingCacheKey("flashinfer::fused_moe", "CutlassFusedMoERunner", 1,
                            ((8, 4096), (4096, 128)), ())
    tuner.profiling_cache[key] = ((3, 1), None)
    table_key = fa.table_key(rank=0, ops=["flashinfer::fused_moe"], shapes=[(8, 4096)])
    assert E.fetch(sock, fa.KIND, table_key) is None  # miss
    assert E.hand_back(sock, fa.KIND, table_key, fa.export_table(tuner))  # hand back
    restarted = AutoTuner()
    fa.adopt_table(E.fetch(sock, fa.KIND, table_key) or b"", restarted)  # hit: adopt
    saved = json.loads(fa.export_table(restarted))
    assert saved[key.file_key] == ["CutlassFusedMoERunner", [3, 1]]
    with pytest.raises(ArtifactError):
        fa.adopt_table(b"not json", restarted)
    # the context manager: a hit yields True and the engine skips its pass
    with fa.tuned(sock, rank=0, ops=["flashinfer::fused_moe"], shapes=[(8, 4096)]) as hit:
        assert hit
    # a miss runs the body under flashinfer.autotune(True), then hands the process-wide
    # tuner's table (AutoTuner.get().save_configs) back: the next engine hits
    other = {"rank": 0, "ops": ["flashinfer::bmm_fp8"], "shapes": [(16, 16)]}
    with fa.tuned(sock, **other) as hit:
        assert not hit
    assert E.fetch(sock, fa.KIND, fa.table_key(**other)) is not None
    with fa.tuned(sock, **other) as hit:
        assert hit


def test_a_respawned_rank_gets_its_artifacts_back_from_the_escrow(tmp_path: Path,
                                                                  llama_ckpt: Path) -> None:
    """No --artifact-dir: the rank escrows each artifact it is handed with the launcher, and
    a rank respawned after a SIGKILL (--on-rank-exit respawn) holds it again."""
    import psutil

    from .conftest import eventually

    sockdir, log = tmp_path / "sock", tmp_path / "launcher.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(llama_ckpt),
         "--plan", "replicate", "--socket-dir", str(sockdir), "--health-port", "-1",
         "--on-rank-exit", "respawn"], stderr=log.open("wb"))
    sock = socket_path(sockdir, 0)

    def rank_pid() -> int | None:
        assert launcher.poll() is None, log.read_text()
        ranks = []
        for p in psutil.Process(launcher.pid).children():
            with contextlib.suppress(psutil.Error):  # the killed rank: a zombie until reaped
                if "vlaunch.cache" in " ".join(p.cmdline()):
                    ranks.append(p)
        return ranks[0].pid if ranks and sock.exists() else None

    try:
        first = eventually(rank_pid, 60, what=lambda: log.read_text())
        assert E.hand_back(sock, KIND, KEY, b"table" * 1000)
        psutil.Process(first).kill()
        eventually(lambda: (rank_pid() or first) != first and "adopted escrowed artifact"
                   in log.read_text(), 60, what=lambda: log.read_text())
        assert E.fetch(sock, KIND, KEY, timeout=30) == b"table" * 1000
        assert "adopted 1 escrowed slab(s)" in log.read_text()
    finally:
        launcher.terminate()
        assert launcher.wait(60) == 0, log.read_text()


def test_the_escrow_bounds_the_artifacts_it_holds_and_hands_them_over() -> None:
    """Pure escrow: a rank not held is ignored, an oversized frame refused, count and bytes
    capped (the oldest go first); a respawn gets the escrow frame, then the artifacts."""
    import socket
    import threading

    from vlaunch.cache.contract import protocol, wire
    from vlaunch.launcher.escrow import MAX_ARTIFACTS, Escrow

    def frame(i: int, size: int = 8) -> dict:
        return protocol.event("artifact", kind=KIND, key=A.artifact_key({"i": i}),
                              data="QQ==" * (size // 4))

    def handed(escrow: Escrow, rank: int, n: int) -> list[dict]:
        """The n frames a respawn of `rank` gets, and that nothing follows them."""
        ours, theirs = socket.socketpair()
        sender = threading.Thread(target=escrow.hand_over, args=(rank, ours))
        sender.start()
        with theirs:
            theirs.settimeout(30)
            frames = [wire.recv_frame(theirs)[0] for _ in range(n)]
            sender.join(30)
            ours.close()
            with pytest.raises(EOFError):
                wire.recv_frame(theirs)
        return frames

    escrow = Escrow()
    escrow.keep_artifact(0, frame(0))  # not held: nothing to attach it to
    assert 0 not in escrow
    for rank in (0, 1):
        escrow.keep(rank, {"manifest": {}, "fingerprint": {}}, [])
    escrow.keep_artifact(0, frame(-1, protocol.MAX_ARTIFACT_DATA + 4))  # over the limit
    for i in range(MAX_ARTIFACTS + 3):
        escrow.keep_artifact(0, frame(i))
    frames = handed(escrow, 0, 1 + MAX_ARTIFACTS)
    assert frames[0]["event"] == "escrow"
    assert [f["key"] for f in frames[1:]] == [frame(i)["key"] for i in range(3, MAX_ARTIFACTS + 3)]
    for i in range(6):  # at the size limit: four fit
        escrow.keep_artifact(1, frame(i, protocol.MAX_ARTIFACT_DATA))
    assert [f["key"] for f in handed(escrow, 1, 5)[1:]] == [frame(i)["key"] for i in range(2, 6)]
