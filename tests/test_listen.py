"""`vlaunch run --listen`: the launcher holds the engine's socket; every engine change with
concurrent clients and nothing refused (real launcher, ranks, reference engine, sockets and
signals on CPU); a bad --listen is a usage error before any rank starts."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.reference.refmodel import make_checkpoint
from vlaunch.launcher.listen import UNIX_PATH_MAX, ListenAddress, bind, open_listeners

from .conftest import eventually, free_port
from .test_launcher import Launcher, launch, serving  # noqa: F401  (launch is a fixture)
from .test_swap import SHAPE, swap

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 2, 77]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of one architecture (a swap's old and new weights)."""
    root = tmp_path_factory.mktemp("listen")
    return {"a": make_checkpoint(root / "a", seed=0, **SHAPE),
            "b": make_checkpoint(root / "b", seed=1, **SHAPE)}


# ------------------------------------------------------------------ addresses and binding


@pytest.mark.parametrize(("value", "want"), [
    ("127.0.0.1:8000", ListenAddress("http", host="127.0.0.1", port=8000)),
    ("api=[::1]:9", ListenAddress("api", host="::1", port=9)),
    (":80", ListenAddress("http", host="0.0.0.0", port=80)),
    ("unix:/run/x.sock", ListenAddress("http", path="/run/x.sock")),
    ("admin=unix:/run/a=b.sock", ListenAddress("admin", path="/run/a=b.sock")),
])
def test_listen_values_parse(value: str, want: ListenAddress) -> None:
    assert ListenAddress.parse(value) == want


@pytest.mark.parametrize("value", ["8000", "host:", "host:65536", "::1:80",
                                   "[::1]80", "unix:", "bad name=1.2.3.4:5", "a:b=unix:/x",
                                   "unix:/" + "x" * UNIX_PATH_MAX])
def test_bad_listen_values_are_usage_errors(value: str) -> None:
    with pytest.raises(UsageError, match="--listen"):
        ListenAddress.parse(value)


def test_bind_in_use_and_a_stale_unix_socket(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match="already in use"):
            bind(ListenAddress.parse(f"127.0.0.1:{port}"))
    path = tmp_path / "e.sock"
    first = bind(ListenAddress.parse(f"unix:{path}"))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(UsageError, match="already in use"):
        bind(ListenAddress.parse(f"unix:{path}"))
    first.close()  # the file stays, nobody listens: a killed launcher's; bound again
    listeners = open_listeners([f"unix:{path}", "127.0.0.1:0"], env={})
    assert listeners is not None and listeners.names == ["http", "http"]
    listeners.close()
    assert not path.exists()


