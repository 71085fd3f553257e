"""The operator's contract, driven through the real `vlaunch` command.

Every troubleshooting row and exit status that a CPU machine can produce, for `vlaunch run`,
`vlaunch cache`, `vlaunch status` and `vlaunch demo`: the status, the message, and never a
traceback. Cases that need no cache rank run in well under a second each; those that start a
rank (it imports torch) are marked slow. What a CPU machine cannot produce is listed in
NOT_ON_CPU with the reason.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vlaunch.cache.contract.sockdir import LauncherLock, RankLock

VLAUNCH = str(Path(sys.executable).with_name("vlaunch"))

NOT_ON_CPU = {
    "71 NO_DEVICE for an index out of range or a missing cuda-bindings": "needs a CUDA machine "
    "(the missing-GPU case runs below: test_rank_failures_pass_their_status_through)",
    "could not unmap slab mapping at": "CUDA only",
}
"""Rows a CPU machine cannot produce, with the reason."""

ELSEWHERE = {
    "sent a bad report": "a rank that breaks the report protocol is a bug; the launcher's "
    "reading of a bad progress frame is tested below (test_report_channel_progress_frames)",
    "74 IO_ERROR": "needs a failing disk; tests/test_exit_statuses.py reads a directory instead",
    "69, 80, 81, 82 (engine and rank deaths while serving)": "need a serving cache; "
    "tests/test_launcher.py and tests/test_supervisor_core.py drive them",
    "67, 72, 79, 83": "checkpoint integrity, connection limits, start-up deadline: "
    "tests/test_identity.py and tests/faults/",
    "engine-side load() rows": "in-process: the load() wait below; tests/test_cache.py",
}
"""Rows and statuses driven by other test files, and where."""


@dataclass
class Case:
    """One command line, what to prepare, the status and text it must end with."""

    argv: list[str]
    status: int
    text: str
    prepare: Callable[[Path], None] = lambda tmp: None
    env: dict[str, str] = field(default_factory=dict)
    absent: str = ""  # text that must NOT be in the output


def _file(tmp: Path) -> None:
    (tmp / "afile").write_text("x")


def _symlink(tmp: Path) -> None:
    (tmp / "real").mkdir(mode=0o700)
    (tmp / "link").symlink_to(tmp / "real")


def _open_mode(tmp: Path) -> None:
    (tmp / "open").mkdir()
    (tmp / "open").chmod(0o755)


def _foreign(tmp: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    (tmp / "theirs").mkdir(mode=0o700)
    os.chown(tmp / "theirs", 65534, -1)


def _config(text: str) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        (tmp / "c.toml").write_text(text)
    return write


LONG = "d" * 110
RUN = ["run", "--model", "{model}", "--socket-dir", "{tmp}/s"]
RUN_CASES = {
    "socket dir under a file": Case(
        ["run", "--model", "{model}", "--socket-dir", "{tmp}/afile/s"], 73,
        "is not usable: Not a directory", _file),
    "socket dir a symlink": Case(
        ["run", "--model", "{model}", "--socket-dir", "{tmp}/link"], 73,
        "is a symlink or not a directory", _symlink),
    "socket dir mode 0755": Case(
        ["run", "--model", "{model}", "--socket-dir", "{tmp}/open"], 73, "has mode 0755",
        _open_mode),
    "socket dir not creatable": Case(
        ["run", "--model", "{model}", "--socket-dir", "/proc/self/vlaunch"], 73,
        "is not usable"),
    "socket dir of another user": Case(
        ["run", "--model", "{model}", "--socket-dir", "{tmp}/theirs"], 73, "is owned by uid",
        _foreign),
    "socket path too long": Case(
        ["run", "--model", "{model}", "--socket-dir", f"{{tmp}}/{LONG}"], 73,
        "bytes; use a shorter --socket-dir"),
    "engine command not found": Case(
        [*RUN, "--", "/no/such/engine"], 64, "is not an executable file and not found on PATH"),
    "preload command not found": Case(
        [*RUN, "--preload-autotune", "no-such-tuner --x"], 64,
        "is not an executable file and not found on PATH; fix --preload-autotune"),
    "preload command unbalanced quotes": Case(
        [*RUN, "--preload-autotune", "tune 'x"], 64, "--preload-autotune cannot be split"),
    "seed port without token": Case(
        [*RUN, "--seed-listen-port", "7000"], 64, "--seed-listen-port needs a seed token"),
    "bad tp by flag": Case(
        [*RUN, "--tensor-parallel-size", "two"], 64, "'--tensor-parallel-size'",
        absent="VLAUNCH_TENSOR_PARALLEL_SIZE"),
    "bad tp by env": Case(
        RUN, 64, "environment variable 'VLAUNCH_TENSOR_PARALLEL_SIZE'",
        env={"VLAUNCH_TENSOR_PARALLEL_SIZE": "two"}),
    "bad tp by config": Case(
        [*RUN, "--config", "{tmp}/c.toml"], 64, "config key 'tensor-parallel-size'",
        _config('tensor-parallel-size = "two"\n')),
    "unknown config key": Case(
        [*RUN, "--config", "{tmp}/c.toml"], 64, "unknown key(s) in",
        _config("tensor-paralel-size = 2\n")),
    "unreadable config": Case(
        [*RUN, "--config", "{tmp}/c.toml"], 64, "cannot read config file",
        _config("this is = = not toml\n")),
    "nodes do not divide": Case(
        [*RUN, "--tensor-parallel-size", "3", "--nnodes", "2"], 64, "do not divide over"),
    "node rank out of range": Case(
        [*RUN, "--nnodes", "1", "--node-rank", "1"], 64, "is not in"),
    "devices without cuda": Case([*RUN, "--devices", "0"], 64, "--devices needs --device cuda"),
    "devices count": Case(
        [*RUN, "--device", "cuda", "--devices", "0,1"], 64, "--devices lists 2 devices"),
    "http readiness without url": Case(
        [*RUN, "--engine-ready", "http", "--", "true"], 64,
        "--engine-ready http needs --engine-health-url"),
    "invalid supervisor config": Case(
        [*RUN, "--backoff-initial", "5", "--backoff-max", "1"], 64,
        "invalid supervisor config"),
    "health host not local": Case(
        [*RUN, "--health-host", "192.0.2.1", "--health-port", "9"], 64,
        "cannot serve health on"),
}


def _run(case: Case, tmp: Path, model: Path) -> subprocess.CompletedProcess[str]:
    case.prepare(tmp)
    argv = [a.format(tmp=tmp, model=model) for a in case.argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLAUNCH_", "NOTIFY_"))}
    extra = {k: v.format(tmp=tmp, model=model) for k, v in case.env.items()}
    return subprocess.run([VLAUNCH, *argv], capture_output=True, text=True, timeout=60,
                          env={**env, **extra}, cwd=tmp)


def _check(r: subprocess.CompletedProcess[str], case: Case) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == case.status, out
    assert case.text in out, out
    assert "Traceback" not in out, out
    assert not case.absent or case.absent not in out, out


@pytest.mark.parametrize("name", sorted(RUN_CASES))
def test_vlaunch_run_fails_before_starting_anything(name: str, tmp_path: Path,
                                                    llama_ckpt: Path) -> None:
    case = RUN_CASES[name]
    _check(_run(case, tmp_path, llama_ckpt), case)
    assert not (tmp_path / "s").exists()  # nothing left behind


def test_health_port_in_use_is_a_usage_error_that_leaves_nothing(tmp_path: Path,
                                                                 llama_ckpt: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        case = Case([*RUN, "--health-port", str(port)], 64,
                    f"health port {port} on 127.0.0.1 is already in use; pick another "
                    "--health-port")
        _check(_run(case, tmp_path, llama_ckpt), case)
    assert not (tmp_path / "s").exists()


def test_second_launcher_leaves_the_first_ones_files_alone(tmp_path: Path,
                                                          llama_ckpt: Path) -> None:
    sockdir = tmp_path / "s"
    sockdir.mkdir(mode=0o700)
    first = LauncherLock(sockdir)
    first.acquire()  # this test process plays the first launcher
    info = sockdir / "launcher.json"
    info.write_text(json.dumps({"pid": os.getpid(), "url": "http://127.0.0.1:1"}))
    try:
        case = Case(RUN, 75, f"another launcher (pid {os.getpid()}) uses socket directory")
        _check(_run(case, tmp_path, llama_ckpt), case)
        assert json.loads(info.read_text())["pid"] == os.getpid()
        assert sorted(p.name for p in sockdir.iterdir()) == ["launcher.json", "launcher.lock"]
    finally:
        first.release()


# ------------------------------------------------------------------------ vlaunch cache

CACHE = ["cache", "--model", "{model}", "--socket-dir"]
CACHE_CASES = {
    "socket dir under a file": Case([*CACHE, "{tmp}/afile/s"], 73, "is not usable", _file),
    "socket dir a symlink": Case([*CACHE, "{tmp}/link"], 73, "is a symlink", _symlink),
    "socket dir mode 0755": Case([*CACHE, "{tmp}/open"], 73, "has mode 0755", _open_mode),
    "socket dir not creatable": Case([*CACHE, "/proc/self/vlaunch"], 73, "is not usable"),
    "bad tp by flag": Case([*CACHE, "{tmp}/s", "--tensor-parallel-size", "two"], 64,
                           "'--tensor-parallel-size'", absent="VLAUNCH_TENSOR_PARALLEL_SIZE"),
    "seed port without token": Case([*CACHE, "{tmp}/s", "--seed-listen-port", "7000"], 64,
                                    "--seed-listen-port needs a seed token"),
    "rank outside the layout": Case([*CACHE, "{tmp}/s", "--rank", "2",
                                     "--tensor-parallel-size", "2"], 64,
                                    "rank must be an integer in 0..1"),
}


@pytest.mark.parametrize("name", sorted(CACHE_CASES))
def test_vlaunch_cache_statuses(name: str, tmp_path: Path, llama_ckpt: Path) -> None:
    case = CACHE_CASES[name]
    _check(_run(case, tmp_path, llama_ckpt), case)


# ----------------------------------------------------------------------- vlaunch status


def test_vlaunch_status_without_a_launcher(tmp_path: Path) -> None:
    case = Case(["status", "--socket-dir", "{tmp}"], 64, "no running launcher found")
    _check(_run(case, tmp_path, tmp_path), case)


def test_vlaunch_status_of_a_launcher_that_is_gone(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed again: nobody answers there
    (tmp_path / "launcher.json").write_text(json.dumps({"pid": 1,
                                                        "url": f"http://127.0.0.1:{port}"}))
    case = Case(["status", "--socket-dir", "{tmp}"], 64, "is it running? (a launcher killed "
                "with SIGKILL leaves")
    _check(_run(case, tmp_path, tmp_path), case)


# ------------------------------------------------------------------------- vlaunch demo


def test_vlaunch_demo_that_cannot_write_its_checkpoint(tmp_path: Path) -> None:
    case = Case(["demo"], 70, "creating the demo checkpoint in", _file,
                env={"VLAUNCH_CACHE_DIR": str(tmp_path / "afile" / "cache")})
    _check(_run(case, tmp_path, tmp_path), case)


def _demo_dir(ckpt: Path) -> Callable[[Path], None]:
    def link(tmp: Path) -> None:  # the tiny checkpoint stands in for the demo model
        demo = tmp / "cache" / "demo-llama"
        demo.mkdir(parents=True)
        for f in ckpt.iterdir():
            (demo / f.name).symlink_to(f)
        (demo / "config.json").write_text("{}")  # the demo creates its model without one
    return link


def test_vlaunch_demo_passes_the_launchers_status_through(tmp_path: Path,
                                                          llama_ckpt: Path) -> None:
    case = Case(["demo", "--tensor-parallel-size", "3"], 78, "does not divide evenly",
                _demo_dir(llama_ckpt), env={"VLAUNCH_CACHE_DIR": str(tmp_path / "cache")})
    _check(_run(case, tmp_path, llama_ckpt), case)


# ------------------------------------------------------------- failures of a cache rank

def _truncated(tmp: Path) -> None:
    (tmp / "cut").mkdir()
    (tmp / "cut" / "model.safetensors").write_bytes((880).to_bytes(8, "little") + b"{")


def _killing_hook(tmp: Path) -> None:  # a rank that dies by a signal before it is ready
    (tmp / "killhook.py").write_text("import os, signal\n\ndef plan(*a, **k):\n"
                                     "    os.kill(os.getpid(), signal.SIGKILL)\n")


RANK_CASES = {
    "no model": Case([*RUN[:2], "{tmp}/missing", *RUN[3:]], 66, "does not exist"),
    "truncated checkpoint": Case([*RUN[:2], "{tmp}/cut", *RUN[3:], "--tensor-parallel-size",
                                  "1"], 65, "file is truncated", _truncated),
    "rank killed before ready": Case(
        [*RUN, "--tensor-parallel-size", "1", "--plan", "killhook:plan"], 68,
        "exited before ready: killed by signal 9", _killing_hook, env={"PYTHONPATH": "{tmp}"}),
    "seed source unreachable": Case(
        [*RUN, "--tensor-parallel-size", "1", "--seed", "unix:{tmp}/nosuch"], 76,
        "seed source unreachable"),
    "bad plan": Case([*RUN, "--tensor-parallel-size", "3"], 78, "does not divide evenly"),
    "missing gpu": Case([*RUN, "--device", "cuda"], 71, "exited before ready: status 71"),
}


SLOW_RANK_CASES = {"missing gpu",  # the CUDA probe: about 6 s
                   "seed source unreachable",  # the seed client retries for 30 s
                   "rank killed before ready"}  # the hook imports the plan machinery: 5-11 s


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RANK_CASES else n
    for n in sorted(RANK_CASES)])
def test_rank_failures_pass_their_status_through(name: str, tmp_path: Path,
                                                 llama_ckpt: Path) -> None:
    if name == "missing gpu":
        import torch

        if torch.cuda.is_available():
            pytest.skip("checks the no-GPU path")
    case = RANK_CASES[name]
    _check(_run(case, tmp_path, llama_ckpt), case)


def test_rank_lock_held_is_cache_busy(tmp_path: Path, llama_ckpt: Path) -> None:
    sockdir = tmp_path / "s"
    sockdir.mkdir(mode=0o700)
    held = RankLock(sockdir, 0)
    held.acquire()
    try:
        case = Case([*RUN, "--tensor-parallel-size", "1"], 75, "another cache process holds")
        _check(_run(case, tmp_path, llama_ckpt), case)
    finally:
        held.release()


@pytest.mark.slow
def test_engine_that_exits_at_once_is_never_ready(tmp_path: Path, llama_ckpt: Path) -> None:
    case = Case([*RUN, "--tensor-parallel-size", "1", "--restart-max", "1",
                 "--backoff-initial", "0", "--", sys.executable, "-c", "raise SystemExit(3)"],
                80, "restart budget exhausted", absent="engine ready")
    _check(_run(case, tmp_path, llama_ckpt), case)


# ------------------------------------------------------------------ engine side: load()


def test_load_without_fallback_says_that_it_waits(tmp_path: Path, llama_ckpt: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    import vlaunch.cache
    from vlaunch.cache.contract.errors import CacheUnavailableError

    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="vlaunch.cache"), \
            pytest.raises(CacheUnavailableError) as err:
        vlaunch.cache.load(str(llama_ckpt), socket_dir=str(empty), fallback=False,
                           timeout=0.2, device="cpu")
    waits = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert waits == [f"rank 0: no cache at {empty}/rank-0.sock yet; waiting up to 0.2 s for "
                     "it (fallback=False)"]
    assert "to wait longer than the 0.2 s it waited, pass a larger timeout" in str(err.value)


# ------------------------------------------------------------------ decisions, no processes


def test_engine_without_readiness_check_is_ready_only_after_it_settled() -> None:
    from vlaunch.launcher.core import Supervisor
    from vlaunch.launcher.core.events import (
        CacheReady,
        ChildExited,
        Log,
        Spawned,
        Started,
        SupervisorConfig,
        Tick,
    )

    sup = Supervisor(SupervisorConfig(ranks=(0,), has_engine=True, engine_readiness="none",
                                      engine_settle=1.0, backoff_initial=0))
    actions = [a for e in (Started(0), Spawned("cache", 0, 100, 0), CacheReady(0, 1),
                           Spawned("engine", None, 201, 1), Tick(1.5),
                           ChildExited("engine", None, 201, 1, 1.6), Tick(1.7),
                           Spawned("engine", None, 202, 1.7), Tick(2.8))
               for a in sup.handle(e)]
    ready = [a.message for a in actions if isinstance(a, Log) and "engine ready" in a.message]
    assert ready == ["engine ready (pid 202, attempt 2)"]  # never the one that exited at once


def test_progress_has_no_eta_until_the_rate_means_something() -> None:
    from vlaunch.cache.contract import progress

    assert progress.describe(1 << 20, 5 << 30, 0.01).endswith("ETA --")  # not 2506 s
    assert progress.describe(2 << 30, 4 << 30, 4.0).endswith("ETA 4s")
    assert "ETA" not in progress.describe(4 << 30, 4 << 30, 8.0)
    assert progress.parse(progress.frame(1, 10, 20)) == (10, 20)
    assert progress.parse({"event": "ready"}) is None
    from vlaunch.cache.contract.errors import ProtocolError

    with pytest.raises(ProtocolError):
        progress.parse({"event": "progress", "loaded": -1, "total": 2})


class _Terminal:
    """A stream that says it is a TTY and records what was written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_tty_display_gives_every_rank_its_own_line() -> None:
    from vlaunch.launcher.progress import LoadDisplay

    now = [0.0]
    term = _Terminal()
    display = LoadDisplay(term, clock=lambda: now[0])  # type: ignore[arg-type]

    def snap(phase: str, *loaded: int) -> dict:
        return {"phase": phase, "ranks": [{"rank": r, "loaded_bytes": b, "total_bytes": 100}
                                          for r, b in enumerate(loaded)]}

    display.show(snap("loading", 0, 0))
    now[0] = 1.0
    display.show(snap("loading", 40, 30))
    now[0] = 2.0
    display.show(snap("loading", 100, 60))  # rank 0 done: its block stays, a new one follows
    now[0] = 3.0
    display.show(snap("loading", 100, 100))
    display.show(snap("serving", 100, 100))  # nothing more once complete
    # frames 2 and 3 redraw in place; the block that shows rank 0 done stays on screen (its
    # own log lines follow it), and the complete block is drawn under it, once
    assert term.text.count("\x1b[3F\x1b[J") == 2 and term.text.count("total") == 4
    lines = term.text.replace("\x1b[3F\x1b[J", "\n").splitlines()
    assert [ln[:8] for ln in lines[-3:]] == ["rank   0", "rank   1", "total   "]
    assert lines[-1].startswith("total    0.00/0.00 GB (100%)")


