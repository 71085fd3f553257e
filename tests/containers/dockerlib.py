"""The Docker CLI for the container suite (marker `containers`): what the tests run, inspect
and clean up. Every name a test creates carries its prefix, so that teardown removes exactly
what the test made, and nothing of anyone else on the same daemon."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.client import HTTPException
from itertools import count
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
IMAGE_ENV = "VLAUNCH_TEST_IMAGE"
START_S = 300.0
"""How long a container's engine may take to serve: torch's import on a loaded 2-core machine
took up to 40 s here, and several engines start at once."""

_names = count()


def docker(*args: str, timeout: float = 180, check: bool = True,
           env: Mapping[str, str] | None = None) -> str:
    """Run `docker ARGS` and return its stdout; a failure raises with its stderr."""
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "DOCKER_BUILDKIT": "0", **(env or {})})
    if check and r.returncode:
        raise AssertionError(f"docker {' '.join(args)[:300]} exited {r.returncode}: "
                             f"{r.stderr.strip()[-2000:]}")
    return r.stdout


def run_script(script: str, *args: str, env: Mapping[str, str],
               timeout: float = START_S) -> str:
    """Run one of docs/examples' scripts as the docs say, with `env` (its variables)."""
    r = subprocess.run(["bash", str(EXAMPLES / script), *args], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **env})
    if r.returncode:
        raise AssertionError(f"{script} {' '.join(args)} exited {r.returncode}:\n"
                             f"{r.stdout}\n{r.stderr}")
    return r.stdout


def unique(what: str) -> str:
    """A name for something this test run creates (containers, volumes, projects)."""
    return f"vlaunch-ct-{os.getpid()}-{next(_names)}-{what}"


def state(container: str) -> dict[str, Any]:
    """The container's `State` (Status, ExitCode, StartedAt, Health...)."""
    return json.loads(docker("inspect", "--format", "{{json .State}}", container))


def restarts(container: str) -> int:
    """How often Docker's restart policy restarted the container."""
    return int(docker("inspect", "--format", "{{.RestartCount}}", container))


def logs(container: str) -> str:
    """Everything the container wrote (stdout and stderr)."""
    r = subprocess.run(["docker", "logs", container], capture_output=True, text=True,
                       timeout=60)
    return r.stdout + r.stderr


def exec_json(container: str, *argv: str) -> dict[str, Any]:
    """Run argv in the container and parse its stdout as JSON."""
    return json.loads(docker("exec", container, *argv, timeout=60))


def launcher_status(container: str, socket_dir: str = "") -> dict[str, Any] | None:
    """`vlaunch status --json` inside the container; None while it has no launcher to ask."""
    argv = ["vlaunch", "status", "--json"] + (["--socket-dir", socket_dir] if socket_dir else [])
    r = subprocess.run(["docker", "exec", container, *argv], capture_output=True, text=True,
                       timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else None


def kill_in(container: str, pid: int, sig: str = "KILL") -> None:
    """Signal a process inside the container (as `docker exec ... kill` does)."""
    docker("exec", container, "sh", "-c", f"kill -{sig} {int(pid)}")


def host_port(container: str, port: int) -> str:
    """host:port where the container's `port` is published."""
    return docker("port", container, str(port)).split()[0]


def ip_of(container: str) -> str:
    """The container's address on Docker's default bridge."""
    return docker("inspect", "--format", "{{.NetworkSettings.IPAddress}}", container).strip()


def http(url: str, body: dict[str, Any] | None = None,
         timeout: float = 5.0) -> tuple[int, dict[str, Any] | None]:
    """(status, JSON body) of a GET, or a POST of `body`; status 0 when nothing answers.

    Any transport error counts as no answer, as a kubelet's or Docker's probe counts it: a
    refused or reset connection, a timeout, a truncated body (http.client.IncompleteRead is an
    HTTPException, not an OSError) or a malformed status line from an engine that was killed
    mid-response."""
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data),
                                    timeout=timeout) as r:
            return r.status, _json(r.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, _json(exc.read())
        except (OSError, HTTPException):
            return exc.code, None
    except (OSError, ValueError, HTTPException):
        return 0, None


def _json(raw: bytes) -> dict[str, Any] | None:
    try:
        return json.loads(raw)
    except ValueError:
        return None


class Events:
    """Docker's events of some containers, streamed from the moment this starts (the daemon
    keeps only its last 256 events; a busy neighbour on the same daemon pushes ours out)."""

    def __init__(self, *containers: str) -> None:
        filters = [arg for name in containers for arg in ("--filter", f"container={name}")]
        self.proc = subprocess.Popen(["docker", "events", *filters, "--format", "{{json .}}"],
                                     stdout=subprocess.PIPE, text=True)
        self.seen: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            ev = json.loads(line)
            attributes = ev.get("Actor", {}).get("Attributes", {})
            with self._lock:
                self.seen.append({"time": int(ev["timeNano"]), "action": ev.get("Action", ""),
                                  **attributes})

    def of(self, name: str, action: str) -> list[dict[str, Any]]:
        """The events so far of container `name` whose action starts with `action` (die,
        start, health_status: healthy), oldest first, each with its time (ns) and its
        attributes (a die's exitCode)."""
        with self._lock:
            return [e for e in self.seen if e.get("name") == name
                    and e["action"].startswith(action)]

    def close(self) -> None:
        """Stop streaming."""
        self.proc.terminate()
        self.proc.wait(30)


def generate(address: str) -> list[int]:
    """The reference engine's greedy tokens for a fixed prompt."""
    status, body = http(f"http://{address}/generate",
                        {"tokens": [1, 2, 3, 4], "max_new_tokens": 4}, timeout=60)
    assert status == 200 and body, (status, body)
    return body["tokens"]


def engine_healthy(address: str) -> bool:
    """Whether the reference engine at address answers /health with 200."""
    return http(f"http://{address}/health")[0] == 200


@contextmanager
def cleanup(*, containers: list[str], volumes: list[str]) -> Iterator[None]:
    """Remove these containers and volumes (what exists of them) when the block ends."""
    try:
        yield
    finally:
        if containers:
            docker("rm", "-f", *containers, check=False)
        if volumes:
            docker("volume", "rm", "-f", *volumes, check=False)
