"""CPU cache rank start: spawn -> ready, against a bare `import torch` process, same run.

A CPU rank only moves bytes (numpy, preadv, memfd), so it never imports torch; the baseline is
what an import of torch alone costs a fresh process here (before, every rank paid it). Each
figure is the median of --repeats alternated runs; the rank's CPU seconds and resident memory
are read from /proc when it reports ready, as is whether libtorch is mapped into it.

    python benchmarks/bench_rank_start.py [--size-mb 64] [--tp 1] [--repeats 5]
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

from benchlib import bare_starts

from vlaunch.cache.contract.progress import recv_ready
from vlaunch.cache.reference.refmodel import make_checkpoint


def rank_start(model: Path, tp: int) -> tuple[float, float, float, bool]:
    """(seconds to ready, CPU seconds, RSS MB, libtorch mapped) of one rank 0 start."""
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o700)
        ours, theirs = socket.socketpair()
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "vlaunch.cache", "--model", str(model), "--socket-dir", d,
             "--tensor-parallel-size", str(tp), "--ready-fd", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stderr=subprocess.DEVNULL)
        theirs.close()
        ours.settimeout(120)
        _, fds = recv_ready(ours)
        wall = time.perf_counter() - start
        stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        rss = next(int(line.split()[1]) for line in
                   Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS")) / 1024
        torch_mapped = "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
        proc.terminate()
        proc.wait(30)
        for fd in fds:
            os.close(fd)
        ours.close()
    return wall, cpu, rss, torch_mapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(Path(tmp) / "m", hidden=512, intermediate=1536, vocab=4096,
                                target_bytes=args.size_mb << 20)
        ranks, bare = [], []
        for _ in range(args.repeats):
            ranks.append(rank_start(model, args.tp))
            bare.extend(bare_starts("cpu", 1))
    wall, cpu, rss = (statistics.median(r[i] for r in ranks) for i in range(3))
    base = statistics.median(bare)
    print(f"cpu rank 0 of TP {args.tp}, {args.size_mb} MB llama checkpoint; median of "
          f"{args.repeats}")
    print(f"{'figure':44s} {'vlaunch':>9s} {'baseline':>9s} {'ratio':>7s}")
    print(f"{'rank spawn->ready vs bare import torch':44s} {wall:8.2f}s {base:8.2f}s "
          f"{base / wall:6.2f}x")
    print(f"{'rank CPU seconds to ready':44s} {cpu:8.2f}s")
    print(f"{'rank resident memory (shard slabs included)':44s} {rss:7.0f}MB")
    print(f"{'libtorch mapped into the rank':44s} {any(r[3] for r in ranks)!s:>9s}")


if __name__ == "__main__":
    main()