# ------------------------------------------------------------- loaded bytes, for real


@pytest.mark.slow  # a real launcher with two ranks: 5-15 s on a loaded machine
def test_loaded_bytes_reach_status_metrics_and_sd_notify(tmp_path: Path,
                                                         llama_ckpt: Path) -> None:
    import urllib.request

    from .test_launcher import Launcher

    la = Launcher(tmp_path, llama_ckpt, engine=None)
    try:
        snap = la.wait_for(lambda s: s["phase"] == "serving")
        ranks = snap["ranks"].values()
        # loaded: the tensors' bytes read; bytes: what the slabs hold (with alignment padding)
        assert all(0 < r["loaded_bytes"] == r["total_bytes"] <= r["bytes"] for r in ranks)
        assert snap["loaded_bytes"] == snap["total_bytes"] == sum(r["loaded_bytes"]
                                                                   for r in ranks)
        with urllib.request.urlopen(la.url + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        gauges = dict(line.rsplit(" ", 1) for line in metrics.splitlines()
                      if line and not line.startswith("#"))
        assert float(gauges['vlaunch_rank_loaded_bytes{rank="0",role="target"}']) == \
            snap["ranks"]["0"]["loaded_bytes"]
        assert float(gauges["vlaunch_loaded_bytes"]) == snap["loaded_bytes"]
        loading = [m for m in la.drain() if "GB loaded" in m]
        assert loading and loading[-1].startswith("STATUS=loading: ")
    finally:
        la.proc.terminate()
        la.wait_exit()
        la.close()


def test_report_channel_progress_frames() -> None:
    from vlaunch.cache.contract import progress, wire
    from vlaunch.cache.contract.errors import ProtocolError
    from vlaunch.launcher.progress import recv_ready

    ours, theirs = socket.socketpair()
    with ours, theirs:
        for loaded in (0, 50, 100):
            wire.send_frame(theirs, progress.frame(0, loaded, 100))
        wire.send_frame(theirs, {"event": "ready", "rank": 0})
        seen: list[tuple[int, int]] = []
        ready, fds = recv_ready(ours, lambda *lt: seen.append(lt))
        assert ready == {"event": "ready", "rank": 0} and fds == []
        assert seen == [(0, 100), (50, 100), (100, 100)]
        wire.send_frame(theirs, {"event": "progress", "loaded": "lots", "total": 1})
        with pytest.raises(ProtocolError, match="bad progress frame"):
            recv_ready(ours, lambda *lt: None)


def test_engine_that_cannot_start_later_is_named_so() -> None:
    from vlaunch.launcher.core import Supervisor
    from vlaunch.launcher.core.events import CacheReady, ChildExited, Log, Spawned, Started
    from vlaunch.launcher.core.events import SupervisorConfig as Config

    sup = Supervisor(Config(ranks=(0,), has_engine=True, engine_readiness="notify",
                            engine_config_error_statuses=frozenset({127})))
    actions = [a for e in (Started(0), Spawned("cache", 0, 100, 0), CacheReady(0, 1),
                           ChildExited("engine", None, 0, 127, 1))  # exec failed: no pid
               for a in sup.handle(e)]
    errors = [a.message for a in actions if isinstance(a, Log) and a.level == "ERROR"]
    assert errors[0].startswith("engine could not be started: status 127")
    assert "pid 0" not in " ".join(errors) and sup.exit_status is None  # stopping the ranks
