#!/usr/bin/env python3
"""TP 2 reference engine on its engine-shaped layout: GPU bytes and kill -> serving again.

    python benchmarks/bench_gpu_engine_layout.py --model DIR [--target-gib 8] [--reps 3]

DIR is a reference-engine checkpoint; if it does not exist, one with Llama-3-8B shapes of
about --target-gib is written there first (on the GPU). Two ranks on GPUs 0 and 1: it needs
two GPUs (the `nvidia-h200-x2` kind), since the engine's NCCL group refuses two ranks on one
GPU. In one run, under `vlaunch run`:
- bytes per GPU (nvidia-smi: the GPU's used memory, and each process's) once the caches hold
  the raw layout, before any engine starts (the engine waits for a go file);
- the same once the first engine has handed its fused, padded layout back and the caches
  released the raw layout (steady state: one copy of the weights per GPU);
- bare: `python -c "import torch; torch.zeros(1, device='cuda')"`, spawn to allocation done;
- kill -> serving: rank 0 of the engine SIGKILLed (its worker dies with it), until the
  restarted engine answers a /generate (and until its weights are ready, from its /stats),
  median of --reps; the restarted engine must report layout "engine";
- where each GPU's bytes go, after the first start and after the last restart (each once it
  has answered a /generate): the engine rank's own breakdown from /stats `memory` (weights
  mapped from the cache vs its own, torch allocated and reserved, KV cache, the process's
  device bytes per NVML and the remainder: CUDA context, NCCL, workspaces) next to
  nvidia-smi's used and per-process MiB.
Prints three tables; NVLink multicast stays off in every process.
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

from benchlib import bare_starts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_restart import VLAUNCH, engine_stats, get, wait

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def smi(query: str) -> list[list[str]]:
    """Rows of an nvidia-smi CSV query (no header, no units)."""
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                         check=True, capture_output=True, text=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def _gpu_bytes() -> dict[str, Any]:
    """Used MiB per GPU index, and per process (pid -> MiB) on each GPU."""
    gpus = {uuid: int(idx) for idx, uuid in smi("gpu=index,uuid")}
    used = {int(i): int(m) for i, m in smi("gpu=index,memory.used")}
    procs: dict[int, dict[int, int]] = {}
    for pid, uuid, mib in smi("compute-apps=pid,gpu_uuid,used_memory"):
        procs.setdefault(gpus.get(uuid, -1), {})[int(pid)] = int(mib)
    return {"used_mib": used, "per_process_mib": procs}


def generate_ok(port_file: Path) -> bool:
    """True once the engine answers a generation."""
    try:
        port = port_file.read_text().strip()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", method="POST",
                                     data=json.dumps({"tokens": [1, 2, 3],
                                                      "max_new_tokens": 1}).encode())
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def ensure_model(path: str, target_gib: float) -> None:
    """Write a Llama-8B-shaped checkpoint of about target_gib at path unless one is there."""
    if Path(path, "config.json").exists():
        return
    subprocess.run([sys.executable, "-m", "vlaunch.cache.reference.refmodel", path,
                    "--llama-8b", "--target-gib", str(target_gib), "--shards", "4",
                    "--device", "cuda"], check=True)


def main() -> None:
    """Measure and print the tables."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--target-gib", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of the procedure (no nvidia-smi figures)")
    args = ap.parse_args()
    os.environ.update(MULTICAST_OFF)
    if args.device == "cuda":
        ensure_model(args.model, args.target_gib)
    devices = "0,1" if args.device == "cuda" else "-"
    if args.device == "cuda" and len(smi("gpu=index")) < 2:
        sys.exit("needs two GPUs (nvidia-h200-x2): NCCL refuses two engine ranks on one GPU")
    gpu_bytes = _gpu_bytes if args.device == "cuda" else lambda: {"used_mib": {},
                                                                  "per_process_mib": {}}
    bare = bare_starts(args.device, args.reps)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sock, pf, go = work / "sock", work / "engine.port", work / "go"
        engine = (f"while [ ! -e {go} ]; do sleep 0.05; done; exec {sys.executable} -m "
                  f"vlaunch.cache.reference.engine --device cuda --tensor-parallel-size 2 "
                  f"--port-file {pf} --log-level WARNING")
        launcher = subprocess.Popen(
            [*VLAUNCH, "run", "--model", args.model, "--device", "cuda", "--devices", devices,
             "--tensor-parallel-size", "2", "--socket-dir", str(sock),
             "--engine-ready", "notify", "--backoff-initial", "0", "--threads", "16",
             "--health-port", "0", "--log-level", "WARNING", "--", "sh", "-c", engine]
            if args.device == "cuda" else
            [*VLAUNCH, "run", "--model", args.model, "--tensor-parallel-size", "2",
             "--socket-dir", str(sock), "--engine-ready", "notify", "--backoff-initial", "0",
             "--health-port", "0", "--log-level", "WARNING", "--", "sh", "-c",
             engine.replace("--device cuda", "--device cpu")])
        try:
            status_url = wait(lambda: _status_url(sock))
            wait(lambda: (get(status_url) or {}).get("caches_ready"))
            raw = gpu_bytes()
            go.touch()
            stats = wait(lambda: engine_stats(pf))
            assert stats["layout"] == "handed-back", stats
            wait(lambda: generate_ok(pf))
            time.sleep(1.0)  # the ranks free the raw slabs just after answering the commit
            layout = gpu_bytes()
            first_memory = (engine_stats(pf) or {}).get("memory") or []
            kill_ready, kill_serving = [], []
            for _ in range(args.reps):
                pf.unlink()
                t = time.time()
                os.kill(stats["pid"], signal.SIGKILL)
                stats = wait(lambda: engine_stats(pf))
                kill_ready.append(stats["ready_at"] - t)
                wait(lambda: generate_ok(pf), 120)
                kill_serving.append(time.time() - t)
                assert (stats["source"], stats["layout"]) == ("cache", "engine"), stats
            steady = gpu_bytes()
            restart_memory = (engine_stats(pf) or {}).get("memory") or []
        finally:
            launcher.send_signal(signal.SIGTERM)
            status = launcher.wait(180)
    _print(args, devices, raw, layout, steady, bare, kill_ready, kill_serving, status)
    _print_memory([("first start", layout, first_memory),
                   ("after restarts", steady, restart_memory)])


