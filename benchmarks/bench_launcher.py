"""CPU: the launcher's own costs — RSS, `vlaunch --help`, engine respawn, rank exit to exit.

    python benchmarks/bench_launcher.py [--repeats 10]

Prints one table: figure, measured (median), target.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file

from vlaunch.cache.contract.waiting import until

ENGINE = ('echo start $(date +%s%N) >> "$LOG"; sleep 0.3; echo exit $(date +%s%N) >> "$LOG"; '
          'exit 3')


def status(sockdir: Path) -> dict:  # type: ignore[type-arg]
    """The launcher's /status."""
    url = json.loads((sockdir / "launcher.json").read_text())["url"]
    with urllib.request.urlopen(url + "/status", timeout=5) as r:
        return json.loads(r.read())


def wait(sockdir: Path, cond, timeout: float = 60) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Poll /status until cond holds."""

    def check() -> dict | None:  # type: ignore[type-arg]
        with contextlib.suppress(OSError, ValueError, KeyError):
            s = status(sockdir)
            return s if cond(s) else None
        return None

    return until(check, timeout, what="the launcher's status", interval=0.05)


def launch(model: Path, sockdir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:  # type: ignore[type-arg]
    """Start `vlaunch run` quietly."""
    return subprocess.Popen(["vlaunch", "run", "--model", str(model), "--socket-dir",
                             str(sockdir), "--log-level", "WARNING", *args],
                            env={**os.environ, **(env or {})}, stderr=subprocess.DEVNULL)


def main() -> None:
    """Run every measurement and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    n = ap.parse_args().repeats
    rows = []
    helps = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["vlaunch", "--help"], check=True, stdout=subprocess.DEVNULL)
        helps.append(time.perf_counter() - t)
    rows.append(("vlaunch --help wall time", f"{statistics.median(helps) * 1e3:.0f} ms",
                 "<= 300 ms"))
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m.safetensors"
        save_file({"model.norm.weight": torch.ones(1024)}, str(model))
        log = Path(tmp) / "engine.log"
        sock = Path(tmp) / "s1"
        proc = launch(model, sock, "--backoff-initial", "0", "--restart-max", "1000",
                      "--", "sh", "-c", ENGINE, env={"LOG": str(log)})
        wait(sock, lambda s: s["engine"]["restarts"] >= n + 1, timeout=120)
        rss = psutil.Process(proc.pid).memory_info().rss
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        events = [line.split() for line in log.read_text().splitlines()]
        gaps = [(int(b[1]) - int(a[1])) / 1e6 for a, b in itertools.pairwise(events)
                if a[0] == "exit" and b[0] == "start"]
        rows.append(("launcher RSS (serving)", f"{rss / 2**20:.1f} MiB", "<= 60 MB"))
        rows.append(("engine exit -> new engine process", f"{statistics.median(gaps):.1f} ms",
                     "<= 50 ms"))
        downs = []
        for i in range(max(3, n // 3)):
            sock = Path(tmp) / f"k{i}"
            proc = launch(model, sock, "--stop-timeout", "10", "--", "sleep", "600")
            snap = wait(sock, lambda s: s["phase"] == "serving")
            t = time.perf_counter()
            os.kill(snap["ranks"]["0"]["pid"], signal.SIGKILL)
            assert proc.wait(30) == 69
            downs.append(time.perf_counter() - t)
        rows.append(("rank SIGKILL -> launcher exit 69", f"{statistics.median(downs) * 1e3:.0f} ms",
                     "< stop timeout (10 s)"))
    print(f"\nlauncher benchmark, median of {n}, {time.strftime('%Y-%m-%d')}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'figure':<36} {'measured':>12}  target")
    for name, value, target in rows:
        print(f"{name:<36} {value:>12}  {target}")


if __name__ == "__main__":
    main()
