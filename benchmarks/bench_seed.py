"""Seeding a rank from a running replica, against a disk load of the same shard and against a
plain copy of the same bytes, all measured in the same run.

A source cache rank (a real `vlaunch cache` process, TCP seeding on) loads the checkpoint; its
start (spawn -> ready) is the first figure. This process then fills fresh slabs of the same
backend, each figure the median of --repeats:

- same host: `seed_unix` over the source's slab fds (map, copy, unmap: device to device on
  CUDA), against a copy of the same number of bytes between two tensors of this process
  (`copy_`: device to device on CUDA, memcpy on CPU). "move" is the map + copy + unmap alone,
  "seed" the whole request (connect, fingerprint, manifest, fds, move, artifacts);
- TCP: `seed_tcp` over loopback (--streams connections, token checked, 64 MiB ranges),
  against a plain copy of the same bytes on as many TCP streams between two processes
  (bench_seed_engines.raw: `sendall` from a memfd, `recv_into` a fresh mapping: the link's
  own rate on this path; the issue's target is >= 80% of it), and against `load_shard` of
  the same shard from the checkpoint (page cache warm: after a first read);
- a seeded rank process (`vlaunch cache --seed unix:...`), spawn -> ready, against the source's;
- all ranks at once (--ranks R > 1, e.g. two ranks on one GPU): R source ranks (TP R, plan
  replicate: each holds the whole shard), then R seeding rank processes over TCP started
  together (the slowest one's own `seeded ... in` seconds), against R plain multi-stream
  copies run together.

The source runs with --no-checksum so neither side adds a crc32 pass (on CUDA it is off anyway).

    python benchmarks/bench_seed.py [--model DIR] [--device cpu|cuda] [--size-mb 1024]
        [--repeats 3] [--tcp-repeats N] [--streams 4] [--ranks 1] [--json FILE] [--logs DIR]

Without --model a checkpoint of about --size-mb is written to a temporary directory. Prints one
table: figure, vlaunch, baseline, ratio (vlaunch throughput / baseline throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from benchlib import machine_name, record_figures
from safetensors.torch import save_file

from vlaunch.cache import CacheClient
from vlaunch.cache.contract.progress import recv_ready
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.rank.seed import seed_tcp, seed_unix
from vlaunch.cache.store.plan import Position
from vlaunch.cache.store.shard import Shard, empty_shard, load_shard
from vlaunch.cache.store.slabs import get_backend

TOKEN = "bench-token-0123456789abcdef"
GB = 1e9


def make_checkpoint(path: Path, size_mb: int) -> None:
    """About size_mb of bf16 tensors, 8 MiB each."""
    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(2048, 2048, generator=g)
               .to(torch.bfloat16) for i in range(max(1, size_mb // 8))}, str(path))


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing on CPU)."""
    if device != "cpu":
        torch.cuda.synchronize(device)


def free(shard: Shard) -> None:
    """Give a shard's slabs back."""
    shard.tensors.clear()
    for slab in shard.slabs:
        slab.release()


def median(fn: Callable[[], float], repeats: int) -> float:
    """Median of fn()'s seconds over `repeats` calls."""
    return statistics.median(fn() for _ in range(max(1, repeats)))


class Rank:
    """A `vlaunch cache` process; `seconds`: spawn -> ready (`wait=False`: call ready())."""

    def __init__(self, model: str, device: str, sockdir: Path, log: Path, *extra: str,
                 wait: bool = True) -> None:
        self.ours, theirs = socket.socketpair()
        self.start = time.perf_counter()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlaunch.cache", "--model", model, "--plan", "replicate",
             "--device", device, "--socket-dir", str(sockdir), "--no-checksum",
             "--ready-fd", str(theirs.fileno()), *extra], pass_fds=[theirs.fileno()],
            env={**os.environ, "VLAUNCH_SEED_TOKEN": TOKEN}, stderr=log.open("wb"))
        theirs.close()
        self.seconds = 0.0
        if wait:
            self.ready()

    def ready(self) -> float:
        """Wait for the ready frame; the seconds from spawn."""
        with self.ours:
            try:
                _, fds = recv_ready(self.ours)  # progress frames, then ready
            except EOFError:
                raise SystemExit(f"rank exited before ready; see {self.log}:\n"
                                 f"{self.log.read_text()[-2000:]}") from None
            for fd in fds:
                os.close(fd)
        self.seconds = time.perf_counter() - self.start
        return self.seconds

    def rate(self, word: str) -> str:
        """The GB/s of the rank's own `loaded`/`seeded` log line, or '?'."""
        found = re.findall(rf"{word} .*?\(([0-9.]+) GB/s[,)]", self.log.read_text())
        return found[-1] if found else "?"

    def seeded_in(self) -> float:
        """The seconds of the rank's own `seeded ... in Xs` log line (nan without one)."""
        found = re.findall(r"seeded .*? in ([0-9.]+)s", self.log.read_text())
        return float(found[-1]) if found else float("nan")

    def stop(self) -> None:
        """SIGTERM and wait."""
        self.proc.terminate()
        self.proc.wait(60)


