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
WATCHDOG, UNHEALTHY = 2.0, 2.0  # --engine-watchdog, --engine-unhealthy-after (a starved
# engine on a loaded 2-core machine missed 1 s of pings: a hang nobody injected)
STOP = 3.0  # --stop-timeout: how long a hung engine gets to handle its SIGTERM
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
        """End the run with SIGQUIT (131: everything SIGKILLed at once; a graceful stop of the
        reference engine takes seconds here, and is tested elsewhere); nothing is left."""
        everything = descendants(self.la.proc.pid)
        self.la.proc.send_signal(signal.SIGQUIT)
        assert self.la.wait_exit(60) == 131, self.la.text()
        assert_reaped(everything)
        assert not self.la.sockdir.exists() or not list(self.la.sockdir.iterdir())


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
            '{"tokens": [1], "max_new_tokens": 1}', "--engine-liveness-deadline", "2",
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
    assert f"hung, stopping it (SIGTERM, SIGKILL after {STOP:g} s): " in text
    assert snap["engine"]["attempt"] == 2 and snap["engine"]["hangs"] == 1
    metrics = urllib.request.urlopen(h.la.url + "/metrics", timeout=5).read().decode()
    assert "vlaunch_engine_hangs 1.0" in metrics

    tree = h.tree(snap)
    took, _ = h.hung(lambda: h.fault.write_text("generate-stall"), hangs=2)
    assert UNHEALTHY <= took <= 0.5 + 2 + UNHEALTHY + SLACK
    served_again(h, snap, before, tree, ranks)
    second = h.la.text()[len(text):]
    hung = next(line for line in second.splitlines() if " hung, stopping it " in line)
    assert "health check" not in hung  # it never stopped answering
    assert "liveness request fails (timed out after 2 s)" in hung or "watchdog fails" in hung
    h.stop()


@pytest.mark.slow
def test_a_tp_worker_stuck_in_a_collective_while_its_peer_waits(hang: Any) -> None:
    """TP 2: worker 1 waits in a receive rank 0 never sends, rank 0 waits for it in the
    request's all-reduce. /health answers; the watchdog (rank 0's loop is stuck) and the
    liveness request catch it; both ranks of the engine are killed, worker included."""
    h = hang("--engine-watchdog", str(WATCHDOG), *LIVENESS, tp=2)
    snap = h.la.wait_for(serving)
    before, tree, ranks = h.generate(), h.tree(snap), rank_pids(snap)
    assert len(tree) == 3  # the keeper, rank 0 and its worker
    took, _ = h.hung(lambda: h.fault.write_text("worker-stall 1"))
    assert UNHEALTHY <= took <= WATCHDOG + UNHEALTHY + SLACK
    served_again(h, snap, before, tree, ranks)
    text = h.la.text()
    assert "rank 1: test fault worker-stall" in text
    hung = next(line for line in text.splitlines() if " hung, stopping it " in line)
    assert "health check" not in hung
    h.stop()


@pytest.mark.slow
def test_a_standby_that_hangs_while_parked_is_replaced(hang: Any) -> None:
    """The parked standby pings WATCHDOG=1 while it waits for its promotion; SIGSTOPped, it
    stops: killed and replaced, the engine untouched; the replacement is promoted later."""
    h = hang("--engine-watchdog", str(WATCHDOG), "--standby")
    snap = h.la.wait_for(lambda s: serving(s) and s["standby"]["state"] == "parked")
    before, ranks, engine = h.generate(), rank_pids(snap), snap["engine"]["pid"]
    standby = h.tree(snap, "standby")
    start = time.monotonic()
    os.killpg(standby[0], signal.SIGSTOP)  # the keeper and the standby (and its workers)
    snap = h.la.wait_for(lambda s: s["standby"]["hangs"] == 1, timeout=60)
    assert UNHEALTHY <= time.monotonic() - start <= WATCHDOG + UNHEALTHY + SLACK
    assert_reaped(standby)
    snap = h.la.wait_for(lambda s: s["standby"]["number"] == 2
                         and s["standby"]["state"] == "parked")
    assert snap["engine"]["pid"] == engine and snap["engine"]["hangs"] == 0
    assert "standby engine 1" in h.la.text() and "hung while parked" in h.la.text()
    promoted, tree = snap["standby"]["pid"], h.tree(snap)
    os.killpg(engine, signal.SIGKILL)
    snap = h.la.wait_for(lambda s: serving(s) and s["engine"]["pid"] == promoted, timeout=60)
    assert_reaped(tree)
    assert rank_pids(snap) == ranks
    h.verify()
    assert h.generate() == before
    h.stop()


