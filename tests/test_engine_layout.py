"""Engine-shaped layouts: real cache ranks, the reference engine's post-processing, CPU slabs.

An "engine" here is the reference model's own post-processing (fused qkv and gate_up, padded
vocabulary), applied to each rank's raw shard: the first start hands it back, later starts
map it without the checkpoint.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import eventually, spawn_cache
from vlaunch.cache import hand_back, load
from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.client.layout import layout_nbytes
from vlaunch.cache.client.loader import load_from_disk
from vlaunch.cache.contract import engine_layout as el
from vlaunch.cache.contract import progress, wire
from vlaunch.cache.contract.errors import CacheBrokenError
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.reference.config import ModelConfig
from vlaunch.cache.reference.layout import engine_layout, layout_fields, padded_part
from vlaunch.cache.reference.refmodel import make_checkpoint
from vlaunch.cache.store.plan import Position
from vlaunch.cache.store.target import Target

STARTUP_S = 150.0
SHAPES = {"hidden": 64, "layers": 2, "heads": 8, "kv_heads": 4, "intermediate": 128,
          "vocab": 252}  # vocab / 4 = 63 rows a rank: padded to 64


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    started: list[Rank] = []
    yield started
    for r in started:
        r.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", **SHAPES)


@dataclass
class Rank:
    """A cache rank whose ready channel the test keeps open, as the launcher does."""

    proc: subprocess.Popen[bytes]
    channel: socket.socket
    ready: dict = field(default_factory=dict)
    fds: list[int] = field(default_factory=list)

    def frame(self) -> tuple[dict, list[int]]:
        """The next frame on the ready channel that is not a progress report, nor what the
        rank tells the launcher of its clients (their hellos, who opened the slabs)."""
        while True:
            msg, fds = progress.recv_ready(self.channel)
            if msg.get("event") not in ("hello", "openers"):
                return msg, fds

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.channel.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _spawn_all(model: Path, sockdir: Path, tp: int, pp: int, ranks: list[Rank]) -> None:
    """Every rank of a tp x pp world, started at once; waits for each one's ready frame."""
    for rank in range(tp * pp):
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "vlaunch.cache", "--model", str(model), "--socket-dir",
               str(sockdir), "--rank", str(rank), "--tensor-parallel-size", str(tp),
               "--pipeline-parallel-size", str(pp), "--ready-fd", str(theirs.fileno())]
        proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stderr=subprocess.DEVNULL)
        theirs.close()
        ours.settimeout(STARTUP_S)  # a loaded 2-core machine starts 8 ranks slowly
        ranks.append(Rank(proc, ours))
    for r in ranks:
        r.ready, r.fds = r.frame()
        assert r.ready["event"] == "ready"


