"""Probe (one GPU): the steps of an in-place swap's copy on the rank (rank/swap.py), alone.

    python benchmarks/probe_inplace.py [--gib 16] [--slabs 4] [--reps 3]

Pinned staging buffers as the rank makes them (staging.host_buffers), new VMM slabs as the
rank allocates them (right after freeing slabs of the same size, as a cutover does), and
staging.copy_bytes between them; against a plain torch copy_ from one pinned tensor into one
device tensor, in the same run. Prints one line per step, medians last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlaunch.cache.rank import staging
from vlaunch.cache.store.slabs_cuda import CudaBackend

perf = time.perf_counter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--slabs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    n = int(a.gib * (1 << 30)) // a.slabs
    sizes = (n,) * a.slabs
    total = n * a.slabs
    backend = CudaBackend(0)
    t0 = perf()
    host, free = staging.host_buffers(sizes, pinned=True)
    pinned_s = perf() - t0
    t0 = perf()
    for b in host:
        b.fill_(3)
    fill_s = perf() - t0
    print(f"pinned staging {total / 1e9:.2f} GB: allocated {pinned_s:.3f} s, filled "
          f"{fill_s:.3f} s", flush=True)
    rows: dict[str, list[float]] = {"allocate": [], "copy_bytes": [], "release": []}
    slabs = [backend.allocate(k) for k in sizes]
    for rep in range(a.reps):
        t0 = perf()
        for s in slabs:
            s.release()
        rows["release"].append(perf() - t0)
        t0 = perf()
        slabs = [backend.allocate(k) for k in sizes]
        rows["allocate"].append(perf() - t0)
        t0 = perf()
        staging.copy_bytes([s.buffer() for s in slabs], host)
        rows["copy_bytes"].append(perf() - t0)
        print(f"rep {rep}: release {rows['release'][-1]:.3f} s, allocate "
              f"{rows['allocate'][-1]:.3f} s, copy_bytes {rows['copy_bytes'][-1]:.3f} s "
              f"({total / rows['copy_bytes'][-1] / 1e9:.1f} GB/s)", flush=True)
    assert bool((slabs[-1].buffer()[-16:] == 3).all())
    plain_src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    plain_dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    plain = []
    for _ in range(a.reps):
        t0 = perf()
        plain_dst.copy_(plain_src, non_blocking=True)
        torch.cuda.synchronize()
        plain.append(perf() - t0)
    print(f"plain pinned copy_ of {n / 1e9:.2f} GB: {n / statistics.median(plain) / 1e9:.1f} "
          "GB/s", flush=True)
    print("step | median s | GB/s")
    for k, v in rows.items():
        m = statistics.median(v)
        print(f"{k} | {m:.3f} | {total / m / 1e9:.1f}")
    free()


if __name__ == "__main__":
    main()
