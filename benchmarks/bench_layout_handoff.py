"""CPU: a later start's share load of an engine layout against the raw layout's, same run.

One CPU cache rank holds a checkpoint of --tensors small tensors and, handed back once, an
engine layout of the same tensors. Each figure is `load()` in a fresh process (torch and
vlaunch imported before the clock), median of --repeats, the two alternated; the collector's
passes inside `load()` are counted too.

    python benchmarks/bench_layout_handoff.py [--tensors 320] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from benchlib import cpu_rank
from safetensors.torch import save_file

from vlaunch.cache import hand_back, load

FIELDS = {"engine": "bench", "engine_version": "1"}
CHILD = """
import gc, json, sys, time
import torch
import vlaunch.cache.client.layout, vlaunch.cache.client.loader
from vlaunch.cache import load
passes = []
gc.callbacks.append(lambda phase, info: passes.append(1) if phase == "start" else None)
t = time.perf_counter()
w = load(sys.argv[1], socket_dir=sys.argv[2], plan="replicate", fallback=False, device="cpu",
         layout=json.loads(sys.argv[3]))
print(json.dumps({"ms": (time.perf_counter() - t) * 1e3, "passes": len(passes),
                  "layout": w.layout}))
"""


def one(model: Path, sockdir: Path, layout: dict | None) -> dict:
    """One fresh-process load (layout None: the raw layout)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(sockdir),
                          json.dumps(layout)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        model.mkdir()
        g = torch.Generator().manual_seed(0)
        save_file({f"model.layers.{i}.w": torch.randn(64, 64, generator=g)
                   for i in range(args.tensors)}, str(model / "model.safetensors"))
        sockdir = Path(tmp) / "s"
        proc, _, channel = cpu_rank(model, sockdir)
        try:
            kw = {"socket_dir": str(sockdir), "plan": "replicate", "device": "cpu",
                  "fallback": False}
            raw = load(str(model), layout=FIELDS, **kw)
            assert not raw.layout, "the rank held an engine layout already"
            hand_back(dict(raw), model=str(model), fields=FIELDS, release_raw=False,
                      socket_dir=str(sockdir), plan="replicate", device="cpu")
            del raw  # the hand-back's own mapping went with its return value
            rows: dict[str, list[dict]] = {"raw layout": [], "engine layout": []}
            for _ in range(args.repeats):
                rows["raw layout"].append(one(model, sockdir, None))
                rows["engine layout"].append(one(model, sockdir, FIELDS))
        finally:
            proc.terminate()
            proc.wait()
            channel.close()
    assert all(r["layout"] for r in rows["engine layout"]), "the engine layout was not mapped"
    print(f"\n{args.tensors} tensors, CPU rank, share mode, fresh processes, median of "
          f"{args.repeats} (alternated)")
    print(f"{'figure':<16} {'load() ms':>10} {'collector passes':>18}")
    for name, runs in rows.items():
        print(f"{name:<16} {statistics.median(r['ms'] for r in runs):>10.2f} "
              f"{statistics.median(r['passes'] for r in runs):>18.0f}")


if __name__ == "__main__":
    main()
