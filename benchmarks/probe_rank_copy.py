"""Probe (one GPU): the facts behind the rank making a copy-mode engine's copy (rank/copies.py).

    python benchmarks/probe_rank_copy.py race [--gib 16] [--reps 6]
    python benchmarks/probe_rank_copy.py alloc [--gib 16] [--reps 4]
    python benchmarks/probe_rank_copy.py smi
    python benchmarks/probe_rank_copy.py pieces [--gib 16] [--reps 4] [--pause 2]
    python benchmarks/probe_rank_copy.py split [--gib 16] [--reps 4] [--pause 1]

- race: a forked "rank" holds a VMM slab; per request it allocates a fresh slab, queues the
  copy into it on a stream of its own, sends the new slab's fd and then "copied"; the "engine"
  maps the fd while the copy runs. Against the engine's own way (import, torch.empty, copy_)
  and a plain copy_ between two allocations, same process, same run (call 19 of
  results/gpu_2026-12-01.md).
- alloc: the driver calls of one VMM allocation of that size (create, reserve, map, set
  access, unmap + release), median of the repetitions; then RankCopier.start() itself
  (call 22).
- smi: what nvidia-smi charges to whom when a copy-mode engine holds a 1 GiB copy the rank
  made (call 20; docs/memory.md).
- pieces: the copy's destination made of several allocations, each piece's copy queued as soon
  as that piece is mapped (does mapping a piece stall on the copies already running?), the
  ways of cutting taken in turn with a pause after each (call 27: right after a free of the
  same size, an allocation waited for the freed memory's scrub); then
  the engine's side, every piece imported into one reserved range with one cuMemSetAccess,
  and its bytes checked across the seams. Against one allocation and a plain copy_.
- split: the same cut into pieces as the product would run it: a forked rank allocates the
  pieces and queues each piece's copy as soon as it is mapped, sends their fds and then
  "copied"; the engine maps them into one range while the copy runs and frees them itself
  (in one process an allocation right after a free of its size was slow: calls 27-29).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from ctypes import byref, c_ulonglong, c_void_p
from pathlib import Path

import torch

from vlaunch.cache.contract import wire
from vlaunch.cache.store import cudadrv as cu
from vlaunch.cache.store.slabs_cuda import CudaBackend

perf = time.perf_counter


def _d2d(n: int, reps: int, pause: float = 0.0) -> list[float]:
    """Seconds of a plain copy_ of n bytes between two allocations, reps times after a
    warm-up, with `pause` seconds after each."""
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for i in range(reps + 1):
        t0 = perf()
        b.copy_(a)
        torch.cuda.synchronize()
        if i:
            times.append(perf() - t0)
        time.sleep(pause)
    return times


def _rank_side(sock: socket.socket, n: int) -> None:
    """The forked rank: a filled source slab, then one fresh copy per request."""
    backend = CudaBackend(0)
    src = backend.allocate(n)
    src.tensor().fill_(7)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    fd = src.export_fd()
    wire.send_frame(sock, {"ready": True}, [fd])
    os.close(fd)
    while not wire.recv_frame(sock)[0].get("quit"):
        t0 = perf()
        dst = backend.allocate(n)
        t1 = perf()
        with torch.cuda.stream(stream):
            dst.tensor().copy_(src.tensor(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        t2 = perf()
        fd = dst.export_fd()
        wire.send_frame(sock, {"alloc": t1 - t0, "queue": t2 - t1}, [fd])
        os.close(fd)
        event.synchronize()
        wire.send_frame(sock, {"copied": perf() - t0})
        dst.release()


def _split_rank(sock: socket.socket, n: int) -> None:
    """The forked rank of `split`: per request, the copy into `pieces` fresh allocations."""
    backend = CudaBackend(0)
    src = backend.allocate(n)
    src.tensor().fill_(7)
    src.tensor()[n // 2:].fill_(9)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    sp = c_void_p(stream.cuda_stream)
    wire.send_frame(sock, {"ready": True})
    while True:
        ask = wire.recv_frame(sock)[0]
        if ask.get("quit"):
            return
        t0 = perf()
        sizes, slabs, marks, offset = ask["sizes"], [], [], 0
        for k in sizes:
            slabs.append(backend.allocate(k))
            cu.call("cuMemcpyDtoDAsync_v2", slabs[-1].ptr, src.ptr + offset, k, sp)
            marks.append(perf() - t0)
            offset += k
        event = torch.cuda.Event()
        event.record(stream)
        fds = [slab.export_fd() for slab in slabs]
        wire.send_frame(sock, {"first": marks[0], "all": marks[-1]}, fds)
        wire.close_fds(fds)
        event.synchronize()
        wire.send_frame(sock, {"done": perf() - t0})
        for slab in slabs:
            slab.release()


def split(n: int, reps: int, pause: float) -> None:
    engine, rank = socket.socketpair()
    pid = os.fork()  # before this process touches CUDA
    if pid == 0:
        engine.close()
        _split_rank(rank, n)
        os._exit(0)
    rank.close()
    wire.recv_frame(engine)
    backend = CudaBackend(0)
    g = backend.granularity
    n = -(-n // g) * g  # as the rank's allocate() rounded it
    cuts = {k: v for k, v in _splits(n, g).items() if k != "1/16 then 2"}
    rw = cu.access_desc(0, False)
    rows: dict[str, list[tuple[float, ...]]] = {}
    for rep in range(reps + 1):
        for label, sizes in cuts.items():
            t0 = perf()
            wire.send_frame(engine, {"sizes": sizes})
            reply, fds = wire.recv_frame(engine)
            t1 = perf()
            va = int(cu.out("cuMemAddressReserve", c_ulonglong, n, g, 0, 0))
            offset = 0
            for fd, k in zip(fds, sizes, strict=True):
                h = int(cu.out("cuMemImportFromShareableHandle", c_ulonglong, c_void_p(fd),
                               cu.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
                cu.call("cuMemMap", va + offset, k, 0, h, 0)
                cu.call("cuMemRelease", h)
                offset += k
            cu.call("cuMemSetAccess", va, n, byref(rw), 1)
            wire.close_fds(fds)
            t2 = perf()
            done = wire.recv_frame(engine)[0]
            t3 = perf()
            view = torch.as_tensor(_Range(va, n), device="cuda")
            assert int(view[0]) == 7 and int(view[n // 2]) == 9 and int(view[n - 1]) == 9
            del view
            torch.cuda.synchronize()
            cu.call("cuMemUnmap", va, n)
            cu.call("cuMemAddressFree", va, n)
            if rep:
                rows.setdefault(label, []).append((t3 - t0, t1 - t0, t2 - t1, reply["first"],
                                                   reply["all"], done["done"]))
            time.sleep(pause)
    wire.send_frame(engine, {"quit": 1})
    os.waitpid(pid, 0)
    base = statistics.median(_d2d(n, reps))
    print(f"d2d copy_ of {n / 1e9:.2f} GB: median {base * 1e3:.2f} ms")
    print(f"{'destination':12s} {'total':>7s} {'% D2D':>6s} {'reply':>6s} {'import':>7s} "
          f"{'rank: 1st queued':>16s} {'all queued':>10s} {'done':>7s}  (ms, medians)")
    for label, runs in rows.items():
        med = [statistics.median(r[j] for r in runs) * 1e3 for j in range(6)]
        print(f"{label:12s} {med[0]:7.2f} {base * 1e3 / med[0] * 100:6.1f} {med[1]:6.2f} "
              f"{med[2]:7.2f} {med[3]:16.2f} {med[4]:10.2f} {med[5]:7.2f}")


def race(n: int, reps: int) -> None:
    engine, rank = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        engine.close()
        _rank_side(rank, n)
        os._exit(0)
    rank.close()
    _, fds = wire.recv_frame(engine)
    source = fds[0]
    backend = CudaBackend(0)
    rows: dict[str, list[float]] = {"rank copies": [], "engine copies": [], "d2d copy_": []}
    parts = []
    for i in range(reps + 1):  # the first of each is a warm-up
        t0 = perf()
        wire.send_frame(engine, {"go": 1})
        reply, fds = wire.recv_frame(engine)
        t1 = perf()
        mine = backend.import_fd(fds[0], n, readonly=False)
        os.close(fds[0])
        t2 = perf()
        done, _ = wire.recv_frame(engine)
        t3 = perf()
        assert bool(mine[:: 1 << 24].eq(7).all())
        if i:
            rows["rank copies"].append(t3 - t0)
            parts.append((t1 - t0, t2 - t1, t3 - t2, reply["alloc"], reply["queue"],
                          done["copied"]))
        del mine
        torch.cuda.synchronize()
        t0 = perf()
        mapped = backend.import_fd(source, n, readonly=True)
        own = torch.empty(n, dtype=torch.uint8, device="cuda")
        own.copy_(mapped, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        if i:
            rows["engine copies"].append(perf() - t0)
        del mapped, own
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    rows["d2d copy_"] = _d2d(n, reps)
    wire.send_frame(engine, {"quit": 1})
    os.waitpid(pid, 0)
    d2d = statistics.median(rows["d2d copy_"])
    for name, times in rows.items():
        med = statistics.median(times)
        print(f"{name:14s} median {med * 1e3:7.2f} ms, best {min(times) * 1e3:7.2f} = "
              f"{d2d / med * 100:5.1f}% of D2D")
    print("rank copies, ms: reply, import, wait after it | rank: allocate, queue, done")
    for p in parts:
        print("  " + "  ".join(f"{x * 1e3:6.2f}" for x in p))


def alloc(n: int, reps: int) -> None:
    from vlaunch.cache.rank.copies import RankCopier

    backend = CudaBackend(0)
    n = -(-n // backend.granularity) * backend.granularity  # cuMemCreate takes whole granules
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("create", "reserve", "map", "access", "unmap+release")}
    prop, rw = cu.allocation_prop(0), cu.access_desc(0, False)
    for i in range(reps + 1):
        t0 = perf()
        handle = int(cu.out("cuMemCreate", c_ulonglong, n, byref(prop), 0))
        t1 = perf()
        ptr = int(cu.out("cuMemAddressReserve", c_ulonglong, n, backend.granularity, 0, 0))
        t2 = perf()
        cu.call("cuMemMap", ptr, n, 0, handle, 0)
        t3 = perf()
        cu.call("cuMemSetAccess", ptr, n, byref(rw), 1)
        t4 = perf()
        cu.call("cuMemUnmap", ptr, n)
        cu.call("cuMemAddressFree", ptr, n)
        cu.call("cuMemRelease", handle)
        t5 = perf()
        if i:
            for key, t in zip(rows, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                rows[key].append(t * 1e3)
    for key, times in rows.items():
        print(f"vmm {key:14s} median {statistics.median(times):.3f} ms")
    src = backend.allocate(n)
    fd = src.export_fd()

    async def starts() -> None:
        copier = RankCopier(backend, [fd], (n,))
        for _ in range(reps):
            t0 = perf()
            copy = copier.start("probe")
            assert copy is not None
            t1 = perf()
            copy.close()
            await copy.done()
            print(f"RankCopier.start() {(t1 - t0) * 1e3:.2f} ms; the copy done "
                  f"{(perf() - t1) * 1e3:.2f} ms later")
            await asyncio.sleep(0.05)

    asyncio.run(starts())


def _splits(n: int, g: int) -> dict[str, list[int]]:
    """Ways to cut n bytes (a multiple of g) into pieces of whole granules."""
    def cut(fractions: list[float]) -> list[int]:
        sizes = [max(g, int(n * f) // g * g) for f in fractions[:-1]]
        return [*sizes, n - sum(sizes)]
    return {"1 piece": [n], "2 equal": cut([0.5, 0.5]), "4 equal": cut([0.25] * 4),
            "8 equal": cut([0.125] * 8), "1/16 then 2": cut([1 / 16, 0.3, 0.64])}


def pieces(n: int, reps: int, pause: float) -> None:
    backend = CudaBackend(0)
    g = backend.granularity
    n = -(-n // g) * g
    src = backend.allocate(n)
    src.tensor().fill_(7)
    src.tensor()[n // 2:].fill_(9)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    sp = c_void_p(stream.cuda_stream)
    prop, rw = cu.allocation_prop(0), cu.access_desc(0, False)
    rows: dict[str, list[tuple[float, float, float, float]]] = {}

    def one(sizes: list[int]) -> tuple[float, float, float, float]:
        t0 = perf()
        made, offset, first = [], 0, 0.0
        for i, k in enumerate(sizes):
            h = int(cu.out("cuMemCreate", c_ulonglong, k, byref(prop), 0))
            p = int(cu.out("cuMemAddressReserve", c_ulonglong, k, g, 0, 0))
            cu.call("cuMemMap", p, k, 0, h, 0)
            cu.call("cuMemSetAccess", p, k, byref(rw), 1)
            cu.call("cuMemcpyDtoDAsync_v2", p, src.ptr + offset, k, sp)
            if not i:
                first = perf() - t0
            made.append((h, p, k, offset))
            offset += k
        queued = perf() - t0
        event = torch.cuda.Event()
        event.record(stream)
        event.synchronize()
        done = perf() - t0
        fds = []
        for h, _, _, _ in made:
            fd = ctypes.c_int(-1)
            cu.call("cuMemExportToShareableHandle", byref(fd), h,
                    cu.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            fds.append(fd.value)
        t1 = perf()  # the engine's side: one range, every piece mapped into it, one access call
        va = int(cu.out("cuMemAddressReserve", c_ulonglong, n, g, 0, 0))
        for fd, (_, _, k, off) in zip(fds, made, strict=True):
            h = int(cu.out("cuMemImportFromShareableHandle", c_ulonglong, c_void_p(fd),
                           cu.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
            cu.call("cuMemMap", va + off, k, 0, h, 0)
            cu.call("cuMemRelease", h)
        cu.call("cuMemSetAccess", va, n, byref(rw), 1)
        imported = perf() - t1
        view = torch.as_tensor(_Range(va, n), device="cuda")
        for _, _, k, off in made:  # each seam, and the middle
            for at in {off, off + k - 1, n // 2 - 1, n // 2}:
                want = 7 if at < n // 2 else 9
                assert int(view[at]) == want, (sizes, at, int(view[at]))
        del view
        torch.cuda.synchronize()
        cu.call("cuMemUnmap", va, n)
        cu.call("cuMemAddressFree", va, n)
        for fd in fds:
            os.close(fd)
        for h, p, k, _ in made:
            cu.call("cuMemUnmap", p, k)
            cu.call("cuMemAddressFree", p, k)
            cu.call("cuMemRelease", h)
        return first, queued, done, imported

    # round robin, and a pause after each: right after a free of its size an allocation took
    # 4-10 ms, not 0.6 (calls 27-28: 0.3 s was not pause enough)
    splits = _splits(n, g)
    for rep in range(reps + 1):
        for label, sizes in splits.items():
            run = one(sizes)
            if rep:
                rows.setdefault(label, []).append(run)
            time.sleep(pause)
    base = statistics.median(_d2d(n, reps, pause))
    print(f"d2d copy_ of {n / 1e9:.2f} GB: median {base * 1e3:.2f} ms")
    print(f"{'destination':28s} {'1st copy queued':>15s} {'all queued':>10s} {'done':>8s} "
          f"{'% D2D':>6s} {'engine import':>13s}  (ms, medians)")
    for label, runs in rows.items():
        med = [statistics.median(r[j] for r in runs) * 1e3 for j in range(4)]
        print(f"{label:28s} {med[0]:15.3f} {med[1]:10.3f} {med[2]:8.2f} "
              f"{base * 1e3 / med[2] * 100:6.1f} {med[3]:13.3f}")


class _Range:
    """A mapped device range as a uint8 CUDA array (for a probe's checks)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"version": 3, "shape": (n,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None,
                                         "stream": None}


