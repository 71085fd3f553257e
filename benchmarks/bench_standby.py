#!/usr/bin/env python3
"""Engine kill -> serving again, with and without `vlaunch run --standby`, in one run.

    python benchmarks/bench_standby.py [--device cpu|cuda] [--tp 2] [--reps 3] [--model DIR]
        [--devices 0,0] [--out FILE]

Runs the reference engine under `vlaunch run` twice: ordinary restarts (default backoff), then
with --standby. Each rep SIGKILLs the serving engine's process group and times kill -> the
first generated token (POST /generate, max_new_tokens 1, on the port the new engine writes to
its port file), and checks that the outputs equal those before the kill. With --standby it
also reports what a parked standby holds: RSS and USS of its process tree (USS leaves out the
shared weight mappings) and, on CUDA, the device memory nvidia-smi charges to its processes.
Prints one JSON line per figure and the ratio ordinary / standby; --out writes them all.
Without --model a small random checkpoint is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from benchlib import get

from vlaunch.cache.contract.waiting import until

PROMPT = [1, 5, 9, 2, 7]


def generate(port_file: Path, max_new: int) -> list[int] | None:
    """The tokens the engine on the port file's port generates, None if it does not answer."""
    try:
        port = port_file.read_text().strip()
        body = json.dumps({"tokens": PROMPT, "max_new_tokens": max_new}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["tokens"]
    except (OSError, ValueError, KeyError):
        return None


def tree_memory(pid: int) -> tuple[int, int]:
    """RSS and USS in bytes of `pid` and its descendants."""
    rss = uss = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rss, uss = rss + info.rss, uss + info.uss
    return rss, uss


def gpu_mib(pids: set[int]) -> float | None:
    """Device memory nvidia-smi charges to these processes, in MiB (None without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = 0.0
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids:
            total += float(mib)
    return total


def tree_pids(pid: int) -> set[int]:
    """`pid` and its descendants."""
    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def run_mode(args: argparse.Namespace, model: Path, work: Path, standby: bool) -> dict:
    """Start a launcher, kill its engine --reps times, return the timings and memory."""
    sock, port_file = work / f"sock-{standby}", work / f"port-{standby}"
    engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port-file",
              str(port_file), "--device", args.device]
    cmd = [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(model),
           "--device", args.device, "--tensor-parallel-size", str(args.tp), "--socket-dir",
           str(sock), "--health-port", "0", "--engine-ready", "notify", "--restart-max", "100",
           *(["--devices", args.devices] if args.devices else []),
           *(["--standby"] if standby else []), "--", *engine]
    log = (work / f"launcher-{standby}.log").open("wb")
    proc = subprocess.Popen(cmd, stderr=log, stdout=log)
    out: dict[str, Any] = {"standby": standby, "kill_to_first_token_s": []}
    try:
        url = until(lambda: _url(sock), 600, what="launcher.json")
        status = lambda: get(url + "/status") or {}  # noqa: E731
        for rep in range(args.reps):
            snap = until(lambda: _ready(status(), standby), 900, what="serving (and parked)")
            expected = until(lambda: generate(port_file, 6), 60, what="first answer")
            if standby and rep == 0:
                pid = snap["standby"]["pid"]
                rss, uss = tree_memory(pid)
                out.update(standby_rss_mib=rss / 2**20, standby_uss_mib=uss / 2**20,
                           standby_gpu_mib=gpu_mib(tree_pids(pid)),
                           engine_rss_mib=tree_memory(snap["engine"]["pid"])[0] / 2**20)
            port_file.unlink()
            t0 = time.perf_counter()
            os.killpg(snap["engine"]["pid"], signal.SIGKILL)
            until(lambda: generate(port_file, 1), 600, what="first token", interval=0.005)
            out["kill_to_first_token_s"].append(time.perf_counter() - t0)
            out.setdefault("same_output", True)
            again = until(lambda: generate(port_file, 6), 60, what="answer")
            out["same_output"] = out["same_output"] and again == expected
    except Exception:
        lines = (work / f"launcher-{standby}.log").read_text(errors="replace").splitlines()
        print("\n".join(lines[-40:]), file=sys.stderr)
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    out["median_s"] = statistics.median(out["kill_to_first_token_s"])
    return out


def _url(sock: Path) -> str | None:
    try:
        return json.loads((sock / "launcher.json").read_text())["url"]
    except (OSError, ValueError, KeyError):
        return None


def _ready(snap: dict[str, Any], standby: bool) -> dict[str, Any] | None:
    if snap.get("phase") != "serving" or not snap.get("engine_ready"):
        return None
    if standby and (snap.get("standby") or {}).get("state") != "parked":
        return None
    return snap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--devices", default="", help="--devices for vlaunch run (e.g. 0,0)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="", help="a reference-engine checkpoint directory")
    ap.add_argument("--out", default="", help="also write the results here (JSON)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-standby-") as tmp:
        work = Path(tmp)
        if args.model:
            model = Path(args.model)
        else:
            from vlaunch.cache.reference.refmodel import make_checkpoint

            model = make_checkpoint(work / "model", hidden=256, layers=4, heads=8, kv_heads=4,
                                    intermediate=512, vocab=1024)
        results = [run_mode(args, model, work, standby=False),
                   run_mode(args, model, work, standby=True)]
    for r in results:
        print(json.dumps(r), flush=True)
    ratio = results[0]["median_s"] / results[1]["median_s"]
    summary = {"figure": "kill -> first token, median", "device": args.device, "tp": args.tp,
               "ordinary_s": round(results[0]["median_s"], 3),
               "standby_s": round(results[1]["median_s"], 3),
               "ratio_ordinary_over_standby": round(ratio, 2),
               "target_standby_le_s": 1.0}
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0 if all(r["same_output"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