def all_ranks(model: str, device: str, ranks: int, streams: int, nbytes: int, logs: Path,
              short: Path) -> dict[str, Any]:
    """R source ranks, then R seeding rank processes at once, against R plain copies at
    once; seconds to the last one done."""
    from bench_seed_engines import raw

    port = free_port_block(ranks)
    sizes = ("--tensor-parallel-size", str(ranks))
    (short / "all-src").mkdir(mode=0o700)
    (short / "all-new").mkdir(mode=0o700)
    sources = [Rank(model, device, short / "all-src", logs / f"all-source-{r}.log", *sizes,
                    "--rank", str(r), "--seed-listen-port", str(port)) for r in range(ranks)]
    try:
        start = time.perf_counter()
        new = [Rank(model, device, short / "all-new", logs / f"all-seeded-{r}.log", *sizes,
                    "--rank", str(r), "--seed", f"tcp://127.0.0.1:{port}", "--seed-streams",
                    str(streams), wait=False) for r in range(ranks)]
        for rank in new:
            rank.ready()
        wall = time.perf_counter() - start
        seeded = max(rank.seeded_in() for rank in new)  # they seed at the same time
        rates = [rank.rate("seeded") for rank in new]
        for rank in new:
            rank.stop()
    finally:
        for rank in sources:
            rank.stop()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(ranks) as pool:  # each copy's own seconds, its sender spawned
        plain = max(pool.map(lambda _: raw(model, nbytes, streams, "raw-send"), range(ranks)))
    return {"all_ranks": ranks, "all_seed_s": seeded, "all_raw_s": plain,
            "all_rank_gbps": rates, "all_wall_s": wall}


