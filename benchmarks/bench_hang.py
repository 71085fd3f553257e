#!/usr/bin/env python3
"""Engine hang -> first token against kill -> first token, ordinary vs `--standby`, in one run.

    python benchmarks/bench_hang.py [--device cpu|cuda] [--tp 1] [--reps 3] [--model DIR]
        [--devices 0,0] [--hang sigstop|stall] [--watchdog 2] [--unhealthy-after 2]
        [--stop-timeout 2] [--hang-kill-after S] [--out FILE]

Runs the reference engine under `vlaunch run --engine-watchdog W --engine-unhealthy-after U`
twice: ordinary restarts (without backoff, so that the figure is the engine's start, not the
restart policy's wait), then with --standby. Each rep first SIGKILLs the serving engine's
process group and times kill -> the first generated token (POST /generate, max_new_tokens 1),
then hangs the next engine and times hang -> first token, split into: detected (the launcher
calls it hung: W + U after its last ping, by design), gone (SIGTERM, then SIGKILL after the
stop timeout: neither hang handles SIGTERM; with --hang-kill-after 0, SIGKILL at once) and first
token after the old engine was gone.
`--hang sigstop` stops the engine process; `stall` blocks its serving loop behind a healthy
/health (the reference engine's test-only fault hook, VLAUNCH_REFERENCE_FAULT_FILE). Outputs
must equal those before each fault. Prints one JSON line per mode, then the medians and the
ratios ordinary / standby; --out writes them all. Without --model a small random checkpoint
is written to a temporary directory.
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
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from benchlib import fmt_s, free_port, get, launcher_url, machine_name, record_figures

from vlaunch.cache.contract.waiting import until

PROMPT = [1, 5, 9, 2, 7]


def generate(port: int, max_new: int, timeout: float = 30) -> list[int] | None:
    """The tokens the engine on `port` generates, None if it does not answer."""
    body = json.dumps({"tokens": PROMPT, "max_new_tokens": max_new}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())["tokens"]
    except (OSError, ValueError, KeyError):
        return None


class Mode:
    """One launcher (ordinary or --standby) and the faults its engines get."""

    def __init__(self, args: argparse.Namespace, model: Path, work: Path, standby: bool):
        self.args, self.standby, self.port = args, standby, free_port()
        self.fault = work / f"fault-{standby}"
        self.log_path = work / f"launcher-{standby}.log"
        sock = work / f"sock-{standby}"
        engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port",
                  str(self.port), "--device", args.device]
        cmd = [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(model),
               "--device", args.device, "--tensor-parallel-size", str(args.tp),
               "--socket-dir", str(sock), "--health-port", "0", "--engine-ready", "notify",
               "--restart-max", "100", "--backoff-initial", "0",
               "--engine-watchdog", str(args.watchdog),
               "--engine-unhealthy-after", str(args.unhealthy_after), "--stop-timeout",
               str(args.stop_timeout), *(["--devices", args.devices] if args.devices else []),
               *([] if args.hang_kill_after is None else
                 ["--engine-hang-kill-after", str(args.hang_kill_after)]),
               *(["--standby"] if standby else []), "--", *engine]
        env = {**os.environ, "VLAUNCH_REFERENCE_FAULT_FILE": str(self.fault)}
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stderr=log, stdout=log, env=env)
        self.url = until(lambda: launcher_url(sock), 600, what="launcher.json")

    def status(self) -> dict[str, Any]:
        return get(self.url + "/status") or {}

    def serving(self) -> dict[str, Any]:
        """The status once the engine serves (and, with --standby, a standby is parked)."""
        def ready() -> dict[str, Any] | None:
            s = self.status()
            parked = not self.standby or (s.get("standby") or {}).get("state") == "parked"
            return s if s.get("phase") == "serving" and s.get("engine_ready") and parked \
                else None
        return until(ready, 900, what="serving (and parked)")

    def kill(self, snap: dict[str, Any]) -> float:
        """SIGKILL the engine's group: seconds to the first token."""
        t0 = time.perf_counter()
        os.killpg(snap["engine"]["pid"], signal.SIGKILL)
        until(lambda: generate(self.port, 1), 600, what="first token", interval=0.005)
        return time.perf_counter() - t0

    def hang(self, snap: dict[str, Any]) -> dict[str, float]:
        """Hang the engine: seconds to detected, gone, first token."""
        keeper, hangs = snap["engine"]["pid"], snap["engine"]["hangs"]
        command = psutil.Process(keeper).children()[0].pid  # the engine under its keeper
        t0 = time.perf_counter()
        if self.args.hang == "sigstop":
            os.kill(command, signal.SIGSTOP)
        else:
            self.fault.write_text("generate-stall")  # the next request blocks the loop
            threading.Thread(target=generate, args=(self.port, 1, 600), daemon=True).start()
        until(lambda: self.status().get("engine", {}).get("hangs", 0) > hangs, 600,
              what="the hang detected", interval=0.005)
        detected = time.perf_counter() - t0
        def gone() -> bool:
            engine = self.status().get("engine") or {}
            return engine.get("pid") not in (keeper, None) or engine.get("state") == "backoff"
        until(gone, 600, what="the hung engine gone", interval=0.005)
        gone = time.perf_counter() - t0
        until(lambda: generate(self.port, 1), 600, what="first token", interval=0.005)
        return {"detected_s": detected, "gone_s": gone, "first_token_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_mode(args: argparse.Namespace, model: Path, work: Path, standby: bool) -> dict:
    """Kill, then hang, the engine --reps times each; the timings."""
    mode = Mode(args, model, work, standby)
    out: dict[str, Any] = {"standby": standby, "hang": args.hang, "kill_to_first_token_s": [],
                           "hangs": [], "same_output": True}
    try:
        for _ in range(args.reps):
            snap = mode.serving()
            hangs = snap["engine"]["hangs"]
            expected = until(lambda: generate(mode.port, 6), 60, what="first answer")
            out["kill_to_first_token_s"].append(mode.kill(snap))
            snap = mode.serving()
            out["same_output"] &= generate(mode.port, 6) == expected
            out["hangs"].append(mode.hang(snap))
            snap = mode.serving()
            out["same_output"] &= generate(mode.port, 6) == expected
            out["unasked_hangs"] = out.get("unasked_hangs", 0) + snap["engine"]["hangs"] - \
                hangs - 1  # a starved engine missing its pings: the watchdog is too short
    except Exception:
        lines = mode.log_path.read_text(errors="replace").splitlines()
        print("\n".join(lines[-40:]), file=sys.stderr)
        raise
    finally:
        mode.close()
    out["kill_median_s"] = statistics.median(out["kill_to_first_token_s"])
    for key in ("detected_s", "gone_s", "first_token_s"):
        out[f"hang_{key.removesuffix('_s')}_median_s"] = statistics.median(
            h[key] for h in out["hangs"])
    out["hang_after_gone_median_s"] = statistics.median(
        h["first_token_s"] - h["gone_s"] for h in out["hangs"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--devices", default="", help="--devices for vlaunch run (e.g. 0,0)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="", help="a reference-engine checkpoint directory")
    ap.add_argument("--hang", default="sigstop", choices=["sigstop", "stall"])
    ap.add_argument("--watchdog", type=float, default=2.0, help="--engine-watchdog")
    ap.add_argument("--unhealthy-after", type=float, default=2.0,
                    help="--engine-unhealthy-after")
    ap.add_argument("--stop-timeout", type=float, default=2.0, help="--stop-timeout")
    ap.add_argument("--hang-kill-after", type=float, default=None,
                    help="--engine-hang-kill-after (default: not given, --stop-timeout)")
    ap.add_argument("--out", default="", help="also write the results here (JSON)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-hang-") as tmp:
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
    ordinary, standby = results
    detection = args.watchdog + args.unhealthy_after
    summary = {
        "figure": "hang -> first token and kill -> first token, medians", "device": args.device,
        "tp": args.tp, "hang": args.hang, "configured_detection_s": detection,
        "stop_timeout_s": args.stop_timeout, "hang_kill_after_s": args.hang_kill_after,
        "kill_ordinary_s": round(ordinary["kill_median_s"], 3),
        "kill_standby_s": round(standby["kill_median_s"], 3),
        "hang_ordinary_s": round(ordinary["hang_first_token_median_s"], 3),
        "hang_standby_s": round(standby["hang_first_token_median_s"], 3),
        "hang_detected_s": round(standby["hang_detected_median_s"], 3),
        "after_gone_ordinary_s": round(ordinary["hang_after_gone_median_s"], 3),
        "after_gone_standby_s": round(standby["hang_after_gone_median_s"], 3),
        "ratio_hang_ordinary_over_standby": round(
            ordinary["hang_first_token_median_s"] / standby["hang_first_token_median_s"], 2),
        "ratio_kill_ordinary_over_standby": round(
            ordinary["kill_median_s"] / standby["kill_median_s"], 2),
        "ratio_standby_after_gone_over_kill": round(
            standby["hang_after_gone_median_s"] / standby["kill_median_s"], 2),
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    key = (f"hang.{'gpu' if args.device == 'cuda' else 'cpu'}.tp{args.tp}.{args.hang}"
           + (".kill0" if args.hang_kill_after == 0 else ""))
    record_figures({f"{key}.detected": fmt_s(standby["hang_detected_median_s"]),
                    f"{key}.first_token": fmt_s(standby["hang_first_token_median_s"]),
                    f"{key}.after_gone": fmt_s(standby["hang_after_gone_median_s"]),
                    f"{key}.kill_first_token": fmt_s(standby["kill_median_s"])},
                   machine=machine_name(args.device),
                   source=f"hang.md: bench_hang.py --device {args.device} --tp {args.tp} --hang "
                          f"{args.hang} --reps {args.reps} (watchdog {args.watchdog:g} s, "
                          f"unhealthy-after {args.unhealthy_after:g} s, stop timeout "
                          f"{args.stop_timeout:g} s, hang-kill-after {args.hang_kill_after}; "
                          f"{args.model or 'its small random model'}), "
                          f"--standby, medians of {args.reps}")
    return 0 if all(r["same_output"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
