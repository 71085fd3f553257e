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


def record_figures(values: dict[str, str], *, machine: str, source: str,
                   date: str | None = None, path: str | Path | None = None) -> Path | None:
    """Merge measured figures (id -> value as the docs quote it, "0.714 s") into a summary.

    The summary is `path`, else $RECORD_FIGURES; with neither, nothing is written (a run on a
    busy laptop does not overwrite a GPU session's figures by accident). On a device machine
    point RECORD_FIGURES at $OUT/summary.json and merge it back with
    `python benchmarks/figures.py --merge FILE`, then run `python benchmarks/figures.py`
    to rewrite the pages that quote them. `source` names the results file and section the
    run's table goes to (e.g. "standby.md: One H200, 2026-12-01 (gpu_standby.sh), tp1")."""
    import os

    target = path or os.environ.get("RECORD_FIGURES")
    if not target:
        return None
    target = Path(target)
    doc: dict[str, Any] = {"figures": {}}
    if target.exists():
        doc = json.loads(target.read_text())
    day = date or time.strftime("%Y-%m-%d", time.gmtime())
    for fid, value in values.items():
        doc["figures"][fid] = {"value": value, "machine": machine, "date": day,
                               "source": source}
    doc["figures"] = dict(sorted(doc["figures"].items()))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {len(values)} figure(s) in {target}: {', '.join(values)}")
    return target


def machine_name(device: str) -> str:
    """What summary.json calls the machine a run measured on: the GPU's model for cuda
    ("H200"; "2 x H200" with two), else "N-core CPU". No torch import (nvidia-smi)."""
    import os

    if device.startswith("cuda"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            names = []
        names = [n.strip().removeprefix("NVIDIA ") for n in names if n.strip()]
        if names:
            return names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"
        return "GPU"
    return f"{os.cpu_count()}-core CPU"


def fmt_s(seconds: float) -> str:
    """A duration as the docs quote it: three significant figures ("0.160 s", "16.9 s")."""
    if seconds < 0.1:
        return f"{seconds * 1000:#.3g} ms".replace(". ms", " ms")
    return f"{seconds:#.3g} s".replace(". s", " s")
