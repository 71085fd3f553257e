"""The embedded default: a small random Llama-shaped checkpoint, and the `vlaunch demo`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def demo_dir() -> Path:
    """Where the demo checkpoint lives: $VLAUNCH_CACHE_DIR, else ~/.cache/vlaunch/demo."""
    base = os.environ.get("VLAUNCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vlaunch")
    return Path(base) / "demo-llama"


def ensure_demo_checkpoint() -> Path:
    """Create the demo checkpoint once (in a child process: the launcher holds no torch)."""
    path = demo_dir()
    if not (path / "config.json").exists():
        code = ("import sys; from vlaunch.cache.refmodel import make_checkpoint; "
                "make_checkpoint(sys.argv[1], hidden=512, layers=8, heads=8, kv_heads=4, "
                "intermediate=1536, vocab=8192, shards=2)")
        subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    return path
