"""vLLM on CPU: seconds from process start to the first token, vlaunch load format vs safetensors.

    python benchmarks/bench_vllm_cpu.py --python .venv-vllm/bin/python [--large]

For the tiny test model and (with --large) a random Llama of about 2.2 GB, each run a fresh
vLLM process (tests/vllm_child.py): start to LLM ready, start to first token, and the weight
loading share as vLLM and the vlaunch loader log it. The cache runs here (share mode).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--large", action="store_true", help="also a ~2.2 GB random checkpoint")
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
                for fmt in ("safetensors", "vlaunch", "safetensors", "vlaunch"):
                    print(json.dumps({"model": label, **run(a.python, model, fmt, sockdir)}),
                          flush=True)
            finally:
                cache.terminate()
                cache.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