def test_socket_activation_takes_systemds_fds_and_unsets_the_variables() -> None:
    code = ("import json, os\n"
            "from vlaunch.launcher.listen import open_listeners\n"
            "os.environ['LISTEN_PID'] = str(os.getpid())\n"
            "ls = open_listeners(['127.0.0.1:1'])\n"  # named, not bound: systemd's win
            "print(json.dumps([ls.names, ls.fds(), ls.activated, ls.describe(),\n"
            "       sorted(k for k in os.environ if k.startswith('LISTEN_'))]))\n")
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        shim = ("import os, sys\nos.dup2(int(sys.argv[1]), 3)\n"
                "os.execv(sys.executable, [sys.executable, '-c', sys.argv[2]])\n")
        env = {**os.environ, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "api"}
        r = subprocess.run([sys.executable, "-c", shim, str(lsock.fileno()), code], env=env,
                           pass_fds=(lsock.fileno(),), capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        port = lsock.getsockname()[1]
    assert r.returncode == 0, r.stderr
    names, fds, activated, where, left = json.loads(r.stdout)
    assert (names, fds, activated, left) == (["api"], [3], True, [])
    assert where == f"api=127.0.0.1:{port}"


KEEPER_CHILD = ("import json, os, socket, stat\n"
                "s = socket.socket(fileno=3)\n"
                "print(json.dumps({'pid': os.getpid(), 'env': {k: v for k, v in os.environ.items()"
                " if k.startswith(('LISTEN_', 'VLAUNCH_'))},\n"
                "  'listening': s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN),\n"
                "  'port': s.getsockname()[1], 'promote': os.read(int(os.environ["
                "'VLAUNCH_PROMOTE_FD']), 2).decode(),\n"
                "  'fds': sorted(int(f) for f in os.listdir('/proc/self/fd'))}))\n"
                "s.detach()\n")


def test_the_keeper_puts_the_sockets_at_fd_3_for_the_engines_own_pid() -> None:
    """The launcher passes its socket at a high fd and the standby's promote pipe where the
    socket must go (fd 3): the engine finds the socket at 3, LISTEN_PID its own pid, the pipe
    moved and named in its variable, nothing else left open."""
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        high = os.dup2(lsock.fileno(), 40)
        r, w = os.pipe()
        os.write(w, b"go")
        shim = ("import os, sys\nos.dup2(int(sys.argv[1]), 3)\nos.close(int(sys.argv[1]))\n"
                "os.execv(sys.executable, [sys.executable, '-m', 'vlaunch.launcher.keeper',"
                " '--', sys.executable, '-c', sys.argv[2]])\n")
        env = {**os.environ, "VLAUNCH_LISTEN_PASS": "40", "VLAUNCH_LISTEN_NAMES": "api",
               "VLAUNCH_PROMOTE_FD": "3"}
        try:
            out = subprocess.run([sys.executable, "-c", shim, str(r), KEEPER_CHILD], env=env,
                                 pass_fds=(r, high), capture_output=True, text=True,
                                 timeout=60, cwd=ROOT)
        finally:
            for fd in (r, w, high):
                os.close(fd)
        port = lsock.getsockname()[1]
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    promote = int(got["env"]["VLAUNCH_PROMOTE_FD"])
    assert got["env"] == {"LISTEN_FDS": "1", "LISTEN_PID": str(got["pid"]),
                          "LISTEN_FDNAMES": "api", "VLAUNCH_PROMOTE_FD": str(promote)}
    assert got["listening"] and got["port"] == port and got["promote"] == "go"
    others = set(got["fds"]) - {0, 1, 2, 3, promote}
    assert promote > 3 and len(others) == 1  # the one listdir opened to list them


# -------------------------------------------------------------- a bad --listen, end to end


def _run_bad(tmp_path: Path, model: Path, value: str, *prefix: str) -> tuple[int, str]:
    sockdir = tmp_path / "sock"
    r = subprocess.run([*prefix, sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model",
                        str(model), "--socket-dir", str(sockdir), "--health-port", "-1",
                        "--listen", value, "--", sys.executable, "-c", "pass"],
                       capture_output=True, text=True, timeout=120)
    assert "starting cache ranks" not in r.stderr and not sockdir.exists(), r.stderr
    return r.returncode, r.stderr


def test_a_bad_listen_stops_the_launcher_with_64_before_any_rank(
        tmp_path: Path, ckpts: dict[str, Path]) -> None:
    usage = int(ExitStatus.USAGE)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        code, err = _run_bad(tmp_path, ckpts["a"], f"127.0.0.1:{taken.getsockname()[1]}")
    assert code == usage and "the address is already in use" in err, err
    code, err = _run_bad(tmp_path, ckpts["a"], "unix:/" + "d" * 120)
    assert code == usage and "longer than the 107" in err, err
    code, err = _run_bad(tmp_path, ckpts["a"], "localhost")
    assert code == usage and "is not HOST:PORT" in err, err
    code, err = _run_bad(tmp_path, ckpts["a"], f"unix:{tmp_path}/no/such/dir.sock")
    assert code == usage and "cannot listen" in err, err
    # a port below 1024 without CAP_NET_BIND_SERVICE (root here: setpriv drops it)
    unprivileged = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text().strip()
    drop = ["setpriv", "--inh-caps=-net_bind_service", "--bounding-set=-net_bind_service"] \
        if os.geteuid() == 0 and shutil.which("setpriv") else []
    if (os.geteuid() != 0 or drop) and int(unprivileged) > 1:
        code, err = _run_bad(tmp_path, ckpts["a"], "127.0.0.1:1", *drop)
        assert code == usage and "permission denied" in err, err


# ------------------------------------------------------------ clients across engine changes


class Clients:
    """`n` threads sending one-token /generate requests back to back, each on a new
    connection; counts answers, refused connections and failed requests."""

    def __init__(self, port: int | str, n: int = 4) -> None:
        self.port = port  # a TCP port on 127.0.0.1, or a Unix socket's path
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = self.refused = 0
        self.failed: list[str] = []
        self.gap = 0.0  # the longest wait for one answer
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _run(self) -> None:
        body = json.dumps({"tokens": PROMPT, "max_new_tokens": 1})
        while not self.stop.is_set():
            start = time.monotonic()
            conn = _connection(self.port)
            try:
                conn.request("POST", "/generate", body=body,
                             headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                status = r.status
            except ConnectionRefusedError:
                with self.lock:
                    self.refused += 1
                time.sleep(0.01)
                continue
            except (OSError, http.client.HTTPException) as exc:  # reset, truncated
                with self.lock:
                    self.failed.append(repr(exc))
                continue
            finally:
                conn.close()
            with self.lock:
                if status == 200:
                    self.ok += 1
                    self.gap = max(self.gap, time.monotonic() - start)
                else:
                    self.failed.append(str(status))

    def more(self, n: int = 20, timeout: float = 120) -> None:
        """Wait until `n` more requests were answered."""
        target = self.ok + n
        eventually(lambda: self.ok >= target, timeout, what="answers", interval=0.05)

    def figures(self) -> str:
        return (f"{self.ok} ok, {self.refused} refused, {len(self.failed)} failed, longest "
                f"answer {self.gap * 1000:.0f} ms")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path)


def _connection(where: int | str) -> http.client.HTTPConnection:
    if isinstance(where, str):
        return _UnixConnection(where)
    return http.client.HTTPConnection("127.0.0.1", where, timeout=60)


def _engine(tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port",
            str(free_port()), "--warmup-tokens", "0"]


def _parked(s: dict) -> bool:
    return serving(s) and s["standby"]["state"] == "parked" and s["swap"]["state"] == "none"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nothing_refused_across_a_kill_a_hang_and_both_swaps(
        launch, ckpts: dict[str, Path], tmp_path: Path, capsys) -> None:  # noqa: F811
    """--listen --standby at TP 1, four clients: a SIGKILL of the engine (at most the
    requests it held fail), a hang (SIGSTOP; killed, the standby takes over), a double swap
    (the standby is promoted while the old engine drains: nothing fails), an in-place swap
    (the old engine drains, the queue waits: nothing fails) and a SIGHUP restart; no
    connection is ever refused and the socket the launcher bound is the same throughout."""
    port = free_port()
    la = launch(ckpts["a"], "--listen", f"127.0.0.1:{port}", "--standby",
                "--engine-ready", "notify", "--drain-timeout", "20",
                "--engine-liveness-request", f"GET http://127.0.0.1:{port}/health",
                "--engine-liveness-interval", "0.5", "--engine-liveness-deadline", "1",
                "--engine-unhealthy-after", "1.5", "--engine-hang-kill-after", "0",
                tp=1, engine=_engine(tmp_path))
    snap = la.wait_for(_parked, timeout=240)
    assert snap["launcher"]["listen"] == f"http=127.0.0.1:{port}"
    lines = []
    with Clients(port) as clients:
        clients.more()
        held = len(clients.threads)
        # 1. SIGKILL: what the engine held is lost, nothing is refused
        before = len(clients.failed)
        os.killpg(snap["engine"]["pid"], signal.SIGKILL)
        snap = la.wait_for(lambda s: _parked(s) and s["standby"]["promotions"] == 1)
        clients.more()
        assert clients.refused == 0 and len(clients.failed) - before <= held, clients.failed
        lost = snap["drain"]["lost_connections"]  # sampled every 0.5 s: an estimate
        assert lost <= held
        lines.append(f"kill: {clients.figures()}, lost_connections {lost}")
        # 2. a hang: SIGSTOP, found by the liveness request, SIGKILLed, the standby serves
        before = len(clients.failed)
        os.killpg(snap["engine"]["pid"], signal.SIGSTOP)
        snap = la.wait_for(lambda s: _parked(s) and s["standby"]["promotions"] == 2)
        clients.more()
        assert clients.refused == 0 and len(clients.failed) - before <= held, clients.failed
        # counted right before its SIGKILL: exactly what the hung engine held
        hang_lost = snap["drain"]["lost_connections"] - lost
        assert hang_lost == len(clients.failed) - before, (hang_lost, clients.failed)
        lines.append(f"hang: {clients.figures()}, lost_connections {hang_lost}")
        # 3. double swap: overlap, nothing fails
        before = len(clients.failed)
        r = swap(la, ckpts["b"], "--mode", "double")
        assert r.returncode == 0, r.stderr + la.text()[-3000:]
        snap = la.wait_for(lambda s: _parked(s) and s["drain"]["drained"] == 1)
        clients.more()
        assert clients.refused == 0 and len(clients.failed) == before, clients.failed
        lines.append(f"double swap: {clients.figures()}")
        # 4. in place: the old engine drains and exits, the queue waits, nothing fails
        r = swap(la, ckpts["a"], "--mode", "in-place")
        assert r.returncode == 0, r.stderr + la.text()[-3000:]
        snap = la.wait_for(_parked)
        clients.more()
        assert clients.refused == 0 and len(clients.failed) == before, clients.failed
        lines.append(f"in-place swap: {clients.figures()}")
        # 5. SIGHUP: promote then drain, like the double swap
        la.proc.send_signal(signal.SIGHUP)
        snap = la.wait_for(lambda s: _parked(s) and s["drain"]["drained"] == 2)
        clients.more()
        assert clients.refused == 0 and len(clients.failed) == before, clients.failed
        lines.append(f"SIGHUP: {clients.figures()}")
    assert snap["drain"]["killed"] == 0
    assert snap["drain"]["lost_connections"] == lost + hang_lost  # the drains lost nothing
    metrics = urllib.request.urlopen(la.url + "/metrics", timeout=5).read().decode()
    assert "vlaunch_engines_drained 2.0" in metrics, metrics
    text = la.text()
    assert "the standby takes over first" in text and "drained: stopped accepting" in text
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
    with socket.socket() as probe:  # the launcher's socket went with it
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_unix_socket_across_a_kill_and_a_sighup_with_a_standby(
        launch, ckpts: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    """--listen unix:PATH --standby, four clients: the engine SIGKILLed (only what it held
    may fail), then SIGHUP (the standby is promoted first, the old engine drains: nothing
    fails); never a refused connection; the socket file goes with the launcher."""
    path = str(tmp_path / "engine.sock")
    la = launch(ckpts["a"], "--listen", f"unix:{path}", "--standby", "--engine-ready",
                "notify", tp=1, engine=_engine(tmp_path))
    snap = la.wait_for(_parked, timeout=240)
    assert snap["launcher"]["listen"] == f"http=unix:{path}"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    with Clients(path) as clients:
        clients.more()
        os.killpg(snap["engine"]["pid"], signal.SIGKILL)
        snap = la.wait_for(lambda s: _parked(s) and s["standby"]["promotions"] == 1)
        clients.more()
        killed = len(clients.failed)
        assert clients.refused == 0 and killed <= len(clients.threads), clients.failed
        la.proc.send_signal(signal.SIGHUP)
        snap = la.wait_for(lambda s: _parked(s) and s["drain"]["drained"] == 1)
        clients.more()
        assert clients.refused == 0 and len(clients.failed) == killed, clients.failed
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
    assert not os.path.exists(path)


@pytest.mark.timeout(300)
def test_an_ordinary_restart_queues_clients_until_the_new_engine_is_ready(
        launch, ckpts: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    """--listen unix:PATH without a standby: the engine SIGKILLed and started again (weights
    mapped, a fresh process): the new engine accepts only once it is ready, so the clients
    that connected meanwhile wait and are answered; only what the killed engine held fails;
    the socket file goes with the launcher."""
    path = str(tmp_path / "engine.sock")
    la = launch(ckpts["a"], "--listen", f"unix:{path}", "--engine-ready", "notify",
                "--backoff-initial", "0", tp=1, engine=_engine(tmp_path))
    snap = la.wait_for(serving, timeout=240)
    assert snap["launcher"]["listen"] == f"http=unix:{path}"
    with Clients(path) as clients:
        clients.more()
        os.killpg(snap["engine"]["pid"], signal.SIGKILL)
        la.wait_for(lambda s: serving(s) and s["engine"]["restarts"] == 1)
        clients.more()
    assert clients.refused == 0 and len(clients.failed) <= len(clients.threads), clients.failed
    assert clients.gap > 0.2  # some waited through the engine's start, and were answered
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
    assert not os.path.exists(path)


def test_a_unix_socket_in_a_directory_others_may_write_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with bind(ListenAddress.parse(f"unix:{shared}/e.sock")):
        pass
    assert "may be written by other users" in caplog.text
    caplog.clear()
    (tmp_path / "own").mkdir(mode=0o700)
    with bind(ListenAddress.parse(f"unix:{tmp_path}/own/e.sock")):
        pass
    assert "may be written" not in caplog.text


def test_a_drain_answers_a_connection_it_accepted_before_its_request_arrived() -> None:
    """The reference engine's drain (on the launcher's socket): a keep-alive connection
    waiting between two requests is closed (its client opens the next one to the next
    engine), while a connection accepted whose request has not been read yet is answered, not
    reset: on a busy host a client's request often arrives after its accept (the double
    swap's failed requests in a CI run of 2026-12-03)."""
    from types import SimpleNamespace

    from vlaunch.cache.reference.http import EngineServer, drain

    listener = bind(ListenAddress.parse("127.0.0.1:0"))
    server = EngineServer.on_socket(listener)
    server.engine = SimpleNamespace(ready=True, stopping=False)  # what /health reads
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = listener.getsockname()[1]
    idle = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    idle.request("GET", "/health")
    assert idle.getresponse().read() and idle.sock is not None  # kept alive: idle now
    fresh = socket.create_connection(("127.0.0.1", port), timeout=30)  # accepted, no request
    eventually(lambda: server.open_connections() == 2, 30, what="both connections accepted")
    drained: list[int] = []
    done = threading.Thread(target=lambda: drained.append(drain(server, limit=30)))
    done.start()
    # the drain stopped accepting and closed its copy of the socket; what is idle goes next
    eventually(lambda: server.socket.fileno() == -1, 30, what="the drain")
    time.sleep(0.3)
    fresh.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = http.client.HTTPResponse(fresh)
    reply.begin()
    assert reply.status == 503  # answered (a draining engine's health is not the next one's)
    assert json.loads(reply.read()) == {"status": "stopping"}
    assert idle.sock.recv(1) == b""  # the idle keep-alive connection was ended
    fresh.close()
    idle.close()
    done.join(30)
    assert drained == [0]
