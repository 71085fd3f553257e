"""`vlaunch run` with real processes: cache ranks on a small checkpoint, tiny engines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from safetensors.torch import load_file

from vlaunch.cache.contract.exitcodes import ExitStatus

from .conftest import eventually, free_port
from .test_notify import fill

ENGINE = r"""
import os, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.connect(os.environ["NOTIFY_SOCKET"])
s.send(b"READY=1\nSTATUS=engine up")
while True:
    time.sleep(0.5)
"""
"""A tiny engine: READY=1 on the notify socket it is given, exit 0 on SIGTERM. Engines that
crash, loop in restarts or ignore SIGTERM are fakes in test_executor.py."""


class Launcher:
    """A `vlaunch run` subprocess with a notify socket standing in for systemd."""

    def __init__(self, tmp: Path, model: Path | str, *args: str, engine: list[str] | None = None,
                 tp: int = 2, notify_socket: str | None = None) -> None:
        self.sockdir = tmp / "sock"
        self.notify_path = tmp / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.settimeout(0.05)
        self.messages: list[str] = []
        self.log = tmp / "launcher.log"
        cmd = [sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model", str(model),
               "--tensor-parallel-size", str(tp), "--socket-dir", str(self.sockdir),
               "--health-port", "0", "--stop-timeout", "5", *args]
        if engine is not None:
            cmd += ["--", *engine]
        env = {**os.environ, "NOTIFY_SOCKET": notify_socket or str(self.notify_path)}
        self.proc = subprocess.Popen(cmd, env=env, stderr=self.log.open("wb"))
        self.url = ""

    def text(self) -> str:
        """Everything the launcher (and its children) logged so far."""
        return self.log.read_text()

    def drain(self) -> list[str]:
        """Collect notify messages received so far."""
        while True:
            try:
                self.messages.append(self.notify.recv(4096).decode())
            except (TimeoutError, BlockingIOError):
                return self.messages

    def status(self) -> dict[str, Any]:
        """GET /status (finding the URL in launcher.json the first time)."""
        if not self.url:
            self.url = json.loads((self.sockdir / "launcher.json").read_text())["url"]
        with urllib.request.urlopen(self.url + "/status", timeout=5) as r:
            return json.loads(r.read())

    def probe(self, path: str) -> int:
        """HTTP status of a probe endpoint."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def wait_for(self, cond: Callable[[dict[str, Any]], bool], timeout: float = 150) -> dict:
        """Poll /status until cond holds (the launcher must not exit meanwhile)."""

        def check() -> dict[str, Any] | None:
            self.drain()
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited {self.proc.returncode}:\n{self.text()}")
            try:
                snap = self.status()
            except (OSError, ValueError, KeyError):
                return None
            return snap if cond(snap) else None

        return eventually(check, timeout, what=lambda: f"launcher status\n{self.text()}",
                          interval=0.1)

    def wait_exit(self, timeout: float = 60) -> int:
        """Wait for the launcher to exit; returns its status."""
        try:
            code = self.proc.wait(timeout)
        finally:
            self.drain()
        return code

    def pids(self, snap: dict[str, Any]) -> list[int]:
        """Every child pid the status shows."""
        out = [r["pid"] for r in snap["ranks"].values() if r["pid"]]
        if snap.get("engine") and snap["engine"]["pid"]:
            out.append(snap["engine"]["pid"])
        return out

    def close(self) -> None:
        """Kill whatever is left (a failed test) and close the notify socket."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Launcher]]:
    started: list[Launcher] = []

    def start(*args: Any, **kw: Any) -> Launcher:
        sub = tmp_path / f"l{len(started)}"
        sub.mkdir()
        launcher = Launcher(sub, *args, **kw)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.close()


def engine() -> list[str]:
    return [sys.executable, "-c", ENGINE]


def serving(s: dict[str, Any]) -> bool:
    return s["phase"] == "serving" and s["engine_ready"]


def assert_all_gone(pids: list[int], sockdir: Path) -> None:
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    assert not list(sockdir.glob("*.sock")), list(sockdir.iterdir())


def test_start_serve_and_sigterm(launch, llama_ckpt: Path) -> None:
    la = launch(llama_ckpt, "--engine-ready", "notify", engine=engine())
    snap = la.wait_for(serving)
    assert la.probe("/livez") == 200 and la.probe("/startupz") == 200
    assert la.probe("/readyz") == 200
    assert {r["state"] for r in snap["ranks"].values()} == {"ready"}
    snap = la.wait_for(lambda s: all(len(r["leases"]) == 0 and r["bytes"] > 0
                                     for r in s["ranks"].values()))
    with urllib.request.urlopen(la.url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'vlaunch_rank_ready{rank="1",role="target"} 1.0' in metrics
    pids = la.pids(snap)
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == ExitStatus.OK
    msgs = la.drain()
    ready = msgs.index(next(m for m in msgs if "READY=1" in m))
    assert any("EXTEND_TIMEOUT_USEC" in m for m in msgs[:ready])
    assert any("STOPPING=1" in m for m in msgs[ready:])
    assert_all_gone(pids, la.sockdir)


def test_rank_sigkill_shuts_down_with_69(launch, llama_ckpt: Path) -> None:
    la = launch(llama_ckpt, "--engine-ready", "notify", engine=engine())
    snap = la.wait_for(serving)
    pids = la.pids(snap)
    victim = snap["ranks"]["1"]["pid"]
    os.kill(victim, signal.SIGKILL)
    assert la.wait_exit() == ExitStatus.RANK_EXITED
    text = la.text()
    assert f"cache rank 1 (pid {victim})" in text and "SIGKILL" in text
    assert any("rank 1" in m and "STATUS=" in m for m in la.drain())
    assert_all_gone(pids, la.sockdir)


def test_rank_that_fails_to_load_ends_startup_with_its_status(launch, tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    la = launch(bad, engine=engine(), tp=1)
    assert la.wait_exit() == ExitStatus.BAD_CHECKPOINT
    assert "bad checkpoint" in la.text() and "engine started" not in la.text()


def test_respawn_adopts_escrowed_slabs_without_the_disk(launch, llama_ckpt: Path,
                                                        tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama_ckpt, model)
    la = launch(model, "--engine-ready", "notify", "--on-rank-exit", "respawn",
                engine=engine())
    snap = la.wait_for(serving)
    engine_pid, victim = snap["engine"]["pid"], snap["ranks"]["0"]["pid"]
    ref = {}
    for f in sorted(model.glob("*.safetensors")):
        ref.update({k: v.clone() for k, v in load_file(str(f)).items()})  # not lazy mmaps
    for f in model.glob("*.safetensors"):  # from now on nobody can read the weights
        f.write_bytes(f.read_bytes()[:8] + b"\0" * 64)
    os.kill(victim, signal.SIGKILL)
    snap = la.wait_for(lambda s: s["ranks"]["0"]["pid"] not in (None, victim)
                       and s["ranks"]["0"]["state"] == "ready")
    assert snap["engine"]["pid"] == engine_pid and snap["engine"]["state"] == "ready"
    assert "adopted 1 escrowed slab(s)" in la.text()
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.contract.sockdir import socket_path

    client = CacheClient(socket_path(la.sockdir, 0))
    tensors = client.map(client.manifest())
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert tensors[name].view(-1).equal(ref[name].view(-1))
    # the engine that mapped the slabs before the respawn still does: the adopted rank found
    # it in /proc (its maps) and follows it, so nothing is handed over while it runs
    assert "which opened them before and still run" in client.status()["handover_blocked"]
    client.close()
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


def test_usage_errors_exit_64(tmp_path: Path, llama_ckpt: Path) -> None:
    for args in (["--tensor-parallel-size", "0"], ["--bogus"],
                 ["--tensor-parallel-size", "3", "--nnodes", "2"],
                 ["--device", "cpu", "--devices", "0"]):
        r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model",
                            str(llama_ckpt), "--socket-dir", str(tmp_path / "s"), *args],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == ExitStatus.USAGE, (args, r.stderr)


def test_config_file_and_env_vars(tmp_path: Path, llama_ckpt: Path) -> None:
    cfg = tmp_path / "v.toml"
    cfg.write_text('tensor-parallel-size = 3\nnnodes = 2\n')
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "run", "--config",
                        str(cfg), "--model", str(llama_ckpt)], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "VLAUNCH_SOCKET_DIR": str(tmp_path)})
    assert r.returncode == ExitStatus.USAGE and "do not divide over 2 nodes" in r.stderr
    cfg.write_text('tensor-paralel-size = 2\n')
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "run", "--config",
                        str(cfg), "--model", str(llama_ckpt)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == ExitStatus.USAGE and "tensor_paralel_size" in r.stderr
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model",
                        str(llama_ckpt)], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "VLAUNCH_TENSOR_PARALLEL_SIZE": "3",
                            "VLAUNCH_NNODES": "2"})
    assert r.returncode == ExitStatus.USAGE and "do not divide over 2 nodes" in r.stderr


def test_exit_codes_json_lists_every_status() -> None:
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "exit-codes", "--json"],
                       capture_output=True, text=True, timeout=30, check=True)
    assert {row["status"] for row in json.loads(r.stdout)} == {int(s) for s in ExitStatus}


HTTP_ENGINE = r"""
import http.server, os, sys, time
port = int(sys.argv[1])
time.sleep(0.5)  # not ready at once: the launcher must wait for the URL to answer
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_engine_readiness_from_its_health_url(launch, llama_ckpt: Path) -> None:
    port = free_port()
    la = launch(llama_ckpt, "--engine-health-url", f"http://127.0.0.1:{port}/health",
                engine=[sys.executable, "-c", HTTP_ENGINE, str(port)], tp=1)
    snap = la.wait_for(serving)
    assert snap["engine"]["healthy"] is True and la.probe("/readyz") == 200
    assert any("READY=1" in m for m in la.drain())
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


