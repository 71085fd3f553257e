"""Costs that grow with the tensor count (MoE checkpoints hold 30k-100k tensors), at 1k, 10k
and 100k tensors, against safetensors in the same run.

For each count N a checkpoint of N small bf16 tensors named like an MoE's experts is written
(--bytes-per-tensor each), beside one of a single tensor of the same total bytes. Then:

- rank load: a CPU `vlaunch cache` process (plan replicate; --plan llama for the rules'
  cost), spawn -> ready, for the N-tensor checkpoint and for the one-tensor one: the
  difference over N is what each tensor costs a rank beyond its bytes (open, plan, pack,
  read, checksums, fingerprint, ready frame), in wall seconds and in the rank's CPU seconds
  (/proc at ready: steadier than wall time on a loaded machine). The rank's own log line gives
  its open + plan + allocate seconds.
- handoff: `load(mode="share")` from that rank in this process (torch imported, the rank
  warm), per tensor, against safetensors' `load_file` of the same file (page cache warm).
  "+ touch" adds reading one element of every tensor (what an engine's first use of each
  costs on top), on both sides.

    python benchmarks/bench_tensor_count.py [--counts 1000,10000,100000] [--repeats 3]
        [--bytes-per-tensor 256] [--plan replicate] [--json FILE]

Figures are medians of --repeats; ratio = safetensors seconds / vlaunch seconds.
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
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vlaunch.cache import load
from vlaunch.cache.contract.progress import recv_ready


def write(path: Path, count: int, per: int) -> None:
    """`count` bf16 tensors of `per` bytes, named as an MoE's experts (3 per expert, 64
    experts a layer); count 1: one tensor of the same bytes as `count_bytes`."""
    cols = max(1, per // 2 // 8)
    tensors = {}
    for i in range(count):
        layer, rest = divmod(i, 192)
        expert, w = divmod(rest, 3)
        name = f"model.layers.{layer}.mlp.experts.{expert}.{('gate', 'up', 'down')[w]}_proj.weight"
        tensors[name] = torch.full((8, cols), float(i % 13), dtype=torch.bfloat16)
    save_file(tensors, str(path))


def one_tensor(path: Path, nbytes: int) -> None:
    """One bf16 tensor of `nbytes`."""
    save_file({"model.embed_tokens.weight": torch.zeros(nbytes // 2, dtype=torch.bfloat16)},
              str(path))


class Rank:
    """A CPU cache rank of `model`; `seconds`: spawn -> ready; `prepared`: its own open +
    plan + allocate seconds (its log line)."""

    def __init__(self, model: Path, sockdir: Path, plan: str, log: Path) -> None:
        sockdir.mkdir(mode=0o700)
        ours, theirs = socket.socketpair()
        start = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlaunch.cache", "--model", str(model), "--socket-dir",
             str(sockdir), "--plan", plan, "--ready-fd", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stderr=log.open("wb"))
        theirs.close()
        with ours:
            ours.settimeout(600)
            _, fds = recv_ready(ours)
            for fd in fds:
                os.close(fd)
        self.seconds = time.perf_counter() - start
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        self.cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        found = re.findall(r"allocated in ([0-9.]+)s", log.read_text())
        self.prepared = float(found[-1]) if found else float("nan")
        self.sockdir = sockdir

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read one element of every tensor."""
    for t in tensors.values():
        t.view(-1)[0].item()


def measure(count: int, per: int, repeats: int, plan: str, tmp: Path) -> dict[str, Any]:
    """The figures of one tensor count."""
    many, single = tmp / f"n{count}.safetensors", tmp / f"one{count}.safetensors"
    write(many, count, per)
    one_tensor(single, os.path.getsize(many) - 8)
    ranks: list[tuple[float, float, float]] = []
    singles: list[tuple[float, float]] = []
    handoff: list[float] = []
    handoff_touch: list[float] = []
    st: list[float] = []
    st_touch: list[float] = []
    for rep in range(repeats):
        rank = Rank(many, tmp / f"s{count}-{rep}", plan, tmp / f"r{count}-{rep}.log")
        try:
            ranks.append((rank.seconds, rank.prepared, rank.cpu))
            kw = {"socket_dir": str(rank.sockdir), "plan": plan, "fallback": False,
                  "device": "cpu"}
            load(str(many), **kw)  # warm: the memo, the backend, the code paths
            handoff.append(timed(lambda kw=kw: load(str(many), **kw)))
            handoff_touch.append(timed(lambda kw=kw: touch(load(str(many), **kw))))
        finally:
            rank.stop()
        load_file(str(many))
        st.append(timed(lambda: load_file(str(many))))
        st_touch.append(timed(lambda: touch(load_file(str(many)))))
        base = Rank(single, tmp / f"b{count}-{rep}", plan, tmp / f"b{count}-{rep}.log")
        singles.append((base.seconds, base.cpu))
        base.stop()
    med = statistics.median
    return {"count": count, "bytes": os.path.getsize(many), "rank_s": med(r[0] for r in ranks),
            "rank_prepared_s": med(r[1] for r in ranks),
            "rank_one_tensor_s": med(s[0] for s in singles), "rank_cpu_s": med(r[2] for r in ranks),
            "rank_one_tensor_cpu_s": med(s[1] for s in singles),
            "handoff_s": med(handoff), "handoff_touch_s": med(handoff_touch),
            "safetensors_s": med(st), "safetensors_touch_s": med(st_touch)}


def table(rows: list[dict[str, Any]], plan: str) -> str:
    """The printed table."""
    us = 1e6
    lines = [f"CPU, plan {plan}; per tensor in microseconds; ratio = safetensors / vlaunch; "
             f"load average {os.getloadavg()[0]:.1f}",
             f"{'tensors':>8} {'MB':>6} {'rank/t':>8} {'cpu/t':>8} {'prep/t':>8} {'handoff/t':>10} "
             f"{'st/t':>8} {'ratio':>7} {'+touch/t':>9} {'st+touch/t':>11} {'ratio':>7}"]
    for r in rows:
        n = r["count"]
        lines.append(
            f"{n:>8} {r['bytes'] / 1e6:>6.1f} "
            f"{(r['rank_s'] - r['rank_one_tensor_s']) / n * us:>8.2f} "
            f"{(r['rank_cpu_s'] - r['rank_one_tensor_cpu_s']) / n * us:>8.2f} "
            f"{r['rank_prepared_s'] / n * us:>8.2f} {r['handoff_s'] / n * us:>10.2f} "
            f"{r['safetensors_s'] / n * us:>8.2f} {r['safetensors_s'] / r['handoff_s']:>6.2f}x "
            f"{r['handoff_touch_s'] / n * us:>9.2f} {r['safetensors_touch_s'] / n * us:>11.2f} "
            f"{r['safetensors_touch_s'] / r['handoff_touch_s']:>6.2f}x")
    lines.append("rank/t: (rank spawn->ready - the same for one tensor of the same bytes) / N; "
                 "cpu/t: the same in the rank's CPU seconds; prep/t: the rank's open + plan + "
                 "allocate / N")
    return "\n".join(lines)


def main() -> None:
    """Measure every count and print the table (and --json)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1000,10000,100000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bytes-per-tensor", type=int, default=256)
    ap.add_argument("--plan", default="replicate")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vl-count-") as tmp:
        for count in (int(c) for c in args.counts.split(",")):
            rows.append(measure(count, args.bytes_per_tensor, args.repeats, args.plan,
                                Path(tmp)))
            print(table(rows[-1:], args.plan).splitlines()[-2], flush=True)
    print(table(rows, args.plan))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
