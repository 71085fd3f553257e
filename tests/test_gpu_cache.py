"""The cache core end to end on one CUDA GPU: real cache processes holding CUDA (VMM) slabs.

The GPU counterparts of test_cache.py: bit-exact parity with safetensors for every dtype in
share and copy mode, the Llama plan at tp 1, 2 and 4 (every rank its own process and slab, all
on one GPU), copy-release freeing the cache's device memory, and share-mode tensors that stay
correct after the cache process is SIGKILLed. Run on a GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from vlaunch.cache import CacheClient, load  # noqa: E402
from vlaunch.cache.contract.errors import CacheBrokenError  # noqa: E402
from vlaunch.cache.contract.sockdir import socket_path  # noqa: E402
from vlaunch.cache.store import slabs_cuda  # noqa: E402
from vlaunch.cache.store.plan import LLAMA_PLAN  # noqa: E402

from .conftest import spawn_cache  # noqa: E402
from .test_cache import ALL_DTYPES, _random, _same_bits  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda:0"
MiB = 1 << 20


def _same_bits_on_host(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """`got` (on the GPU) holds exactly the bits of `ref` (on the host)."""
    assert got.device == torch.device(DEVICE), got.device
    return _same_bits(got.cpu(), ref)


def _in_a_mapping(t: torch.Tensor) -> bool:
    """Whether `t` lies inside a slab mapping of this process (share mode) or not (copy)."""
    ptr = t.data_ptr()
    return any(m.ptr <= ptr < m.ptr + m.length for m in list(slabs_cuda._mappings.values()))


def _full(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _cuda_cache(model: Path, sockdir: Path, *args: str, **kw: object):
    cache = spawn_cache(model, sockdir, "--device", DEVICE, *args, **kw)  # type: ignore[arg-type]
    if not cache.ready:
        err = cache.proc.stderr.read().decode() if cache.proc.stderr else ""
        pytest.fail(f"CUDA cache did not come up (status {cache.proc.poll()}): {err[-3000:]}")
    assert cache.ready["device"] == DEVICE
    return cache


def _drop_escrow(cache) -> None:
    """Close the test's escrow fds: they would keep the slab memory alive on their own."""
    for fd in cache.escrow:
        os.close(fd)
    cache.escrow = []


def test_every_dtype_round_trips_bit_exactly_on_cuda(tmp_path: Path, sockdir: Path,
                                                     caches) -> None:
    tensors = {}
    for name, dtype in ALL_DTYPES.items():
        tensors[f"{name}.matrix"] = _random(dtype, (7, 5))
        tensors[f"{name}.scalar"] = _random(dtype, ())
        tensors[f"{name}.empty"] = _random(dtype, (0, 3))
        tensors[f"{name}.odd"] = _random(dtype, (3, 333))  # an offset that needs aligning
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path))
    caches.append(_cuda_cache(path, sockdir, "--plan", "replicate"))
    ref = load_file(str(path))
    for mode in ("share", "copy"):
        got = load(str(path), socket_dir=str(sockdir), plan="replicate", mode=mode,
                   device=DEVICE, fallback=False, timeout=10)
        torch.cuda.synchronize()
        assert got.source == "cache"
        assert set(got) == set(tensors)
        assert got.bytes_outside == (0 if mode == "copy" else sum(
            caches[0].ready["manifest"]["slab_sizes"]))
        for key, want in ref.items():
            assert _same_bits_on_host(got[key], want), (mode, key)
            if want.numel():  # share: the cache's slab; copy: the copy the rank made for us
                assert _in_a_mapping(got[key]), (mode, key)
        if mode == "copy":  # our own memory: writing it leaves the cache's bytes as they were
            got["u8.matrix"].untyped_storage().fill_(0)
            torch.cuda.synchronize()
            assert not got["u8.matrix"].any()
    again = load(str(path), socket_dir=str(sockdir), plan="replicate", device=DEVICE,
                 fallback=False, timeout=10)
    for key, want in ref.items():
        assert _same_bits_on_host(again[key], want), key


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_plan_parity_with_safetensors_on_cuda(llama_ckpt: Path, sockdir: Path, caches,
                                                    tp: int) -> None:
    full = _full(llama_ckpt)
    for rank in range(tp):
        caches.append(_cuda_cache(llama_ckpt, sockdir, rank=rank, tp=tp))
    for rank in range(tp):
        for mode in ("share", "copy"):
            got = load(str(llama_ckpt), rank=rank, tensor_parallel_size=tp,
                       socket_dir=str(sockdir), mode=mode, device=DEVICE, fallback=False,
                       timeout=10)
            assert got.source == "cache" and set(got) == set(full)
            for name, ref in full.items():
                dim = LLAMA_PLAN.split_dim(name)
                want = ref if dim is None else ref.chunk(tp, dim=dim)[rank]
                assert _same_bits_on_host(got[name], want), (tp, rank, mode, name)


