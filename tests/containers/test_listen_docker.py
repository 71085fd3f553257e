"""docs/examples/one-container.sh holds the engine's port in the launcher (`--listen`): the
published port stays bound across an engine's death and restart (marker `containers`)."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import eventually
from tests.containers.dockerlib import (
    cleanup,
    host_port,
    http,
    kill_in,
    launcher_status,
    logs,
    run_script,
)

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]


def test_the_published_port_answers_across_an_engine_kill_and_restart(
        recipe_env: dict[str, str]) -> None:
    """Four clients send one-token requests to the published port while the engine is
    SIGKILLed and restarted (an ordinary restart, seconds on CPU): every request but those the
    killed engine held is answered; the others wait in the launcher's backlog."""
    name = recipe_env["VLAUNCH_NAME"]
    with cleanup(containers=[name], volumes=[]):
        run_script("one-container.sh", env=recipe_env)

        def serving() -> dict | None:
            snap = launcher_status(name)
            return snap if snap and snap["phase"] == "serving" and snap["engine_ready"] else None

        snap = eventually(serving, 600, what=lambda: logs(name)[-4000:], interval=0.5)
        assert snap["launcher"]["listen"] == "http=0.0.0.0:8000"
        address = host_port(name, 8000)
        stop, lock = threading.Event(), threading.Lock()
        answered, unanswered = [0], [0]

        def client() -> None:
            while not stop.is_set():
                status, _ = http(f"http://{address}/generate",
                                 {"tokens": [1, 2, 3], "max_new_tokens": 1}, timeout=120)
                with lock:
                    if status == 200:
                        answered[0] += 1
                    else:
                        unanswered[0] += 1

        threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            eventually(lambda: answered[0] >= 20, 120, what="answers before the kill")
            kill_in(name, snap["engine"]["pid"])
            eventually(lambda: (s := serving()) and s["engine"]["restarts"] >= 1, 300,
                       what=lambda: logs(name)[-4000:], interval=0.5)
            before = answered[0]
            eventually(lambda: answered[0] >= before + 20, 120, what="answers after it")
        finally:
            stop.set()
            for t in threads:
                t.join(150)
        assert unanswered[0] <= len(threads), (unanswered[0], logs(name)[-4000:])
        print(f"published port across a kill: {answered[0]} answered, {unanswered[0]} not")
