"""Hung engines with real processes: `vlaunch run` and the reference engine, each kind of hang
(docs/health.md's table). Each case: the hang is detected within the configured time, the
whole engine process tree is gone (nothing orphaned, nothing left unreaped), the caches are
untouched and bit-exact (`vlaunch verify`), and the next engine serves the same tokens.

The two TP 1 cases run by default; the TP 2, standby and rank-respawn cases are `slow`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.test_launcher import Launcher, serving
from vlaunch.cache.reference.faults import FAULT_ENV
from vlaunch.cache.reference.refmodel import make_checkpoint

from ..conftest import eventually, free_port
from .harness import descendants

PROMPT = [1, 5, 9, 2]
WATCHDOG, UNHEALTHY = 1.0, 1.5  # --engine-watchdog, --engine-unhealthy-after
STOP = 5.0  # --stop-timeout: the reference engine's own exit (its final GC) took 3-4 s here
SLACK = 8.0  # a loaded 2-core machine: ticks, probes and log lines run late, never early


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hang") / "tiny", hidden=64, layers=2,
                           heads=4, kv_heads=2, intermediate=128, vocab=256)


class Hang:
    """A launcher over the reference engine on a fixed port, with its fault file."""

    def __init__(self, tmp: Path, model: Path, *args: str, tp: int = 1) -> None:
        self.port = free_port()
        self.fault = tmp / "fault"
        url = f"http://127.0.0.1:{self.port}"
        # raw tensors, no engine layout handed back: the rank keeps the checkpoint-shaped
        # slabs that `vlaunch verify` checks against the files
        engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port",
                  str(self.port), "--no-engine-layout"]
        args = tuple(a.replace("{port}", str(self.port)) for a in args)
        self.la = Launcher(tmp, model, "--engine-ready", "http", "--engine-health-url",
                           f"{url}/health", "--engine-unhealthy-after", str(UNHEALTHY),
                           "--stop-timeout", str(STOP), "--backoff-initial", "0", *args,
                           engine=engine, tp=tp)

    def generate(self) -> list[int]:
        """POST /generate to the engine serving now."""
        body = json.dumps({"tokens": PROMPT, "max_new_tokens": 6}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["tokens"]

    def tree(self, snap: dict[str, Any], role: str = "engine") -> list[int]:
        """The engine's (or standby's) keeper and every process under it."""
        keeper = snap[role]["pid"]
        return [keeper, *descendants(keeper)]

    def command(self, snap: dict[str, Any], role: str = "engine") -> int:
        """The engine command's own process (the keeper's child)."""
        return eventually(lambda: psutil.Process(snap[role]["pid"]).children(), 30,
                          what="the engine under its keeper")[0].pid

    def hung(self, fault: Callable[[], None], hangs: int = 1) -> tuple[float, dict[str, Any]]:
        """Inject `fault`; seconds until the launcher called the engine hung, and its status."""
        start = time.monotonic()
        fault()
        snap = self.la.wait_for(lambda s: s["engine"]["hangs"] >= hangs, timeout=60)
        return time.monotonic() - start, snap

    def verify(self) -> None:
        """`vlaunch verify`: every byte each rank serves matches the files."""
        r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "verify",
                            "--socket-dir", str(self.la.sockdir)], capture_output=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()

    def stop(self) -> None:
        """SIGTERM the launcher: a clean stop (0)."""
        self.la.proc.send_signal(signal.SIGTERM)
        assert self.la.wait_exit(60) == 0, self.la.text()


@pytest.fixture
def hang(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    started: list[Hang] = []

    def start(*args: str, tp: int = 1) -> Hang:
        sub = tmp_path / f"h{len(started)}"
        sub.mkdir()
        monkeypatch.setenv(FAULT_ENV, str(sub / "fault"))  # inherited by every engine
        h = Hang(sub, tiny, *args, tp=tp)
        started.append(h)
        return h

    yield start
    for h in started:
        h.la.close()


def assert_reaped(pids: list[int]) -> None:
    """No process of `pids` exists any more: not running, not a zombie nobody reaped."""
    def reaped() -> bool:
        return not any(psutil.pid_exists(p) for p in pids)
    eventually(reaped, 30, what=lambda: f"processes {[p for p in pids if psutil.pid_exists(p)]}"
                                        " to be gone and reaped")


def served_again(h: Hang, snap: dict[str, Any], before: list[int], tree: list[int],
                 ranks: dict[str, int]) -> dict[str, Any]:
    """The checks every case ends with: the old tree gone, the caches untouched and
    bit-exact, the next engine serving the same tokens."""
    after = h.la.wait_for(lambda s: serving(s) and s["engine"]["pid"] not in tree, timeout=90)
    assert_reaped(tree)
    assert {r: v["pid"] for r, v in after["ranks"].items()} == ranks  # caches untouched
    h.verify()
    assert h.generate() == before
    return after


def rank_pids(snap: dict[str, Any]) -> dict[str, int]:
    return {r: v["pid"] for r, v in snap["ranks"].items()}


LIVENESS = ("--engine-liveness-request", "POST http://127.0.0.1:{port}/generate "
            '{"tokens": [1], "max_new_tokens": 1}', "--engine-liveness-deadline", "1",
            "--engine-liveness-interval", "0.5")


def test_a_stopped_engine_then_one_whose_generation_blocks(hang: Any) -> None:
    """SIGSTOP: /health times out and the watchdog pings stop; a stopped process cannot
    handle SIGTERM, so it ends with SIGKILL after --stop-timeout. Then, in the next engine,
    the main thread stops before a request (the fault hook): /health keeps answering 200,
    the liveness request (a one-token /generate) and the watchdog fail."""
    h = hang("--engine-watchdog", str(WATCHDOG), *LIVENESS)
    snap = h.la.wait_for(serving)
    before, tree, ranks = h.generate(), h.tree(snap), rank_pids(snap)
    took, _ = h.hung(lambda: os.kill(h.command(snap), signal.SIGSTOP))
    assert UNHEALTHY <= took <= WATCHDOG + UNHEALTHY + SLACK
    snap = served_again(h, snap, before, tree, ranks)
    text = h.la.text()
    assert f"ignored SIGTERM for {STOP:g} s: killing it" in text
    assert "hung: health check fails (timed out after 2 s)" in text or \
        "hung: liveness request fails" in text or "hung: watchdog fails" in text
    assert snap["engine"]["attempt"] == 2 and snap["engine"]["hangs"] == 1
    metrics = urllib.request.urlopen(h.la.url + "/metrics", timeout=5).read().decode()
    assert "vlaunch_engine_hangs 1.0" in metrics

    tree = h.tree(snap)
    took, _ = h.hung(lambda: h.fault.write_text("generate-stall"), hangs=2)
    assert UNHEALTHY <= took <= 0.5 + 1 + UNHEALTHY + SLACK
    served_again(h, snap, before, tree, ranks)
    second = h.la.text()[len(text):]
    hung = next(line for line in second.splitlines() if " hung: " in line)
    assert "health check" not in hung  # it never stopped answering
    assert "liveness request fails (timed out after 1 s)" in hung or "watchdog fails" in hung
    h.stop()
