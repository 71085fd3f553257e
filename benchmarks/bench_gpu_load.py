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

from vlaunch.cache.contract import wire

CHUNK = 64 << 20
CHILD = r"""
import gc, json, sys, time
spec = json.loads(sys.argv[1])
import torch
dev = spec["device"]
torch.zeros(1, device=dev); torch.cuda.synchronize(dev)
out = {}
if spec["what"] == "d2d":
    n = 16 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    b.copy_(a); torch.cuda.synchronize(dev)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); b.copy_(a); torch.cuda.synchronize(dev)
        ts.append(time.perf_counter() - t)
    ts.sort(); out = {"seconds": ts[2], "bytes": n}
else:
    import vlaunch.cache.client.loader as L
    free0, total = torch.cuda.mem_get_info(dev); alloc0 = torch.cuda.memory_allocated(dev)
    t = time.perf_counter()
    w = L.load(spec["model"], socket_dir=spec["sock"], mode=spec["what"], fallback=False,
               device=dev)
    torch.cuda.synchronize(dev)
    out["seconds"] = time.perf_counter() - t
    free1, _ = torch.cuda.mem_get_info(dev)
    out.update(source=w.source, tensors=len(w), bytes=sum(x.nbytes for x in w.values()),
               bytes_outside=w.bytes_outside, free_before=free0, free_after=free1,
               allocated_before=alloc0, allocated_after=torch.cuda.memory_allocated(dev),
               checksum=float(sum(x.float().sum().item() for x in list(w.values())[:8])))
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
                prefix: list[str] | None = None) -> tuple[subprocess.Popen[bytes], dict, float]:
    """Start a cache rank; returns (process, ready frame, load GB/s from its log)."""
    ours, theirs = socket.socketpair()
    log = sock.parent / f"cache-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "vlaunch.cache", "--model",
                             str(model), "--device", device, "--socket-dir", str(sock),
                             "--threads", str(threads), "--ready-fd", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], stderr=log.open("wb"),
                            start_new_session=True)
    theirs.close()
    ready, fds = wire.recv_frame(ours)
    for fd in fds:
        os.close(fd)
    m = re.search(r"in ([\d.]+)s \(([\d.]+) GB/s\)", log.read_text())
    return proc, ready, float(m.group(2)) if m else 0.0


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM its process group (unshare does not forward signals) and wait."""
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


def step_handoff(model: Path, device: str, tmp: Path) -> None:
    """Share and copy at scale, memory accounting, D2D baseline."""
    proc, _, load = start_cache(model, tmp / "h", device, 16)
    try:
        spec = {"device": device, "model": str(model), "sock": str(tmp / "h")}
        share = [child({**spec, "what": "share"}) for _ in range(5)]
        copy = [child({**spec, "what": "copy"}) for _ in range(3)]
    finally:
        stop(proc)
    d2d = child({"device": device, "what": "d2d"})
    bw = 2 * d2d["bytes"] / d2d["seconds"]
    s_ms = statistics.median(r["seconds"] for r in share) * 1e3
    c = statistics.median(r["seconds"] for r in copy)
    c_bw = 2 * copy[0]["bytes"] / c
    s0 = share[0]
    table(f"handoff at scale: {s0['tensors']} tensors, {s0['bytes'] / 1e9:.1f} GB in one rank "
          f"(cache load {load:.1f} GB/s)",
          [("share handoff (median of 5)", f"{s_ms:.2f} ms", "", "", "<= 20 ms"),
           ("copy handoff (median of 3)", f"{c * 1e3:.1f} ms = {c_bw / 1e12:.2f} TB/s r+w",
            f"D2D copy_ {bw / 1e12:.2f} TB/s r+w", f"{c_bw / bw:.0%}", ">= 80% of D2D")])
    print("memory accounting around one share handoff (engine process):")
    print(f"  mem_get_info free: {s0['free_before'] / 2**30:.2f} GiB -> "
          f"{s0['free_after'] / 2**30:.2f} GiB (the cache's slab is already counted as used)")
    print(f"  memory_allocated: {s0['allocated_before']} -> {s0['allocated_after']} bytes "
          "(torch's allocator does not see mapped slabs)")
    print(f"  bytes_outside reported by vlaunch: {s0['bytes_outside'] / 2**30:.2f} GiB "
          f"(= the rank's slabs: count them once, as outside memory)")
    print(f"  copy mode: bytes_outside {copy[0]['bytes_outside']}, memory_allocated after "
          f"{copy[0]['allocated_after'] / 2**30:.2f} GiB")


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
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", default="first,handoff,pidns")
    args = ap.parse_args()
    print(f"# {' '.join(sys.argv)}\n# {time.strftime('%Y-%m-%d %H:%M:%S')}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.steps.split(","):
            d = Path(tmp) / name
            d.mkdir(mode=0o700)
            for sub in ("c1", "w4", "w8", "w16", "w32", "h", "ns"):
                (d / sub).mkdir(mode=0o700)
            try:
                {"first": step_first, "warm": step_warm, "handoff": step_handoff,
                 "pidns": step_pidns}[name](
                    Path(args.model), args.device, d)
            except Exception as exc:  # one failed step must not hide the others
                print(f"\n## {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
