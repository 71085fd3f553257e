"""CPU: seeding a rank from a running replica against loading the same shard from disk.

A source cache rank holds a shard of about --size-mb; this process then fills fresh CPU slabs
three ways, each timed from nothing to a filled shard (median of --repeats):

- baseline: `load_shard` from the checkpoint file (page cache warm: the second of two reads);
- same host: `seed_unix`, over the source's slab fds (map read-only, memcpy, unmap);
- TCP: `seed_tcp` over loopback, one stream, token checked, slabs streamed in 16 MiB chunks.

The source runs with --no-checksum so both sides skip the crc32 pass (seeding verifies the
checksums when the manifest has them; that pass costs the same on either side).

    python benchmarks/bench_seed.py [--size-mb 1024] [--repeats 3]

Prints one table: figure, vlaunch, baseline, ratio (baseline time / vlaunch time).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from vlaunch.cache import CacheClient
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.rank.seed import seed_tcp, seed_unix
from vlaunch.cache.store.plan import Layout
from vlaunch.cache.store.shard import empty_shard, load_shard
from vlaunch.cache.store.slabs import CpuBackend

TOKEN = "bench-token-0123456789abcdef"


def make_checkpoint(path: Path, size_mb: int) -> None:
    """About size_mb of bf16 tensors, 8 MiB each."""
    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(2048, 2048, generator=g)
               .to(torch.bfloat16) for i in range(max(1, size_mb // 8))}, str(path))


def timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of fn() (which allocates and frees its own shard)."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        shard = fn()
        out.append(time.perf_counter() - start)
        shard.tensors.clear()
        for slab in shard.slabs:
            slab.release()
    return statistics.median(out)


def main() -> None:
    """Run the three figures and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.safetensors"
        make_checkpoint(model, args.size_mb)
        sockdir = Path(tmp) / "s"
        sockdir.mkdir(mode=0o700)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ours, theirs = socket.socketpair()
        src = subprocess.Popen(
            [sys.executable, "-m", "vlaunch.cache", "--model", str(model), "--plan", "replicate",
             "--socket-dir", str(sockdir), "--no-checksum", "--seed-listen-port", str(port),
             "--ready-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            env={**os.environ, "VLAUNCH_SEED_TOKEN": TOKEN}, stderr=subprocess.DEVNULL)
        theirs.close()
        try:
            _, fds = wire.recv_frame(ours)
            for fd in fds:
                os.close(fd)
            client = CacheClient(socket_path(sockdir, 0))
            fingerprint = client.status()["fingerprint"]
            client.close()
            backend, layout = CpuBackend(), Layout.from_global(0, 1, 1, 1)

            def disk():  # type: ignore[no-untyped-def]
                return load_shard(str(model), "replicate", layout, backend)

            def seeded(how: str):  # type: ignore[no-untyped-def]
                shard = empty_shard(str(model), "replicate", layout, backend)
                if how == "unix":
                    seed_unix(str(sockdir), 0, fingerprint, shard.manifest, shard.tensors, "cpu")
                else:
                    seed_tcp("127.0.0.1", port, TOKEN, fingerprint, shard.manifest,
                             shard.tensors)
                return shard

            timed(disk, 1)  # warm the page cache
            base = timed(disk, args.repeats)
            unix = timed(lambda: seeded("unix"), args.repeats)
            tcp = timed(lambda: seeded("tcp"), args.repeats)
        finally:
            src.terminate()
            src.wait(30)
    gb = args.size_mb / 1024 * 1.073741824
    print(f"shard: {args.size_mb} MiB on CPU, median of {args.repeats}; ratio = disk / seed")
    print(f"{'figure':<40} {'vlaunch':>12} {'baseline':>12} {'ratio':>8}")
    for name, t in (("seed same host (slab fds) vs disk load", unix),
                    ("seed TCP loopback vs disk load", tcp)):
        print(f"{name:<40} {t * 1e3:>9.0f} ms {base * 1e3:>9.0f} ms {base / t:>7.2f}x")
    for name, t in (("  throughput same host", unix), ("  throughput TCP", tcp)):
        print(f"{name:<40} {gb / t:>7.2f} GB/s {gb / base:>7.2f} GB/s")


if __name__ == "__main__":
    main()