COPY_RELEASE_CLIENT = ("import sys; from vlaunch.cache import load; "
                       "w = load(sys.argv[1], socket_dir=sys.argv[2], mode='copy-release', "
                       "fallback=False, device='cpu'); print(w.source, w.bytes_outside)")


def memfd_holders(inodes: set[int]) -> list[str]:
    """Every process (that we may inspect) with an fd or a mapping on one of these memfds."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = f"/proc/{pid}/fd/{fd}"
                    if "memfd:" in os.readlink(link) and os.stat(link).st_ino in inodes:
                        out.append(f"{pid} fd {fd}")
            with open(f"/proc/{pid}/maps") as maps:
                out += [f"{pid} map" for line in maps if "memfd:" in line
                        and int(line.split()[4]) in inodes]
    return out


def test_caches_only_copy_release_returns_the_memory(launch, llama_ckpt: Path,
                                                     tmp_path: Path) -> None:
    # the caches-only layout (no engine) serves; systemd's notify socket is one that nobody
    # reads: the launcher must not stall on it
    full = tmp_path / "full.sock"
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    reader.bind(str(full))
    assert fill(str(full)) > 0  # the launcher's first message finds the queue full
    la = launch(llama_ckpt, tp=1, notify_socket=str(full))
    snap = la.wait_for(lambda s: s["phase"] == "serving")
    assert snap["engine"] is None and la.probe("/readyz") == 200
    rank = snap["ranks"]["0"]["pid"]
    fds = [f"/proc/{rank}/fd/{fd}" for fd in os.listdir(f"/proc/{rank}/fd")]
    inodes = {os.stat(p).st_ino for p in fds if "memfd:vlaunch-slab" in os.readlink(p)}
    assert inodes and any(h.startswith(f"{la.proc.pid} ") for h in memfd_holders(inodes))
    r = subprocess.run([sys.executable, "-c", COPY_RELEASE_CLIENT, str(llama_ckpt),
                        str(la.sockdir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["cache", "0"], r.stderr
    eventually(lambda: not memfd_holders(inodes), 30, what="the slabs freed everywhere")
    la.wait_for(lambda s: s["ranks"]["0"]["bytes"] == 0 and s["ranks"]["0"]["state"] == "ready")
    with urllib.request.urlopen(la.url + "/metrics", timeout=5) as resp:
        assert 'vlaunch_rank_bytes{device="cpu",rank="0",role="target"} 0.0' in \
            resp.read().decode()
    assert "released its checkpoint slabs: closed 1 escrowed fd(s)" in la.text()
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
    reader.close()
    assert la.text().count("not keeping up") == 1 and "Traceback" not in la.text()


def test_an_engine_under_run_needs_no_flags(launch, tmp_path: Path) -> None:
    from vlaunch.cache.reference.refmodel import make_checkpoint

    model = make_checkpoint(tmp_path / "tiny", hidden=64, layers=2, heads=4, kv_heads=2,
                            intermediate=128, vocab=256)
    port_file = tmp_path / "port"
    # a plan other than the default: an engine that does not read it asks for another
    # fingerprint than the caches have, and with --no-fallback never serves
    engine = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--no-fallback",
              "--port-file", str(port_file)]  # no --model, --tensor-parallel-size, --plan
    # and systemd's NOTIFY_SOCKET is stale (a missing path): one warning, nothing else
    la = launch(model, "--plan", "replicate", "--engine-ready", "notify", "--stop-timeout", "60",
                engine=engine, tp=1, notify_socket=str(tmp_path / "gone.sock"))
    la.wait_for(serving)
    url = f"http://127.0.0.1:{port_file.read_text().strip()}"
    with urllib.request.urlopen(url + "/stats", timeout=5) as resp:
        stats = json.loads(resp.read())
    assert stats["source"] == "cache" and stats["tp_size"] == 1, stats
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
    log = la.text()
    assert log.count("sd_notify to") == 1 and "Traceback" not in log, log


def test_status_table_shows_the_copies_a_rank_is_making() -> None:
    from vlaunch.launcher.status import format_status

    rank = {"state": "ready", "pid": 7, "device": "cuda:0", "bytes": 10**9, "leases": [],
            "last_exit": None}
    status = {"phase": "serving", "caches_ready": True, "engine_ready": True,
              "ranks": {"0": {**rank, "copies": {"in_flight": 2, "bytes": 3 * 10**9}},
                        "1": {**rank, "copies": {"in_flight": 0, "bytes": 0}}}}
    text = format_status(status)
    assert "rank 0: making 2 copy-mode engine copies (3.00 GB of device memory)" in text
    assert "rank 1: making" not in text


def test_metrics_name_a_draft_rank_by_its_group_and_role() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from vlaunch.launcher.health import MetricsCollector

    status = {"ranks": {
        0: {"state": "ready", "bytes": 10, "device": "cpu", "role": "target", "group_rank": 0,
            "copies": {"in_flight": 1, "bytes": 8}},
        1: {"state": "ready", "bytes": 4, "device": "cpu", "role": "draft", "group_rank": 0}}}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(lambda: status))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'vlaunch_rank_bytes{device="cpu",rank="0",role="target"} 10.0' in text
    assert 'vlaunch_rank_bytes{device="cpu",rank="0",role="draft"} 4.0' in text
    assert 'vlaunch_rank_copy_bytes{rank="0",role="target"} 8.0' in text
    assert 'vlaunch_rank_copy_bytes{rank="0",role="draft"} 0.0' in text
    assert 'rank="1"' not in text