@pytest.mark.slow
def test_a_hang_during_a_rank_respawn(hang: Any) -> None:
    """--on-rank-exit respawn: the engine hangs, then rank 0 is killed and its respawn held
    (SIGSTOP) while the hung engine is stopped. The next engine waits for the rank, then maps
    the escrowed slabs: nothing read from disk, every byte verified."""
    h = hang("--engine-watchdog", str(WATCHDOG), "--on-rank-exit", "respawn")
    snap = h.la.wait_for(serving)
    before, tree = h.generate(), h.tree(snap)
    os.kill(h.command(snap), signal.SIGSTOP)
    h.la.wait_for(lambda s: s["engine"]["hangs"] == 1, timeout=60)  # SIGKILL in STOP s
    old = snap["ranks"]["0"]["pid"]
    known = set(descendants(h.la.proc.pid))
    os.kill(old, signal.SIGKILL)
    new = eventually(lambda: [p for p in descendants(h.la.proc.pid) if p not in known
                              and "vlaunch.cache" in psutil.Process(p).cmdline()], 30,
                     interval=0.005, what="the respawned rank")[0]
    os.kill(new, signal.SIGSTOP)  # the respawn is held until the hung engine is gone
    snap = h.la.wait_for(lambda s: s["engine"]["state"] == "backoff", timeout=60)
    assert snap["ranks"]["0"]["state"] == "respawning" and snap["engine"]["attempt"] == 1
    assert_reaped(tree)
    os.kill(new, signal.SIGCONT)
    snap = h.la.wait_for(lambda s: serving(s) and s["ranks"]["0"]["state"] == "ready"
                         and s["engine"]["attempt"] == 2, timeout=90)
    assert snap["ranks"]["0"]["pid"] == new
    text = h.la.text()
    assert text.index("ready again, from the escrowed slabs") < \
        text.index("starting the engine (attempt 2)")
    h.verify()
    assert h.generate() == before
    assert "weights from cache" in text[text.index("starting the engine (attempt 2)"):]
    h.stop()


@pytest.mark.slow
def test_a_hung_engine_killed_at_once_hands_over_to_the_parked_standby(hang: Any) -> None:
    """--engine-hang-kill-after 0 with --standby: the SIGSTOPped engine gets no SIGTERM and no
    --stop-timeout of grace; its process tree is SIGKILLed with the hang and the parked standby
    serves the same tokens as soon as it is gone."""
    h = hang("--engine-watchdog", str(WATCHDOG), "--standby", "--engine-hang-kill-after", "0")
    snap = h.la.wait_for(lambda s: serving(s) and s["standby"]["state"] == "parked")
    before, tree, ranks = h.generate(), h.tree(snap), rank_pids(snap)
    promoted = snap["standby"]["pid"]
    took, _ = h.hung(lambda: os.kill(h.command(snap), signal.SIGSTOP))
    assert UNHEALTHY <= took <= WATCHDOG + UNHEALTHY + SLACK
    snap = h.la.wait_for(lambda s: serving(s) and s["engine"]["pid"] == promoted, timeout=60)
    assert_reaped(tree)
    assert rank_pids(snap) == ranks
    assert h.generate() == before
    text = h.la.text()
    assert "hung, killing it (SIGKILL at once, --engine-hang-kill-after 0): " in text
    assert "ignored SIGTERM" not in text
    h.verify()
    h.stop()
