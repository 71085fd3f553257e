"""The cache core end to end on CPU: real processes, real sockets, real safetensors files."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaunch.cache import CacheClient, load
from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.errors import (
    CacheBrokenError,
    CacheUnavailableError,
    FingerprintMismatchError,
)
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.store.fingerprints import fingerprint
from vlaunch.cache.store.plan import LLAMA_PLAN, Position
from vlaunch.cache.store.target import Target

from .conftest import CacheProc, eventually, spawn_cache

ALL_DTYPES = {
    "f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2, "i64": torch.int64,
    "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8,
    "bool": torch.bool,
}


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,),
                        dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw[: torch.Size(shape).numel()] & 1).bool().reshape(shape)
    return raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def test_every_dtype_round_trips_bit_exactly(tmp_path: Path, sockdir: Path, caches) -> None:
    tensors = {}
    for name, dtype in ALL_DTYPES.items():
        tensors[f"{name}.matrix"] = _random(dtype, (7, 5))
        tensors[f"{name}.scalar"] = _random(dtype, ())
        tensors[f"{name}.empty"] = _random(dtype, (0, 3))
    save_file(tensors, str(tmp_path / "all.safetensors"))
    caches.append(spawn_cache(tmp_path / "all.safetensors", sockdir, "--plan", "replicate"))
    for mode in ("share", "copy"):
        got = load(str(tmp_path / "all.safetensors"), socket_dir=str(sockdir), plan="replicate",
                   mode=mode, fallback=False, timeout=10)
        assert got.source == "cache"
        assert set(got) == set(tensors)
        for key, ref in load_file(str(tmp_path / "all.safetensors")).items():
            assert _same_bits(got[key], ref), (mode, key)


@pytest.fixture(scope="module")
def one_cache(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("one") / "s"
    d.mkdir(mode=0o700)
    c = spawn_cache(llama_ckpt, d)
    yield c
    c.stop()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_plan_parity_with_safetensors(llama_ckpt: Path, sockdir: Path, caches,
                                            one_cache, tp: int) -> None:
    full = {}
    for f in sorted(llama_ckpt.glob("*.safetensors")):
        full.update(load_file(str(f)))
    if tp == 1:  # the module's rank is rank 0 of TP 1 on this checkpoint
        sockdir = one_cache.socket_dir
    else:
        caches.extend(spawn_cache(llama_ckpt, sockdir, rank=rank, tp=tp) for rank in range(tp))
    for rank in range(tp):
        got = load(str(llama_ckpt), rank=rank, tensor_parallel_size=tp,
                   socket_dir=str(sockdir), fallback=False, timeout=10)
        assert got.source == "cache" and set(got) == set(full)
        for name, ref in full.items():
            dim = LLAMA_PLAN.split_dim(name)
            want = ref if dim is None else ref.chunk(tp, dim=dim)[rank]
            assert _same_bits(got[name], want), (tp, rank, name)


def test_manifest_checksums_match_the_file_bytes(llama_ckpt: Path, one_cache) -> None:
    import zlib

    client = CacheClient(socket_path(one_cache.socket_dir, 0))
    manifest = client.manifest()
    full = {}
    for f in sorted(llama_ckpt.glob("*.safetensors")):
        full.update(load_file(str(f)))
    for rec in manifest.tensors:
        data = full[rec.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert rec.checksum == zlib.crc32(data)
    client.close()


def test_every_fingerprint_field_mismatch_is_reported(llama_ckpt: Path, one_cache) -> None:
    engine = fingerprint(Target(str(llama_ckpt), Position(1, 0), "cpu"))
    client = CacheClient(socket_path(one_cache.socket_dir, 0))
    assert client.hello(engine) == engine
    for field in fp.FIELDS:
        wrong = dict(engine, **{field: engine[field] + "-other"})
        with pytest.raises(FingerprintMismatchError) as err:
            client.hello(wrong)
        assert err.value.mismatches == [(field, engine[field], engine[field] + "-other")]
        assert field in str(err.value)
    both = dict(engine, tp_size="2", kernel_backends="flashinfer=9")
    with pytest.raises(FingerprintMismatchError) as err:
        client.hello(both)
    assert [m[0] for m in err.value.mismatches] == ["tp_size", "kernel_backends"]
    client.close()


def test_at_one_rank_plans_that_split_nothing_agree(llama_ckpt: Path, one_cache) -> None:
    """A cache on the default plan and an engine that names `replicate` hold the same bytes at
    TP 1: the two-container layout with each side on its own default must not be refused."""
    got = load(str(llama_ckpt), socket_dir=str(one_cache.socket_dir), plan="replicate",
               fallback=False, timeout=10)
    assert got.source == "cache"
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    for name, want in ref.items():
        assert _same_bits(got[name], want), name
    got.client.close()


def test_plans_that_split_differently_are_still_refused(llama_ckpt: Path, sockdir: Path,
                                                        caches) -> None:
    """At TP 2 the default plan and `replicate` hold different bytes: refused, both named."""
    caches.append(spawn_cache(llama_ckpt, sockdir, tp=2))
    with pytest.raises(FingerprintMismatchError, match="plan") as err:
        load(str(llama_ckpt), socket_dir=str(sockdir), rank=0, tensor_parallel_size=2,
             plan="replicate", fallback=False, timeout=5)
    assert [m[0] for m in err.value.mismatches] == ["plan"]


def test_fallback_true_loads_from_disk_with_one_warning(llama_ckpt: Path, one_cache, sockdir,
                                                        caplog) -> None:
    caplog.set_level(logging.WARNING, "vlaunch.cache")
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    got = load(str(llama_ckpt), socket_dir=str(sockdir))  # no cache there
    assert got.source == "disk" and "unavailable" in got.reason
    name = next(iter(ref))
    assert _same_bits(got[name], ref[name])
    got = load(str(llama_ckpt), socket_dir=str(one_cache.socket_dir), kernel_backends="x=1")
    assert got.source == "disk" and got.reason.startswith("mismatched")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "is unavailable" in warnings[0] and "is mismatched" in warnings[1]
    assert "kernel_backends" in warnings[1]


def test_fallback_false_waits_then_names_the_cause(llama_ckpt: Path, one_cache,
                                                   sockdir: Path) -> None:
    with pytest.raises(CacheUnavailableError, match="no cache is serving"):
        load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, timeout=0.3)
    with pytest.raises(FingerprintMismatchError, match="kernel_backends"):
        load(str(llama_ckpt), socket_dir=str(one_cache.socket_dir), fallback=False,
             kernel_backends="x=1")


def test_fallback_false_waits_for_a_cache_that_comes_up(llama_ckpt: Path, sockdir: Path,
                                                        caches) -> None:
    threading.Timer(0.5, lambda: caches.append(spawn_cache(llama_ckpt, sockdir))).start()
    got = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, timeout=60)
    assert got.source == "cache"


def test_copy_release_drops_the_cache_copy(llama_ckpt: Path, sockdir: Path, caches,
                                           caplog) -> None:
    caches.append(spawn_cache(llama_ckpt, sockdir))
    got = load(str(llama_ckpt), socket_dir=str(sockdir), mode="copy-release", fallback=False)
    assert got.source == "cache" and got.bytes_outside == 0
    client = CacheClient(socket_path(sockdir, 0))
    status = client.status()
    assert status["state"] == "released" and status["bytes_held"] == {"cpu": 0}
    with pytest.raises(CacheBrokenError, match="released"):
        client.manifest()
    caplog.set_level(logging.WARNING, "vlaunch.cache")
    again = load(str(llama_ckpt), socket_dir=str(sockdir))
    assert again.source == "disk" and "released" in again.reason
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    for name, t in ref.items():
        assert _same_bits(got[name], t) and _same_bits(again[name], t)


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping that holds `address`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return line
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copy_release_with_nobody_else_takes_the_slabs_without_a_copy(
        llama_ckpt: Path, sockdir: Path, caches) -> None:
    """The rank hands its own slabs over: the engine maps them writable (privately on a CPU,
    since the memfd is sealed) instead of copying them, and may write into them."""
    caches.append(spawn_cache(llama_ckpt, sockdir))
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    got = load(str(llama_ckpt), socket_dir=str(sockdir), mode="copy-release", fallback=False,
               device="cpu")
    name = next(iter(ref))
    line = _mapping_of(got[name].data_ptr())
    assert "memfd:vlaunch-slab" in line and line.split()[1] == "rw-p", line
    for key, want in ref.items():
        assert _same_bits(got[key], want), key
    got[name].view(-1)[0] += 1  # ours to write
    assert not _same_bits(got[name], ref[name])
    client = CacheClient(socket_path(sockdir, 0))
    assert client.status()["state"] == "released"
    client.close()


def test_copy_release_next_to_a_share_engine_copies(llama_ckpt: Path, sockdir: Path,
                                                    caches) -> None:
    """With another engine mapping the slabs they are not handed over: the copy-release
    engine gets a copy, and its writes never reach the share engine's tensors."""
    caches.append(spawn_cache(llama_ckpt, sockdir))
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    shared = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, device="cpu")
    got = load(str(llama_ckpt), socket_dir=str(sockdir), mode="copy-release", fallback=False,
               device="cpu")
    name = next(iter(ref))
    assert "memfd:" not in _mapping_of(got[name].data_ptr())
    got[name].view(-1)[0] += 1
    for key, want in ref.items():
        assert _same_bits(shared[key], want), key


