#!/usr/bin/env python3
"""What an engine pays for its first share handoff: `import vlaunch.cache` + `load()`.

Each run is a fresh process that imports torch (and, on a GPU, brings CUDA up) before the
clock starts, then times `import vlaunch.cache`, the import `vlaunch.cache.load` pulls in,
and the share `load()` against a running cache rank. The baseline, in the same run and the
same kind of fresh process, is `import safetensors.torch` + `safe_open` of every shard of the
same checkpoint with its tensor names listed: the least an engine that loads from disk pays
before its first byte. Each figure is given in wall time and in CPU time (every thread of the
process: the steadier figure on a busy host), with the load average over the run. Then the
share load()'s steps (recorded through `connection.install_trace`) and the per-module import
breakdown (`-X importtime`, median self and cumulative time of each module imported after
torch).

    python benchmarks/bench_import.py                       # CPU, a small generated shard
    python benchmarks/bench_import.py --repeats 3           # CI: about a minute here
    python benchmarks/bench_import.py --model DIR --device cuda:0   # a GPU, a real checkpoint
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import vlaunch.cache
from vlaunch.cache.contract.progress import recv_ready

CHILD = r"""
import json, sys, time
spec = json.loads(sys.argv[1])
import torch
dev = spec["device"]
if dev.startswith("cuda"):
    torch.zeros(1, device=dev); torch.cuda.synchronize(dev)
before = set(sys.modules)
sys.stderr.write("CLOCK STARTS\n"); sys.stderr.flush()
cpu = time.process_time  # every thread of the process: steadier than wall on a busy host
if spec["what"] == "baseline":
    c0, t0 = cpu(), time.perf_counter()
    from safetensors import safe_open
    c1, t1 = cpu(), time.perf_counter()
    names = []
    for f in spec["files"]:
        with safe_open(f, "pt", device=dev) as h:
            names += h.keys()
    c2, t2 = cpu(), time.perf_counter()
    out = {"import_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0, "tensors": len(names),
           "cpu_import_s": c1 - c0, "cpu_load_s": c2 - c1, "cpu_total_s": c2 - c0}
else:
    c0, t0 = cpu(), time.perf_counter()
    import vlaunch.cache as V  # what an engine writes
    c1, t1 = cpu(), time.perf_counter()
    load = V.load  # imports the loader (load() would)
    c2, t2 = cpu(), time.perf_counter()
    steps = {}
    try:  # the handoff's steps; off the clock
        from vlaunch.cache.client.connection import install_trace
        install_trace(lambda step: steps.__setitem__(step, time.perf_counter()))
    except ImportError:  # a tree from before the trace was a callback
        from vlaunch.cache.client.connection import TRACE as steps
    ci, ti = cpu(), time.perf_counter()
    c2, t2 = c2 + cpu() - ci, t2 + time.perf_counter() - ti
    w = load(spec["model"], socket_dir=spec["sock"], mode="share", fallback=False, device=dev,
             plan=spec["plan"])
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)
    c3, t3 = cpu(), time.perf_counter()
    out = {"package_s": t1 - t0, "import_s": t2 - t0, "load_s": t3 - t2, "total_s": t3 - t0,
           "cpu_package_s": c1 - c0, "cpu_import_s": c2 - c0, "cpu_load_s": c3 - c2,
           "cpu_total_s": c3 - c0, "steps": {k: v - t2 for k, v in steps.items()},
           "tensors": len(w), "source": w.source,
           "modules": sorted(m for m in set(sys.modules) - before if m.startswith("vlaunch"))}
