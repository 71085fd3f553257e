"""--standby with the real launcher and the reference engine at TP 2: kill, promote, serve."""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from vlaunch.cache.contract.standby import PROMOTE, StandbyError, wait_for_promotion
from vlaunch.cache.reference.refmodel import make_checkpoint

from .conftest import eventually
from .test_launcher import engine, launch, serving  # noqa: F401  (launch is a fixture)

PROMPT = [1, 5, 9, 2]


def generate(port_file: Path) -> list[int]:
    """POST /generate to the engine whose port the port file names."""
    url = f"http://127.0.0.1:{port_file.read_text().strip()}/generate"
    body = json.dumps({"tokens": PROMPT, "max_new_tokens": 6}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["tokens"]


def standby_of(snap: dict[str, Any]) -> dict[str, Any]:
    """The standby's status record."""
    return snap["standby"]


def test_wait_for_promotion_reads_promote_and_refuses_eof() -> None:
    r, w = os.pipe()
    os.write(w, PROMOTE)
    os.close(w)
    wait_for_promotion(r)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(StandbyError, match="without promoting"):
        wait_for_promotion(r)


def test_kill_the_engine_promotes_the_standby_at_tp2(launch, tmp_path: Path) -> None:  # noqa: F811
    model = make_checkpoint(tmp_path / "tiny", hidden=64, layers=2, heads=4, kv_heads=2,
                            intermediate=128, vocab=256)
    port_file = tmp_path / "port"
    engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port-file",
              str(port_file)]
    la = launch(model, "--standby", "--engine-ready", "notify", "--backoff-initial", "5",
                engine=engine, tp=2)
    la.wait_for(serving)
    before = generate(port_file)
    snap = la.wait_for(lambda s: standby_of(s)["state"] == "parked")
    first, standby_pid = snap["engine"]["pid"], standby_of(snap)["pid"]
    assert not la.text().count("Traceback")
    # /status samples what each child holds: the parked standby too (its keeper and its two
    # ranks), and on the CPU no device figure at all (null, not 0)
    mem = la.wait_for(lambda s: ((s["memory"] or {}).get("standby") or {}).get("pid")
                      == standby_pid)["memory"]
    assert len(mem["standby"]["pids"]) == 3 and len(mem["engine"]["pids"]) == 3
    for entry in (*mem["ranks"].values(), mem["engine"], mem["standby"]):
        assert 0 < entry["uss"] <= entry["pss"] <= entry["rss"]
        assert entry["device_bytes"] is None
    assert sorted(mem["ranks"]) == ["0", "1"] and mem["device_absent"]
    # a parked standby holds no port: the port file is still the serving engine's
    port_file.unlink()
    os.killpg(first, signal.SIGKILL)
    snap = la.wait_for(lambda s: serving(s) and s["engine"]["pid"] == standby_pid, timeout=60)
    assert snap["engine"]["attempt"] == 2 and snap["engine"]["restarts"] == 1
    assert standby_of(snap)["promotions"] == 1
    eventually(lambda: port_file.exists() or None, 30, what=lambda: la.text())
    assert generate(port_file) == before
    assert "promoting standby engine 1" in la.text()
    # backoff-initial is 5 s: an ordinary restart would not be ready yet; no engine was spawned
    assert "starting the engine (attempt 2)" not in la.text()
    # and a new standby is started and parks
    snap = la.wait_for(lambda s: standby_of(s)["number"] == 2
                       and standby_of(s)["state"] == "parked")
    second = standby_of(snap)["pid"]
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
    for pid in (standby_pid, second):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid


def test_an_engine_that_never_parks_is_given_up_and_restarts_are_ordinary(
        launch, llama_ckpt: Path) -> None:  # noqa: F811
    # the tiny engine knows nothing of the protocol: it says READY=1, never PARKED=1
    la = launch(llama_ckpt, "--standby", "--standby-park-timeout", "1", "--engine-ready",
                "notify", "--backoff-initial", "0", engine=engine(), tp=1)
    snap = la.wait_for(lambda s: serving(s) and standby_of(s)["given_up"]
                       and standby_of(s)["state"] == "none")
    assert "did not park within 1 s" in la.text()
    os.killpg(snap["engine"]["pid"], signal.SIGKILL)
    snap = la.wait_for(lambda s: serving(s) and s["engine"]["attempt"] == 2)
    assert standby_of(snap)["number"] == 1 and standby_of(snap)["promotions"] == 0
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


def test_a_standby_that_dies_is_replaced(launch, llama_ckpt: Path) -> None:  # noqa: F811
    # a stop that began while the new standby starts: on a busy machine (a second suite
    # beside this one) it ran past the harness's 5 s --stop-timeout once (82); the test is
    # about the replacement, so the stop gets a generous timeout
    la = launch(llama_ckpt, "--standby", "--engine-ready", "notify", "--stop-timeout", "60",
                engine=engine(), tp=1)
    snap = la.wait_for(lambda s: serving(s) and standby_of(s)["pid"])
    os.killpg(standby_of(snap)["pid"], signal.SIGKILL)
    snap = la.wait_for(lambda s: standby_of(s)["number"] == 2 and standby_of(s)["pid"])
    assert "replacing it" in la.text() and snap["engine"]["attempt"] == 1
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit(120) == 0
