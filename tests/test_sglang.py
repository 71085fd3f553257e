"""SGLang 0.5 through vlaunch's loader (cache/integrations/sglang_loader.py), on CPU.

SGLang runs in its own venv (VLAUNCH_SGLANG_PYTHON, default .venv-sglang; `.ci/run` builds
it); tests/sglang_child.py loads a tiny Qwen2 with SGLang's default loader, then twice with
vlaunch's, from a cache rank running in the same venv (the fingerprint's torch version is the
engine's). Run with `-m sglang`; skipped where the venv is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import rank_status, spawn_cache

ROOT = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("VLAUNCH_SGLANG_PYTHON", str(ROOT / ".venv-sglang" / "bin" / "python"))
CHILD = str(ROOT / "tests" / "sglang_child.py")

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600),
              pytest.mark.skipif(not Path(PYTHON).exists(),
                                 reason=f"no SGLang python at {PYTHON}")]


def _child(*args: str, sockdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLAUNCH_SOCKET_DIR": str(sockdir or "/nonexistent")}
    env.pop("VLAUNCH_PLAN", None)
    return subprocess.run([PYTHON, CHILD, *args], capture_output=True, text=True, env=env,
                          timeout=400, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen2")
    r = _child("make", str(root))
    assert r.returncode == 0, r.stderr[-4000:]
    return root


@pytest.mark.parametrize("mode", ["share", "copy"])
def test_every_parameter_is_bit_equal_to_sglangs_default_loader(tiny: Path, sockdir: Path,
                                                                caches, mode: str) -> None:
    """SGLang's own dispatch (`get_model_loader` with the loader class as load_format) builds
    the same Qwen2 as its default loader, bit for bit: in share mode the first load maps what
    fits and hands SGLang's fused parameters back, the second maps that engine layout; in
    copy mode both are the engine's own copies."""
    caches.append(spawn_cache(tiny, sockdir, python=PYTHON))
    r = _child("compare", str(tiny), "--mode", mode, sockdir=sockdir)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert "model.layers.0.self_attn.qkv_proj.weight" in got["names"]  # SGLang's fused layout
    for run in ("first", "second"):
        assert got[run]["differ"] == [], (run, got[run])
    status = rank_status(sockdir)
    if mode == "share":  # every parameter a mapping of the cache's engine layout
        assert got["first"]["mapped"] == got["second"]["mapped"] == got["parameters"]
        (layout,) = status["layouts"]
        assert layout["fields"]["engine"] == "sglang" and status["raw"] == "released"
    else:
        assert got["first"]["mapped"] == got["second"]["mapped"] == 0
        assert not status["layouts"] and status["raw"] == "held"
