"""Small helpers the benchmark scripts share (run them as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from typing import Any


def get(url: str) -> dict[str, Any] | None:
    """GET a JSON document, None on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def bare_starts(device: str, reps: int) -> list[float]:
    """Seconds from spawn to a first allocation on `device` in a bare `import torch` process."""
    # the moment the allocation is done is printed, so interpreter teardown is not counted
    code = f"import time, torch; torch.zeros(1, device={device!r}); print(time.time())"
    out = []
    for _ in range(reps):
        t = time.time()
        text = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                              text=True).stdout
        out.append(float(text.split()[-1]) - t)
    return out
