#!/usr/bin/env python3
"""Engine restart under `vlaunch run` with a draft model's cache group beside the target's.

    python benchmarks/bench_draft.py --model DIR --draft-model DRAFT [--device cuda] [--tp 2]
        [--devices 0,0] [--reps 3]

DIR and DRAFT are reference-engine checkpoints with one vocabulary (e.g. written by
`python -m vlaunch.cache.reference.refmodel DIR --llama-8b --target-gib 16 --device cuda` and
`... DRAFT --llama-8b --layers 1 --seed 1 --device cuda`). In one run, median of --reps:
- target only: `vlaunch run --model DIR`, the reference engine SIGKILLed; kill -> the
  restarted engine's weights ready (it maps its shard from the cache);
- target + draft: the same with `--draft-model DRAFT` (the engine decodes speculatively and
  maps the draft from the draft group too).
Checks that both runs generate the same tokens and that every draft load came from the cache;
prints the two figures and their ratio (target + draft / target only).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_restart import VLAUNCH, engine_stats, wait  # the shared helpers

PROMPT = [1, 5, 9, 2, 7]


def generate(port_file: Path, n: int = 16) -> list[int]:
    """POST /generate to the engine on the port in `port_file`."""
    import json
    import urllib.request

    body = json.dumps({"tokens": PROMPT, "max_new_tokens": n}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port_file.read_text().strip()}/generate",
                                 data=body, method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["tokens"]


def run(args: Any, work: Path, draft: str) -> tuple[list[float], float, list[int], str]:
    """Restart times (s), the first start (s), the tokens and the launcher's log."""
    sock, pf, log = work / f"sock{bool(draft)}", work / f"e{bool(draft)}.port", \
        work / f"launcher{bool(draft)}.log"
    device = args.device.split(":")[0]
    cmd = [*VLAUNCH, "run", "--model", args.model, "--device", device, "--socket-dir",
           str(sock), "--tensor-parallel-size", str(args.tp), "--engine-ready", "notify",
           "--backoff-initial", "0", "--threads", "16"]
    cmd += ["--devices", args.devices] if args.devices else []
    cmd += ["--draft-model", draft] if draft else []
    cmd += ["--", sys.executable, "-m", "vlaunch.cache.reference.engine", "--port-file",
            str(pf), "--no-fallback"]
    t = time.time()
    launcher = subprocess.Popen(cmd, stderr=log.open("wb"))
    times = []
    try:
        stats = wait(lambda: engine_stats(pf), 900)
        first = stats["ready_at"] - t
        tokens = generate(pf)
        for _ in range(args.reps):
            pf.unlink()
            t = time.time()
            os.kill(stats["pid"], signal.SIGKILL)
            stats = wait(lambda: engine_stats(pf))
            times.append(stats["ready_at"] - t)
            assert stats["source"] == "cache", stats
            assert generate(pf) == tokens
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(120)
    return times, first, tokens, log.read_text()


def main() -> None:
    """Measure and print the figures and the ratio."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--devices", default="")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain, first_plain, tokens, _ = run(args, Path(tmp), "")
        spec, first_spec, spec_tokens, log = run(args, Path(tmp), args.draft_model)
    assert spec_tokens == tokens, (spec_tokens, tokens)
    drafts = log.count("draft model from cache")
    assert drafts == args.tp * (args.reps + 1), f"{drafts} draft loads from the cache"
    a, b = statistics.median(plain), statistics.median(spec)
    print(f"\n## engine restart with a draft group, {args.device}, TP {args.tp}, median of "
          f"{args.reps}, {time.strftime('%Y-%m-%d')}")
    print(f"{'figure':<58} {'seconds':>8}")
    print(f"{'first start, target only (disk)':<58} {first_plain:>8.2f}")
    print(f"{'first start, target + draft (disk)':<58} {first_spec:>8.2f}")
    print(f"{'engine kill -> weights ready, target only':<58} {a:>8.2f}")
    print(f"{'engine kill -> weights ready, target + draft':<58} {b:>8.2f}")
    print(f"ratio target + draft / target only: {b / a:.2f}; tokens equal: yes; draft loads "
          f"from the cache: {drafts}")


if __name__ == "__main__":
    main()