def test_copy_release_after_a_lease_that_kept_its_tensors_copies(
        llama_ckpt: Path, sockdir: Path, caches) -> None:
    """An engine may end its lease and keep its tensors (`CacheClient.close()`): the rank
    cannot see that mapping, so while that process lives no slab is handed over (on a GPU
    the new owner's writes would land in the other engine's weights)."""
    caches.append(spawn_cache(llama_ckpt, sockdir))
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    shared = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, device="cpu")
    shared.client.close()  # the lease ends; the tensors, and their mappings, stay
    status = CacheClient(socket_path(sockdir, 0))
    eventually(lambda: not status.status()["leases"], 30, what="the lease gone")
    status.close()
    got = load(str(llama_ckpt), socket_dir=str(sockdir), mode="copy-release", fallback=False,
               device="cpu")
    name = next(iter(ref))
    assert "memfd:" not in _mapping_of(got[name].data_ptr())  # a copy
    got[name].view(-1)[0] += 1
    for key, want in ref.items():
        assert _same_bits(shared[key], want), key


def test_a_copy_release_engine_that_fails_its_hello_leaves_the_cache_serving(
        llama_ckpt: Path, sockdir: Path, caches) -> None:
    """The slabs go only once the engine says `drop` (after its fingerprint matched): until
    then another engine's open is refused as busy, and an engine that leaves (a mismatch)
    gives them back untouched."""
    caches.append(spawn_cache(llama_ckpt, sockdir))
    taker = CacheClient(socket_path(sockdir, 0))
    reply, fds = taker.request({"op": "open", "mode": "copy-release"})
    wire.close_fds(fds)
    assert reply.get("handover") is True and len(fds) == 1
    other = CacheClient(socket_path(sockdir, 0))
    with pytest.raises(CacheUnavailableError, match="handing its slabs over"):
        other.request({"op": "open", "mode": "share"})
    with pytest.raises(CacheUnavailableError, match="nothing to verify"):  # vlaunch verify
        other.request({"op": "digest", "start": 0, "count": 10})
    other.close()
    bad = fingerprint(Target(str(llama_ckpt), Position.from_global(0, 1, 1, 1), "cpu"))
    with pytest.raises(FingerprintMismatchError):
        taker.hello({**bad, "checkpoint": "another checkpoint"})
    taker.close()
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))

    def serving() -> object:
        try:
            return load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False,
                        device="cpu")
        except CacheUnavailableError:  # until the rank has seen the taker leave
            return None

    again = eventually(serving, 30, what="the rank serving again")
    assert again.source == "cache"
    for key, want in ref.items():
        assert _same_bits(again[key], want), key