print("RESULT " + json.dumps(out))
"""


def child(spec: dict[str, Any], importtime: bool = False) -> tuple[dict[str, Any], str]:
    """Run CHILD in a fresh process; returns its RESULT and its stderr."""
    flags = ["-X", "importtime"] if importtime else []
    r = subprocess.run([sys.executable, *flags, "-c", CHILD, json.dumps(spec)],
                       capture_output=True, text=True, timeout=300)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), r.stderr
    raise RuntimeError(f"child failed ({r.returncode}): {r.stderr[-2000:]}")


def breakdown(stderrs: list[str]) -> list[tuple[str, float, float]]:
    """(module with its tree indent, median self ms, median cumulative ms) of every module
    imported once the clock started, in import-time order of the first run."""
    runs: list[dict[str, tuple[int, int]]] = []
    order: list[str] = []
    for text in stderrs:
        after = text.split("CLOCK STARTS\n", 1)[-1]
        rows: dict[str, tuple[int, int]] = {}
        for line in after.splitlines():
            parts = line.split("|")
            if len(parts) != 3 or not parts[0].startswith("import time:"):
                continue
            name = parts[2].rstrip()
            rows[name] = (int(parts[0].split(":")[1]), int(parts[1]))
            if not runs:
                order.append(name)
        runs.append(rows)
    out = []
    for name in order:
        got = [r[name] for r in runs if name in r]
        out.append((name, statistics.median(s for s, _ in got) / 1e3,
                    statistics.median(c for _, c in got) / 1e3))
    return out


def make_checkpoint(path: Path, layers: int) -> None:
    """A small Llama-shaped shard (9 tensors a layer, 64-wide): many names, few bytes."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"] + [
        f"{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                "mlp.down_proj")]
    tensors = {f"model.layers.{i}.{n}": torch.randn(64, 64, generator=g).to(torch.bfloat16)
               for i in range(layers) for n in names}
    tensors["model.embed_tokens.weight"] = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    save_file(tensors, str(path))


def start_rank(model: Path, sock: Path, device: str, plan: str) -> subprocess.Popen[bytes]:
    """Start one cache rank and wait until it serves."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "vlaunch.cache", "--model", str(model),
                             "--device", device, "--socket-dir", str(sock), "--plan", plan,
                             "--ready-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        _, fds = recv_ready(ours)
    except EOFError:
        proc.kill()
        raise RuntimeError(f"the cache rank exited ({proc.wait()}) before it served") from None
    for fd in fds:
        os.close(fd)
    return proc


def report(ours: list[dict[str, Any]], base: list[dict[str, Any]],
           stderrs: list[str], device: str, loadavg: tuple[float, float]) -> None:
    """Print the tables."""
    def ms(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs) * 1e3

    total, b_total = ms(ours, "total_s"), ms(base, "total_s")
    print(f"\n{ours[0]['tensors']} tensors, device {device}, median of {len(ours)} fresh "
          f"processes each (torch imported{', CUDA up' if device != 'cpu' else ''} before the "
          f"clock), {time.strftime('%Y-%m-%d')}, load average {loadavg[0]:.2f} -> "
          f"{loadavg[1]:.2f} on {os.cpu_count()} CPUs; baseline: import safetensors + safe_open "
          "of every shard, names listed")
    print(f"{'figure':<44} {'vlaunch':>10} {'baseline':>10} {'ratio':>7} {'target':>8}")
    rows = [("import vlaunch.cache (package alone)", ms(ours, "package_s"), None, "-"),
            ("import of what load() needs", ms(ours, "import_s"), ms(base, "import_s"), "-"),
            ("share load() / safe_open, once imported", ms(ours, "load_s"), ms(base, "load_s"),
             "-"),
            ("import vlaunch.cache + share load(), all in", total, b_total,
             "<=15 ms" if device != "cpu" else "GPU"),
            ("CPU time: import of what load() needs", ms(ours, "cpu_import_s"),
             ms(base, "cpu_import_s"), "-"),
            ("CPU time: share load() / safe_open", ms(ours, "cpu_load_s"), ms(base, "cpu_load_s"),
             "-"),
            ("CPU time: all in", ms(ours, "cpu_total_s"), ms(base, "cpu_total_s"), "-")]
    for name, v, b, target in rows:
        ratio = f"{v / b:.2f}x" if b else "-"
        bt = f"{b:.2f} ms" if b is not None else "-"
        print(f"{name:<44} {f'{v:.2f} ms':>10} {bt:>10} {ratio:>7} {target:>8}")
    steps = {k: statistics.median(r["steps"][k] for r in ours if k in r["steps"]) * 1e3
             for k in ours[0]["steps"]}
    print("\nshare load() steps, ms after the call (median; connection.install_trace): " +
          ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
    mods = ours[0]["modules"]
    print(f"\nmodules imported after torch, -X importtime, median of {len(stderrs)} "
          f"(ms; adds its own overhead); {len(mods)} vlaunch modules loaded:")
    print(f"{'self':>7} {'cumul':>7}  module")
    for name, self_ms, cum_ms in breakdown(stderrs):
        print(f"{self_ms:7.2f} {cum_ms:7.2f}  {name}")


def main() -> None:
    """Run the benchmark and print its tables."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a checkpoint (file or directory); default: a small one")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--plan", default="llama")
    ap.add_argument("--layers", type=int, default=32, help="layers of the generated checkpoint")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--importtime-runs", type=int, default=3)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    # As installed packages are: byte-compiled (a process that must compile the modules it
    # imports, e.g. under PYTHONDONTWRITEBYTECODE with stale caches, pays several times more)
    compileall.compile_dir(Path(vlaunch.cache.__file__).parent, quiet=1)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "m.safetensors"
        if not args.model:
            make_checkpoint(model, args.layers)
        files = sorted(model.glob("*.safetensors")) if model.is_dir() else [model]
        sock = Path(tmp) / "s"
        sock.mkdir(mode=0o700)
        proc = start_rank(model, sock, args.device, args.plan)
        spec = {"device": args.device, "model": str(model), "sock": str(sock),
                "plan": args.plan, "files": [str(f) for f in files]}
        try:
            child({**spec, "what": "vlaunch"})  # warm-up: the page cache holds the modules
            ours, base = [], []
            for _ in range(args.repeats):  # interleaved: a noisy machine hits both sides
                ours.append(child({**spec, "what": "vlaunch"})[0])
                base.append(child({**spec, "what": "baseline"})[0])
            stderrs = [child({**spec, "what": "vlaunch"}, importtime=True)[1]
                       for _ in range(args.importtime_runs)]
        finally:
            proc.terminate()
            proc.wait()
    if any(r["source"] != "cache" for r in ours):
        raise SystemExit("a load() did not come from the cache")
    report(ours, base, stderrs, args.device, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
