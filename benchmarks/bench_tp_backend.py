#!/usr/bin/env python3
"""The reference engine's collectives at TP 2 on each backend that can run them here.

    python benchmarks/bench_tp_backend.py [--hidden 4096] [--vocab 128256] [--tokens 8]
        [--iters 200] [--out FILE]

Two processes per case, a gloo or nccl group over a TCP store on loopback, timing what one
forward pass of the reference engine does per layer and per token: an all-reduce of the
[tokens, hidden] float32 activations (two per layer), and the all-gather of one token's
vocab-split logits. Cases: gloo with CPU tensors (the CPU engine); on CUDA, gloo with CUDA
tensors of two ranks on GPU 0 (what `--devices 0,0` uses: gloo stages them through pinned host
memory), the same staged by hand (.cpu() then copy back), and nccl with one rank a GPU where
there are two. Prints one JSON line per case (median and p90 microseconds of each collective)
and the ratio of each case's all-reduce to the first case's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def worker(rank: int, port: int, case: str, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of a case: join the group, time both collectives, return rank 0's figures."""
    import torch
    import torch.distributed as dist

    backend, where = case.split(":")
    device = {"cpu": "cpu", "gpu0": "cuda:0", "staged": "cuda:0", "gpus": f"cuda:{rank}"}[where]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group(backend, store=store, rank=rank, world_size=2)
    act = torch.randn(args.tokens, args.hidden, device=device)
    logits = torch.randn(1, args.vocab // 2, device=device)
    parts = [torch.empty_like(logits) for _ in range(2)]

    def reduce() -> None:
        if where == "staged":
            host = act.cpu()
            dist.all_reduce(host)
            act.copy_(host)
        else:
            dist.all_reduce(act)

    def gather() -> None:
        if where == "staged":
            host = [torch.empty_like(logits, device="cpu") for _ in range(2)]
            dist.all_gather(host, logits.cpu())
            for p, h in zip(parts, host, strict=True):
                p.copy_(h)
        else:
            dist.all_gather(parts, logits)

    out = {}
    for name, op in (("all_reduce", reduce), ("all_gather", gather)):
        times = []
        for i in range(args.iters + 10):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            op()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= 10:  # the first calls set up the connections
                times.append((time.perf_counter() - t) * 1e6)
        times.sort()
        out[name] = {"median_us": round(statistics.median(times), 1),
                     "p90_us": round(times[int(0.9 * len(times))], 1)}
    dist.destroy_process_group()
    return out


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start both ranks of a case and return rank 0's figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--worker", case, "--port", str(port), "--hidden",
            str(args.hidden), "--vocab", str(args.vocab), "--tokens", str(args.tokens),
            "--iters", str(args.iters)]
    procs = [subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        return {"case": case, "error": f"exit statuses {[p.returncode for p in procs]}"}
    return {"case": case, **json.loads(outs[0].strip().splitlines()[-1])}


def cases() -> list[str]:
    """The cases this machine can run."""
    out = ["gloo:cpu"]
    try:
        import torch
    except ImportError:
        return out
    if torch.cuda.is_available():
        out += ["gloo:gpu0", "gloo:staged"]
        if torch.cuda.device_count() >= 2:
            out.append("nccl:gpus")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        print(json.dumps(worker(args.rank, args.port, args.worker, args)), flush=True)
        return 0
    results = [run_case(c, args) for c in cases()]
    base = results[0].get("all_reduce", {}).get("median_us")
    for r in results:
        mine = r.get("all_reduce", {}).get("median_us")
        if base and mine:
            r["all_reduce_ratio_to_" + results[0]["case"]] = round(mine / base, 2)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
