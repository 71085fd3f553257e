"""Small helpers the benchmark scripts share (run them as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def get(url: str) -> dict[str, Any] | None:
    """GET a JSON document, None on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_url(sockdir: Path) -> str | None:
    """The health URL a launcher wrote to its socket directory's launcher.json, if it did."""
    try:
        return json.loads((sockdir / "launcher.json").read_text())["url"]
    except (OSError, ValueError, KeyError):
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


def cpu_rank(model: Path, sockdir: Path
             ) -> tuple[subprocess.Popen[bytes], dict[str, Any], socket.socket]:
    """A CPU cache rank of `model` (plan replicate) serving in `sockdir` (made here, 0700),
    once it is ready: its process, its ready frame (the fds that came with it closed) and
    the ready channel, which the caller keeps open as a launcher does (engine layouts and
    releases are reported on it)."""
    from vlaunch.cache.contract import wire
    from vlaunch.cache.contract.progress import recv_ready

    sockdir.mkdir(mode=0o700)
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "vlaunch.cache", "--model", str(model),
                             "--socket-dir", str(sockdir), "--plan", "replicate",
                             "--ready-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    ready, fds = recv_ready(ours)  # progress frames come first, then the ready frame
    wire.close_fds(fds)
    return proc, ready, ours