def _memfd_inodes(pid: int) -> set[int]:
    """Inodes of the memfd slabs a process holds open or mapped."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "vlaunch-slab" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            continue
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if "vlaunch-slab" in line:
                found.add(int(line.split()[4]))
    return found


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize(("tp", "pp"), [(2, 2), (4, 2)])
def test_engine_layout_round_trip_at_tp_and_pp(model: Path, sockdir: Path, ranks: list[Rank],
                                                tmp_path: Path, tp: int, pp: int) -> None:
    cfg = ModelConfig.from_dir(model)
    _spawn_all(model, sockdir, tp, pp, ranks)
    raw_inodes = {r.ready["rank"]: {os.fstat(fd).st_ino for fd in r.fds} for r in ranks}
    fields = layout_fields(cfg, "bfloat16")
    where = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "socket_dir": str(sockdir),
             "device": "cpu"}
    expected = {}
    for rank in range(tp * pp):
        disk = dict(load_from_disk(Target(str(model), Position.from_global(rank, tp, pp), "cpu")))
        raw = load(str(model), rank=rank, fallback=False, layout=fields, **where)
        assert raw.source == "cache" and not raw.layout and "no engine layout" in raw.layout_miss
        _equal(dict(raw), disk)  # the raw layout: bit-exact against a disk load
        expected[rank] = engine_layout(disk, cfg, tp)
        norm = next(n for n in expected[rank] if n.endswith("norm.weight"))
        back = hand_back(engine_layout(raw, cfg, tp), model=str(model), fields=fields,
                         copy=[norm], rank=rank, **where)
        del raw
        _equal(dict(back), expected[rank])
        assert back.layout == el.layout_key(fields) and back.copied == {norm}
        back[norm].add_(1)  # a copied tensor is the engine's own: writable, not shared
        if "model.embed_tokens.weight" in back:  # shared: a view of the read-only mapping
            assert back["model.embed_tokens.weight"].shape[0] == padded_part(cfg, tp)
        del back
    gc.collect()
    for p in ranks:  # the engine layout adopted and escrowed, the raw layout released
        rank = p.ready["rank"]
        layout, layout_fds = p.frame()
        assert layout["event"] == "layout" and layout["key"] == el.layout_key(fields)
        assert p.frame() == ({"event": "release", "layout": "raw"}, [])
        for fd in p.fds + layout_fds:  # as the launcher does on "release"
            os.close(fd)
        p.fds = []
        status = CacheClient(socket_path(sockdir, rank)).status()
        (summary,) = status["layouts"]
        assert status["raw"] == "released" and summary["key"] == el.layout_key(fields)
        assert summary["copied"] == 1 and summary["shared"] == summary["tensors"] - 1
        assert status["bytes_held"] == {"cpu": summary["bytes"]}
        assert not raw_inodes[rank] & _memfd_inodes(p.proc.pid)
        assert not raw_inodes[rank] & _memfd_inodes(os.getpid())

    moved = tmp_path / "moved"  # a restart maps the engine layout without the checkpoint
    moved.mkdir()
    for f in model.glob("*.safetensors*"):
        shutil.move(str(f), moved / f.name)
    try:
        for rank in range(tp * pp):
            again = load(str(model), rank=rank, fallback=False, layout=fields, **where)
            assert again.layout and again.source == "cache"
            _equal(dict(again), expected[rank])
    finally:
        for f in moved.iterdir():
            shutil.move(str(f), model / f.name)


def test_every_field_of_an_engine_layout_must_match(model: Path, sockdir: Path,
                                                    caches: list) -> None:
    cfg = ModelConfig.from_dir(model)
    caches.append(spawn_cache(model, sockdir))
    fields = {**layout_fields(cfg, "bfloat16"), "kernel_backends": "attn=sdpa"}
    raw = load(str(model), socket_dir=str(sockdir), device="cpu")
    eng = engine_layout(raw, cfg, 1)
    back = hand_back(eng, model=str(model), fields=fields, socket_dir=str(sockdir),
                     device="cpu", release_raw=False, copy=["model.norm.weight"])
    del raw, back
    target = Target.resolve(str(model), socket_dir=str(sockdir), device="cpu")
    (held,) = CacheClient(socket_path(sockdir, 0)).status()["layouts"]
    shared = held["bytes"] - eng["model.norm.weight"].nbytes  # slabs, less the private copy
    assert layout_nbytes(target, fields) == shared
    assert layout_nbytes(target, {**fields, "engine": "x"}) == 0
    for name in fields:
        other = {**fields, name: fields[name] + "-other"}
        weights = load(str(model), socket_dir=str(sockdir), device="cpu", layout=other)
        assert not weights.layout and weights.source == "cache"  # the raw layout instead
        assert f"{name}: cache='{fields[name]}' engine='{fields[name]}-other'" in \
            weights.layout_miss, weights.layout_miss
    same = load(str(model), socket_dir=str(sockdir), device="cpu", layout=dict(fields))
    assert same.layout == el.layout_key(fields)
    fds = set(os.listdir("/proc/self/fd"))
    # raw fields count too (not the plan: at TP 1 every rule plan holds the same, "whole")
    for where in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        miss = load(str(model), socket_dir=str(sockdir), device="cpu", layout=fields, **where)
        assert not miss.layout and miss.source == "disk" and "mismatch" in miss.layout_miss
    # the layout's slabs came with the open that went out with the hello: closed, not kept
    assert set(os.listdir("/proc/self/fd")) <= fds


def test_an_engine_layout_load_sets_off_no_collection(model: Path, sockdir: Path, caches: list,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapping an engine layout holds the collector off, as a raw load does: no collection in
    the middle of the handoff, none due when it returns."""
    from vlaunch.cache.client import layout as client_layout

    cfg = ModelConfig.from_dir(model)
    caches.append(spawn_cache(model, sockdir))
    fields = layout_fields(cfg, "bfloat16")
    raw = load(str(model), socket_dir=str(sockdir), device="cpu")
    back = hand_back(engine_layout(raw, cfg, 1), model=str(model), fields=fields,
                     socket_dir=str(sockdir), device="cpu", release_raw=False)
    del raw, back
    passes: list[int] = []
    handing: list[int] = []  # passes counted when the layout's handoff began
    handoff = client_layout._handoff

    def begin(*args: object, **kw: object) -> object:
        handing.append(len(passes))
        return handoff(*args, **kw)

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append(info["generation"])

    monkeypatch.setattr(client_layout, "_handoff", begin)
    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(20, 10, 10)  # far fewer objects than the handoff makes
    gc.callbacks.append(count)
    try:
        weights = load(str(model), socket_dir=str(sockdir), device="cpu", layout=fields)
        after = gc.get_count()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*thresholds)
    assert weights.layout == el.layout_key(fields) and gc.isenabled()
    assert len(passes) == handing[0] and after[0] < 20, (passes, handing, after)


