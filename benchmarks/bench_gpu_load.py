#!/usr/bin/env python3
"""First load and handoff at scale on one GPU, against the disk, safetensors and the copy engine.

    python benchmarks/bench_gpu_load.py --model DIR [--device cuda:0] [--steps first,handoff,pidns]

- first: page cache dropped (fadvise DONTNEED on every shard, plus drop_caches when allowed):
  the best parallel O_DIRECT read of the same files (1, 4 and 8 threads of 64 MiB reads), the
  cache rank's first load, safetensors load_file(device=cuda); page cache warm: the cache rank
  (8, 16, 32 reader threads) and safetensors.
- handoff: in fresh processes (torch + CUDA initialised before the clock starts), share x5 and
  copy x3 to a synchronize, with torch.cuda.mem_get_info, memory_allocated and the client's
  bytes_outside before/after a share handoff; the device-to-device copy bandwidth of a 16 GiB
  copy_ in a fresh process (bytes read + written / time).
- pidns: the cache and the engine in sibling PID namespaces (unshare --pid --fork
  --mount-proc), sharing only the socket directory: the share handoff works and is timed.
Prints one table per step (figure, vlaunch, baseline, ratio, target).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import machine_name, record_figures

from vlaunch.cache.contract.engine_env import READER_THREADS
from vlaunch.cache.contract.progress import recv_ready

CHUNK = 64 << 20
RESULTS: dict[str, Any] = {}
RACE = ("imp", "alloc", "serial", "alloc_on_thread", "import_on_thread", "vmm_on_thread")
ARGS: argparse.Namespace
CHILD = r"""
import gc, json, os, sys, time
spec = json.loads(sys.argv[1])
import torch
dev = spec["device"]
torch.zeros(1, device=dev); torch.cuda.synchronize(dev)
out = {"preloaded": sorted(m for m in ("numpy", "cuda.bindings.driver") if m in sys.modules)}
if spec["what"] == "d2d":
    n = 16 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    b.copy_(a); torch.cuda.synchronize(dev)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); b.copy_(a); torch.cuda.synchronize(dev)
        ts.append(time.perf_counter() - t)
    ts.sort(); out = {"seconds": ts[2], "bytes": n}
elif spec["what"] == "alloc_d2d":  # what any copy in a fresh process pays: allocate + copy
    n = spec["bytes"]
    a = torch.empty(n, dtype=torch.uint8, device=dev); torch.cuda.synchronize(dev)
    t = time.perf_counter(); b = torch.empty_like(a); b.copy_(a); torch.cuda.synchronize(dev)
    out = {"seconds": time.perf_counter() - t, "bytes": n}
elif spec["what"] == "parts":  # copy mode taken apart: allocation, first and second copy
    def timed(fn):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter(); e0.record(); r = fn(); e1.record()
        launch = time.perf_counter() - t; torch.cuda.synchronize(dev)
        return r, {"launch_ms": launch * 1e3, "gpu_ms": e0.elapsed_time(e1),
                   "wall_ms": (time.perf_counter() - t) * 1e3}
    import vlaunch.cache as V
    w = V.load(spec["model"], socket_dir=spec["sock"], fallback=False, device=dev)
    slabs = {id(s): s for s in (x.untyped_storage() for x in w.values())}.values()
    src = [torch.empty(0, dtype=torch.uint8, device=dev).set_(s) for s in slabs]
    n = sum(s.numel() for s in src)
    dst, out["alloc"] = timed(lambda: [torch.empty_like(s) for s in src])
    _, out["first_copy_from_slabs"] = timed(lambda: [d.copy_(s, non_blocking=True)
                                                     for d, s in zip(dst, src)])
    _, out["second_copy_from_slabs"] = timed(lambda: [d.copy_(s, non_blocking=True)
                                                      for d, s in zip(dst, src)])
    own = [torch.empty_like(s) for s in src]; torch.cuda.synchronize(dev)
    _, out["copy_between_own"] = timed(lambda: [o.copy_(d, non_blocking=True)
                                                for o, d in zip(own, dst)])
    out.update(slabs=len(src), bytes=n)
elif spec["what"] == "loadparts":  # a TP 1 first load in-process, taken apart (page cache warm)
    from vlaunch.cache.contract.engine_env import READER_THREADS
    from vlaunch.cache.store import reader
    from vlaunch.cache.store.checkpoint import open_checkpoint
    from vlaunch.cache.store.manifest import pack
    from vlaunch.cache.store.plan import load_plan, plan_rank
    from vlaunch.cache.store.ranks import Position
    from vlaunch.cache.store.shard import MAX_SLAB
    from vlaunch.cache.store.slabs import get_backend
    be, ms = get_backend(dev), {}
    def timed(name, fn):
        t = time.perf_counter(); r = fn(); ms[name] = (time.perf_counter() - t) * 1e3; return r
    def wrap(name):
        orig = getattr(reader._CudaMover, name)
        def timed_method(self):
            t = time.perf_counter(); orig(self); ms[name] = (time.perf_counter() - t) * 1e3
        setattr(reader._CudaMover, name, timed_method)
    t0 = time.perf_counter()
    ckpt = timed("open_checkpoint", lambda: open_checkpoint(spec["model"]))
    plan = timed("load_plan", lambda: load_plan("llama"))
    specs = timed("plan_rank", lambda: plan_rank(ckpt, plan, Position.from_global(0, 1, 1, 1)))
    man = timed("pack", lambda: pack([(x.name, x.dtype, x.shape) for x in specs],
                                     backend=be.name, alignment=be.alignment, max_slab=MAX_SLAB))
    slabs = timed("allocate", lambda: [be.allocate(n) for n in man.slab_sizes])
    bufs = [x.buffer() for x in slabs]
    wrap("finish"); wrap("close")
    if spec.get("sync"):  # the staging pool freed before fill returns, as before 2026-12-01
        reader.release_later = lambda mover: mover.close()
    timed("fill", lambda: reader.fill(specs, man, bufs, threads=READER_THREADS))
    torch.cuda.synchronize(dev)
    ms["total"] = (time.perf_counter() - t0) * 1e3
    for th in __import__("threading").enumerate():  # a release on its thread, timed apart
        if th.name == "vlaunch-unpin":
            th.join()
    out.update(ms=ms, bytes=man.nbytes, buffers=reader.STAGING.get("buffers"),
               pinned_ms=reader.STAGING.get("pinned_s", 0.0) * 1e3)
