"""docs/examples/k8s.yaml's pod, run by tests/kubepod.py on Docker (marker `containers`): its
container with its command, args, env, user and volumes, in a pod sandbox's network
namespace, probed the kubelet's way, deleted the kubelet's way."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.containers.dockerlib import EXAMPLES, START_S, docker, http, kill_in, logs, unique
from tests.containers.kubepod import Kubelet, Pod

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

PLACEHOLDER = "registry.example.com/llama-vlaunch:1.0"  # the manifest's image


def test_the_k8s_pod_starts_probes_restarts_its_engine_and_stops_in_its_grace_period(
        image: str, models: Path) -> None:
    pod = Pod(EXAMPLES / "k8s.yaml", images={PLACEHOLDER: image},
              claims={"llama-weights": models}, prefix=unique("pod"))
    [server] = pod.containers
    try:
        pod.start()
        kubelet = Kubelet(pod, server).start()
        try:
            _serve_and_restart(pod, server.docker_name, kubelet)
        finally:
            kubelet.stop()
        assert not kubelet.restarts, kubelet.restarts  # nothing the kubelet would restart
        assert not kubelet.failed("liveness"), kubelet.results
        stopped = pod.delete()
        code, took = stopped["server"]
        assert code == 0 and took < pod.grace, (stopped, logs(server.docker_name)[-3000:])
        assert "exiting with status 0 (OK)" in logs(server.docker_name)
    finally:
        pod.remove()


def _serve_and_restart(pod: Pod, name: str, kubelet: Kubelet) -> None:
    try:
        eventually(lambda: kubelet.ready, START_S + 30, what="the pod Ready", interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {kubelet.results}\n{logs(name)[-4000:]}") from None
    assert kubelet.started
    ip = pod.ip
    status, snap = http(f"http://{ip}:8081/status")
    assert status == 200 and snap and snap["phase"] == "serving", snap
    assert docker("exec", name, "stat", "-c", "%a %U", "/run/vlaunch/sockets").split() == \
        ["700", "app"]  # the launcher's own 0700 directory inside the emptyDir
    ranks = {r: info["pid"] for r, info in snap["ranks"].items()}
    readiness = pod.containers[0].probes["readiness"]
    kill_in(name, snap["engine"]["pid"])
    # the readiness endpoint, asked as the probe asks it, fails while the engine restarts...
    eventually(lambda: not readiness.passes(ip), 60, what="readiness failing", interval=0.1)
    failed_at = time.monotonic()
    # ...and passes again once the new engine serves, with the caches kept
    eventually(lambda: readiness.passes(ip), START_S, what="readiness back", interval=0.2)
    status, snap = http(f"http://{ip}:8081/status")
    assert snap and snap["engine"]["restarts"] == 1 and snap["engine"]["last_exit"] == -9
    assert {r: info["pid"] for r, info in snap["ranks"].items()} == ranks
    eventually(lambda: kubelet.ready, 60, what="the pod Ready again", interval=0.5)
    assert all(ok for t, kind, ok in kubelet.results if kind == "liveness" and t >= failed_at)
