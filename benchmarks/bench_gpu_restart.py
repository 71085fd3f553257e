#!/usr/bin/env python3
"""Engine restart under `vlaunch run`: kill -> weights usable, against disk and a bare start.

    python benchmarks/bench_gpu_restart.py --model DIR [--device cuda] [--reps 3]

DIR is a reference-engine checkpoint (config.json + safetensors), e.g. written by
`python -m vlaunch.cache.reference.refmodel DIR --llama-8b --target-gib 16 --shards 4
--device cuda`.
In one run it measures, median of --reps:
- bare: `python -c "import torch; torch.zeros(1, device=...)"`, spawn to allocation done;
- disk: the reference engine started alone (no cache), spawn to weights ready (its /stats
  `ready_at`, taken once its weights are loaded and its model built);
- vlaunch: the reference engine under `vlaunch run`, SIGKILLed; kill to the restarted engine's
  weights ready (the launcher respawns it at once, it maps its shard from the cache).
Prints a table: figure, seconds, ratio to bare, target (vlaunch <= 1.05x bare).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import bare_starts, get

from vlaunch.cache.contract.waiting import until

# the console script when installed, else the same entry point from the checkout
VLAUNCH = [shutil.which("vlaunch")] if shutil.which("vlaunch") else [
    sys.executable, "-c", "import sys; from vlaunch.launcher.cli import main; sys.exit(main())"]


def engine_stats(port_file: Path) -> dict[str, Any] | None:
    """The engine's /stats once it is ready."""
    try:
        port = port_file.read_text().strip()
    except OSError:
        return None
    stats = get(f"http://127.0.0.1:{port}/stats") if port else None
    return stats if stats and stats.get("ready_at") else None


def wait(fn: Any, timeout: float = 600) -> Any:
    """Poll fn every 10 ms until it returns something."""
    return until(fn, timeout, interval=0.01)


def engine_cmd(model: str, device: str, port_file: Path, socket_dir: Path | None) -> list[str]:
    """The reference engine's command line."""
    cmd = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--model", model,
           "--device", device, "--port-file", str(port_file), "--log-level", "WARNING"]
    return cmd + (["--socket-dir", str(socket_dir)] if socket_dir else [])


def main() -> None:
    """Measure and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    disk, cached, weights_ms = [], [], {}
    bare = bare_starts(args.device, args.reps)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        empty = work / "empty"
        empty.mkdir(mode=0o700)
        for i in range(args.reps):
            pf = work / f"disk{i}.port"
            t = time.time()
            proc = subprocess.Popen(engine_cmd(args.model, args.device, pf, empty))
            stats = wait(lambda pf=pf: engine_stats(pf))
            disk.append(stats["ready_at"] - t)
            weights_ms["disk"] = stats["weights_ms"]
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        sock, pf = work / "sock", work / "engine.port"
        launcher = subprocess.Popen(
            [*VLAUNCH, "run", "--model", args.model, "--device", args.device.split(":")[0],
             "--socket-dir", str(sock), "--engine-ready", "notify", "--backoff-initial", "0",
             "--threads", "16", "--log-level", "WARNING", "--",
             *engine_cmd(args.model, args.device.split(":")[0], pf, None)])
        try:
            stats = wait(lambda: engine_stats(pf))
            for _ in range(args.reps):
                pf.unlink()
                t = time.time()
                os.kill(stats["pid"], signal.SIGKILL)
                stats = wait(lambda: engine_stats(pf))
                cached.append(stats["ready_at"] - t)
                weights_ms["cache"] = stats["weights_ms"]
                assert stats["source"] == "cache", stats
        finally:
            launcher.send_signal(signal.SIGTERM)
            status = launcher.wait(120)
    b = statistics.median(bare)
    rows = [("bare python + import torch + first CUDA alloc", b, "", "-"),
            ("engine from disk: spawn -> weights ready", statistics.median(disk),
             f"weights {weights_ms['disk']:.0f} ms", "-"),
            ("vlaunch: engine kill -> restarted engine's weights", statistics.median(cached),
             f"weights {weights_ms['cache']:.1f} ms", "<= 1.05x bare")]
    print(f"\n## engine restart, {args.device}, median of {args.reps}, "
          f"{time.strftime('%Y-%m-%d')}; launcher exit after SIGTERM: {status}")
    print(f"{'figure':<52} {'seconds':>8} {'x bare':>7}  {'detail':<18} target")
    for name, sec, detail, target in rows:
        print(f"{name:<52} {sec:>8.2f} {sec / b:>7.2f}  {detail:<18} {target}")


if __name__ == "__main__":
    main()