elif spec["what"] == "fp":  # what the engine's fingerprint costs, step by step, first time
    import cProfile, io, pstats
    marks = [("start", time.perf_counter())]
    def mark(name): marks.append((name, time.perf_counter()))
    from vlaunch.cache.store import fingerprints as F
    from vlaunch.cache.store import target as W
    from vlaunch.cache.store.slabs import backend_for
    from vlaunch.cache.contract.sockdir import socket_path
    from vlaunch.cache.store import cudadrv, identity, quant
    from vlaunch.cache.store.ranks import Position
    mark("imports")
    cudadrv._load(); mark("libcuda")
    prof = cProfile.Profile(); prof.enable(); be = backend_for(dev); prof.disable()
    mark("backend")
    text = io.StringIO(); pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(10)
    out["backend_profile"] = [line.strip() for line in text.getvalue().splitlines()
                              if line.strip()[:1].isdigit()][:10]
    be.device_info(); mark("device_info")
    sock = socket_path(spec["sock"], 0)
    identity.identities(spec["model"], identity.memo_path(sock)); mark("identities")
    quant.fingerprint_fields(spec["model"], None); mark("quantization")
    F.plan_identity("llama"); mark("plan")
    F.fingerprint(W.Target(spec["model"], Position.from_global(0, 1, 1, 1), dev, "llama", "",
                           "vlaunch", socket=sock)); mark("whole_again")
    out["ms"] = {b[0]: (b[1] - a[1]) * 1e3 for a, b in zip(marks, marks[1:])}
elif spec["what"] == "race":  # copy mode's destination allocation against the slab import
    import threading
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.store.slabs import backend_for
    from vlaunch.cache.contract.sockdir import socket_path
    client = CacheClient(socket_path(spec["sock"], 0))
    reply, fds = client.request({"op": "open", "mode": "copy"})
    sizes, be, got = reply["sizes"], backend_for(dev), {}  # backend made before the clock
    def imp(): got["src"] = [be.import_fd(fd, n, readonly=True) for fd, n in zip(fds, sizes)]
    def alloc(): got["dst"] = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
    def vmm():
        got["slabs"] = [be.allocate(n) for n in sizes]
        got["dst"] = [s.tensor() for s in got["slabs"]]
    first, second = {"imp": (imp, None), "alloc": (alloc, None), "serial": (imp, alloc),
                     "alloc_on_thread": (imp, alloc), "import_on_thread": (alloc, imp),
                     "vmm_on_thread": (imp, vmm)}[spec["variant"]]
    t = time.perf_counter()
    if second is not None and spec["variant"] != "serial":
        th = threading.Thread(target=second); th.start(); first(); th.join()
    else:
        first()
        if second is not None:
            second()
    t1 = time.perf_counter()
    out.update(ms=(t1 - t) * 1e3, variant=spec["variant"])
    if "src" in got and "dst" in got:
        for d, s_ in zip(got["dst"], got["src"]):
            d.copy_(s_, non_blocking=True)
        torch.cuda.synchronize(dev)
        out["copy_ms"] = (time.perf_counter() - t1) * 1e3
else:
    free0, total = torch.cuda.mem_get_info(dev); alloc0 = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    import vlaunch.cache as V  # what an engine writes; the loader itself is imported lazily
    t1 = time.perf_counter()
    import vlaunch.cache.client.loader  # noqa: F401  (timed apart: load() would import it)
    import gc
    collections, started = [], [0.0]
    def on_gc(phase, info):  # the collector's passes inside load(): when, and how long
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], round((started[0] - t2) * 1e3, 3),
                                round((time.perf_counter() - started[0]) * 1e3, 3)))
    gc.callbacks.append(on_gc)
    from vlaunch.cache.client.connection import install_trace

    steps: dict[str, float] = {}
    install_trace(lambda step: steps.__setitem__(step, time.perf_counter()))
    out["gc"] = {"freeze_count": gc.get_freeze_count(), "counts": gc.get_count(),
                 "thresholds": gc.get_threshold()}
    t2 = time.perf_counter()
    w = V.load(spec["model"], socket_dir=spec["sock"], mode=spec["what"], fallback=False,
               device=dev)
    returned = time.perf_counter()
    gc.callbacks.remove(on_gc)
    out["gc"]["collections"] = collections  # (generation, at ms, took ms)
    torch.cuda.synchronize(dev)
    t3 = time.perf_counter()
    out["steps_ms"] = {k: round((v - t2) * 1e3, 3) for k, v in
                       [*steps.items(), ("returned", returned), ("synchronized", t3)]}
    out.update(package_import_s=t1 - t0, loader_import_s=t2 - t1, seconds=t3 - t2,
               total_s=t3 - t0, cuda_modules=sorted(m for m in sys.modules
                                                   if m.split(".")[0] == "cuda"))
    free1, _ = torch.cuda.mem_get_info(dev)
    out.update(source=w.source, tensors=len(w), bytes=sum(x.nbytes for x in w.values()),
               bytes_outside=w.bytes_outside, free_before=free0, free_after=free1,
               allocated_before=alloc0, allocated_after=torch.cuda.memory_allocated(dev),
               checksum=float(sum(x.float().sum().item() for x in list(w.values())[:8])))
