#!/usr/bin/env python3
"""Where a CPU rank's first load spends its time per tensor: each store step alone, in order.

    python benchmarks/bench_rank_steps.py [--count 100000] [--bytes-per-tensor 256] [--repeats 3]

Writes an MoE-shaped checkpoint of --count small bf16 tensors (bench_tensor_count.write), then,
in a fresh process per repeat and with the cyclic collector off (the rank pauses it for its
load), times what the rank's load does: opening the checkpoint (the header's JSON and every
entry's checks), the sampled identity, the plan, `load_shard` (a second open, served from the
parsed-header cache, the plan again, the slab allocation and the fill), the checksums, the
manifest with them, and the columns manifest. Prints microseconds a tensor, median of the
repeats. bench_tensor_count.py gives the rank's whole cost beyond its bytes to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import gc, json, sys, time
gc.disable()
from vlaunch.cache.store import columns, identity
from vlaunch.cache.store.checkpoint import open_checkpoint
from vlaunch.cache.store.manifest import with_checksums
from vlaunch.cache.store.plan import load_plan, plan_rank
from vlaunch.cache.store.ranks import Position
from vlaunch.cache.store.reader import checksums
from vlaunch.cache.store.shard import load_shard
from vlaunch.cache.store.slabs import backend_for

path, count = sys.argv[1], int(sys.argv[2])
out = {}

def step(name, fn):
    start = time.perf_counter()
    value = fn()
    out[name] = (time.perf_counter() - start) * 1e6 / count
    return value

ckpt = step("open (header JSON + checks)", lambda: open_checkpoint(path))
step("sampled identity", lambda: identity.sample_identity(ckpt))
step("plan", lambda: plan_rank(ckpt, load_plan("replicate"), Position(1, 0)))
shard = step("load_shard (open again, plan, allocate, fill)", lambda: load_shard(
    path, "replicate", Position(1, 0), backend_for("cpu"), threads=4, label="bench"))
out["  of it: open again + plan + allocate"] = shard.prepared * 1e6 / count
sums = step("checksums", lambda: checksums(shard.manifest, shard.tensors, 4))
manifest = step("manifest with checksums", lambda: with_checksums(shard.manifest, sums))
step("columns manifest", lambda: columns.encode(manifest))
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=100000)
    ap.add_argument("--bytes-per-tensor", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_tensor_count import write

    with tempfile.TemporaryDirectory(prefix="bench-rank-steps-") as tmp:
        path = Path(tmp) / "many.safetensors"
        write(path, args.count, args.bytes_per_tensor)
        runs = [json.loads(subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(args.count)], check=True,
            capture_output=True, text=True).stdout) for _ in range(args.repeats)]
    print(f"{args.count} tensors of {args.bytes_per_tensor} bytes, microseconds a tensor, "
          f"median of {args.repeats} fresh processes (collector off)")
    for name in runs[0]:
        values = [r[name] for r in runs]
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:<48} {statistics.median(values):6.2f}  ({each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
