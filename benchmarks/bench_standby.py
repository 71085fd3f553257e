#!/usr/bin/env python3
"""Engine kill -> serving again: ordinary restarts against a standby, cold and warm, in one run.

    python benchmarks/bench_standby.py [--device cpu|cuda] [--tp 2] [--reps 3] [--model DIR]
        [--devices 0,0] [--variants ordinary,cold,warm,warm-kept] [--out FILE]

Runs the reference engine under `vlaunch run` once per variant:

- ordinary: restarts (default backoff), no standby;
- cold: --standby, the standby parks without a warm-up (engine --warmup-tokens 0);
- warm: --standby, the standby warms up (prefill + one decode step) and gives the allocator's
  cached blocks back before it parks (the default);
- warm-kept: as warm, but the standby keeps those blocks (--standby-keep-memory).

Each rep SIGKILLs the serving engine's process group and times kill -> the first generated
token (POST /generate, max_new_tokens 1, on the port the new engine writes to its port file),
and checks that the outputs equal those before the kill. For each standby variant it also
reports what a parked standby holds, as the launcher's /status reports it (RSS, USS and PSS of
its process tree; on CUDA the device bytes NVML charges it) and nvidia-smi's figure, and the
promoted standby's warm-up report (its /stats `warmup`: time, memory before, warm, kept).
Prints one JSON line per variant, then a summary with each variant's median and its ratio to
the ordinary one, and a table; --out writes them all. Without --model a small random
checkpoint is written to a temporary directory.
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

from benchlib import fmt_s, get, machine_name, record_figures

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


VARIANTS: dict[str, tuple[bool, list[str]]] = {
    "ordinary": (False, []),
    "cold": (True, ["--warmup-tokens", "0"]),
    "warm": (True, []),
    "warm-kept": (True, ["--standby-keep-memory"]),
}
"""Each variant: (--standby, extra engine arguments)."""


def run_mode(args: argparse.Namespace, model: Path, work: Path, variant: str) -> dict:
    """Start a launcher, kill its engine --reps times, return the timings and memory."""
    standby, extra = VARIANTS[variant]
    sock, port_file = work / f"sock-{variant}", work / f"port-{variant}"
    engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port-file",
              str(port_file), "--device", args.device, *extra]
    cmd = [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(model),
           "--device", args.device, "--tensor-parallel-size", str(args.tp), "--socket-dir",
           str(sock), "--health-port", "0", "--engine-ready", "notify", "--restart-max", "100",
           *(["--devices", args.devices] if args.devices else []),
           *(["--standby"] if standby else []), "--", *engine]
    log_path = work / f"launcher-{variant}.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stderr=log, stdout=log)
    out: dict[str, Any] = {"variant": variant, "standby": standby, "engine_args": extra,
                           "kill_to_first_token_s": []}
    try:
        url = until(lambda: _url(sock), 600, what="launcher.json")
        status = lambda: get(url + "/status") or {}  # noqa: E731
        for rep in range(args.reps):
            snap = until(lambda: _ready(status(), standby), 900, what="serving (and parked)")
            expected = until(lambda: generate(port_file, 6), 60, what="first answer")
            if standby and rep == 0:
                out.update(parked_memory(snap, status))
            port_file.unlink()
            t0 = time.perf_counter()
            os.killpg(snap["engine"]["pid"], signal.SIGKILL)
            until(lambda: generate(port_file, 1), 600, what="first token", interval=0.005)
            out["kill_to_first_token_s"].append(time.perf_counter() - t0)
            if standby and rep == 0:
                out["warmup"] = (stats(port_file) or {}).get("warmup")
            out.setdefault("same_output", True)
            again = until(lambda: generate(port_file, 6), 60, what="answer")
            out["same_output"] = out["same_output"] and again == expected
    except Exception:
        lines = log_path.read_text(errors="replace").splitlines()
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


def parked_memory(snap: dict[str, Any], status: Any) -> dict[str, Any]:
    """What the parked standby holds: the launcher's sample of it, and nvidia-smi's figure."""
    pid, parked_at = snap["standby"]["pid"], time.time()
    # a sample taken after the standby parked: the first one that names it may be from
    # before its warm-up made its CUDA context (0 bytes then; the sampler runs every 5 s)
    mem = until(lambda: (m := status().get("memory") or {}).get("sampled_at", 0) > parked_at
                and (m.get("standby") or {}).get("pid") == pid and m, 60,
                what="a memory sample of the parked standby")
    sb, engine = mem["standby"], mem.get("engine") or {}
    device = sb.get("device_bytes")
    return {"standby_rss_mib": sb["rss"] / 2**20, "standby_uss_mib": sb["uss"] / 2**20,
            "standby_pss_mib": sb["pss"] / 2**20,
            "standby_device_mib": None if device is None else device / 2**20,
            "standby_nvidia_smi_mib": gpu_mib(set(sb["pids"])),
            "engine_rss_mib": engine.get("rss", 0) / 2**20,
            "engine_device_mib": None if engine.get("device_bytes") is None
            else engine["device_bytes"] / 2**20,
            "devices": mem.get("devices"), "device_absent": mem.get("device_absent")}


def stats(port_file: Path) -> dict[str, Any] | None:
    """The engine's /stats, None if it does not answer."""
    try:
        return get(f"http://127.0.0.1:{port_file.read_text().strip()}/stats")
    except OSError:
        return None


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
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--model", default="", help="a reference-engine checkpoint directory")
    ap.add_argument("--out", default="", help="also write the results here (JSON)")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"unknown variant(s) {unknown}; pick from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="bench-standby-") as tmp:
        work = Path(tmp)
        if args.model:
            model = Path(args.model)
        else:
            from vlaunch.cache.reference.refmodel import make_checkpoint

            model = make_checkpoint(work / "model", hidden=256, layers=4, heads=8, kv_heads=4,
                                    intermediate=512, vocab=1024)
        results = [run_mode(args, model, work, v) for v in variants]
    for r in results:
        print(json.dumps(r), flush=True)
    base = results[0]["median_s"]
    summary = {"figure": "kill -> first token, median", "device": args.device, "tp": args.tp,
               "devices": args.devices or None, "baseline": results[0]["variant"],
               "medians_s": {r["variant"]: round(r["median_s"], 4) for r in results},
               "ratio_baseline_over": {r["variant"]: round(base / r["median_s"], 2)
                                       for r in results},
               "target_standby_le_s": 0.1}
    print(json.dumps(summary), flush=True)
    print(table(results), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    key = f"standby.{'gpu' if args.device == 'cuda' else 'cpu'}.tp{args.tp}"
    figures = {f"{key}.{r['variant'].replace('-', '_')}": fmt_s(r["median_s"]) for r in results}
    medians = {r["variant"]: r["median_s"] for r in results}
    if "ordinary" in medians and "warm" in medians:
        figures[f"{key}.ratio"] = f"{medians['ordinary'] / medians['warm']:.0f}x"
    record_figures(figures, machine=machine_name(args.device),
                   source=f"standby.md: bench_standby.py --device {args.device} --tp {args.tp} "
                          f"--reps {args.reps} ({args.model or 'its small random model'}), "
                          f"SIGKILL -> first token, median of {args.reps}")
    return 0 if all(r["same_output"] for r in results) else 1


def table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: each variant's median, ratio and what its parked standby held."""
    base = results[0]["median_s"]
    rows = ["| variant | kill -> first token, median (each) | ratio | parked standby USS / "
            "device MiB | warm-up ms | rank 0 device MiB: before -> warm -> kept |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        each = ", ".join(f"{t:.3f}" for t in r["kill_to_first_token_s"])
        dev = r.get("standby_device_mib")
        held = "-" if not r["standby"] else \
            f"{r['standby_uss_mib']:.0f} / {'absent' if dev is None else f'{dev:.0f}'}"
        report = r.get("warmup") or {}
        warm = report.get("ms")
        steps = [(report.get(k) or {}).get("device_bytes") for k in ("before", "warm", "kept")]
        cost = "-" if not report else "absent" if None in steps else \
            " -> ".join(f"{b / 2**20:.0f}" for b in steps)  # type: ignore[operator]
        rows.append(f"| {r['variant']} | {r['median_s']:.3f} s ({each}) | "
                    f"{base / r['median_s']:.1f}x | {held} | "
                    f"{'-' if warm is None else f'{warm:.1f}'} | {cost} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