import psutil
out.update(cpu=psutil.Process().cpu_num(), cpus=len(os.sched_getaffinity(0)))  # where it ran
print("RESULT " + json.dumps(out))
"""


def child(spec: dict[str, Any], prefix: list[str] | None = None) -> dict[str, Any]:
    """Run CHILD in a fresh process; returns its RESULT."""
    r = subprocess.run([*(prefix or []), sys.executable, "-c", CHILD, json.dumps(spec)],
                       capture_output=True, text=True, timeout=300)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child failed ({r.returncode}): {r.stderr[-2000:]}")


def shards(model: Path) -> list[Path]:
    """The checkpoint's safetensors files."""
    return sorted(model.glob("*.safetensors")) if model.is_dir() else [model]


def evict(files: list[Path]) -> str:
    """Drop the files from the page cache; returns how."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "fadvise DONTNEED + drop_caches"
    except OSError:
        return "fadvise DONTNEED"


def direct_read(files: list[Path], threads: int) -> float:
    """GB/s of O_DIRECT reads of every file by `threads` threads, 64 MiB each."""
    work = [(f, off) for f in files for off in range(0, f.stat().st_size, CHUNK)]
    lock = threading.Lock()
    total = sum(f.stat().st_size for f in files)

    def run() -> None:
        buf = mmap.mmap(-1, CHUNK)
        fds: dict[Path, int] = {}
        while True:
            with lock:
                if not work:
                    break
                f, off = work.pop()
            fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY | os.O_DIRECT))
            os.preadv(fd, [buf], off)
        for fd in fds.values():
            os.close(fd)

    t = time.perf_counter()
    pool = [threading.Thread(target=run) for _ in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return total / 1e9 / (time.perf_counter() - t)


def start_cache(model: Path, sock: Path, device: str, threads: int,
                prefix: list[str] | None = None, extra: tuple[str, ...] = ()
                ) -> tuple[subprocess.Popen[bytes], dict, float]:
    """Start a cache rank; returns (process, ready frame, load GB/s from its log)."""
    proc, ours, log = spawn_cache(model, sock, device, threads, prefix, extra)
    return proc, *wait_ready(proc, ours, log)


def spawn_cache(model: Path, sock: Path, device: str, threads: int,
                prefix: list[str] | None = None, extra: tuple[str, ...] = (),
                env: dict[str, str] | None = None
                ) -> tuple[subprocess.Popen[bytes], socket.socket, Path]:
    """Start a cache rank without waiting; returns (process, ready channel, log path)."""
    ours, theirs = socket.socketpair()
    log = sock.parent / f"cache-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "vlaunch.cache", "--model",
                             str(model), "--device", device, "--socket-dir", str(sock),
                             "--threads", str(threads), "--ready-fd", str(theirs.fileno()),
                             *extra], pass_fds=[theirs.fileno()], stderr=log.open("wb"),
                            start_new_session=True, env=env)
    theirs.close()
    return proc, ours, log


def wait_ready(proc: subprocess.Popen[bytes], ours: socket.socket, log: Path
               ) -> tuple[dict, float]:
    """The rank's ready frame (progress frames skipped) and its load GB/s from its log."""
    try:
        frame, fds = recv_ready(ours)
    except EOFError:
        raise RuntimeError(f"cache rank exited ({proc.poll()}): "
                           f"{log.read_text()[-1500:]}") from None
    for fd in fds:
        os.close(fd)
    text = log.read_text()
    m = re.search(r"in ([\d.]+)s \(([\d.]+) GB/s\)", text)
    done = re.findall(r"\(100%\) ([\d.]+) GB/s", text)  # the reader's own rate, from fill()
    frame["reader_gbps"] = float(done[-1]) if done else 0.0
    frame["register_refused"] = "cannot register" in text
    return frame, float(m.group(2)) if m else 0.0


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM its process group (unshare does not forward signals) and wait."""
    with contextlib.suppress(ProcessLookupError):  # it may have exited on its own
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


def safetensors_gbps(files: list[Path], device: str) -> float:
    """GB/s of safetensors load_file(device=...) over every shard, in a fresh process."""
    code = ("import sys, time, torch; from safetensors.torch import load_file\n"
            f"torch.zeros(1, device={device!r}); t = time.perf_counter(); n = 0\n"
            "for f in sys.argv[1:]:\n"
            f"    n += sum(x.nbytes for x in load_file(f, device={device!r}).values())\n"
            f"torch.cuda.synchronize({device!r}); print(n / 1e9 / (time.perf_counter() - t))")
    r = subprocess.run([sys.executable, "-c", code, *map(str, files)], capture_output=True,
                       text=True, check=True, timeout=600)
    return float(r.stdout.split()[-1])


def table(title: str, rows: list[tuple[str, str, str, str, str]]) -> None:
    """Print one table."""
    print(f"\n## {title}")
    print(f"{'figure':<44} | {'vlaunch':<26} | {'baseline':<30} | {'ratio':<7} | target")
    for r in rows:
        print(f"{r[0]:<44} | {r[1]:<26} | {r[2]:<30} | {r[3]:<7} | {r[4]}")
    sys.stdout.flush()


def step_first(model: Path, device: str, tmp: Path) -> None:
    """First load, cold and warm."""
    files = shards(model)
    how = evict(files)
    disk = {n: direct_read(files, n) for n in (1, 4, 8)}
    best = max(disk.values())
    evict(files)
    proc, _, cold = start_cache(model, tmp / "c1", device, 16)
    stop(proc)
    evict(files)
    st_cold = safetensors_gbps(files, device)
    st_warm = safetensors_gbps(files, device)
    warm = {}
    for threads in (8, 16, 32):
        proc, _, warm[threads] = start_cache(model, tmp / f"w{threads}", device, threads)
        stop(proc)
    w_best = max(warm.values())
    table(f"first load ({how}; direct reads {', '.join(f'{k}T {v:.2f}' for k, v in disk.items())}"
          f" GB/s; cache warm by threads {', '.join(f'{k}T {v:.1f}' for k, v in warm.items())})",
          [("cold load GB/s", f"{cold:.2f}", f"best direct read {best:.2f}",
            f"{cold / best:.0%}", ">= 95%"),
           ("cold, against safetensors", f"{cold:.2f}", f"safetensors cold {st_cold:.2f}",
            f"{cold / st_cold:.2f}x", "-"),
           ("warm load GB/s", f"{w_best:.1f}", f"safetensors warm {st_warm:.2f}",
            f"{w_best / st_warm:.1f}x", ">= 40 GB/s and >= 5x")])


def step_warm(model: Path, device: str, tmp: Path) -> None:
    """Warm first load only: reader threads sweep against safetensors."""
    files = shards(model)
    st_warm = safetensors_gbps(files, device)
    warm = {}
    for threads in (4, 8, 16):
        proc, _, warm[threads] = start_cache(model, tmp / f"w{threads}", device, threads)
        stop(proc)
    best = max(warm.values())
    table(f"warm first load (by threads {', '.join(f'{k}T {v:.1f}' for k, v in warm.items())})",
          [("warm load GB/s", f"{best:.1f}", f"safetensors warm {st_warm:.2f}",
            f"{best / st_warm:.1f}x", ">= 40 GB/s and >= 5x")])


def step_loadparts(model: Path, device: str, tmp: Path) -> None:
    """A TP 1 first load in fresh processes, taken apart: where the time outside reading goes."""
    spec = {"device": device, "model": str(model), "what": "loadparts"}
    runs = [child({**spec, "sync": sync}) for _ in range(3) for sync in (False, True)]
    for r, sync in zip(runs, [False, True] * 3, strict=True):
        r["sync"] = sync
    RESULTS["loadparts"] = runs
    print("\n## TP 1 first load taken apart, in-process, page cache warm (ms, median 3; "
          "alternated: the staging pool freed on a thread, or before fill returns)")
    for sync in (False, True):
        mine = [r for r in runs if bool(r.get("sync")) == sync] or runs
        med = {k: statistics.median(r["ms"].get(k, 0.0) for r in mine) for k in mine[0]["ms"]}
        gb = mine[0]["bytes"] / 1e9
        print(f"  {'freed before fill returns' if sync else 'freed on a thread'}: "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f"; whole load {gb / med['total'] * 1e3:.1f} GB/s ({gb:.1f} GB, "
              f"{mine[0]['buffers']} pinned buffers, their allocation "
              f"{statistics.median(r['pinned_ms'] for r in mine):.0f} ms summed over threads)")


def _print_handoff_parts(parts: list[dict[str, Any]], race: list[dict[str, Any]],
                         fps: list[dict[str, Any]]) -> None:
    """Copy mode taken apart, its allocation against the import, the fingerprint's steps."""
    print(f"copy mode taken apart (fresh process, after a share load; {parts[0]['slabs']} slab(s), "
          "ms, median 3: CPU launch / GPU events / wall):")
    for key in ("alloc", "first_copy_from_slabs", "second_copy_from_slabs", "copy_between_own"):
        cells = [statistics.median(p[key][k] for p in parts)
                 for k in ("launch_ms", "gpu_ms", "wall_ms")]
        print(f"  {key}: " + " / ".join(f"{c:.2f}" for c in cells))
    print("copy mode's destination against the slab import (fresh process, slab backend made "
          "first; ms, median 3: both steps / the copy after them):")
    for v in RACE:
        runs = [r for r in race if r["variant"] == v]
        copy_ms = [r["copy_ms"] for r in runs if "copy_ms" in r]
        print(f"  {v}: {statistics.median(r['ms'] for r in runs):.2f}"
              + (f" / {statistics.median(copy_ms):.2f}" if copy_ms else ""))
    print("the engine's fingerprint, first time in a fresh process (ms, median 3): " + ", ".join(
        f"{k} {statistics.median(f['ms'][k] for f in fps):.2f}" for k in fps[0]["ms"]))
    print("  the slab backend's creation, profiled once (tottime, function):\n    "
          + "\n    ".join(fps[0]["backend_profile"]))