def free_port_block(n: int) -> int:
    """A base port with nothing listening on it and the n - 1 after it."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(1, n)):
            return base
    raise SystemExit("no block of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def measure(model: str, device: str, repeats: int, tcp_repeats: int, logs: Path,
            streams: int = 4, ranks: int = 1) -> dict[str, Any]:
    """Every figure of the table, as a dict."""
    short = Path(tempfile.mkdtemp(prefix="vl-seed-"))  # socket paths stay short
    sockdir, newdir = short / "src", short / "new"
    for d in (sockdir, newdir):
        d.mkdir(mode=0o700)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = Rank(model, device, sockdir, logs / "source.log", "--seed-listen-port", str(port))
    out: dict[str, Any] = {"device": device, "source_start_s": source.seconds,
                           "source_load_gbps": source.rate("loaded")}
    try:
        client = CacheClient(socket_path(sockdir, 0))
        fingerprint, nbytes = client.status()["fingerprint"], client.manifest().nbytes
        client.close()
        backend = get_backend(device)
        device = backend.device
        position = Position.from_global(0, 1, 1, 1)
        out["bytes"] = nbytes

        def seeded(how: str) -> tuple[float, float, dict[str, float]]:
            shard = empty_shard(model, "replicate", position, backend)
            try:
                if how == "unix":
                    got = seed_unix(str(sockdir), 0, fingerprint, shard.manifest, shard.tensors,
                                    device)
                else:
                    got = seed_tcp("127.0.0.1", port, TOKEN, fingerprint, shard.manifest,
                                   shard.tensors, streams=streams)
                return got.seconds, got.copy_seconds, got.phases
            finally:
                free(shard)

        def disk() -> float:
            start = time.perf_counter()
            shard = load_shard(model, "replicate", position, backend)
            sync(device)
            seconds = time.perf_counter() - start
            free(shard)
            return seconds

        pair = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]

        def copy() -> float:
            sync(device)
            start = time.perf_counter()
            pair[1].copy_(pair[0])
            sync(device)
            return time.perf_counter() - start

        copy()  # first touch / warm-up
        out["copy_s"] = median(copy, repeats)
        pair.clear()
        if device != "cpu":
            torch.cuda.empty_cache()  # the seeded rank process needs that memory
        seeded("unix")  # warm-up: first import of the source's slabs, allocator
        unix = [seeded("unix") for _ in range(max(1, repeats))]
        out["seed_unix_s"] = statistics.median(u[0] for u in unix)
        out["seed_unix_move_s"] = statistics.median(u[1] for u in unix)
        out["seed_unix_phases_ms"] = {k: statistics.median(u[2][k] for u in unix) * 1e3
                                      for k in unix[0][2]}
        disk()  # page cache warm
        out["disk_s"] = median(disk, repeats)
        from bench_seed_engines import raw

        tcp, plain = [], []
        for _ in range(max(1, tcp_repeats)):  # alternated: the same load on both
            tcp.append(seeded("tcp"))
            plain.append(raw(model, nbytes, streams, "raw-send"))
        out["seed_tcp_s"] = statistics.median(t[0] for t in tcp)
        out["raw_tcp_s"] = statistics.median(plain)
        out["streams"] = streams
        new = Rank(model, device, newdir, logs / "seeded.log", "--seed", f"unix:{sockdir}")
        out["seeded_start_s"], out["seeded_rank_gbps"] = new.seconds, new.rate("seeded")
        new.stop()
    finally:
        source.stop()
    if ranks > 1:
        out.update(all_ranks(model, device, ranks, streams, nbytes, logs, short))
    return out


def table(r: dict[str, Any]) -> str:
    """The printed table."""
    gb = r["bytes"] / GB

    def row(name: str, ours: float, base: float) -> str:
        return (f"{name:<44} {gb / ours:>8.1f} GB/s {gb / base:>8.1f} GB/s "
                f"{base / ours:>7.2f}x")

    lines = [f"{r['device']}: {gb:.2f} GB shard; ratio = vlaunch throughput / baseline",
             f"{'figure':<44} {'vlaunch':>13} {'baseline':>13} {'ratio':>8}",
             row("seed same host (slab fds) vs copy_", r["seed_unix_s"], r["copy_s"]),
             row("  its move alone (map+copy+unmap) vs copy_", r["seed_unix_move_s"],
                 r["copy_s"]),
             row(f"seed TCP loopback ({r['streams']} streams) vs raw copy", r["seed_tcp_s"],
                 r["raw_tcp_s"]),
             row("seed TCP loopback vs disk load (warm)", r["seed_tcp_s"], r["disk_s"]),
             f"{'seeded rank spawn->ready vs source rank':<44} {r['seeded_start_s']:>10.2f} s "
             f"{r['source_start_s']:>10.2f} s {r['source_start_s'] / r['seeded_start_s']:>7.2f}x",
             f"  rank logs: source loaded at {r['source_load_gbps']} GB/s, the seeded rank "
             f"seeded at {r['seeded_rank_gbps']} GB/s",
             "  same-host steps (ms): " + ", ".join(
                 f"{k} {v:.2f}" for k, v in r["seed_unix_phases_ms"].items()),
             f"  times: seed {r['seed_unix_s'] * 1e3:.1f} ms (move "
             f"{r['seed_unix_move_s'] * 1e3:.1f} ms), copy_ {r['copy_s'] * 1e3:.1f} ms, TCP "
             f"{r['seed_tcp_s']:.2f} s, raw TCP {r['raw_tcp_s']:.2f} s, disk "
             f"{r['disk_s']:.2f} s"]
    if r.get("all_ranks"):
        n = r["all_ranks"]
        lines += [
            f"{f'all {n} ranks at once: seed TCP vs raw copies':<44} "
            f"{n * gb / r['all_seed_s']:>8.1f} GB/s {n * gb / r['all_raw_s']:>8.1f} GB/s "
            f"{r['all_raw_s'] / r['all_seed_s']:>7.2f}x",
            f"  per rank (its log line): {', '.join(r['all_rank_gbps'])} GB/s; the slowest "
            f"seeded in {r['all_seed_s']:.2f} s (spawn -> all ready {r['all_wall_s']:.2f} s), "
            f"raw {r['all_raw_s']:.2f} s"]
    return "\n".join(lines)


def main() -> None:
    """Measure and print the table (and --json)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="checkpoint (default: write one of --size-mb)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tcp-repeats", type=int, default=0, help="default: --repeats")
    ap.add_argument("--streams", type=int, default=4, help="TCP streams a rank seeds on")
    ap.add_argument("--ranks", type=int, default=1, help="> 1: also every rank at once")
    ap.add_argument("--json", default="")
    ap.add_argument("--logs", default="", help="rank logs (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if not model:
            model = str(Path(tmp) / "model.safetensors")
            make_checkpoint(Path(model), args.size_mb)
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        result = measure(model, args.device, args.repeats, args.tcp_repeats or args.repeats,
                         logs, args.streams, args.ranks)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    gb, key = result["bytes"] / GB, f"seed.{'cpu' if args.device == 'cpu' else 'gpu'}.tcp"
    figures = {f"{key}.rate": f"{gb / result['seed_tcp_s']:.1f} GB/s",
               f"{key}.ratio": f"{result['raw_tcp_s'] / result['seed_tcp_s']:.2f}x"}
    if result.get("all_ranks"):
        figures[f"{key}.all_ranks"] = f"{result['all_ranks'] * gb / result['all_seed_s']:.1f} GB/s"
    record_figures(figures, machine=machine_name(args.device),
                   source=f"seed_engines.md: bench_seed.py --device {args.device} ({gb:.2f} GB "
                          f"shard, {args.streams} streams, --ranks {args.ranks}), seed TCP "
                          f"loopback against a plain {args.streams}-stream socket copy")


if __name__ == "__main__":
    main()