def _status_url(sock: Path) -> str | None:
    """The launcher's /status URL, from launcher.json in its socket directory."""
    try:
        return json.loads((sock / "launcher.json").read_text())["url"] + "/status"
    except (OSError, ValueError, KeyError):
        return None


def _print(args: Any, devices: str, raw: dict[str, Any], layout: dict[str, Any],
           steady: dict[str, Any], bare: list[float], ready: list[float],
           serving: list[float], status: int) -> None:
    print(f"\n## engine layout, TP 2 on GPUs {devices}, {args.model}, median of {args.reps}, "
          f"{time.strftime('%Y-%m-%d')}; launcher exit after SIGTERM: {status}")
    print(f"{'GPU':>3} {'raw only MiB':>13} {'layout+engine MiB':>18} {'after kills MiB':>16}")
    for gpu in sorted(raw["used_mib"]):
        print(f"{gpu:>3} {raw['used_mib'][gpu]:>13} {layout['used_mib'][gpu]:>18} "
              f"{steady['used_mib'][gpu]:>16}")
    print("per process (MiB), raw only:", json.dumps(raw["per_process_mib"]))
    print("per process (MiB), engine layout:", json.dumps(layout["per_process_mib"]))
    b = statistics.median(bare)
    rows = [("bare python + import torch + first CUDA alloc", b),
            ("engine kill -> restarted engine's weights ready", statistics.median(ready)),
            ("engine kill -> restarted engine serves /generate", statistics.median(serving))]
    print(f"{'figure':<52} {'seconds':>8} {'x bare':>7}")
    for name, sec in rows:
        print(f"{name:<52} {sec:>8.2f} {sec / b:>7.2f}")


def _print_memory(phases: list[tuple[str, dict[str, Any], list[dict[str, Any]]]]) -> None:
    """Per GPU (engine rank r on GPU r): nvidia-smi beside the engine rank's own breakdown.

    engine MiB is the rank's device memory per NVML (nvidia-smi's per-process figure; the
    mapped weights are the cache rank's and not in it); other = engine MiB - torch reserved;
    cache MiB = the GPU's per-process sum less the engine's.
    """
    mib = 1 << 20

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v / mib:.0f}"

    print("\nwhere the bytes go (MiB): engine rank r on GPU r; weights mapped = the cache's "
          "slabs the engine maps (held by the cache rank)")
    head = ("phase", "GPU", "smi used", "cache", "engine", "mapped", "own", "alloc",
            "reserved", "KV", "other")
    print(f"{head[0]:<15}" + "".join(f"{h:>9}" for h in head[1:]))
    for name, smi_bytes, memory in phases:
        for m in memory:
            gpu = int(m["rank"])
            used = smi_bytes["used_mib"].get(gpu)
            procs = smi_bytes["per_process_mib"].get(gpu, {})
            engine = m.get("device_bytes")
            cache = (sum(procs.values()) - round(engine / mib)) if engine is not None and \
                procs else None
            cells = [gpu, used, cache, fmt(engine), fmt(m["weights_shared"]),
                     fmt(m["weights_own"]), fmt(m["torch_allocated"]), fmt(m["torch_reserved"]),
                     fmt(m["kv_cache"]), fmt(m.get("other"))]
            print(f"{name:<15}" + "".join(f"{'-' if c is None else c:>9}" for c in cells))
        if not memory:
            print(f"{name:<15} (the engine reported no memory in /stats)")
        print(f"{'':<15} nvidia-smi per process (pid: MiB): "
              f"{json.dumps(smi_bytes['per_process_mib'])}")


if __name__ == "__main__":
    main()