def test_layout_requests_are_bounded_and_checked(model: Path, sockdir: Path,
                                                 caches: list) -> None:
    cache = spawn_cache(model, sockdir)
    caches.append(cache)
    client = CacheClient(socket_path(sockdir, 0))
    ours = client.status()["fingerprint"]
    fields = {"engine": "t"}
    alloc = {"op": "layout_alloc", "fingerprint": ours, "fields": fields}
    with pytest.raises(CacheBrokenError, match="exceed this rank's limit"):
        client.request({**alloc, "sizes": [1 << 40]})
    with pytest.raises(CacheBrokenError, match="sizes must be"):
        client.request({**alloc, "sizes": [0]})
    with pytest.raises(CacheBrokenError, match="not allowed"):
        client.request({**alloc, "fields": {"tp_rank": "1"}, "sizes": [256]})
    commit = {"op": "layout_commit", "fields": fields, "copy": [], "release_raw": True}
    with pytest.raises(CacheBrokenError, match="without a layout_alloc"):
        client.request({**commit, "tensors": [["x", "BF16", [2], [1], 0, 0, 4, None]]})
    _, fds = client.request({**alloc, "sizes": [256]})
    pending = {os.fstat(fd).st_ino for fd in fds}
    for fd in fds:
        os.close(fd)
    with pytest.raises(CacheBrokenError, match="extends past the end"):
        client.request({**commit, "tensors": [["x", "BF16", [200], [1], 0, 0, 400, None]]})
    assert pending & _memfd_inodes(cache.proc.pid) == set()  # a refused commit frees its slabs
    _, fds = client.request({**alloc, "sizes": [256]})
    pending = {os.fstat(fd).st_ino for fd in fds}
    for fd in fds:
        os.close(fd)
    assert pending <= _memfd_inodes(cache.proc.pid)
    client.close()  # a connection that goes before its commit takes its allocation with it
    probe = CacheClient(socket_path(sockdir, 0))
    assert probe.status()["layouts"] == []
    assert pending & _memfd_inodes(cache.proc.pid) == set()
    assert probe.status()["raw"] == "held"