def test_copy_release_frees_the_cache_device_memory(tmp_path: Path, sockdir: Path,
                                                    caches, caplog) -> None:
    size = 256 * MiB
    tensors = {"big": _random(torch.uint8, (size,)), "small": _random(torch.bfloat16, (33, 7))}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    cache = _cuda_cache(path, sockdir, "--plan", "replicate")
    caches.append(cache)
    _drop_escrow(cache)  # from here the cache's own handle and fds alone hold the slab
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info(0)[0]
    got = load(str(path), socket_dir=str(sockdir), plan="replicate", mode="copy-release",
               device=DEVICE, fallback=False, timeout=10)
    torch.cuda.synchronize()
    assert got.source == "cache" and got.bytes_outside == 0
    for key, want in tensors.items():
        assert _same_bits_on_host(got[key], want), key
    # Alone on the rank, we were handed its own slab (no copy): mapped writable, ours.
    got["big"][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=DEVICE)
    assert got["big"][:4].tolist() == [1, 2, 3, 4]
    # One copy left on the device, ours: the cache's slab was freed once we had taken it.
    assert _settles(lambda: abs(free0 - torch.cuda.mem_get_info(0)[0]) < size * 0.1)
    client = CacheClient(socket_path(sockdir, 0))
    status = client.status()
    assert status["state"] == "released" and status["bytes_held"] == {DEVICE: 0}
    with pytest.raises(CacheBrokenError, match="released"):
        client.manifest()
    client.close()
    caplog.set_level(logging.WARNING, "vlaunch.cache")
    again = load(str(path), socket_dir=str(sockdir), plan="replicate", device=DEVICE)
    assert again.source == "disk" and "released" in again.reason
    for key, want in tensors.items():
        assert _same_bits_on_host(again[key], want), key


def _settles(condition, seconds: float = 10.0) -> bool:
    """Whether `condition()` becomes true within `seconds` (ranks free memory on threads)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_gpu_rank_makes_the_engines_copy_and_lets_go_of_it(tmp_path: Path, sockdir: Path,
                                                              caches) -> None:
    """Copy mode on a GPU: the rank allocates the engine's copy and copies into it while the
    engine maps it (rank/copies.py). The engine's weights are then that memory, not torch's;
    the rank keeps no hold on it, whether the engine finishes its handoff or walks away in
    the middle of it; and past MAX_IN_FLIGHT copies an engine copies for itself."""
    size = 256 * MiB
    tensors = {"big": _random(torch.uint8, (size,)), "small": _random(torch.bfloat16, (33, 7))}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    caches.append(_cuda_cache(path, sockdir, "--plan", "replicate"))
    kw = {"socket_dir": str(sockdir), "plan": "replicate", "device": DEVICE,
          "fallback": False, "timeout": 10}
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0, reserved0 = torch.cuda.mem_get_info(0)[0], torch.cuda.memory_reserved(0)

    def used() -> int:
        return free0 - torch.cuda.mem_get_info(0)[0]

    got = load(str(path), mode="copy", **kw)
    assert got.source == "cache" and got.bytes_outside == 0
    # the slab came as PIECES allocations, mapped into one range: every byte across the seams
    # is compared below
    assert torch.cuda.memory_reserved(0) == reserved0  # not torch's memory: the rank's copy
    for key, want in tensors.items():
        assert _same_bits_on_host(got[key], want), key
        assert _in_a_mapping(got[key]), key
    assert size <= used() < size * 1.1
    del got
    gc.collect()
    assert _settles(lambda: used() < size * 0.1), used()  # dropped: nobody holds the copy

    client = CacheClient(socket_path(sockdir, 0))  # an engine that leaves mid-handoff
    reply, fds = client.request({"op": "open", "mode": "copy"})
    from vlaunch.cache.rank.copies import PIECES

    assert reply["copying"] is True and len(reply["pieces"]) == 1
    assert len(fds) == len(reply["pieces"][0]) == PIECES  # a 256 MiB slab: four pieces
    for fd in fds:
        os.close(fd)
    client.close()
    assert _settles(lambda: used() < size * 0.1), used()

    from vlaunch.cache.rank.copies import MAX_IN_FLIGHT

    holders = [CacheClient(socket_path(sockdir, 0)) for _ in range(MAX_IN_FLIGHT)]
    for holder in holders:  # copies in flight that nobody asks `copied` for yet
        reply, fds = holder.request({"op": "open", "mode": "copy"})
        assert reply["copying"] is True
        for fd in fds:
            os.close(fd)
    copies = holders[0].status()["copies"]  # the rank's status counts them and their memory
    assert copies["in_flight"] == MAX_IN_FLIGHT
    assert size * MAX_IN_FLIGHT <= copies["bytes"] < size * MAX_IN_FLIGHT * 1.1
    got = load(str(path), mode="copy", **kw)  # the rank has no slot left: we copy ourselves
    assert torch.cuda.memory_reserved(0) >= reserved0 + size
    for key, want in tensors.items():
        assert _same_bits_on_host(got[key], want), key
        assert not _in_a_mapping(got[key]), key
    for holder in holders:
        holder.close()
    del got
    gc.collect()
    torch.cuda.empty_cache()
    assert _settles(lambda: used() < size * 0.1), used()


def test_share_tensors_survive_sigkill_of_the_cuda_cache(llama_ckpt: Path, sockdir: Path,
                                                         caches, caplog) -> None:
    caplog.set_level(logging.WARNING, "vlaunch.cache")
    cache = _cuda_cache(llama_ckpt, sockdir)
    caches.append(cache)
    got = load(str(llama_ckpt), socket_dir=str(sockdir), device=DEVICE, fallback=False)
    assert got.source == "cache" and got.bytes_outside > 0
    assert all(_in_a_mapping(t) for t in got.values() if t.numel())
    _drop_escrow(cache)  # the escrow would keep the memory alive too: drop it for this test
    cache.proc.send_signal(signal.SIGKILL)
    assert cache.proc.wait(10) == -signal.SIGKILL
    ref = _full(llama_ckpt)
    for name, t in ref.items():
        assert _same_bits_on_host(got[name], t), name
        # a kernel reads the mapping too, not only a copy engine
        assert torch.equal((got[name].float() * 2).cpu(), t.float() * 2), name
    torch.cuda.synchronize()
    for _ in range(50):
        if any("went away" in r.getMessage() for r in caplog.records):
            break
        threading.Event().wait(0.05)
    went = [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]
    assert len(went) == 1 and "keeps serving" in went[0]
