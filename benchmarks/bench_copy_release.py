#!/usr/bin/env python3
"""copy-release under `vlaunch run` returns the memory: device memory before, with the cache,
and after a copy-release client took its copy and exited.

    python benchmarks/bench_copy_release.py [--device cuda] [--gib 4]

Writes a random Llama checkpoint of about --gib GiB (in a temporary directory), runs
`vlaunch run` with one cache rank and no engine, then a client process that loads with
mode="copy-release" and exits. On CUDA it prints nvidia-smi's memory.used of the device at
each step (the last must come back to the first); on CPU, whether any process still holds
the rank's memfd. Also prints what /status says the rank holds. One line per step; exit 0
when the memory came back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from vlaunch.cache.contract.waiting import until
from vlaunch.cache.reference.refmodel import make_checkpoint

# The engine: imports, load() timed alone (what a copy-release start adds to an engine's),
# then the device memory in use while it holds its weights: with the rank's own slabs handed
# over it is what the cache held (plus the client's CUDA context); with a copy, one slab more.
CLIENT = """import sys, time
import torch
torch.zeros(1, device=sys.argv[3])  # torch imported and CUDA up, as in an engine
from vlaunch.cache import load
t = time.perf_counter()
w = load(sys.argv[1], socket_dir=sys.argv[2], mode='copy-release', fallback=False,
         device=sys.argv[3])
ms = (time.perf_counter() - t) * 1e3
used = -1.0
if sys.argv[3].startswith("cuda"):
    torch.cuda.synchronize(); free, total = torch.cuda.mem_get_info(sys.argv[3])
    used = (total - free) / 2**20
print(w.source, w.bytes_outside, f"{ms:.1f}", f"{used:.0f}", flush=True)
"""


def used_mib(device: str) -> float | None:
    """nvidia-smi's memory.used of the device in MiB (None on CPU)."""
    if not device.startswith("cuda"):
        return None
    index = device.partition(":")[2] or "0"
    out = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=memory.used",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    return float(out.strip())


def memfd_inodes(pid: int) -> set[int]:
    """The inodes of a rank's memfd slabs (CPU)."""
    fds = [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    return {os.stat(p).st_ino for p in fds if "memfd:vlaunch-slab" in os.readlink(p)}


def memfd_holders(inodes: set[int]) -> int:
    """Processes holding an fd of one of these memfds (CPU)."""
    holders = set()
    for other in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{other}/fd"):
                link = f"/proc/{other}/fd/{fd}"
                if "memfd:" in os.readlink(link) and os.stat(link).st_ino in inodes:
                    holders.add(other)
        except OSError:
            continue
    return len(holders)


def status(sockdir: Path) -> dict[str, Any] | None:
    """The launcher's /status, None until it answers."""
    try:
        url = json.loads((sockdir / "launcher.json").read_text())["url"]
        with urllib.request.urlopen(url + "/status", timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError, KeyError):
        return None


def main() -> int:
    """Run the steps; exit 0 when the device memory (or the memfd) is gone after the client."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gib", type=float, default=4.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vlaunch-copy-release-"))
    shapes = (dict(hidden=2048, heads=16, kv_heads=8, intermediate=8192, vocab=32000)
              if args.gib >= 1 else dict(hidden=256, heads=8, kv_heads=4, intermediate=512,
                                         vocab=1024))
    model = make_checkpoint(tmp / "model", **shapes, target_bytes=int(args.gib * (1 << 30)))
    sockdir = tmp / "sock"
    before = used_mib(args.device)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    devices = ["--devices", args.device] if kind == "cuda" else []
    launcher = subprocess.Popen([sys.executable, "-m", "vlaunch.launcher.cli", "run",
                                 "--model", str(model), "--device", kind, *devices,
                                 "--socket-dir", str(sockdir), "--health-port", "0"])
    try:
        snap = until(lambda: (s := status(sockdir)) and s["caches_ready"] and s, 1200,
                     what="the cache ready")
        rank = snap["ranks"]["0"]
        held = used_mib(args.device)
        inodes = memfd_inodes(rank["pid"]) if kind == "cpu" else set()
        print(f"with the cache: {rank['bytes'] / 2**30:.2f} GiB held (/status); device used "
              f"{held} MiB (before the launcher: {before} MiB)", flush=True)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CLIENT, str(model), str(sockdir),
                              args.device], capture_output=True, text=True, check=True)
        source, outside, ms, used = out.stdout.split()[-4:]
        print(f"copy-release client: {source}, bytes_outside {outside}, load() {ms} ms"
              + (f", device used while it held its weights {used} MiB" if kind == "cuda"
                 else "") + f"; {time.perf_counter() - t0:.1f} s in all, exited", flush=True)
        after = until(lambda: (s := status(sockdir)) and s["ranks"]["0"]["bytes"] == 0 and s,
                      60, what="/status at 0 bytes")
        if kind == "cuda":
            # The rank keeps its CUDA context (about 0.5-0.6 GiB on an H200) after releasing:
            # what must come back is the slab, so compare with what the cache held, not 0.
            slab_mib = rank["bytes"] / 2**20
            gone = until(lambda: (u := used_mib(args.device)) is not None and held is not None
                         and u <= held - 0.95 * slab_mib and u, 60,
                         what="the device memory back")
            print(f"after: /status {after['ranks']['0']['bytes']} bytes; device used {gone} MiB "
                  f"(before {before}, with the cache {held})", flush=True)
        else:
            assert inodes, "the rank holds no memfd slab"
            until(lambda: memfd_holders(inodes) == 0, 60, what="no memfd holder")
            print(f"after: /status {after['ranks']['0']['bytes']} bytes; no process holds the "
                  "memfd", flush=True)
        return 0
    except TimeoutError as exc:
        print(f"FAIL: {exc}", flush=True)
        return 1
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(120)


if __name__ == "__main__":
    sys.exit(main())
