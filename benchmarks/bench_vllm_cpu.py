"""vLLM on CPU: seconds from process start to the first token, vlaunch load format vs safetensors.

    python benchmarks/bench_vllm_cpu.py --python .venv-vllm/bin/python [--large]
    python benchmarks/bench_vllm_cpu.py --standby [--reps 3] [--large]

For the tiny test model and (with --large) a random Llama of about 2.2 GB, each run a fresh
vLLM process (tests/vllm_child.py): start to LLM ready, start to first token, and the weight
loading share as vLLM and the vlaunch loader log it. The cache runs here (share mode).

--standby compares, in one run and against one cache (engine layout handed back by a first
start), a fresh vLLM start (process start -> first token, weights from the cache) with a
standby vLLM (the protocol of docs/standby.md: parked in the load format, PARKED=1 on a
datagram socket, then PROMOTE on a pipe -> first token); --reps of each, interleaved, medians
and their ratio. vLLM's own "init engine (profile, create kv cache, warmup model)" seconds are
shown for both: that part a promotion still runs; and the parked standby's RSS and USS (private
memory: the shared weight mappings left out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_standby import tree_memory

from vlaunch.cache.contract.notify import parse_fields
from vlaunch.cache.contract.standby import PARKED_FIELD, PROMOTE, standby_env

ROOT = Path(__file__).resolve().parents[1]
CHILD = str(ROOT / "tests" / "vllm_child.py")
LOAD_S = re.compile(r"(?:Loading weights took|tensors mapped from the \w+, the rest loaded by "
                    r"vLLM, in) ([\d.]+)")


def run(python: str, model: Path, fmt: str, sockdir: Path) -> dict:
    """One fresh vLLM process: its timings and the weight-loading seconds it logged."""
    env = {**os.environ, "VLAUNCH_SOCKET_DIR": str(sockdir)}
    r = subprocess.run([python, CHILD, "generate", str(model), "--load-format", fmt,
                        "--max-tokens", "1"], capture_output=True, text=True, env=env, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    load = LOAD_S.search(r.stderr + r.stdout)
    return {"format": fmt, "ready_s": round(out["ready_s"], 2),
            "first_token_s": round(out["first_token_s"], 2),
            "import_s": round(out["import_s"], 2),
            "weights_s": float(load.group(1)) if load else None}


INIT_S = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)")


def _child_env(sockdir: Path, **more: str) -> dict[str, str]:
    env = {**os.environ, "VLAUNCH_SOCKET_DIR": str(sockdir), **more}
    env.pop("VLAUNCH_PLAN", None)
    return env


def fresh(python: str, model: Path, sockdir: Path) -> dict:
    """A fresh vLLM on the load format: process start -> LLM ready and -> first token."""
    t0 = time.time()
    r = subprocess.run([python, CHILD, "generate", str(model), "--load-format", "vlaunch",
                        "--max-tokens", "1"], capture_output=True, text=True,
                       env=_child_env(sockdir), check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    init = INIT_S.search(r.stderr + r.stdout)
    return {"mode": "fresh", "start_to_ready_s": round(out["ready_at"] - t0, 3),
            "start_to_first_token_s": round(out["first_token_at"] - t0, 3),
            "init_engine_s": float(init.group(1)) if init else None}


def standby(python: str, model: Path, sockdir: Path) -> dict:
    """A standby vLLM: start -> PARKED=1, then PROMOTE -> LLM ready and -> first token."""
    notify_path = sockdir.parent / f"notify-{os.getpid()}.sock"
    notify_path.unlink(missing_ok=True)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(600)
    r, w = os.pipe()
    env = _child_env(sockdir, NOTIFY_SOCKET=str(notify_path), **standby_env(r))
    t0 = time.time()
    proc = subprocess.Popen([python, CHILD, "generate", str(model), "--load-format", "vlaunch",
                             "--max-tokens", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, pass_fds=(r,))
    os.close(r)
    try:
        while parse_fields(notify.recv(4096)).get(PARKED_FIELD) != "1":
            pass
        parked = time.time()
        rss, uss = tree_memory(proc.pid)
        os.write(w, PROMOTE)
    finally:
        os.close(w)
        notify.close()
        notify_path.unlink(missing_ok=True)
    stdout, stderr = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"standby vLLM exited {proc.returncode}: {stderr[-2000:]}")
    out = json.loads(stdout.strip().splitlines()[-1])
    init = INIT_S.search(stderr + stdout)
    return {"mode": "standby", "start_to_parked_s": round(parked - t0, 3),
            "parked_rss_mib": round(rss / 2**20), "parked_uss_mib": round(uss / 2**20),
            "promote_to_ready_s": round(out["ready_at"] - parked, 3),
            "promote_to_first_token_s": round(out["first_token_at"] - parked, 3),
            "init_engine_s": float(init.group(1)) if init else None}


def compare_standby(python: str, model: Path, sockdir: Path, label: str, reps: int) -> None:
    """Fresh starts and standby promotions, interleaved; one JSON line each, then medians."""
    fresh(python, model, sockdir)  # the first start hands the engine layout back
    runs: dict[str, list[float]] = {"fresh": [], "standby": []}
    for _ in range(reps):
        for mode, key, f in (("fresh", "start_to_first_token_s", fresh),
                             ("standby", "promote_to_first_token_s", standby)):
            row = f(python, model, sockdir)
            runs[mode].append(row[key])
            print(json.dumps({"model": label, **row}), flush=True)
    med = {mode: statistics.median(v) for mode, v in runs.items()}
    print(json.dumps({"model": label, "figure": "to first token, median",
                      "fresh_start_s": round(med["fresh"], 3),
                      "standby_promote_s": round(med["standby"], 3),
                      "ratio_fresh_over_standby": round(med["fresh"] / med["standby"], 1),
                      "fresh_all": runs["fresh"], "standby_all": runs["standby"]}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--large", action="store_true", help="also a ~2.2 GB random checkpoint")
    ap.add_argument("--standby", action="store_true",
                    help="fresh start vs standby promotion, to the first token")
    ap.add_argument("--reps", type=int, default=3, help="--standby: runs of each")
    a = ap.parse_args()
    sizes = [("tiny", ["--hidden", "128", "--layers", "2"])]
    if a.large:
        sizes.append(("2.2GB", ["--hidden", "2048", "--layers", "16", "--vocab", "32000",
                                "--intermediate", "5632"]))
    with tempfile.TemporaryDirectory() as tmp:
        for label, make_args in sizes:
            model, sockdir = Path(tmp) / label, Path(tmp) / f"s-{label}"
            sockdir.mkdir(mode=0o700)
            subprocess.run([a.python, CHILD, "make", str(model), *make_args], check=True,
                           capture_output=True)
            cache = subprocess.Popen([sys.executable, "-m", "vlaunch.cache", "--model", str(model),
                                      "--socket-dir", str(sockdir), "--plan", "replicate"],
                                     stderr=subprocess.DEVNULL)
            try:
                if a.standby:
                    compare_standby(a.python, model, sockdir, label, a.reps)
                    continue
                for fmt in ("safetensors", "vlaunch", "safetensors", "vlaunch"):
                    print(json.dumps({"model": label, **run(a.python, model, fmt, sockdir)}),
                          flush=True)
            finally:
                cache.terminate()
                cache.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
