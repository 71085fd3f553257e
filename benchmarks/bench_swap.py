#!/usr/bin/env python3
"""Downtime and memory of `vlaunch swap`, per mode, against a cold restart on the new weights.

    python benchmarks/bench_swap.py [--device cpu|cuda] [--tp 1] [--gib 16] [--devices 0]
        [--modes double,double+standby,in-place,in-place+standby] [--keep DIR] [--out FILE]

Writes two random reference-engine checkpoints A and B of one architecture (about --gib each,
16 on CUDA, a 2-layer model on CPU; --model-a/--model-b or --keep DIR to reuse them). For
each mode it starts `vlaunch run` on A with the reference engine on a fixed port, keeps one
client asking it for one token at a time, and runs `vlaunch swap --model B`. Downtime is the
time from the last answer that came from A to the first that came from B (the two
checkpoints answer differently). Meanwhile it samples, every 50 ms, what each cache rank
holds per device (its own report: the served slabs, the staging, the old slabs kept) and, on
CUDA, each GPU's memory in use (nvidia-smi: engines included), and reports the most of each
during every step of the swap. Last, the cold restart: SIGTERM to a launcher serving A, then
`vlaunch run` on B, last A answer -> first B answer. Prints one JSON line per run and a
summary with the targets (in-place <= 1 s and never two copies of the shard on a device;
double with a standby <= 0.2 s).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchlib import fmt_s, free_port, get, launcher_url, machine_name, record_figures

from vlaunch.cache.contract.waiting import until
from vlaunch.launcher.statusview import query_rank

PROMPT = [1, 5, 9, 2, 7]
MODES = ("double", "double+standby", "in-place", "in-place+standby")


def ask(port: int) -> list[int] | None:
    """One token from the engine on `port`, None if it does not answer."""
    body = json.dumps({"tokens": PROMPT, "max_new_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["tokens"]
    except (OSError, ValueError, KeyError):
        return None


class Client(threading.Thread):
    """Asks for one token at a time until stopped: (completion time, tokens) of each answer."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.answers, self.done = port, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            tokens = ask(self.port)
            if tokens is None:
                time.sleep(0.002)
                continue
            self.answers.append((time.perf_counter(), tokens))

    def downtime(self, old: list[int], new: list[int]) -> float | None:
        """Last answer from the old weights -> first from the new ones."""
        first_new = next((t for t, x in self.answers if x == new), None)
        if first_new is None:
            return None
        last_old = max((t for t, x in self.answers if x == old and t < first_new), default=None)
        return None if last_old is None else first_new - last_old


