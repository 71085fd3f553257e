"""The Docker recipes of docs/docker.md, run as written, on the image of docs/examples/Dockerfile
(marker `containers`: see conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.containers.dockerlib import (
    EXAMPLES,
    START_S,
    Events,
    cleanup,
    docker,
    engine_healthy,
    exec_json,
    generate,
    host_port,
    kill_in,
    launcher_status,
    logs,
    restarts,
    run_script,
    state,
    unique,
)
from vlaunch.cache.contract import peers
from vlaunch.cache.contract.exitcodes import ExitStatus

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

SOCKETS = "/run/vlaunch"  # the two-container layout's socket directory (docs/docker.md)


def _serving(container: str, socket_dir: str = "") -> dict | None:
    snap = launcher_status(container, socket_dir)
    return snap if snap and snap["phase"] == "serving" and snap["engine_ready"] else None


def _wait(check, what: str, container: str, timeout: float = START_S):  # type: ignore[no-untyped-def]
    """eventually(check), and the container's log in the failure."""
    try:
        return eventually(check, timeout, what=what, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- docker logs {container}:\n{logs(container)[-6000:]}"
                             ) from None


# ------------------------------------------------------------------------- one container


@pytest.fixture
def one_container(recipe_env: dict[str, str]) -> Iterator[str]:
    """docs/examples/one-container.sh started; yields the container's name."""
    name = recipe_env["VLAUNCH_NAME"]
    with cleanup(containers=[name], volumes=[]):
        run_script("one-container.sh", env=recipe_env)
        yield name


def test_one_container_restarts_the_engine_against_the_caches_and_stops_with_0(
        one_container: str) -> None:
    name = one_container
    first = _wait(lambda: _serving(name), "the engine serving", name)
    _doctor_in(name)
    address = host_port(name, 8000)
    tokens = generate(address)
    ranks = {r: (info["pid"], info["loaded_bytes"]) for r, info in first["ranks"].items()}
    old = {lease["pid"] for info in first["ranks"].values() for lease in info["leases"]}
    kill_in(name, first["engine"]["pid"])

    def restarted() -> dict | None:  # the launcher refreshes each rank's leases every few s
        snap = _serving(name)
        if not snap or snap["engine"]["restarts"] != 1:
            return None
        leases = [lease for info in snap["ranks"].values() for lease in info["leases"]]
        return snap if leases and not {lease["pid"] for lease in leases} & old else None

    snap = _wait(restarted, "the restarted engine serving, leased", name)
    # the launcher's report: the same ranks, never reloaded, each leased to the new engine's
    # processes for every byte it holds (weights from the caches, not the disk)
    assert {r: (i["pid"], i["loaded_bytes"]) for r, i in snap["ranks"].items()} == ranks
    for info in snap["ranks"].values():
        assert info["respawns"] == 0 and info["state"] == "ready"
        [lease] = info["leases"]
        assert lease["pid"] not in old and lease["mode"] == "share"
        assert lease["bytes"] == info["bytes"] > 0
    assert snap["engine"]["last_exit"] == -9 and snap["engine"]["pid"] != first["engine"]["pid"]
    assert generate(address) == tokens
    assert "(source: cache)" in logs(name).rsplit("engine started (pid", 1)[1]
    docker("stop", name, timeout=120)  # the script's --stop-timeout, then SIGKILL
    final = state(name)
    assert final["ExitCode"] == 0 and restarts(name) == 0, final
    assert "exiting with status 0 (OK)" in logs(name)


def _doctor_in(name: str) -> None:
    """`vlaunch doctor` inside the recipe's container, beside the launcher it checks: no
    blocker for the recipe's own model and TP (the checks this image and host chose are
    printed; 4 KiB slab pages or no cgroup v2 are warnings, not failures)."""
    r = subprocess.run(["docker", "exec", name, "vlaunch", "doctor", "--json", "--model",
                        "/models/llama", "--tensor-parallel-size", "2"],
                       capture_output=True, text=True, timeout=120)
    report = json.loads(r.stdout)
    print("doctor in the container:", [(c["check"], c["severity"]) for c in report["checks"]])
    assert r.returncode == report["status"] == 0 and report["blockers"] == 0, r.stdout
    checks = {c["check"]: c for c in report["checks"]}
    assert {"slab_pages", "memfd_seals", "nofile", "socket_dir", "memory"} <= set(checks)
    assert checks["memfd_seals"]["severity"] == "ok"  # the product's CPU slabs need them


