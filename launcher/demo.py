"""The embedded default: a small random Llama-shaped checkpoint, and the `vlaunch demo`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from vlaunch.cache.contract import settings
from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.waiting import until


class DemoError(VlaunchError):
    """The demo could not run; `status` is the launcher's when it ended the demo."""

    def __init__(self, message: str, status: int = int(ExitStatus.INTERNAL)) -> None:
        super().__init__(message)
        self.status = status  # type: ignore[assignment]


def demo_dir() -> Path:
    """Where the demo checkpoint lives: $VLAUNCH_CACHE_DIR, else ~/.cache/vlaunch/demo."""
    base = settings.get("VLAUNCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vlaunch")
    return Path(base) / "demo-llama"


def ensure_demo_checkpoint() -> Path:
    """Create the demo checkpoint once (in a child process: the launcher holds no torch)."""
    path = demo_dir()
    if not (path / "config.json").exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DemoError(f"creating the demo checkpoint in {path} failed ({exc.strerror}); "
                            "set VLAUNCH_CACHE_DIR to a writable directory") from None
        code = ("import sys\nfrom vlaunch.cache.reference.refmodel import make_checkpoint\n"
                "try:\n    make_checkpoint(sys.argv[1], hidden=512, layers=8, heads=8, "
                "kv_heads=4, intermediate=1536, vocab=8192, shards=2)\n"
                "except Exception as exc:\n    sys.exit(f'error: {exc}')\n")
        made = subprocess.run([sys.executable, "-c", code, str(path)], check=False)
        if made.returncode:
            raise DemoError(f"creating the demo checkpoint in {path} failed (status "
                            f"{made.returncode}); its error is above; set VLAUNCH_CACHE_DIR to "
                            "a writable directory, or reinstall vlaunch")
    return path


def _get(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _wait(what: str, fn: Callable[[], Any], proc: subprocess.Popen[bytes],
          timeout: float = 300, launcher: bool = True) -> Any:
    def check() -> Any:
        value = fn()
        if not value and proc.poll() is not None:
            # the launcher's status means what its table says; anything else is the demo's own
            ok = launcher and proc.returncode > 0
            status = proc.returncode if ok else int(ExitStatus.INTERNAL)
            raise DemoError(f"{what}: process exited with {proc.returncode}; its error is "
                            "above", status)
        return value

    try:
        return until(check, timeout, what=what, interval=0.05)
    except TimeoutError:
        raise DemoError(f"timed out waiting for {what}; check the machine's load") from None


def _engine_cmd(model: Path, tp: int, port_file: Path, socket_dir: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--model", str(model),
           "--tensor-parallel-size", str(tp), "--port-file", str(port_file)]
    return cmd + (["--socket-dir", str(socket_dir)] if socket_dir else [])


def _stats(port_file: Path) -> dict[str, Any] | None:
    if not port_file.exists() or not port_file.read_text().strip():
        return None
    port = port_file.read_text().strip()
    health = _get(f"http://127.0.0.1:{port}/health")
    return _get(f"http://127.0.0.1:{port}/stats") if health else None


def run_demo(tp: int = 2) -> int:
    """Caches + reference engine, one engine restart, then cache vs disk; returns a status."""
    model = ensure_demo_checkpoint()
    with tempfile.TemporaryDirectory(prefix="vlaunch-demo-") as tmp:
        work = Path(tmp)
        sockdir, port_file = work / "sock", work / "engine.port"
        click.echo(f"demo: {model}, {tp} tensor-parallel ranks on CPU")
        launcher = subprocess.Popen(
            [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(model),
             "--tensor-parallel-size", str(tp), "--socket-dir", str(sockdir),
             "--engine-ready", "notify", "--backoff-initial", "0",
             "--", *_engine_cmd(model, tp, port_file, None)])
        try:
            first = _wait("the first engine", lambda: _stats(port_file), launcher)
            click.echo(f"demo: engine up (pid {first['pid']}), weights from "
                       f"{first['source']} in {first['weights_ms']:.1f} ms; killing it")
            port_file.unlink()
            killed = time.monotonic()
            os.kill(first["pid"], signal.SIGKILL)
            second = _wait("the restarted engine", lambda: _stats(port_file), launcher)
            restart_s = time.monotonic() - killed
        finally:
            launcher.send_signal(signal.SIGTERM)
            status = launcher.wait(60)
        disk_port = work / "disk.port"
        empty = work / "empty"
        empty.mkdir(mode=0o700)
        alone = subprocess.Popen(_engine_cmd(model, tp, disk_port, empty))
        try:
            disk = _wait("the engine loading from disk", lambda: _stats(disk_port), alone,
                         launcher=False)
        finally:
            alone.send_signal(signal.SIGTERM)
            alone.wait(60)
    ratio = disk["weights_ms"] / max(second["weights_ms"], 1e-6)
    click.echo("\n"
               f"restarted engine got its weights from the {second['source']} in "
               f"{second['weights_ms']:.1f} ms; from disk: {disk['weights_ms']:.1f} ms "
               f"({ratio:.0f}x faster)\n"
               f"kill -> restarted engine serving: {restart_s:.2f} s (process start + torch "
               f"import dominate)\nlauncher exit status after SIGTERM: {status}")
    return status