class Sampler(threading.Thread):
    """Every 50 ms: the swap's step, each rank's bytes per device, each GPU's memory used."""

    def __init__(self, url: str, sockets: list[Path], cuda: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.sockets, self.cuda = url, sockets, cuda
        self.samples: list[dict[str, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            snap = get(self.url + "/status") or {}
            step = (snap.get("swap") or {}).get("state", "?")
            held: dict[str, int] = {}
            for path in self.sockets:
                try:
                    for where, n in query_rank(path)["bytes_held"].items():
                        held[where] = held.get(where, 0) + int(n)
                except (OSError, KeyError, ValueError):
                    pass
            self.samples.append({"step": step, "cache": held,
                                 "gpu_mib": gpu_used_mib() if self.cuda else None})
            time.sleep(0.05)

    def per_step(self) -> dict[str, dict[str, Any]]:
        """The most held in each step: cache bytes per device, GPU MiB per GPU."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.samples:
            step = out.setdefault(s["step"], {"cache_gib": {}, "gpu_mib": {}})
            for where, n in s["cache"].items():
                step["cache_gib"][where] = max(step["cache_gib"].get(where, 0), n / 2**30)
            for gpu, mib in (s["gpu_mib"] or {}).items():
                step["gpu_mib"][gpu] = max(step["gpu_mib"].get(gpu, 0), mib)
        return out


def gpu_used_mib() -> dict[str, float]:
    """Memory used on each GPU (nvidia-smi), by index."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {i.strip(): float(m) for i, m in (line.split(",") for line in out.splitlines())}


def launcher(args: argparse.Namespace, model: Path, work: Path, name: str, port: int,
             standby: bool) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`vlaunch run` on `model` with the reference engine on `port`, once it serves."""
    sock = work / f"sock-{name}"
    engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port", str(port),
              "--device", args.device]
    cmd = [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(model),
           "--device", args.device, "--tensor-parallel-size", str(args.tp), "--socket-dir",
           str(sock), "--health-port", "0", "--engine-ready", "notify", "--stop-timeout", "60",
           *(["--devices", args.devices] if args.devices else []),
           *(["--standby"] if standby else []), "--", *engine]
    log = (work / f"launcher-{name}.log").open("wb")
    proc = subprocess.Popen(cmd, stderr=log, stdout=log)
    url = until(lambda: launcher_url(sock), 900, what="launcher.json")
    until(lambda: _serving(get(url + "/status") or {}, standby), 1800, what="serving")
    return proc, url, sock


def run_mode(args: argparse.Namespace, a: Path, b: Path, work: Path, mode: str,
             tokens: dict[str, list[int]]) -> dict[str, Any]:
    """One launcher on A, one swap to B in `mode`: downtime and memory per step."""
    swap_mode, standby = mode.split("+")[0], mode.endswith("+standby")
    port = free_port()
    proc, url, sock = launcher(args, a, work, mode, port, standby)
    try:
        tokens.setdefault("a", until(lambda: ask(port), 120, what="A's answer"))
        sockets = sorted(sock.glob("rank-*.sock"))
        client, sampler = Client(port), Sampler(url, sockets, args.device == "cuda")
        client.start()
        sampler.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "swap", "--socket-dir",
                            str(sock), "--model", str(b), "--mode", swap_mode,
                            *([] if standby else ["--no-standby"])], capture_output=True,
                           text=True)
        swap_s = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"vlaunch swap exited {r.returncode}: {r.stderr}")
        until(lambda: (len(client.answers) and client.answers[-1][1] != tokens["a"]) or None, 120,
              what="B's answers")
        time.sleep(1.0)
        client.done.set()
        sampler.done.set()
        tokens.setdefault("b", client.answers[-1][1])
        return {"mode": mode, "downtime_s": client.downtime(tokens["a"], tokens["b"]),
                "swap_command_s": round(swap_s, 3), "per_step": sampler.per_step()}
    except Exception:
        print((work / f"launcher-{mode}.log").read_text(errors="replace")[-6000:],
              file=sys.stderr)
        raise
    finally:
        stop(proc)


def cold_restart(args: argparse.Namespace, a: Path, b: Path, work: Path,
                 tokens: dict[str, list[int]]) -> dict[str, Any]:
    """SIGTERM a launcher serving A, start one on B: last A answer -> first B answer."""
    port = free_port()
    proc, _, _ = launcher(args, a, work, "cold-a", port, False)
    client = Client(port)
    client.start()
    time.sleep(1.0)
    stop(proc)
    started = launcher(args, b, work, "cold-b", port, False)[0]
    try:
        until(lambda: (client.answers and client.answers[-1][1] == tokens["b"]) or None, 600,
              what="B's answer")
    finally:
        client.done.set()
        stop(started)
    return {"mode": "cold restart", "downtime_s": client.downtime(tokens["a"], tokens["b"])}


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _serving(snap: dict[str, Any], standby: bool) -> bool:
    parked = not standby or (snap.get("standby") or {}).get("state") == "parked"
    return snap.get("phase") == "serving" and bool(snap.get("engine_ready")) and parked


def one_copy(per_step: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Per step: whether the ranks held no more bytes on a device than serving did (2%
    spare). The starting step includes the new engine's first start, which builds its engine
    layout beside the raw one for a moment (docs/engine-layout.md), as every first start."""
    served = per_step.get("none", {}).get("cache_gib", {})
    return {name: all(gib <= served.get(where, 0) * 1.02 for where, gib in
                      step["cache_gib"].items() if where != "host")
            for name, step in per_step.items()}


def checkpoints(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """A and B: --model-a/--model-b, or two random ones of one architecture written now (of
    about --gib each; without it on CPU a 2-layer model, so that one answer takes
    milliseconds and the downtime is not lost between two of them)."""
    if args.model_a and args.model_b:
        return Path(args.model_a), Path(args.model_b)
    from vlaunch.cache.reference.refmodel import make_checkpoint

    if args.gib is None and args.device == "cpu":
        size: dict[str, Any] = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2,
                                "intermediate": 256, "vocab": 512}
    else:
        gib = 16.0 if args.gib is None else args.gib
        size = {"target_bytes": int(gib * 2**30), **(
            {"hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 32000}
            if gib >= 1 else {"hidden": 256, "heads": 8, "kv_heads": 4, "intermediate": 512,
                              "vocab": 1024})}
    device = "cuda" if args.device == "cuda" else "cpu"
    root = Path(args.keep) if args.keep else work
    return tuple(make_checkpoint(root / name, seed=seed, device=device, **size)  # type: ignore
                 for name, seed in (("a", 0), ("b", 1)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--devices", default="", help="--devices for vlaunch run (e.g. 0)")
    ap.add_argument("--gib", type=float, default=None,
                    help="size of each checkpoint [default: 16 on cuda, a 2-layer model on cpu]")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--model-a", default="")
    ap.add_argument("--model-b", default="")
    ap.add_argument("--keep", default="", help="write the checkpoints here (and keep them)")
    ap.add_argument("--out", default="", help="also write the results here (JSON)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        work = Path(tmp)
        a, b = checkpoints(args, work)
        shard_gib = sum(f.stat().st_size for f in b.glob("*.safetensors")) / 2**30 / args.tp
        tokens: dict[str, list[int]] = {}
        runs = [run_mode(args, a, b, work, mode, tokens) for mode in args.modes.split(",")]
        runs.append(cold_restart(args, a, b, work, tokens))
    for r in runs:
        print(json.dumps(r), flush=True)
    by = {r["mode"]: r for r in runs}
    summary = {
        "device": args.device, "tp": args.tp, "shard_gib": round(shard_gib, 2),
        "downtime_s": {m: r["downtime_s"] and round(r["downtime_s"], 3) for m, r in by.items()},
        "cold_over": {m: by["cold restart"]["downtime_s"] and r["downtime_s"] and round(
            by["cold restart"]["downtime_s"] / r["downtime_s"], 1)
            for m, r in by.items() if m != "cold restart"},
        "targets": {"in-place+standby_le_s": 1.0, "double+standby_le_s": 0.2}}
    if args.device == "cuda":  # the device's own memory: the host's staging is not on it
        summary["in_place_one_copy"] = {r["mode"]: one_copy(r["per_step"]) for r in runs
                                        if r["mode"].startswith("in-place")}
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    key = f"swap.{'gpu' if args.device == 'cuda' else 'cpu'}.tp{args.tp}"
    record_figures({f"{key}.{m.replace('+', '_').replace('-', '_').replace(' restart', '')}":
                    fmt_s(r["downtime_s"]) for m, r in by.items() if r["downtime_s"]},
                   machine=machine_name(args.device),
                   source=f"swap.md: bench_swap.py --device {args.device} --tp {args.tp} "
                          f"({shard_gib:.2f} GiB shards), downtime: last A answer -> first B "
                          f"answer, one run of each mode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
