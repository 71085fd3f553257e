"""The README's main job: `vlaunch demo` runs for real on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlaunch.cache.contract.exitcodes import ExitStatus


@pytest.mark.slow  # .ci/run also runs the README's demo command itself, in a fresh venv
def test_vlaunch_demo_restarts_the_engine_from_the_cache(demo_ckpt: Path) -> None:
    # the checkpoint the demo would write first (made by the same function, shared with the
    # quick start's test); tests/test_operator.py covers the demo failing to write it
    env = {**os.environ, "VLAUNCH_CACHE_DIR": str(demo_ckpt.parent)}
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "demo"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == ExitStatus.OK, r.stderr[-3000:]
    m = re.search(r"restarted engine got its weights from the cache in ([\d.]+) ms; from disk: "
                  r"([\d.]+) ms", r.stdout)
    assert m, r.stdout
    assert float(m.group(1)) < float(m.group(2))
    assert "launcher exit status after SIGTERM: 0" in r.stdout
    assert "swept" not in r.stderr  # nothing outlived its parent
