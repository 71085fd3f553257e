"""Probe (one GPU): which step of an in-place swap's staging stalls the serving engine.

    python benchmarks/probe_staging_stall.py [--gib 16]

A "serving" child process runs what a decode step does, back to back: a small host-to-device
copy, a few bf16 matmuls, a device-to-host copy of the result, synchronized; then the reference
engine's per-request memory figure (NVML's per-process query) and torch.cuda.mem_get_info; it
records each one's latency. Meanwhile this process takes the staging's steps one after another
(each alone, a pause between them): pinned host memory by cudaHostAlloc, pinned by malloc +
cudaHostRegister (the reader's setting), pageable host memory, a host fill of the pinned
buffers, a device-to-host copy of a served-sized device buffer into them (the rollback copy),
and a host-to-device copy back (the cutover). Prints, per step, the serving loop's median and
worst latency while it ran, against the idle baseline.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

perf = time.perf_counter


def serve(stop: mp.Event, out: mp.Queue) -> None:
    import torch

    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    host = torch.zeros(64, 4096, dtype=torch.bfloat16)


    from vlaunch.cache.reference.memory import process_device_bytes

    samples: dict[str, list[tuple[float, float]]] = {"step": [], "nvml": [], "mem_get_info": []}
    while not stop.is_set():
        t0 = perf()
        x = host.to("cuda", non_blocking=False)
        for _ in range(8):
            x = (x + a) @ w
        x.float().sum().item()
        t1 = perf()
        process_device_bytes("cuda:0")  # what the reference engine asks after each request
        t2 = perf()
        torch.cuda.mem_get_info(0)
        t3 = perf()
        samples["step"].append((t0, t1 - t0))
        samples["nvml"].append((t1, t2 - t1))
        samples["mem_get_info"].append((t2, t3 - t2))
        time.sleep(0.002)
    out.put(samples)



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16)
    args = ap.parse_args()
    import torch

    n = int(args.gib * (1 << 30))
    chunk = 256 << 20
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=serve, args=(stop, out))
    child.start()
    torch.cuda.init()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    time.sleep(8)  # the child's CUDA start
    marks: list[tuple[str, float, float]] = []

    def step(name: str, fn) -> None:
        t0 = perf()
        fn()
        torch.cuda.synchronize()
        marks.append((name, t0, perf()))
        print(f"{name}: {perf() - t0:.3f} s", flush=True)
        time.sleep(1.5)

    t_idle = perf()
    time.sleep(2)
    marks.append(("idle", t_idle, perf()))
    held: dict[str, object] = {}
    step("pinned cudaHostAlloc", lambda: held.update(
        a=torch.empty(n, dtype=torch.uint8, pin_memory=True)))
    held.clear()
    step("free it", lambda: getattr(torch._C, "_host_emptyCache", lambda: None)())
    settings = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    if settings is not None:
        settings("pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
    step("pinned host-register", lambda: held.update(
        a=torch.empty(n, dtype=torch.uint8, pin_memory=True)))
    pinned = held["a"]
    step("host fill of pinned", lambda: pinned.fill_(7))  # type: ignore[attr-defined]
    step("pageable alloc+fill", lambda: held.update(b=torch.full((n,), 7, dtype=torch.uint8)))

    def d2h() -> None:
        for at in range(0, n, chunk):
            pinned[at:at + chunk].copy_(dev[at:at + chunk], non_blocking=True)  # type: ignore

    def h2d() -> None:
        for at in range(0, n, chunk):
            dev[at:at + chunk].copy_(pinned[at:at + chunk], non_blocking=True)  # type: ignore

    step("D2H 256 MiB chunks", d2h)
    step("H2D 256 MiB chunks", h2d)
    held.clear()
    pinned = None
    step("unpin (free)", lambda: getattr(torch._C, "_host_emptyCache", lambda: None)())
    stop.set()
    samples = out.get(timeout=60)
    child.join(30)
    print("step | s | " + " | ".join(f"{k} median / worst ms" for k in samples))
    for name, t0, t1 in marks:
        cells = []
        for series in samples.values():
            inside = [w * 1000 for s, w in series if s + w > t0 and s < t1]
            cells.append(f"{statistics.median(inside):.2f} / {max(inside):.1f}" if inside
                         else "-")
        print(f"{name} | {t1 - t0:.3f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