def test_a_respawned_rank_adopts_the_escrowed_engine_layout(
        model: Path, sockdir: Path, ranks: list[Rank]) -> None:
    """What the launcher does with the ready channel: keep it, escrow the engine layout, drop
    the raw slabs on release; a rank respawned from that escrow serves the engine layout."""
    cfg = ModelConfig.from_dir(model)
    _spawn_all(model, sockdir, 1, 1, ranks)
    (first,) = ranks
    fields = layout_fields(cfg, "bfloat16")
    raw = load(str(model), socket_dir=str(sockdir), device="cpu")
    want = engine_layout(dict(raw), cfg, 1)
    del raw
    hand_back(want, model=str(model), fields=fields, socket_dir=str(sockdir), device="cpu")
    layout, layout_fds = first.frame()
    assert first.frame() == ({"event": "release", "layout": "raw"}, [])
    first.stop()  # the rank dies; the launcher respawns it from what it escrowed

    adopt_ours, adopt_theirs = socket.socketpair()
    ours, theirs = socket.socketpair()
    cmd = [sys.executable, "-m", "vlaunch.cache", "--model", str(model), "--socket-dir",
           str(sockdir), "--ready-fd", str(theirs.fileno()), "--adopt-fd",
           str(adopt_theirs.fileno())]
    proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno(), adopt_theirs.fileno()],
                            stderr=subprocess.DEVNULL)
    adopt_theirs.close()
    theirs.close()
    ours.settimeout(STARTUP_S)
    second = Rank(proc, ours)
    ranks.append(second)
    with adopt_ours:
        wire.send_frame(adopt_ours, {"event": "escrow", "manifest": first.ready["manifest"],
                                     "fingerprint": first.ready["fingerprint"],
                                     "released": True})
        wire.send_frame(adopt_ours, layout, layout_fds)
    for fd in layout_fds:
        os.close(fd)
    second.ready, second.fds = second.frame()
    again, again_fds = second.frame()  # re-announced, for the new escrow
    second.fds += again_fds
    assert second.ready["event"] == "ready" and again["key"] == layout["key"]
    assert second.frame() == ({"event": "release", "layout": "raw"}, [])
    got = load(str(model), socket_dir=str(sockdir), device="cpu", layout=fields,
               fallback=False)
    assert got.layout == layout["key"]
    _equal(dict(got), want)
    status = CacheClient(socket_path(sockdir, 0)).status()
    assert status["raw"] == "released" and len(status["layouts"]) == 1


def test_reference_engine_hands_back_then_restarts_on_its_own_layout(
        model: Path, sockdir: Path, ranks: list[Rank], tmp_path: Path) -> None:
    """TP 2: the first engine fuses, pads and hands back; a restart maps that layout with the
    checkpoint moved away and generates the same tokens; workers start before torch loads."""
    from tests.test_engine import engine

    _spawn_all(model, sockdir, 2, 1, ranks)
    args = ("--socket-dir", str(sockdir), "--tensor-parallel-size", "2", "--no-fallback")
    with engine(tmp_path, "first", model, *args) as first:
        first.wait_healthy(STARTUP_S)
        stats = first.request("GET", "/stats")[1]
        assert (stats["source"], stats["layout"]) == ("cache", "handed-back")
        tokens = [first.generate(p, 6)[1]["tokens"] for p in ([1, 2, 3], [200, 7, 7])]
        _one_copy_each(first.request("GET", "/stats")[1]["memory"], stats["bytes"])
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait() == 0
    log = first.log.read_text()
    assert "started rank 1 (pid " in log and "before importing torch" in log
    for r in ranks:  # each rank adopted the layout and released its raw slabs
        assert r.frame()[0]["event"] == "layout"
        assert r.frame()[0] == {"event": "release", "layout": "raw"}
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in model.glob("*.safetensors*"):
        shutil.move(str(f), moved / f.name)
    try:
        with engine(tmp_path, "again", model, *args) as again:
            again.wait_healthy(STARTUP_S)
            stats = again.request("GET", "/stats")[1]
            assert (stats["source"], stats["layout"]) == ("cache", "engine")
            assert [again.generate(p, 6)[1]["tokens"]
                    for p in ([1, 2, 3], [200, 7, 7])] == tokens
            _one_copy_each(again.request("GET", "/stats")[1]["memory"], stats["bytes"])
            again.proc.send_signal(signal.SIGTERM)
            assert again.wait() == 0
    finally:
        for f in moved.iterdir():
            shutil.move(str(f), model / f.name)