def smi() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from safetensors.torch import save_file

    from tests.conftest import spawn_cache
    from vlaunch.cache import load

    tmp = Path(tempfile.mkdtemp())
    model = tmp / "m.safetensors"
    save_file({"w": torch.randint(0, 255, (1 << 30,), dtype=torch.uint8)}, str(model))
    sockdir = tmp / "s"
    sockdir.mkdir(mode=0o700)
    cache = spawn_cache(model, sockdir, "--device", "cuda:0", "--plan", "replicate")
    assert cache.ready, cache.proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]

    def show(when: str) -> None:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True)
        print(f"{when}: engine pid {os.getpid()}, rank pid {cache.proc.pid}: "
              f"{apps.stdout.strip().replace(chr(10), ' | ')}")

    torch.zeros(1, device="cuda")
    show("before")
    weights = load(str(model), socket_dir=str(sockdir), plan="replicate", mode="copy",
                   device="cuda:0", fallback=False)
    time.sleep(0.5)
    show("the engine holds its copy")
    del weights
    gc.collect()
    time.sleep(0.5)
    show("dropped")
    cache.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("race", "alloc", "smi", "pieces", "split"))
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--pause", type=float, default=2.0, help="pieces: seconds after each run")
    args = ap.parse_args()
    n = int(args.gib * (1 << 30))
    if args.what == "race":
        race(n, args.reps)
    elif args.what == "alloc":
        alloc(n, args.reps)
    elif args.what == "pieces":
        pieces(n, args.reps, args.pause)
    elif args.what == "split":
        split(n, args.reps, args.pause)
    else:
        smi()


if __name__ == "__main__":
    main()
