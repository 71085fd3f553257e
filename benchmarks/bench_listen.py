#!/usr/bin/env python3
"""Refused and failed requests, and the wait clients see, across engine changes: the engine's
own port against `vlaunch run --listen` (the launcher holds the socket).

    python benchmarks/bench_listen.py [--device cpu|cuda] [--tp 1] [--clients 1,8]
        [--reps 2] [--model DIR [--twin DIR]] [--events kill,double,in-place:3,sighup]
        [--modes port,listen] [--out FILE]

For each mode (the engine binds --port itself / the launcher binds it with --listen), each
client count and each event, the reference engine runs under `vlaunch run --standby` and N
threads send one-token `POST /generate` requests back to back, each on a new connection. The
event (SIGKILL of the engine's group, a double or an in-place `vlaunch swap` between two
checkpoints, SIGHUP) happens once the standby is parked; the clients run on until the next
standby has parked. Per event: refused connections, failed requests (reset, truncated, 5xx),
the longest wait for one answer (`max_wait_s`), and the added wait (`added_s`: that minus the
median answer before the event), and when the longest wait began after the event's start
(`worst_began_s`: a swap's event starts with its staging). `EVENT:N` runs that event N times
(default --reps). Prints one JSON line per run and a table; --out writes them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import free_port, get, launcher_url, machine_name, record_figures

from vlaunch.cache.contract.waiting import until

BODY = json.dumps({"tokens": [1, 5, 9, 2, 7], "max_new_tokens": 1})


class Clients:
    """N threads of back-to-back one-token requests; what each answer cost, and what failed."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.stop = port, threading.Event()
        self.lock = threading.Lock()
        self.waits: list[tuple[float, float]] = []  # (start, seconds) of each answer
        self.refused = self.failed = 0
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            try:
                conn.request("POST", "/generate", BODY, {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                ok = r.status == 200
            except ConnectionRefusedError:
                with self.lock:
                    self.refused += 1
                time.sleep(0.001)  # a client's immediate retry
                continue
            except (OSError, http.client.HTTPException):  # reset, truncated
                ok = False
            finally:
                conn.close()
            with self.lock:
                if ok:
                    self.waits.append((start, time.monotonic() - start))
                else:
                    self.failed += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


class Launcher:
    """`vlaunch run --standby` with the reference engine on one fixed port."""

    def __init__(self, args: argparse.Namespace, model: Path, work: Path, listen: bool):
        self.port, self.work = free_port(), work
        self.sockdir = work / f"sock-{listen}"
        engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port",
                  str(self.port), "--device", args.device]
        cmd = [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(model),
               "--device", args.device, "--tensor-parallel-size", str(args.tp),
               "--socket-dir", str(self.sockdir), "--health-port", "0", "--engine-ready",
               "notify", "--standby", "--restart-max", "100", "--backoff-initial", "0",
               *(["--listen", f"127.0.0.1:{self.port}"] if listen else []), "--", *engine]
        self.log = (work / f"launcher-{listen}.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        self.url = until(lambda: launcher_url(self.sockdir), 600, what="launcher.json")

    def parked(self, promotions: int = 0) -> dict[str, Any]:
        def ok() -> dict[str, Any] | None:
            s = get(self.url + "/status") or {}
            sb = s.get("standby") or {}
            return s if s.get("engine_ready") and sb.get("state") == "parked" and \
                sb.get("promotions", 0) >= promotions and \
                (s.get("swap") or {}).get("state") == "none" else None
        return until(ok, 900, what="serving with a parked standby", interval=0.02)

    def event(self, name: str, snap: dict[str, Any], models: list[Path], n: int) -> None:
        if name == "kill":
            os.killpg(snap["engine"]["pid"], signal.SIGKILL)
        elif name == "sighup":
            self.proc.send_signal(signal.SIGHUP)
        else:
            subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "swap",
                            "--socket-dir", str(self.sockdir), "--model", str(models[n % 2]),
                            "--mode", name], check=True, capture_output=True, timeout=600)

    def close(self, keep: str = "") -> None:
        """Stop the launcher; its log goes to `keep` (the steps behind each figure)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        if keep:
            Path(keep).write_bytes(Path(self.log.name).read_bytes())


def measure(la: Launcher, event: str, clients: int, models: list[Path], n: int) -> dict:
    snap = la.parked()
    c = Clients(la.port, clients)
    try:
        until(lambda: len(c.waits) >= 20 * clients, 120, what="answers before the event")
        before = statistics.median(w for _, w in c.waits)
        t0 = time.monotonic()
        la.event(event, snap, models, n)
        la.parked(snap["standby"]["promotions"] + 1)
        until(lambda: sum(1 for s, _ in c.waits if s > t0) >= 20 * clients, 120,
              what="answers after the event")
    finally:
        c.close()
    at, worst = max(((s, w) for s, w in c.waits if s + w > t0), key=lambda sw: sw[1])
    return {"event": event, "clients": clients, "refused": c.refused, "failed": c.failed,
            "median_before_s": round(before, 4), "max_wait_s": round(worst, 4),
            "added_s": round(worst - before, 4), "worst_began_s": round(at - t0, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--events", default="kill,double,in-place,sighup")
    ap.add_argument("--model", default="", help="a reference-engine checkpoint directory "
                                                "(a swap goes to a random twin of it)")
    ap.add_argument("--twin", default="", help="the checkpoint a swap goes to (same shapes as "
                                                "--model; default: a random twin of --model's "
                                                "small default shapes)")
    ap.add_argument("--modes", default="port,listen")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from vlaunch.cache.reference.refmodel import make_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-listen-") as tmp:
        work = Path(tmp)
        shape = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 512,
                 "vocab": 1024}
        models = [Path(args.model)] if args.model else [make_checkpoint(work / "a", **shape)]
        models.append(Path(args.twin) if args.twin else
                      make_checkpoint(work / "b", seed=1, **shape))
        for listen in (mode == "listen" for mode in args.modes.split(",")):
            la = Launcher(args, models[0], work, listen)
            n = 1
            try:
                for item in args.events.split(","):  # EVENT or EVENT:REPS
                    event, _, reps = item.partition(":")
                    for clients in (int(x) for x in args.clients.split(",")):
                        for _ in range(int(reps or args.reps)):
                            row = {"listen": listen,
                                   **measure(la, event, clients, models, n)}
                            n += event in ("double", "in-place")
                            print(json.dumps(row), flush=True)
                            rows.append(row)
            finally:
                la.close(f"{args.out}.{'listen' if listen else 'port'}.log" if args.out else "")
    print(f"\n{'mode':<8} {'event':<9} {'clients':>7} {'refused':>8} {'failed':>7} "
          f"{'max wait s':>10} {'added s':>8} {'began s':>8}")
    for r in rows:
        print(f"{'listen' if r['listen'] else 'port':<8} {r['event']:<9} {r['clients']:>7} "
              f"{r['refused']:>8} {r['failed']:>7} {r['max_wait_s']:>10.3f} "
              f"{r['added_s']:>8.3f} {r['worst_began_s']:>8.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": args.device, "tp": args.tp,
                                              "rows": rows}, indent=2) + "\n")
    _record(args, rows)
    return 0


def _record(args: argparse.Namespace, rows: list[dict]) -> None:
    """Medians per mode, event and client count into the figures summary ($RECORD_FIGURES):
    listen.DEV.tpN.MODE.EVENT.cN.{added,refused,failed}."""
    dev = "gpu" if args.device == "cuda" else "cpu"
    values: dict[str, str] = {}
    for key in {(r["listen"], r["event"], r["clients"]) for r in rows}:
        same = [r for r in rows if (r["listen"], r["event"], r["clients"]) == key]
        fid = f"listen.{dev}.tp{args.tp}.{'listen' if key[0] else 'port'}." \
              f"{key[1]}.c{key[2]}"
        values[f"{fid}.added"] = f"{statistics.median(r['added_s'] for r in same):.3f} s"
        values[f"{fid}.refused"] = str(max(r["refused"] for r in same))
        values[f"{fid}.failed"] = str(max(r["failed"] for r in same))
    record_figures(values, machine=machine_name(args.device),
                   source=f"listen.md: bench_listen.py --device {args.device} --tp {args.tp}")


if __name__ == "__main__":
    sys.exit(main())