def step_handoff(model: Path, device: str, tmp: Path) -> None:
    """Import + share load as an engine pays them, copy against D2D, memory accounting."""
    proc, _, load = start_cache(model, tmp / "h", device, 16)
    try:
        spec = {"device": device, "model": str(model), "sock": str(tmp / "h")}
        share = [child({**spec, "what": "share"}) for _ in range(5)]
        # five: one machine gave 83% then 79% of D2D in two calls of three (2026-12-01)
        copy = [child({**spec, "what": "copy"}) for _ in range(5)]
        detail = os.environ.get("HANDOFF_PARTS", "1") != "0"
        parts = [child({**spec, "what": "parts"}) for _ in range(3 if detail else 0)]
        race = [child({**spec, "what": "race", "variant": v})
                for _ in range(3 if detail else 0) for v in RACE]
        fps = [child({**spec, "what": "fp"}) for _ in range(3 if detail else 0)]
    finally:
        stop(proc)
    made = [line.split("made ", 1)[1] for log in sorted(tmp.glob("cache-*.log"))
            for line in log.read_text().splitlines() if "'s copy (" in line and "made " in line]
    d2d = child({"device": device, "what": "d2d"})
    fresh = [child({"device": device, "what": "alloc_d2d", "bytes": copy[0]["bytes"]})
             for _ in range(3)]
    RESULTS["handoff"] = {"share": share, "copy": copy, "alloc_d2d": fresh, "d2d": d2d,
                          "cache_load_gbps": load, "rank_copies": made}
    bw = 2 * d2d["bytes"] / d2d["seconds"]

    def ms(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs) * 1e3

    c = statistics.median(r["seconds"] for r in copy)
    c_bw = 2 * copy[0]["bytes"] / c
    ct = statistics.median(r["seconds"] for r in fresh)
    s0 = share[0]
    table(f"handoff: {s0['tensors']} tensors, {s0['bytes'] / 1e9:.1f} GB in one rank (cache load "
          f"{load:.1f} GB/s); fresh processes with torch + CUDA up; cuda modules after load: "
          f"{s0['cuda_modules'] or 'none'}",
          [("import vlaunch.cache + share load() (med 5)", f"{ms(share, 'total_s'):.2f} ms",
            f"package {ms(share, 'package_import_s'):.2f} + loader "
            f"{ms(share, 'loader_import_s'):.2f} + load {ms(share, 'seconds'):.2f}", "",
            "<= 15 ms"),
           ("copy load() (med 5), loader imported", f"{c * 1e3:.1f} ms = {c_bw / 1e12:.2f} "
            "TB/s r+w", f"D2D copy_ {bw / 1e12:.2f} TB/s r+w", f"{c_bw / bw:.0%}",
            ">= 80% of D2D"),
           ("copy load() against a fresh process's torch.empty + copy_ (med 3)",
            f"{c * 1e3:.1f} ms", f"allocate + copy {ct * 1e3:.1f} ms", f"{ct / c:.0%}", "")])
    # this call's headline figures, printed against the committed ones by the session script
    # (gpu_lib.sh compare_figures); merging them is a person's choice: summary.json keeps
    # ranges over many calls under the same ids
    record_figures({"share.import_load": f"{ms(share, 'total_s'):.1f} ms",
                    "share.imports": f"{ms(share, 'loader_import_s'):.1f} ms",
                    "share.load": f"{ms(share, 'seconds'):.1f} ms",
                    "copy.load": f"{c * 1e3:.1f} ms", "copy.d2d_pct": f"{c_bw / bw:.0%}"},
                   machine=machine_name(device),
                   source="bench_gpu_load.py --steps handoff: median of 5 fresh processes, one "
                          "call")
    for label, runs in (("share", share), ("copy", copy)):
        steps = runs[len(runs) // 2].get("steps_ms", {})
        print(f"{label} load() steps, ms after load() was called (one run): "
              + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
        print(f"  the collector in those load() calls: {[r.get('gc') for r in runs]}")
    RESULTS["handoff"].update(parts=parts, race=race, fingerprint=fps)
    if parts:
        _print_handoff_parts(parts, race, fps)
    print("the rank's copies for the copy-mode engines (its log):\n  " + "\n  ".join(made))
    print("memory accounting around one share handoff (engine process):")
    print(f"  mem_get_info free: {s0['free_before'] / 2**30:.2f} GiB -> "
          f"{s0['free_after'] / 2**30:.2f} GiB (the cache's slab is already counted as used)")
    print(f"  memory_allocated: {s0['allocated_before']} -> {s0['allocated_after']} bytes "
          "(torch's allocator does not see mapped slabs)")
    print(f"  bytes_outside reported by vlaunch: {s0['bytes_outside'] / 2**30:.2f} GiB")
    print(f"  copy mode: bytes_outside {copy[0]['bytes_outside']}, memory_allocated after "
          f"{copy[0]['allocated_after'] / 2**30:.2f} GiB")


LAYOUTS = {"tp1": (1, 1, "llama"), "tp2": (2, 1, "llama"), "tp4": (4, 1, "llama"),
           "pp2": (1, 2, "llama"), "tp2pp2": (2, 2, "llama"), "tp2r": (2, 1, "replicate")}
# NAME runs the layout with the default reader (VLAUNCH_READER unset: staging); NAME:MODE
# with another: span (VLAUNCH_SPLIT_READ=span: whole spans read and split on the device) or
# register (VLAUNCH_READER=register: DMA from the registered page cache), e.g. tp2:register


def gpu_count() -> int:
    """GPUs nvidia-smi lists (1 when it lists none or is missing)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in out.splitlines()))


def step_layouts(model: Path, device: str, tmp: Path) -> None:
    """First load per rank, every rank of a layout started at once, page cache warm (or with
    --cold, evicted before each layout: the ranks' rates together against the disk's best
    parallel O_DIRECT read of the same files)."""
    files, disk = shards(model), 0.0
    if ARGS.cold:
        evict(files)
        disk = max(direct_read(files, n) for n in (4, 8))
    for f in ([] if ARGS.cold else files):  # warm the page cache
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass
    gpus = gpu_count() if device.startswith("cuda") else 1
    rows, base = [], 0.0
    for name in ARGS.layouts.split(","):
        if ARGS.cold:
            evict(files)
        kind, _, mode = name.partition(":")
        tp, pp, plan = LAYOUTS[kind]
        env = {k: v for k, v in os.environ.items() if k != "VLAUNCH_READER"}  # the default
        env["VLAUNCH_SPLIT_READ"] = "span" if mode == "span" else "gather"
        if mode in ("staging", "register"):
            env["VLAUNCH_READER"] = mode
        world = tp * pp
        devices = [f"cuda:{r * gpus // world}" if device.startswith("cuda") else device
                   for r in range(world)]
        procs = []
        try:
            for r in range(world):
                sock = tmp / f"{name}"
                sock.mkdir(mode=0o700, exist_ok=True)
                procs.append(spawn_cache(model, sock, devices[r], ARGS.threads, None, (
                    "--rank", str(r), "--tensor-parallel-size", str(tp),
                    "--pipeline-parallel-size", str(pp), "--plan", plan),
                    env))
            ready = [wait_ready(*p) for p in procs]
        except Exception as exc:  # one failed layout must not hide the others
            rows.append((name, f"FAILED: {type(exc).__name__}: {str(exc)[-300:]}", "", "", ""))
            RESULTS.setdefault("layouts", {})[name] = {"failed": f"{exc}"[-2000:]}
            continue
        finally:
            for p in procs:
                stop(p[0])
        rates = [r[1] for r in ready]
        reader = [r[0]["reader_gbps"] for r in ready]
        if any(r[0]["register_refused"] for r in ready):
            name += " (registration REFUSED: staging)"
        RESULTS.setdefault("layouts", {})[name] = {"devices": devices, "gbps": rates,
                                                   "reader_gbps": reader}
        med = statistics.median(rates)
        if ARGS.cold:  # the ranks read at once: their rates add up to what the disk gave
            rows.append((f"{name} cold, {world} ranks together", f"{sum(rates):.2f} GB/s",
                         f"O_DIRECT best {disk:.2f}", f"{sum(rates) / disk:.0%}", ">= 95%"))
            continue
        base = base or (med if name == "tp1" else 0.0)
        rows.append((f"{name} ({plan}, {world} ranks on {','.join(sorted(set(devices)))})",
                     f"min {min(rates):.1f} med {med:.1f} max {max(rates):.1f} (reader "
                     f"{statistics.median(reader):.1f})",
                     f"tp1 per rank {base:.1f}" if base else "",
                     f"{med / base:.0%}" if base else "", ">= 80%" if name != "tp1" else ""))
    table(f"first load per rank, {'cold' if ARGS.cold else 'warm'}, --threads {ARGS.threads}, "
          f"{gpus} GPU(s)", rows)


SWEEP = r"""
import json, os, sys, threading, time
spec = json.loads(sys.argv[1])
import torch
from vlaunch.cache.store.checkpoint import open_checkpoint
from vlaunch.cache.store.manifest import pack
from vlaunch.cache.store.plan import LLAMA_PLAN, Position, plan_rank
from vlaunch.cache.store import reader, registered
from vlaunch.cache.store.reader import fill
from vlaunch.cache.store.slabs import get_backend
dev = spec["device"]
torch.zeros(1, device=dev); torch.cuda.synchronize(dev)
out = {}
ckpt = open_checkpoint(spec["model"])
files = sorted({str(e.file) for e in ckpt.tensors.values()})
total = sum(os.path.getsize(f) for f in files)
t = time.perf_counter()
src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
out["pinned_alloc_gib_s"] = time.perf_counter() - t
dst = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
dst.copy_(src, non_blocking=True); torch.cuda.synchronize(dev)
t = time.perf_counter()
for _ in range(8):
    dst.copy_(src, non_blocking=True)
torch.cuda.synchronize(dev)
out["h2d_gbps"] = 8 * (1 << 30) / 1e9 / (time.perf_counter() - t)
del dst


def reads(n, chunk=16 << 20):
    work = [(f, o) for f in files for o in range(0, os.path.getsize(f), chunk)]
    lock = threading.Lock()

    def run(i):
        view = memoryview(src[i * chunk:(i + 1) * chunk].numpy())
        fds = {f: os.open(f, os.O_RDONLY) for f in files}
        while True:
            with lock:
                if not work:
                    break
                f, o = work.pop()
            os.preadv(fds[f], [view], o)
        for fd in fds.values():
            os.close(fd)
    t = time.perf_counter()
    ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for x in ths:
        x.start()
    for x in ths:
        x.join()
    return total / 1e9 / (time.perf_counter() - t)


out["reads_gbps"] = {n: reads(n) for n in ((16,) if spec.get("quick") else (8, 16, 32))}
del src
backend = get_backend(dev)
held = {}


def rank_fill(position, threads, chunk):
    specs = plan_rank(ckpt, LLAMA_PLAN, position)
    m = pack([(s.name, s.dtype, s.shape) for s in specs], backend="cuda", alignment=256,
             max_slab=64 << 30)
    key = tuple(m.slab_sizes)
    if key not in held:
        for slabs in held.values():
            for x in slabs:
                x.release()
        held.clear()
        held[key] = [backend.allocate(n) for n in m.slab_sizes]
    tensors = [x.tensor() for x in held[key]]
    t = time.perf_counter()
    fill(specs, m, tensors, threads=threads, chunk=chunk)
    rate = m.nbytes / 1e9 / (time.perf_counter() - t)
    if os.environ.get("VLAUNCH_READER") != "register":
        out.setdefault("staging", {})[f"tp{position.tp_size} {threads}T {chunk >> 20}M "
                                      f"spare {reader.SPARE_BUFFERS}"] = dict(reader.STAGING)
    return rate


MiB = 1 << 20
configs = ((8, 16), (16, 16)) if spec.get("quick") else (
    (8, 16), (16, 16), (24, 16), (4, 32), (8, 32), (16, 32))
out["tp1"] = {f"{th}T {ch}M": rank_fill(Position(1, 0), th, ch * MiB) for th, ch in configs}
if spec.get("quick"):
    print("RESULT " + json.dumps(out))
    sys.exit(0)
reader.SPARE_BUFFERS = 16
out["tp1_run1_pool"] = rank_fill(Position(1, 0), 16, 16 * MiB)  # 32 buffers, as in run 1
reader.SPARE_BUFFERS = 2
best = max(out["tp1"], key=out["tp1"].get)
th, ch = int(best.split("T")[0]), int(best.split()[1][:-1])
out["best"] = best
out["split"] = {}
for mode in ("span", "gather"):
    os.environ["VLAUNCH_SPLIT_READ"] = mode
    for tp in (2, 4):
        out["split"][f"tp{tp} {mode}"] = rank_fill(Position(tp, 0), th, ch * MiB)
os.environ["VLAUNCH_SPLIT_READ"] = "gather"
os.environ["VLAUNCH_READER"] = "register"  # DMA from the registered page cache
out["register"] = {}
for tp in (1, 2, 4):
    rate = rank_fill(Position(tp, 0), th, None)
    out["register"][f"tp{tp}" + (" REFUSED, staging" if registered.LAST.get("refused")
                                  else "")] = rate
os.environ["VLAUNCH_READER"] = "staging"
out["tp1_again"] = rank_fill(Position(1, 0), th, ch * MiB)
for slabs in held.values():
    for x in slabs:
        x.release()
held.clear()
# probe: DMA straight from the page cache, the file's mapping registered with the driver
try:
    import mmap
    import numpy as np
    n = min(os.path.getsize(files[0]), 4 << 30) & ~((2 << 20) - 1)
    fd = os.open(files[0], os.O_RDONLY)
    arr = np.frombuffer(mmap.mmap(fd, n, prot=mmap.PROT_READ), dtype=np.uint8)
    cr = torch.cuda.cudart()
    t = time.perf_counter()
    err = cr.cudaHostRegister(arr.ctypes.data, n, 8)  # cudaHostRegisterReadOnly
    probe = {"bytes": n, "register_s": time.perf_counter() - t, "error": str(err)}
    if int(getattr(err, "value", err)) == 0:
        import warnings
        warnings.simplefilter("ignore")
        host = torch.from_numpy(arr)
        d = torch.empty(n, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        d.copy_(host, non_blocking=True)
        torch.cuda.synchronize(dev)
        probe["h2d_s"] = time.perf_counter() - t
        probe["same"] = bool(torch.equal(d[:1 << 20].cpu(), host[:1 << 20]))
        t = time.perf_counter()
        cr.cudaHostUnregister(arr.ctypes.data)
        probe["unregister_s"] = time.perf_counter() - t
        del d
    out["register_probe"] = probe
except Exception as e:  # a probe: its failure is a finding, not an error
    out["register_probe"] = {"failed": repr(e)}
from safetensors.torch import load_file
load_file(files[0], device=dev)
torch.cuda.synchronize(dev)
t = time.perf_counter()
n = 0
for f in files:
    n += sum(x.nbytes for x in load_file(f, device=dev).values())
torch.cuda.synchronize(dev)
out["safetensors_gbps"] = n / 1e9 / (time.perf_counter() - t)
print("RESULT " + json.dumps(out))
"""


def step_sweep(model: Path, device: str, tmp: Path) -> None:
    """In one process: the reader's warm rate by threads and chunk, against pinned H2D, plain
    reads into pinned memory and safetensors; split reads (rank 0 of TP 2 and 4) alone."""
    r = subprocess.run([sys.executable, "-c", SWEEP, json.dumps({"device": device,
                                                                   "model": str(model)})],
                       capture_output=True, text=True, timeout=400)
    out = next((json.loads(line[7:]) for line in r.stdout.splitlines()
                if line.startswith("RESULT ")), None)
    if out is None:
        raise RuntimeError(f"sweep failed ({r.returncode}): {r.stderr[-3000:]}")
    RESULTS["sweep"] = out
    # the same reader with torch's pinned memory made by malloc + cudaHostRegister on 8
    # threads instead of cudaHostAlloc (a torch allocator setting; quick: TP 1 only)
    conf = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    q = subprocess.run([sys.executable, "-c", SWEEP, json.dumps({
        "device": device, "model": str(model), "quick": True})], capture_output=True,
        text=True, timeout=200, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf})
    quick = next((json.loads(line[7:]) for line in q.stdout.splitlines()
                  if line.startswith("RESULT ")), {"failed": q.stderr[-1500:]})
    RESULTS["sweep_host_register"] = quick
    best = out["tp1"][out["best"]]
    reads = max(out["reads_gbps"].values())
    table(f"warm reader in one process (tp1 by threads/chunk: "
          f"{', '.join(f'{k} {v:.1f}' for k, v in out['tp1'].items())}; again at the best: "
          f"{out['tp1_again']:.1f}; plain reads into pinned by threads: "
          f"{', '.join(f'{k}T {v:.1f}' for k, v in out['reads_gbps'].items())}; 1 GiB pinned "
          f"alloc {out['pinned_alloc_gib_s'] * 1e3:.0f} ms)",
          [("warm load GB/s (best)", f"{best:.1f} ({out['best']})",
            f"safetensors {out['safetensors_gbps']:.2f}", f"{best / out['safetensors_gbps']:.1f}x",
            ">= 40 GB/s"),
           ("warm load vs pinned H2D", f"{best:.1f}", f"H2D {out['h2d_gbps']:.1f}",
            f"{best / out['h2d_gbps']:.0%}", ""),
           ("warm load vs plain reads into pinned", f"{best:.1f}", f"reads {reads:.1f}",
            f"{best / reads:.0%}", ""),
           *[(f"split read alone, rank 0 of {k}", f"{v:.1f}", f"tp1 {best:.1f}",
              f"{v / best:.0%}", ">= 80%") for k, v in out["split"].items()],
           *[(f"registered page cache, rank 0 of {k}", f"{v:.1f}", f"staging tp1 {best:.1f}",
              f"{v / best:.0%}", ">= 40 GB/s" if k == "tp1" else "")
             for k, v in out.get("register", {}).items()]])
    print(f"tp1 16T 16M with run 1's pool (32 buffers): {out['tp1_run1_pool']:.1f} GB/s")
    if "tp1" in quick:
        print(f"with PYTORCH_CUDA_ALLOC_CONF={conf}: 1 GiB pinned alloc "
              f"{quick['pinned_alloc_gib_s'] * 1e3:.0f} ms; tp1 "
              f"{', '.join(f'{k} {v:.1f}' for k, v in quick['tp1'].items())} GB/s")
    else:
        print(f"with PYTORCH_CUDA_ALLOC_CONF={conf}: failed: {quick}")
    for k, v in out.get("staging", {}).items():
        print(f"  staging {k}: {v.get('buffers')} buffers, {v.get('pinned_s', 0) * 1e3:.0f} ms "
              "allocating pinned memory")
    p = out.get("register_probe", {})
    if "h2d_s" in p:
        print(f"probe, page cache registered (cudaHostRegister read-only) and copied: "
              f"{p['bytes'] / 2**30:.1f} GiB, register {p['register_s'] * 1e3:.0f} ms "
              f"({p['bytes'] / 1e9 / p['register_s']:.1f} GB/s), H2D {p['h2d_s'] * 1e3:.0f} ms "
              f"({p['bytes'] / 1e9 / p['h2d_s']:.1f} GB/s), unregister "
              f"{p['unregister_s'] * 1e3:.0f} ms, bytes equal: {p['same']}")
    else:
        print(f"probe, page cache registered: {p}")


def _local_cpus(device: str) -> list[int]:
    """The CPUs the kernel lists as local to the GPU's PCI device (its NUMA node's); every
    CPU of the process where that cannot be read."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(device.partition(":")[2] or 0)
        bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).busId
        bus = bus.decode() if isinstance(bus, bytes) else bus
        text = Path(f"/sys/bus/pci/devices/{bus[-12:].lower()}/local_cpulist").read_text()
    except Exception as exc:  # a probe: say so and use them all
        print(f"local CPUs unknown ({type(exc).__name__}: {exc}); using every CPU")
        return sorted(os.sched_getaffinity(0))
    cpus: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def step_placement(model: Path, device: str, tmp: Path) -> None:
    """The share handoff by where its process runs: wherever the scheduler puts it, pinned to
    the CPUs local to the GPU, pinned to one of them (alternated, 7 each): whether the spread
    between calls and between runs of one call is the CPU a fresh process lands on."""
    local = _local_cpus(device)
    proc, _, _ = start_cache(model, tmp / "h", device, 16)
    try:
        idle0 = _cpu_seconds(proc.pid)
        time.sleep(1.0)
        idle = _cpu_seconds(proc.pid) - idle0
        spec = {"device": device, "model": str(model), "sock": str(tmp / "h"), "what": "share"}
        one = str(local[len(local) // 2])
        variants = {"free": [], "local": ["taskset", "-c", ",".join(map(str, local))],
                    "one_core": ["taskset", "-c", one]}
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        child(spec)  # the first fresh process of a call pays the page cache and the driver
        for _ in range(7):
            for v, prefix in variants.items():
                runs[v].append(child(spec, prefix=prefix or None))
    finally:
        stop(proc)
    RESULTS["placement"] = {"local_cpus": local, "nproc": os.cpu_count(),
                            "rank_idle_cpu_s_per_s": idle, "runs": runs}

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rs) * 1e3

    rows = []
    for v, rs in runs.items():
        spread = sorted(round(r["total_s"] * 1e3, 1) for r in rs)
        rows.append((f"import + share load, {v} (median 7)", f"{med(rs, 'total_s'):.2f} ms",
                     f"import {med(rs, 'loader_import_s'):.2f} load {med(rs, 'seconds'):.2f}",
                     f"{spread[0]}-{spread[-1]}", f"cpus {sorted({r['cpu'] for r in rs})}"))
    table(f"share handoff by placement ({len(local)} CPUs local to {device}: {local[0]}-"
          f"{local[-1]} of {os.cpu_count()}; the idle rank used {idle:.3f} CPU s/s)", rows)


def step_pidns(model: Path, device: str, tmp: Path) -> None:
    """Cache and engine in sibling PID namespaces, sharing only the socket directory."""
    ns = ["unshare", "--pid", "--fork", "--mount-proc"]
    if not shutil.which("unshare"):
        print("\n## pid namespaces: unshare not found; not run")
        return
    try:
        proc, _, _ = start_cache(model, tmp / "ns", device, 16, prefix=ns)
    except (EOFError, OSError) as exc:
        print(f"\n## pid namespaces: could not start the cache under unshare: {exc}")
        return
    try:
        spec = {"device": device, "model": str(model), "sock": str(tmp / "ns")}
        runs = [child({**spec, "what": "share"}, prefix=ns) for _ in range(3)]
        plain = child({**spec, "what": "share"})
    finally:
        stop(proc)
    ms = statistics.median(r["seconds"] for r in runs) * 1e3
    same = all(r["checksum"] == plain["checksum"] for r in runs)
    table("cache and engine in sibling PID namespaces (unshare --pid --fork --mount-proc)",
          [("share handoff across namespaces (median 3)", f"{ms:.2f} ms",
            f"same namespace {plain['seconds'] * 1e3:.2f} ms", "",
            f"works: {runs[0]['source'] == 'cache' and same}")])


def main() -> None:
    """Run the chosen steps."""
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", default="first,handoff,pidns")
    ap.add_argument("--layouts", default="tp1,tp2,tp4,pp2", help=f"of {','.join(LAYOUTS)}")
    ap.add_argument("--threads", type=int, default=READER_THREADS,
                    help="reader threads per rank (layouts; default: the rank's)")
    ap.add_argument("--cold", action="store_true", help="layouts: page cache evicted before each")
    ap.add_argument("--json", default="", help="write every raw number here after each step")
    ARGS = args = ap.parse_args()
    print(f"# {' '.join(sys.argv)}\n# {time.strftime('%Y-%m-%d %H:%M:%S')}")
    steps = {"first": step_first, "warm": step_warm, "handoff": step_handoff,
             "loadparts": step_loadparts,
             "pidns": step_pidns, "placement": step_placement, "layouts": step_layouts,
             "sweep": step_sweep}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.steps.split(","):
            d = Path(tmp) / name
            d.mkdir(mode=0o700)
            for sub in ("c1", "w4", "w8", "w16", "w32", "h", "ns"):
                (d / sub).mkdir(mode=0o700)
            try:
                steps[name](Path(args.model), args.device, d)
            except Exception as exc:  # one failed step must not hide the others
                print(f"\n## {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
                RESULTS.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"
            if args.json:
                Path(args.json).write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