def test_first_start_keeps_one_copy_the_caches_mappings(
        model: Path, sockdir: Path, caches: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """After its hand-back the reference engine's rank holds the cache's engine layout and
    nothing else: every tensor lies in one of the layout's slab mappings (by address), and the
    fused, padded tensors it built are freed (their storages are gone)."""
    import vlaunch.cache.reference.weights as ref_weights
    from vlaunch.cache.reference.memory import weight_split
    from vlaunch.cache.reference.options import parse_args

    cache = spawn_cache(model, sockdir)
    caches.append(cache)
    built: list[weakref.ref] = []

    def spied(raw: dict, cfg: ModelConfig, tp: int) -> dict[str, torch.Tensor]:
        out = engine_layout(raw, cfg, tp)
        built.extend(weakref.ref(t.untyped_storage()) for n, t in out.items()
                     if "qkv_proj" in n or "gate_up_proj" in n)  # the engine's own tensors
        return out

    monkeypatch.setattr(ref_weights, "engine_layout", spied)
    cfg = ModelConfig.from_dir(model)
    opts = parse_args(["--model", str(model), "--socket-dir", str(sockdir), "--no-fallback"])
    raw = _memfd_inodes(cache.proc.pid)
    loaded = ref_weights.load_weights(opts, 0, "cpu", cfg)
    assert loaded.layout == "handed-back" and built
    assert [r for r in built if r() is not None] == []  # the own copy is gone
    eventually(lambda: not raw & _memfd_inodes(cache.proc.pid), what="the raw layout released")
    layout = _memfd_inodes(cache.proc.pid)
    spans = _mapped_spans(os.getpid())
    for name, t in loaded.tensors.items():
        start = t.data_ptr()
        inode = next((i for lo, hi, i in spans if lo <= start and start + t.nbytes <= hi), None)
        assert inode in layout, f"{name} is not in the cache's engine layout"
    total = sum(t.nbytes for t in loaded.tensors.values())
    assert weight_split(loaded.tensors.values(), "cpu") == (total, 0)  # what /stats reports


def _mapped_spans(pid: int) -> list[tuple[int, int, int]]:
    """(start, end, inode) of each shared mapping of a process."""
    spans = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            span, perms, _, _, inode = line.split()[:5]
            if perms[3] == "s":
                lo, _, hi = span.partition("-")
                spans.append((int(lo, 16), int(hi, 16), int(inode)))
    return spans


def _one_copy_each(memory: list[dict], nbytes: int) -> None:
    """/stats memory of a TP 2 engine on CPU: every rank's weights are the cache's mappings."""
    assert [m["rank"] for m in memory] == [0, 1]
    assert sum(m["weights_shared"] for m in memory) == nbytes
    for m in memory:
        assert m["weights_own"] == 0 and m["kv_cache"] == 0, m
        assert m["device_bytes"] is None and m["other"] is None  # CPU: no device figure


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_first_start_on_cuda_gives_its_own_copy_back(tmp_path: Path, sockdir: Path,
                                                     caches: list) -> None:
    """CUDA: after the hand-back torch's allocator no longer keeps the engine's fused copy
    reserved (it would, freed but cached, without release_cached), and the weights are
    mappings, not torch allocations."""
    import vlaunch.cache.reference.weights as ref_weights
    from vlaunch.cache.reference.memory import process_device_bytes, weight_split
    from vlaunch.cache.reference.options import parse_args

    big = make_checkpoint(tmp_path / "m", hidden=1024, layers=4, heads=8, kv_heads=4,
                          intermediate=4096, vocab=4096)  # 2 x 24 MiB fused a layer
    caches.append(spawn_cache(big, sockdir, "--device", "cuda:0"))
    cfg = ModelConfig.from_dir(big)
    opts = parse_args(["--model", str(big), "--socket-dir", str(sockdir), "--no-fallback",
                       "--device", "cuda"])
    torch.cuda.set_device(0)
    loaded = ref_weights.load_weights(opts, 0, "cuda:0", cfg)
    assert loaded.layout == "handed-back"
    fused = sum(t.nbytes for n, t in loaded.tensors.items() if "_proj" in n and "o_proj" not in
                n and "down_proj" not in n)
    assert torch.cuda.memory_reserved(0) < fused // 4, (torch.cuda.memory_reserved(0), fused)
    total = sum(t.nbytes for t in loaded.tensors.values())
    assert weight_split(loaded.tensors.values(), "cuda:0") == (total, 0)
    assert (process_device_bytes("cuda:0") or 0) > 0
