"""CPU: share handoff of a shard against safetensors.load_file from a warm page cache.

On CPU, safetensors' load_file maps the file lazily: it returns before any byte is read, and
the bytes arrive as page faults on first use. So the table compares the call alone and the
call plus one read of every page (tensors really usable) on both sides; the second is the
figure that counts (its >= 2x target was retired with file slabs: it needs 2 MiB pages).
Pages are touched from one thread (numpy), so that waking torch's thread pool on a busy
machine is not what is timed. What a touch costs is decided by the slab's page size, so the
table says which page size the rank reports for its sealed memfd slabs
(cache/store/cpubacking.py), how much of the client's mapping ended up in 2 MiB entries, and
the host's shmem huge-page policy. VLAUNCH_CPU_SLAB_PAGES=4k in the environment
makes the rank never ask for 2 MiB pages (the rank inherits it).

    python benchmarks/bench_cpu_handoff.py [--size-mb 512] [--repeats 7]
    python benchmarks/bench_cpu_handoff.py --size-mb 64 --repeats 3      # CI: a few seconds

Prints one table: figure, vlaunch, baseline, ratio; each as median (best) of
alternated runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchlib import cpu_rank
from safetensors.torch import load_file, save_file

from vlaunch.cache import load


def make_checkpoint(path: Path, size_mb: int) -> None:
    """About size_mb of bf16 tensors, 8 MiB each."""
    n = max(1, size_mb // 8)
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(2048, 2048, generator=g)
               .to(torch.bfloat16) for i in range(n)}
    save_file(tensors, str(path))


def paired_ms(ours, theirs, repeats: int) -> tuple[list[float], list[float]]:  # type: ignore[no-untyped-def]
    """Wall times in ms of ours() and theirs(), alternated so that load on a shared machine
    falls on both alike; one untimed warm-up of each first."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats + 1):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            t = time.perf_counter()
            fn()
            if i:
                out.append((time.perf_counter() - t) * 1e3)
    return times


def cell(times: list[float]) -> str:
    """'median (best)' of a list of milliseconds."""
    return f"{statistics.median(times):.1f} ({min(times):.1f})"


def ratio(ours: list[float], theirs: list[float]) -> str:
    """theirs / ours, of the medians (of the best times)."""
    return (f"{statistics.median(theirs) / statistics.median(ours):.2f}x "
            f"({min(theirs) / min(ours):.2f}x)")


def touch(tensors: dict, pmd: list[int] | None = None) -> None:  # type: ignore[type-arg]
    """Touch every page once, so lazily mapped pages are faulted in; note the PMD-mapped kB."""
    for t in tensors.values():
        t.reshape(-1).view(torch.uint8).numpy()[::4096].sum()
    if pmd is not None:
        pmd.append(pmd_mapped_kb())
    client = getattr(tensors, "client", None)
    if client is not None:
        client.close()


def pmd_mapped_kb() -> int:
    """kB of this process's shared file and shmem mappings mapped by 2 MiB entries."""
    kb = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(("FilePmdMapped:", "ShmemPmdMapped:")):
            kb += int(line.split()[1])
    return kb


def pages_of(sockdir: Path) -> str:
    """The page size rank 0 reports for its slabs ("2M" or "4k")."""
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.contract.sockdir import socket_path

    client = CacheClient(socket_path(sockdir, 0))
    try:
        return str(client.status().get("slab_pages", "?"))
    finally:
        client.close()


def shmem_policy() -> str:
    """The host's shmem THP policy (the bracketed word of shmem_enabled), or 'unknown'."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return "unknown"
    words = [w[1:-1] for w in text.split() if w.startswith("[")]
    return words[0] if words else text.strip()


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m.safetensors"
        make_checkpoint(model, args.size_mb)
        sockdir = Path(tmp) / "s"
        proc, ready, channel = cpu_rank(model, sockdir)
        try:
            load_file(str(model))  # warm the page cache
            kw = {"socket_dir": str(sockdir), "plan": "replicate", "fallback": False,
                  "device": "cpu"}
            call = paired_ms(lambda: load(str(model), **kw).client.close(),
                             lambda: load_file(str(model)), args.repeats)
            pmd: list[int] = []
            touch(load(str(model), **kw), pmd)  # untimed: reading smaps takes milliseconds
            touched = paired_ms(lambda: touch(load(str(model), **kw)),
                                lambda: touch(load_file(str(model))), args.repeats)
            pages = pages_of(sockdir)
            copy = paired_ms(lambda: load(str(model), mode="copy", **kw),
                             lambda: load_file(str(model)), args.repeats)
        finally:
            proc.terminate()
            proc.wait()
            channel.close()
    gb = ready["bytes"] / 1e9
    rows = [("share handoff (call returns)", *call), ("share + touch every page", *touched),
            ("copy handoff", *copy)]
    print(f"\nshard {gb:.2f} GB, {args.repeats} alternated runs: median (best), "
          f"{time.strftime('%Y-%m-%d')}; baseline: safetensors.torch.load_file, page cache "
          f"warm; shmem huge pages: {shmem_policy()}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"slab pages (as the rank reports): {pages}; client mapping in 2 MiB entries "
          "after the touch: "
          f"{pmd[0] >> 10} of {ready['bytes'] >> 20} MiB")
    print(f"{'figure':<28} {'vlaunch ms':>14} {'baseline ms':>14} {'ratio':>15}")
    for name, ours, theirs in rows:
        print(f"{name:<28} {cell(ours):>14} {cell(theirs):>14} {ratio(ours, theirs):>15}")


if __name__ == "__main__":
    main()