def test_one_container_exits_with_the_launchers_status_when_a_rank_dies(
        one_container: str) -> None:
    name = one_container
    snap = _wait(lambda: _serving(name), "the engine serving", name)
    watch = Events(name)
    try:
        kill_in(name, snap["ranks"]["1"]["pid"])
        died = _wait(lambda: watch.of(name, "die"), "the container's exit", name, 120)
    finally:
        watch.close()
    assert int(died[0]["exitCode"]) == ExitStatus.RANK_EXITED, died
    assert f"exiting with status {int(ExitStatus.RANK_EXITED)} (RANK_EXITED)" in logs(name)
    # --restart on-failure:5 starts it again: caches and engine anew
    _wait(lambda: restarts(name) >= 1, "Docker's restart", name, 60)


# ------------------------------------------------------------------------ two containers


@pytest.fixture
def two_containers(recipe_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The two-container recipe's environment; its containers and volume removed after."""
    name = recipe_env["VLAUNCH_NAME"]
    with cleanup(containers=[f"{name}-engine", f"{name}-cache", f"{name}-probe"],
                 volumes=[f"{name}-sockets"]):
        yield recipe_env


def _cache_status(name: str) -> dict:
    snap = launcher_status(f"{name}-cache", SOCKETS)
    assert snap is not None
    return snap


RANK_STATUS = ("import json, sys\n"
               "from pathlib import Path\n"
               "from vlaunch.launcher.statusview import query_rank\n"
               "print(json.dumps(query_rank(Path(sys.argv[1]))))\n")


def _rank_status(name: str, rank: int = 0) -> dict:
    """A cache rank's own status, asked on its socket inside the cache container (the
    launcher's view of it is refreshed only every few seconds)."""
    return exec_json(f"{name}-cache", "python3", "-c", RANK_STATUS,
                     f"{SOCKETS}/rank-{rank}.sock")


def test_two_containers_replace_the_engine_and_outlive_the_cache(
        two_containers: dict[str, str]) -> None:
    env = two_containers
    name = env["VLAUNCH_NAME"]
    run_script("two-containers.sh", "up", env=env)  # returns once the caches serve
    engine = f"{name}-engine"
    for container in (engine, f"{name}-cache"):  # no host namespaces
        modes = docker("inspect", "--format", "{{.HostConfig.PidMode}} {{.HostConfig.IpcMode}}",
                       container)
        assert "host" not in modes, modes
    address = host_port(engine, 8000)
    _wait(lambda: engine_healthy(address), "the engine serving", engine)
    tokens = generate(address)
    first = _cache_status(name)
    ranks = {r: (i["pid"], i["loaded_bytes"]) for r, i in first["ranks"].items()}
    for rank in (0, 1):  # across PID namespaces the engine is pid 0
        info = _rank_status(name, rank)
        [lease] = info["leases"]
        assert lease["pid"] == peers.UNKNOWN_PID and lease["client"].startswith("pid ")
        assert lease["bytes"] == sum(info["bytes_held"].values()) > 0
    cache_log = logs(f"{name}-cache")
    assert cache_log.count("adopted from a process in another PID namespace") == 2, cache_log

    run_script("two-containers.sh", "engine", env=env)  # a new engine container
    address = host_port(engine, 8000)
    _wait(lambda: engine_healthy(address), "the replaced engine serving", engine)
    assert generate(address) == tokens
    text = logs(engine)
    assert text.count("engine layout mapped from the cache") == 2, text
    assert "(source: cache)" in text
    again = _cache_status(name)
    assert {r: (i["pid"], i["loaded_bytes"]) for r, i in again["ranks"].items()} == ranks

    docker("kill", f"{name}-cache")
    _wait(lambda: logs(engine).count("went away") == 2, "the engine's warnings", engine, 60)
    assert "the engine keeps serving" in logs(engine)
    assert generate(address) == tokens and state(engine)["Status"] == "running"


KEEPER = ("import sys, time\n"
          "from vlaunch.cache import load\n"
          "w = load('/models/llama', rank=0, tensor_parallel_size=2, fallback=False)\n"
          "w.client.close()\n"  # the lease ends; the tensors, and their mappings, stay
          "print('mapped', flush=True)\n"
          "time.sleep(3600)\n")
COPY_RELEASE = ("from pathlib import Path\n"
                "from vlaunch.cache import load\n"
                "w = load('/models/llama', rank=0, tensor_parallel_size=2, mode='copy-release',"
                " fallback=False)\n"
                "address = next(iter(w.values())).data_ptr()\n"
                "for line in Path('/proc/self/maps').read_text().splitlines():\n"
                "    lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
                "    if lo <= address < hi:\n"  # the rank's slab, or memory of its own
                "        print('handed over' if line.split()[4] != '0' else 'copy')\n")


def _engine_container(env: dict[str, str], name: str, code: str, *args: str) -> list[str]:
    """docker run argv of a one-off engine container as two-containers.sh starts its own."""
    return ["run", *args, "--name", name, "--user", "1000:1000",
            "-e", f"VLAUNCH_SOCKET_DIR={SOCKETS}",
            "-v", f"{env['VLAUNCH_NAME']}-sockets:{SOCKETS}",
            "-v", f"{env['VLAUNCH_MODELS']}:/models:ro", env["VLAUNCH_IMAGE"],
            "python3", "-c", code]


def test_copy_release_across_containers_waits_for_the_other_engine_to_exit(
        two_containers: dict[str, str]) -> None:
    """An engine container that ended its lease but keeps its tensors: the cache container
    cannot see its pid (0), follows it by its socket's pidfd, and hands the slabs over only
    once that container is gone. On a kernel without SO_PEERPIDFD: a copy, always."""
    env = two_containers
    name = env["VLAUNCH_NAME"]
    run_script("two-containers.sh", "caches", env=env)
    keeper = f"{name}-engine"
    docker(*_engine_container(env, keeper, KEEPER, "-d"))
    _wait(lambda: "mapped" in logs(keeper), "the keeper's mapping", keeper, 120)
    _wait(lambda: not _rank_status(name)["leases"], "its lease gone", keeper)
    blocked = _rank_status(name)["handover_blocked"]
    if peers.peer_pidfds():
        assert blocked.endswith("which opened them before and still runs (its lease "
                                  "ended; its tensors may not have)"), blocked
    else:
        assert "another PID namespace" in blocked and "SO_PEERPIDFD" in blocked, blocked
    docker("rm", "-f", keeper)
    if peers.peer_pidfds():
        _wait(lambda: _rank_status(name)["handover_blocked"] == "",
              "the cache seeing the keeper gone", f"{name}-cache", 60)
    got = docker(*_engine_container(env, f"{name}-probe", COPY_RELEASE, "--rm"))
    assert got.split() == (["handed", "over"] if peers.peer_pidfds() else ["copy"]), got
    text = logs(f"{name}-cache")
    assert ("handing the slabs over" in text) == peers.peer_pidfds(), text


# ------------------------------------------------------------------------------ Compose


def test_compose_starts_the_engine_once_the_cache_is_healthy(image: str, models: Path) -> None:
    project = unique("compose")
    env = {**os.environ, "VLAUNCH_IMAGE": image, "VLAUNCH_MODELS": str(models),
           "VLAUNCH_PORT": "127.0.0.1:"}
    compose = ["docker-compose", "-p", project, "-f", str(EXAMPLES / "compose.yaml")]
    cache, engine = f"{project}_cache_1", f"{project}_engine_1"
    # the GPU host's variant: this docker-compose takes the override (GPUs: docs/docker.md)
    merged = subprocess.run([*compose, "-f", str(EXAMPLES / "compose.gpus.yaml"), "config"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0 and "driver: nvidia" in merged.stdout, merged.stderr
    watch = Events(cache, engine)
    try:
        started = time.time()
        up = subprocess.run([*compose, "up", "-d"], env=env, capture_output=True, text=True,
                            timeout=START_S)
        assert up.returncode == 0, up.stdout + up.stderr
        healthy = watch.of(cache, "health_status: healthy")
        engine_start = watch.of(engine, "start")
        assert healthy and engine_start, watch.seen
        # the engine started only after the cache's first passing health check
        assert engine_start[0]["time"] > healthy[0]["time"]
        assert state(cache)["Health"]["Status"] == "healthy"
        address = host_port(engine, 8000)
        _wait(lambda: engine_healthy(address), "the engine serving", engine)
        generate(address)
        text = logs(engine)
        assert "(source: cache)" in text, text
        assert time.time() - started < START_S
    finally:
        watch.close()
        subprocess.run([*compose, "down", "-v", "--timeout", "60"], env=env,
                       capture_output=True, timeout=180)