def test_share_tensors_survive_sigkill_of_the_cache(llama_ckpt: Path, sockdir: Path, caches,
                                                    caplog) -> None:
    caplog.set_level(logging.WARNING, "vlaunch.cache")
    cache = spawn_cache(llama_ckpt, sockdir)
    caches.append(cache)
    got = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False)
    assert got.bytes_outside > 0
    for fd in cache.escrow:  # the escrow would keep memory alive too: drop it for this test
        os.close(fd)
    cache.escrow = []
    cache.proc.send_signal(signal.SIGKILL)
    cache.proc.wait(10)
    ref = {}
    for f in sorted(llama_ckpt.glob("*.safetensors")):
        ref.update(load_file(str(f)))
    for name, t in ref.items():
        assert _same_bits(got[name], t), name
    for _ in range(50):
        if any("went away" in r.getMessage() for r in caplog.records):
            break
        threading.Event().wait(0.05)
    went = [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]
    assert len(went) == 1 and "keeps serving" in went[0]


def test_32_concurrent_clients(llama_ckpt: Path, one_cache) -> None:
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    engine = fingerprint(Target(str(llama_ckpt), Position(1, 0), "cpu"))
    errors: list[BaseException] = []
    barrier = threading.Barrier(32)
    clients: list[CacheClient] = []
    held: list[dict] = []  # a share lease lasts while its tensors do

    def one() -> None:
        try:
            c = CacheClient(socket_path(one_cache.socket_dir, 0))
            clients.append(c)
            barrier.wait(10)
            c.hello(engine)
            tensors = c.map(c.manifest())
            held.append(tensors)
            for name, t in ref.items():
                assert _same_bits(tensors[name], t)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    status = CacheClient(socket_path(one_cache.socket_dir, 0)).status()
    assert sum(1 for lease in status["leases"] if lease["mode"] == "share") == 32
    for c in clients:
        c.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_client_running_as_another_uid_is_refused(one_cache) -> None:
    """Even with the directory opened up by mistake, SO_PEERCRED refuses a foreign uid."""
    path = socket_path(one_cache.socket_dir, 0)
    os.chmod(one_cache.socket_dir, 0o711)
    os.chmod(path, 0o666)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, connect, report what the cache said
        try:
            import socket as so

            from vlaunch.cache.contract import wire

            os.chdir(path.parent)  # as root: the parents are 0700 pytest directories
            os.setgid(65534)
            os.setuid(65534)
            s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
            s.connect(path.name)
            reply, _ = wire.recv_frame(s)
            os.write(write, json.dumps(reply).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    reply = json.loads(os.read(read, 65536) or b"{}")
    os.close(read)
    os.chmod(one_cache.socket_dir, 0o700)
    assert reply.get("ok") is False and reply["error"] == "forbidden"
    assert "uid 65534" in reply["message"] and "refused" in reply["message"]


def _bad_file(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize("case", ["truncated", "past_end", "overlap", "dtype_size"])
def test_bad_checkpoints_end_the_cache_with_status_65(tmp_path: Path, sockdir: Path,
                                                      case: str) -> None:
    if case == "truncated":
        save_file({"w": torch.ones(64, 64)}, str(tmp_path / "m.safetensors"))
        data = (tmp_path / "m.safetensors").read_bytes()
        (tmp_path / "m.safetensors").write_bytes(data[: len(data) - 100])
        path, words = tmp_path / "m.safetensors", ["'w'"]
    else:
        header = {
            "past_end": {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "x": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}},
            "overlap": {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                        "x": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
            "dtype_size": {"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 16]}},
        }[case]
        path = _bad_file(tmp_path / "m.safetensors", header, b"\0" * 24)
        words = {"past_end": ["'x'", "end of the file"], "overlap": ["overlaps"],
                 "dtype_size": ["'w'", "BF16"]}[case]
    cache = spawn_cache(path, sockdir)
    status = cache.proc.wait(30)
    err = cache.proc.stderr.read().decode() if cache.proc.stderr else ""
    assert status == ExitStatus.BAD_CHECKPOINT, err
    assert str(path) in err and "bad checkpoint" in err
    for w in words:
        assert w in err
    assert not socket_path(sockdir, 0).exists()


def test_second_cache_for_the_same_rank_is_refused(llama_ckpt: Path, one_cache) -> None:
    again = spawn_cache(llama_ckpt, one_cache.socket_dir)
    assert again.proc.wait(30) == ExitStatus.CACHE_BUSY
    assert "holds" in again.proc.stderr.read().decode()  # type: ignore[union-attr]


def test_a_cpu_rank_sends_its_own_slabs_to_copy_and_refuses_copied(one_cache) -> None:
    """Only a GPU rank makes an engine's copy (rank/copies.py): a CPU rank's open reply in a
    copy mode carries its own slabs and no "copying", and `copied` out of turn is refused
    without costing the connection."""
    client = CacheClient(socket_path(one_cache.socket_dir, 0))
    try:
        reply, fds = client.request({"op": "open", "mode": "copy"})
        wire.close_fds(fds)
        assert "copying" not in reply and len(fds) == reply["slabs"] >= 1
        with pytest.raises(CacheBrokenError, match="copied follows an open"):
            client.request({"op": "copied"})
        assert client.status()["rank"] == 0
    finally:
        client.close()


@pytest.mark.parametrize("bad", ["symlink", "mode", "missing_model"])
def test_unsafe_socket_dirs_and_missing_models(tmp_path: Path, llama_ckpt: Path,
                                               bad: str) -> None:
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    d, model, status = tmp_path / "s", llama_ckpt, ExitStatus.SOCKET_DIR
    if bad == "symlink":
        d.symlink_to(target)
    elif bad == "mode":
        d.mkdir(mode=0o755)
        os.chmod(d, 0o755)
    else:
        d, model, status = target, tmp_path / "nope", ExitStatus.NO_MODEL
    cache = spawn_cache(model, d)
    assert cache.proc.wait(30) == status


def test_sigterm_removes_socket_and_lock_and_exits_0(llama_ckpt: Path, sockdir: Path) -> None:
    cache = spawn_cache(llama_ckpt, sockdir)
    assert socket_path(sockdir, 0).exists()
    assert cache.stop() == 0
    assert list(sockdir.iterdir()) == []


def test_share_mapping_lives_exactly_as_long_as_its_tensors(llama_ckpt: Path,
                                                            one_cache) -> None:
    def slab_maps() -> int:
        return Path("/proc/self/maps").read_text().count("memfd:vlaunch-slab")

    gc.collect()  # mappings an earlier test left to the collector go before the count
    before = slab_maps()
    c = CacheClient(socket_path(one_cache.socket_dir, 0))
    tensors = c.map(c.manifest())
    assert slab_maps() == before + 1
    keep = tensors["model.norm.weight"]
    del tensors
    gc.collect()
    assert slab_maps() == before + 1  # one view is still alive
    del keep
    gc.collect()
    assert slab_maps() == before
    c.close()


def test_a_share_lease_ends_with_its_tensors_a_close_or_the_process(
        llama_ckpt: Path, sockdir: Path, caches) -> None:
    """The three ends of a lease the docs name (lifecycle.md): the last tensor freed, the
    client's close() (the tensors stay valid), the engine process's exit."""
    one_cache = spawn_cache(llama_ckpt, sockdir)
    caches.append(one_cache)
    path = socket_path(sockdir, 0)
    watcher = CacheClient(path)

    def leases() -> int:
        return len(watcher.status()["leases"])

    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    name = next(iter(ref))
    got = load(str(llama_ckpt), socket_dir=str(one_cache.socket_dir), fallback=False)
    assert leases() == 1
    del got
    gc.collect()
    eventually(lambda: leases() == 0, 30, what="the lease ended with the last tensor")
    got = load(str(llama_ckpt), socket_dir=str(one_cache.socket_dir), fallback=False)
    assert leases() == 1
    got.client.close()
    eventually(lambda: leases() == 0, 30, what="the lease ended by close()")
    assert _same_bits(got[name], ref[name])  # the mapping outlives the lease
    code = (f"from vlaunch.cache import load; import sys, time; w = load({str(llama_ckpt)!r}, "
            f"socket_dir={str(one_cache.socket_dir)!r}, fallback=False); print('up', "
            "flush=True); time.sleep(120)")
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None and engine.stdout.readline() == "up\n"
        assert leases() == 1
    finally:
        engine.kill()
        engine.wait(30)
    eventually(lambda: leases() == 0, 30, what="the lease ended with the process")
    watcher.close()


def _respawned(cache: CacheProc, model: Path, sockdir: Path, rank: int, tp: int) -> CacheProc:
    """What the launcher does when a rank dies under --on-rank-exit respawn: a new rank
    process adopts the old one's escrowed slabs (its ready frame and fds) instead of reading."""
    cache.proc.terminate()
    cache.proc.wait(20)
    ours, theirs = socket.socketpair()
    with ours:  # the whole escrow is queued before the new rank reads it
        wire.send_frame(ours, {"event": "escrow", "manifest": cache.ready["manifest"],
                               "fingerprint": cache.ready["fingerprint"]}, cache.escrow)
    try:
        return spawn_cache(model, sockdir, "--adopt-fd", str(theirs.fileno()), rank=rank,
                           tp=tp, extra_fds=[theirs.fileno()])
    finally:
        theirs.close()


@pytest.mark.parametrize("start", ["disk", "seed", "escrow"])
def test_a_cpu_rank_serves_its_shard_without_loading_torch(llama_ckpt: Path, tmp_path: Path,
                                                           caches, start: str) -> None:
    """A CPU rank only moves bytes: at TP 2 under the llama plan (dim-0 and dim-1 splits) it
    reads, seeds or adopts its shard, serves it bit-exact and digests it for `vlaunch verify`,
    and libtorch is never mapped into it (a torch import costs a rank 2 s and 250 MB)."""
    from vlaunch.cache.client.verify import verify_rank

    tp, dirs = 2, {name: tmp_path / name for name in ("first", "second")}
    for d in dirs.values():
        d.mkdir(mode=0o700)
    first = [spawn_cache(llama_ckpt, dirs["first"], rank=r, tp=tp) for r in range(tp)]
    caches.extend(first)
    ranks, sockdir = first, dirs["first"]
    if start != "disk":
        sockdir = dirs["second"]
        ranks = [spawn_cache(llama_ckpt, sockdir, "--seed", f"unix:{dirs['first']}", rank=r,
                             tp=tp) if start == "seed" else
                 _respawned(first[r], llama_ckpt, sockdir, r, tp) for r in range(tp)]
        caches.extend(ranks)
    full = {}
    for f in sorted(llama_ckpt.glob("*.safetensors")):
        full.update(load_file(str(f)))
    for rank, cache in enumerate(ranks):
        assert cache.ready.get("event") == "ready", cache.proc.stderr.read().decode()
        got = load(str(llama_ckpt), rank=rank, tensor_parallel_size=tp, socket_dir=str(sockdir),
                   fallback=False, timeout=10)
        assert got.source == "cache" and set(got) == set(full)
        for name, ref in full.items():
            dim = LLAMA_PLAN.split_dim(name)
            want = ref if dim is None else ref.chunk(tp, dim=dim)[rank]
            assert _same_bits(got[name], want), (start, rank, name)
        assert verify_rank(socket_path(sockdir, rank))["mismatches"] == []
    for cache in first + ranks:
        if cache.proc.poll() is None:
            maps = Path(f"/proc/{cache.proc.pid}/maps").read_text()
            assert "libtorch" not in maps and "libc10" not in maps, (start, cache.proc.args)


@pytest.mark.parametrize("frozen", ["none", "interpreter", "engine"])
def test_a_share_load_leaves_no_collection_due_and_an_engines_frozen_objects_frozen(
        llama_ckpt: Path, one_cache, frozen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """load() ages the young objects into the oldest GC generation instead of leaving a
    collection due the moment it re-enables the collector, also where the interpreter froze
    a few objects of its own (Python 3.12: 375); objects an engine froze itself stay frozen,
    and the collector is on again afterwards."""
    from vlaunch.cache.client.connection import install_trace

    steps: dict[str, float] = {}
    engine_froze = frozen == "engine"
    if frozen == "interpreter":
        monkeypatch.setattr(gc, "get_freeze_count", lambda: 375)

    started: list[float] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())

    gc.collect()
    marker = [object()]  # a young object of the engine's (frozen, where the engine froze)
    if engine_froze:
        gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 10, 10)  # this small shard's handoff makes more objects than that
    gc.callbacks.append(count)
    install_trace(lambda step: steps.__setitem__(step, time.perf_counter()))
    try:
        weights = load(str(llama_ckpt), socket_dir=str(one_cache.socket_dir), fallback=False,
                       device="cpu", plan="llama")
        returned = time.perf_counter()
        after = gc.get_count()
    finally:
        install_trace(None)
        gc.callbacks.remove(count)
        gc.set_threshold(*thresholds)
    try:
        oldest = any(o is marker for o in gc.get_objects(generation=2))
        tracked = any(o is marker for o in gc.get_objects())  # frozen ones are not listed
    finally:
        if engine_froze:
            gc.unfreeze()
    assert weights.source == "cache" and gc.isenabled()
    if engine_froze:
        assert not tracked  # still frozen
    else:
        # none from the end of the handoff (the collector off) to load()'s return
        assert not [t for t in started if steps["done"] < t < returned]
        assert after[0] < 50 and oldest
    weights.client.close()
