"""Soak: N engine restarts and N share loads against one cache rank; resources must stay flat.

An "engine restart" is a forked engine process that maps the weights in share mode, reads
them, and then exits (every other one is killed with SIGKILL, as a crash would be): from the
rank's side, a lease that appears and vanishes. A "share load" is `load(mode="share")` in the
soak process itself, whose tensors are then dropped. Before and after, for the soak process
and for the rank: open fds, threads, RSS, and the leases the rank still lists. A leak shows
as an end value that grows with N.

    python benchmarks/bench_soak.py                 # N = 1000
    python benchmarks/bench_soak.py --n 200         # CI: about a minute on 2 cores
    python benchmarks/bench_soak.py --device cuda   # GPU: share loads only (no fork with CUDA)

Prints one table: resource, start, end, end - start (fds, threads, leases: want 0).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file

from vlaunch.cache import load
from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract import wire
from vlaunch.cache.contract.sockdir import socket_path


def make_checkpoint(path: Path) -> None:
    """A small Llama-named checkpoint (a few MB: the soak is about counts, not bytes)."""
    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(256, 256, generator=g)
               .to(torch.bfloat16) for i in range(16)}, str(path))


def start_rank(model: Path, sockdir: Path, device: str) -> subprocess.Popen[bytes]:
    """A cache rank; returns once it reported ready."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "vlaunch.cache", "--model", str(model),
                             "--socket-dir", str(sockdir), "--ready-fd", str(theirs.fileno()),
                             "--plan", "replicate", "--device", device],
                            pass_fds=[theirs.fileno()])
    theirs.close()
    ours.settimeout(300)
    while True:
        msg, fds = wire.recv_frame(ours)
        for fd in fds:
            os.close(fd)
        if msg.get("event") == "ready":
            proc.channel = ours  # type: ignore[attr-defined]  # kept open while it serves
            return proc


def snapshot(pid: int, sockdir: Path | None = None) -> dict[str, float]:
    """fds, threads and RSS (MB) of a process; the rank's lease count with `sockdir`."""
    leases = {}
    if sockdir is not None:  # asked first: the rank closes this connection before we count
        client = CacheClient(socket_path(sockdir, 0))
        try:
            leases["leases"] = len(client.status()["leases"])
        finally:
            client.close()
        time.sleep(0.2)
    proc = psutil.Process(pid)
    return {"fds": proc.num_fds(), "threads": proc.num_threads(),
            "rss_mb": proc.memory_info().rss / 2**20, **leases}


def engine_restart(model: Path, sockdir: Path, crash: bool) -> None:
    """Fork an engine that maps the weights, reads them, and exits (or is killed)."""
    pid = os.fork()
    if pid == 0:
        try:
            w = load(str(model), socket_dir=str(sockdir), fallback=False, plan="replicate")
            total = sum(float(t.float().sum()) for t in w.values())
            if crash:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(0 if total == total else 1)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if status not in (0, signal.SIGKILL):
        raise SystemExit(f"engine restart failed with wait status {status}")


def share_load(model: Path, sockdir: Path, device: str = "cpu") -> None:
    """Map the weights here and drop them."""
    w = load(str(model), socket_dir=str(sockdir), fallback=False, plan="replicate",
             device=device)
    assert w.source == "cache"
    del w


def settle(sockdir: Path) -> None:
    """Let ended leases close on the rank's side."""
    gc.collect()
    deadline = time.monotonic() + 10
    while snapshot(os.getpid(), sockdir)["leases"] and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="restarts and share loads each")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (share loads only)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # forked engines: no intra-op thread pool to inherit half-alive
    with tempfile.TemporaryDirectory() as tmp:
        model, sockdir = Path(tmp) / "m.safetensors", Path(tmp) / "s"
        sockdir.mkdir(mode=0o700)
        make_checkpoint(model)
        rank = start_rank(model, sockdir, args.device)
        try:
            share_load(model, sockdir, args.device)  # warm: imports, backends, the watcher
            gpu = args.device.startswith("cuda")
            settle(sockdir)
            me0, rank0 = snapshot(os.getpid()), snapshot(rank.pid, sockdir)
            times: dict[str, list[float]] = {"engine restart": [], "share load": []}
            for i in range(args.n):
                t0 = time.perf_counter()
                if not gpu:  # a forked child cannot use its parent's CUDA context
                    engine_restart(model, sockdir, crash=bool(i % 2))
                t1 = time.perf_counter()
                share_load(model, sockdir, args.device)
                t2 = time.perf_counter()
                if not gpu:
                    times["engine restart"].append(t1 - t0)
                times["share load"].append(t2 - t1)
            settle(sockdir)
            me1, rank1 = snapshot(os.getpid()), snapshot(rank.pid, sockdir)
        finally:
            rank.terminate()
            rank.wait(30)
    restarts = "no engine restarts" if not times["engine restart"] else \
        f"{args.n} engine restarts (half SIGKILLed)"
    print(f"soak on {args.device}: {restarts} and {args.n} share loads")
    print(f"{'resource':<22}{'start':>10}{'end':>10}{'end - start':>14}")
    for who, a, b in (("soak process", me0, me1), ("rank", rank0, rank1)):
        for key in a:
            print(f"{who + ' ' + key:<22}{a[key]:>10.1f}{b[key]:>10.1f}{b[key] - a[key]:>14.1f}")
    for what, ts in times.items():
        if ts:
            print(f"{what:<22} median {statistics.median(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
