"""`vlaunch swap` and published versions with the real launcher, cache ranks and reference
engine at TP 1 and 2 (CPU): both modes, refusals that leave the old weights serving
bit-exact, rollback, a rank killed mid-swap, a published version."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.reference.refmodel import greedy, make_checkpoint

from .conftest import eventually
from .test_engine import run_ranks
from .test_launcher import Launcher, launch, serving  # noqa: F401  (launch is a fixture)

PROMPT = [1, 5, 9, 2, 77]
SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128,
         "vocab": 256}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A and B: one architecture, other values; C: another architecture."""
    root = tmp_path_factory.mktemp("swap")
    return {"a": make_checkpoint(root / "a", seed=0, **SHAPE),
            "b": make_checkpoint(root / "b", seed=1, **SHAPE),
            "c": make_checkpoint(root / "c", seed=2, **{**SHAPE, "intermediate": 192})}


@pytest.fixture(scope="module")
def want(ckpts: dict[str, Path]) -> dict[str, list[int]]:
    """The tokens a fresh disk load of each checkpoint generates."""
    return {name: run_ranks(ckpts[name], 1, lambda m: greedy(m, PROMPT, 6))[0]
            for name in ("a", "b")}


def port_of(la: Launcher) -> Path:
    return la.sockdir.parent / "port"


def reference(la_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "vlaunch.cache.reference.engine", "--port-file",
            str(la_dir / "port"), *args]


def generate(la: Launcher) -> list[int]:
    """POST /generate to the engine that serves now (each writes the port file when it binds
    its port, a moment before it is ready: 503 until then)."""
    def answer() -> list[int] | None:
        if not port_of(la).exists() or not port_of(la).read_text().strip():
            return None
        body = json.dumps({"tokens": PROMPT, "max_new_tokens": 6}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port_of(la).read_text().strip()}"
                                     "/generate", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read())["tokens"]
        except urllib.error.HTTPError as exc:
            if exc.code == 503:
                return None
            raise

    return eventually(answer, 90, what=lambda: la.text(), interval=0.1)


def swap(la: Launcher, model: Path | str, *args: str, timeout: float = 300
         ) -> subprocess.CompletedProcess[str]:
    """`vlaunch swap` against the launcher; its outcome (status, output)."""
    return subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "swap", "--socket-dir",
                           str(la.sockdir), "--model", str(model), *args],
                          capture_output=True, text=True, timeout=timeout)


def swap_later(la: Launcher, model: Path | str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "vlaunch.launcher.cli", "swap",
                             "--socket-dir", str(la.sockdir), "--model", str(model), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def served(la: Launcher) -> dict[str, Any]:
    """The serving status once the swap (if any) is over."""
    return la.wait_for(lambda s: serving(s) and s["swap"]["state"] == "none")


def fresh_port(la: Launcher) -> None:
    """Forget the engine's port: the next engine writes its own."""
    port_of(la).unlink(missing_ok=True)


def test_swap_both_modes_at_tp2_and_refusals_leave_a_serving(
        launch, ckpts: dict[str, Path], want: dict[str, list[int]], tmp_path: Path) -> None:  # noqa: F811
    la = launch(ckpts["a"], "--stop-timeout", "30", "--engine-ready", "notify", tp=2,
                engine=reference(tmp_path / "l0", "--no-engine-layout"))
    snap = served(la)
    assert generate(la) == want["a"]
    # A -> B, double-buffered: the new slabs beside the old, the engine restarts on them
    fresh_port(la)
    r = swap(la, ckpts["b"])
    assert r.returncode == 0, r.stderr + la.text()
    assert "version 1" in r.stdout and "(double)" in r.stdout
    assert generate(la) == want["b"]
    snap = served(la)
    assert snap["swap"]["version"] == 1 and snap["swap"]["model"] == str(ckpts["b"])
    assert snap["launcher"]["model"] == str(ckpts["b"])
    assert all(r["checkpoint"]["model"] == str(ckpts["b"]) for r in snap["ranks"].values())
    with urllib.request.urlopen(la.url + "/metrics", timeout=5) as resp:
        assert "vlaunch_weights_version 1.0" in resp.read().decode()
    verify = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "verify",
                             "--socket-dir", str(la.sockdir)], capture_output=True, text=True,
                            timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr  # it describes B now
    # in place while another process maps B (a share lease): the copy waits, then refuses
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ckpts["b"]), str(la.sockdir)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    fresh_port(la)
    r = swap(la, ckpts["a"], "--mode", "in-place", "--lease-wait", "1")
    holder.kill()
    holder.wait()
    assert r.returncode == ExitStatus.SWAP_ROLLED_BACK, r.stderr + la.text()
    assert f"still mapped by pid {holder.pid} (share)" in r.stderr  # the pid said once
    assert generate(la) == want["b"]  # never overwritten: B serves again, bit-exact
    # B -> A in place: staged on the host, copied into the served slabs
    fresh_port(la)
    r = swap(la, ckpts["a"], "--mode", "in-place")
    assert r.returncode == 0 and "(in-place)" in r.stdout, r.stderr + la.text()
    assert generate(la) == want["a"]
    snap = served(la)
    engine = snap["engine"]["pid"]
    # refusals: nothing was touched, the engine never stopped, A serves bit-exact
    r = swap(la, ckpts["c"])
    assert r.returncode == ExitStatus.BAD_PLAN, r.stderr
    assert "cannot replace the weights rank" in r.stderr and "keeps serving" in r.stderr
    corrupt = tmp_path / "corrupt"
    shutil.copytree(ckpts["b"], corrupt)
    shard = sorted(corrupt.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-64])
    r = swap(la, corrupt)
    assert r.returncode == ExitStatus.BAD_CHECKPOINT, r.stderr
    r = swap(la, tmp_path / "nothing")
    assert r.returncode == ExitStatus.NO_MODEL, r.stderr
    r = swap(la, ckpts["a"])
    assert r.returncode == ExitStatus.SWAP_UNAVAILABLE and "nothing to swap" in r.stderr
    snap = served(la)
    assert snap["engine"]["pid"] == engine and snap["swap"]["version"] == 2
    assert generate(la) == want["a"]
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
    assert "Traceback" not in la.text()


@pytest.mark.slow  # ~30 s: the default suite keeps TP 2 both modes, the rollback and publish
def test_swap_with_a_standby_at_tp1_both_modes(
        launch, ckpts: dict[str, Path], want: dict[str, list[int]], tmp_path: Path) -> None:  # noqa: F811
    la = launch(ckpts["a"], "--stop-timeout", "30", "--standby", "--engine-ready", "notify",
                tp=1, engine=reference(tmp_path / "l0"))
    la.wait_for(lambda s: serving(s) and s["standby"]["state"] == "parked")
    assert generate(la) == want["a"]
    fresh_port(la)
    r = swap(la, ckpts["b"], "--mode", "double")
    assert r.returncode == 0, r.stderr + la.text()
    assert generate(la) == want["b"]
    snap = la.wait_for(lambda s: serving(s) and s["standby"]["state"] == "parked")
    assert snap["standby"]["promotions"] == 1 and snap["standby"]["failures"] == 0
    # in place, A changing after it was staged: refused at the commit, B serves again
    fresh_port(la)
    proc = swap_later(la, ckpts["a"], "--mode", "in-place")
    la.wait_for(lambda s: s["swap"]["state"] == "parking", timeout=120)
    shard = sorted(ckpts["a"].glob("*.safetensors"))[0]
    os.utime(shard)  # the new checkpoint "changes" after it was staged
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == ExitStatus.SWAP_ROLLED_BACK, err + la.text()
    assert "changed after rank 0 staged it" in err
    assert generate(la) == want["b"]
    # and in place for real: the standby parks before its weights and is promoted
    la.wait_for(lambda s: serving(s) and s["standby"]["state"] == "parked")
    fresh_port(la)
    r = swap(la, ckpts["a"], "--mode", "in-place")
    assert r.returncode == 0, r.stderr + la.text()
    assert generate(la) == want["a"]
    assert "to park before its weights" in la.text()
    snap = served(la)
    assert snap["standby"]["promotions"] >= 2 and snap["swap"]["version"] == 2
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


HOLD = r"""
import sys, time
import vlaunch.cache as vc
model, sockdir = sys.argv[1:3]
held = [vc.load(model, rank=r, tensor_parallel_size=2, socket_dir=sockdir, fallback=False,
                device="cpu") for r in (0, 1)]
print("held", flush=True)
time.sleep(600)
"""
"""A second engine outside the launcher: it maps both ranks' weights and keeps them."""

OUTSIDE = r"""
import sys, time
import vlaunch.cache as vc
model, sockdir, mode = sys.argv[1:4]
w = vc.load(model, socket_dir=sockdir, fallback=False, device="cpu", mode=mode)
assert w.source == "cache", w.source
if mode == "share":
    w.client.close()  # the lease ends; the tensors, and their mappings, stay
print("held", flush=True)
time.sleep(600)
"""
"""An engine outside the launcher at TP 1 that keeps its weights: a copy-mode one (its own
memory), or a share one whose lease ended."""


def outside(la: Launcher, model: Path, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", OUTSIDE, str(model), str(la.sockdir), mode],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_in_place_swaps_wait_only_for_what_maps_the_slabs(
        launch, ckpts: dict[str, Path], want: dict[str, list[int]], tmp_path: Path) -> None:  # noqa: F811
    la = launch(ckpts["a"], "--stop-timeout", "30", "--engine-ready", "notify", tp=1,
                engine=reference(tmp_path / "l0", "--no-engine-layout"))
    served(la)
    copier = outside(la, ckpts["a"], "copy")  # holds its own copy, nothing of the slabs
    try:
        fresh_port(la)
        r = swap(la, ckpts["b"], "--mode", "in-place", "--lease-wait", "2")
        assert r.returncode == 0, r.stderr + la.text()
        assert generate(la) == want["b"]
        keeper = outside(la, ckpts["b"], "share")  # its lease ended, its mappings did not
        try:
            fresh_port(la)
            r = swap(la, ckpts["a"], "--mode", "in-place", "--lease-wait", "1")
            assert r.returncode == ExitStatus.SWAP_ROLLED_BACK, r.stderr + la.text()
            assert f"still mapped by pid {keeper.pid}, which opened them before and still " \
                   "runs" in r.stderr, r.stderr
            assert generate(la) == want["b"]
        finally:
            keeper.kill()
            keeper.wait()
    finally:
        copier.kill()
        copier.wait()
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


def respawned(la: Launcher, kill: int) -> dict[str, Any]:
    """SIGKILL rank 0 (`kill`: its pid as this process sees it): its slabs are adopted from
    the escrow (--on-rank-exit respawn); the status once it serves again."""
    os.kill(kill, signal.SIGKILL)
    return la.wait_for(lambda s: serving(s) and s["ranks"]["0"]["respawns"] == 1
                       and s["caches_ready"])


def test_an_adopted_rank_follows_who_maps_its_slabs_and_swaps_in_place(
        launch, ckpts: dict[str, Path], want: dict[str, list[int]], tmp_path: Path) -> None:  # noqa: F811
    la = launch(ckpts["a"], "--stop-timeout", "30", "--engine-ready", "notify",
                "--on-rank-exit", "respawn", tp=1,
                engine=reference(tmp_path / "l0", "--no-engine-layout"))
    snap = served(la)
    respawned(la, snap["ranks"]["0"]["pid"])
    assert "adopted slabs that 1 process(es) may still map" in la.text()  # the engine's
    fresh_port(la)
    r = swap(la, ckpts["b"], "--mode", "in-place", "--lease-wait", "10")
    assert r.returncode == 0, r.stderr + la.text()  # the engine is gone: nothing maps them
    assert generate(la) == want["b"]
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="PID namespaces need unshare(1) and root here")
def test_an_in_place_swap_the_rank_cannot_make_is_refused_before_the_engine_stops(
        launch, ckpts: dict[str, Path], want: dict[str, list[int]], tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = reference(tmp_path / "l0", "--no-engine-layout")
    wrapper = tmp_path / "python-in-a-namespace"  # the launcher in a PID namespace of its own
    wrapper.write_text(f"#!/bin/sh\nexec unshare --pid --fork --mount-proc "
                       f"--kill-child=SIGTERM {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", str(wrapper))
        la = launch(ckpts["a"], "--stop-timeout", "30", "--engine-ready", "notify",
                    "--on-rank-exit", "respawn", tp=1, engine=engine)
    served(la)
    # a second engine out here: to the rank, a process of another PID namespace (pid 0)
    holder = outside(la, ckpts["a"], "share")
    holder.kill()
    holder.wait()
    [rank] = [p for p in psutil.Process(la.proc.pid).children(recursive=True)
              if "vlaunch.cache" in p.cmdline()]
    snap = respawned(la, rank.pid)
    engine_pid = snap["engine"]["pid"]
    r = swap(la, ckpts["b"], "--mode", "in-place")
    assert r.returncode == ExitStatus.SWAP_UNAVAILABLE, r.stderr + la.text()
    assert "rank 0 cannot swap in place: it cannot tell which processes still map its slabs " \
           "(it adopted its slabs from a rank that exited, which could not name every process " \
           "that opened them (one in another PID namespace" in r.stderr, r.stderr
    assert "version 0 keeps serving" in r.stderr
    snap = served(la)
    assert snap["engine"]["pid"] == engine_pid  # never stopped
    assert generate(la) == want["a"]
    r = swap(la, ckpts["b"])  # auto: double fits on this host, and double needs no wait
    assert r.returncode == 0 and "(double)" in r.stdout, r.stderr + la.text()
    assert generate(la) == want["b"]
    inside = psutil.Process(la.proc.pid).children(recursive=True)
    la.proc.kill()  # unshare ignores SIGTERM; its death SIGTERMs the launcher (--kill-child)
    la.wait_exit()
    _, alive = psutil.wait_procs(inside, timeout=60)
    assert not alive, alive


STALE_ON_B = r"""
import os, sys
from vlaunch.cache.store import identity
if os.environ["VLAUNCH_MODEL"].endswith("/b"):
    # what files rewritten with their mtimes restored look like to an engine that took their
    # identity before (the file check's blind spot): its fingerprint is not the cache's
    real = identity.identities
    identity.identities = lambda *a, **k: identity.CheckpointIdentity(real(*a, **k)[0], "old")
from vlaunch.cache.reference.engine import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("mode", ["double", pytest.param("in-place", marks=pytest.mark.slow)])
def test_a_new_engine_that_loads_from_disk_is_no_finished_swap(
        launch, ckpts: dict[str, Path], want: dict[str, list[int]], tmp_path: Path,  # noqa: F811
        mode: str) -> None:
    script = tmp_path / "engine.py"
    script.write_text(STALE_ON_B)
    engine = [sys.executable, str(script), "--port-file", str(tmp_path / "l0" / "port")]
    la = launch(ckpts["a"], "--stop-timeout", "30", "--engine-ready", "notify", tp=1,
                engine=engine)
    la.wait_for(lambda s: serving(s) and s["engine"]["weights"] == {"0": "cache"})
    assert generate(la) == want["a"]
    fresh_port(la)
    r = swap(la, ckpts["b"], "--mode", mode)
    assert r.returncode == ExitStatus.SWAP_ROLLED_BACK, r.stderr + la.text()
    assert "the new engine is ready, but not on the new weights from the caches: cache " \
           "rank 0 refused them (fingerprint mismatch: checkpoint_data is 'old' for it" \
           in r.stderr, r.stderr
    assert "cache rank 0 refused its weights to the engine" in la.text()
    snap = la.wait_for(lambda s: serving(s) and s["swap"]["state"] == "none" and
                       s["engine"]["weights"] == {"0": "cache"})
    assert snap["swap"]["version"] == 0 and "rolled back" in snap["swap"]["last"]
    assert generate(la) == want["a"]  # the old engine's weights, from the caches again
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


CRASH_ON_B = r"""
import os, sys
if os.environ["VLAUNCH_MODEL"].endswith("/b"):
    sys.exit(3)  # this engine cannot run the new checkpoint
from vlaunch.cache.reference.engine import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_new_engine_that_crashes_rolls_back_or_stops(
        launch, ckpts: dict[str, Path], want: dict[str, list[int]], tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "engine.py"
    script.write_text(CRASH_ON_B)
    engine = [sys.executable, str(script), "--port-file", str(tmp_path / "l0" / "port")]
    la = launch(ckpts["a"], "--stop-timeout", "30", "--engine-ready", "notify",
                "--backoff-initial", "0", tp=1, engine=engine)
    served(la)
    assert generate(la) == want["a"]
    for mode in ("double", "in-place"):
        fresh_port(la)
        r = swap(la, ckpts["b"], "--mode", mode, "--attempts", "2")
        assert r.returncode == ExitStatus.SWAP_ROLLED_BACK, r.stderr + la.text()
        assert "exited 2 time(s) before it was ready" in r.stderr
        snap = served(la)
        assert snap["swap"]["version"] == 0 and snap["swap"]["rollbacks"] >= 1
        assert generate(la) == want["a"]  # never a mix: the old weights, bit for bit
    r = swap(la, ckpts["b"], "--on-failure", "stop", "--attempts", "1")
    assert r.returncode == ExitStatus.SWAP_FAILED, r.stderr
    assert la.wait_exit() == ExitStatus.SWAP_FAILED


HANG_ON_B = r"""
import os, sys, time
if os.environ["VLAUNCH_MODEL"].endswith("/b"):
    time.sleep(600)  # never ready on the new checkpoint
from vlaunch.cache.reference.engine import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_launcher_dying_mid_swap_says_whether_the_ranks_had_cut_over(
        launch, ckpts: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "engine.py"
    script.write_text(HANG_ON_B)
    for cut_over in (False, True):
        la = launch(ckpts["a"], "--engine-ready", "notify", tp=1, engine=[
            sys.executable, str(script), "--port-file", str(tmp_path / "port")])
        snap = served(la)
        rank = snap["ranks"]["0"]["pid"]
        if not cut_over:
            os.kill(rank, signal.SIGSTOP)  # the prepare is never answered
        proc = swap_later(la, ckpts["b"], "--mode", "double")
        la.wait_for(lambda s, c=cut_over: s["swap"]["state"] == ("starting" if c else
                                                                  "preparing"))
        la.proc.kill()
        _, err = proc.communicate(timeout=60)
        if not cut_over:
            os.kill(rank, signal.SIGKILL)
        assert proc.returncode == ExitStatus.SWAP_UNAVAILABLE, err
        if cut_over:
            assert "swap to version 1: cutting over (double)" in err, err
            assert "after the ranks began to cut over (it stopped?): they may hold" in err
        else:
            assert "before the ranks began to cut over (it stopped?): the old weights" in err
        la.wait_exit()


@pytest.mark.slow
def test_a_rank_killed_mid_swap(launch, ckpts: dict[str, Path],  # noqa: F811
                                want: dict[str, list[int]], tmp_path: Path) -> None:
    # a short stop timeout: the engine is frozen (SIGSTOP) and killed after it
    la = launch(ckpts["a"], "--stop-timeout", "5", "--engine-ready", "notify",
                "--on-rank-exit", "respawn", tp=2, engine=reference(tmp_path / "l0"))
    snap = served(la)
    # staging: the swap is abandoned (87), the rank respawns from the escrow, A serves
    frozen = snap["ranks"]["1"]["pid"]
    os.kill(frozen, signal.SIGSTOP)
    proc = swap_later(la, ckpts["b"])
    la.wait_for(lambda s: s["swap"]["state"] == "preparing")
    os.kill(frozen, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitStatus.SWAP_UNAVAILABLE, err + la.text()
    assert "exited during the swap to version 1, before any cutover" in err
    snap = la.wait_for(lambda s: serving(s) and s["ranks"]["1"]["respawns"] == 1
                       and s["caches_ready"])
    assert generate(la) == want["a"]
    # past the cutover's start: the launcher stops (69) whatever --on-rank-exit says
    os.killpg(snap["engine"]["pid"], signal.SIGSTOP)  # its stop takes until the SIGKILL
    proc = swap_later(la, ckpts["b"], "--mode", "in-place")
    snap = la.wait_for(lambda s: s["swap"]["state"] == "stopping")
    os.kill(snap["ranks"]["0"]["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitStatus.SWAP_FAILED, err
    assert la.wait_exit() == ExitStatus.RANK_EXITED
    assert "after its cutover began" in la.text()


def test_a_published_version_serves_bit_exact_at_tp2(
        launch, ckpts: dict[str, Path], want: dict[str, list[int]], tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import vlaunch.cache as vc
    from vlaunch.cache.client.loader import load_from_disk
    from vlaunch.cache.store.plan import Position
    from vlaunch.cache.store.target import Target

    # the raw layout stays (no engine layout): vlaunch verify and a raw load read it
    la = launch(ckpts["a"], "--stop-timeout", "30", "--engine-ready", "notify", tp=2,
                engine=reference(tmp_path / "l0", "--no-engine-layout"))
    served(la)
    shards = [{k: v.clone() for k, v in load_from_disk(Target(
        str(ckpts["b"]), Position.from_global(r, 2), "cpu")).items()} for r in (0, 1)]
    wrong = {**shards[0], sorted(shards[0])[0]: torch.zeros(3, dtype=torch.bfloat16)}
    with pytest.raises(vc.PublishError, match=r"not published: .* is BF16"):
        vc.publish(wrong, label="wrong-shape", rank=0, socket_dir=str(la.sockdir))
    fresh_port(la)
    # a trainer per rank (threads here): each call returns once every rank serves the version
    results: list[Any] = [None, None]

    def trainer(rank: int) -> None:
        results[rank] = vc.publish(shards[rank], label="step-1", rank=rank,
                                   socket_dir=str(la.sockdir), timeout=300)

    threads = [threading.Thread(target=trainer, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [(r.version, r.mode) for r in results] == [(1, "double")] * 2, la.text()
    assert generate(la) == want["b"]  # B's bytes, published: the same tokens
    snap = la.wait_for(lambda s: serving(s) and all(
        (r["checkpoint"] or {}).get("published") == "step-1" for r in s["ranks"].values()))
    assert snap["swap"]["label"] == "step-1"
    verify = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "verify",
                             "--socket-dir", str(la.sockdir)], capture_output=True, text=True,
                            timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    identities = ",".join(snap["ranks"][str(r)]["checkpoint"]["identity"] for r in (0, 1))
    monkeypatch.setenv("VLAUNCH_CHECKPOINT_DATA", identities)
    monkeypatch.setenv("VLAUNCH_RANKS", "0,1")
    for rank in (0, 1):  # what an engine maps is what the trainer published, bit for bit
        w = vc.load(str(ckpts["a"]), rank=rank, tensor_parallel_size=2,
                    socket_dir=str(la.sockdir), fallback=False, device="cpu")
        assert w.source == "cache" and set(w) == set(shards[rank])
        assert all(torch.equal(w[k], shards[rank][k]) for k in w), rank
        del w
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0


def test_load_from_disk_is_refused_for_a_published_version(tmp_path: Path,
                                                           ckpts: dict[str, Path]) -> None:
    env = {**os.environ, "VLAUNCH_CHECKPOINT_DATA": "published-x", "VLAUNCH_RANKS": "0",
           "VLAUNCH_SOCKET_DIR": str(tmp_path / "none")}
    r = subprocess.run([sys.executable, "-c", "import sys, vlaunch.cache as vc; "
                        "vc.load(sys.argv[1], device='cpu')", str(ckpts["a"])],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 and "that only its cache holds" in r.stderr, r.stderr


def test_vlaunch_swap_without_a_launcher_is_87(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "swap", "--socket-dir",
                        str(d), "--model", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == ExitStatus.SWAP_UNAVAILABLE and "no launcher answers" in r.stderr


@pytest.mark.slow
def test_a_hundred_swaps_keep_fds_and_memory_flat(launch, ckpts: dict[str, Path]) -> None:  # noqa: F811
    import psutil

    la = launch(ckpts["a"], "--stop-timeout", "30", tp=1)  # caches only: the ranks' work
    snap = la.wait_for(serving)
    rank, launcher = psutil.Process(snap["ranks"]["0"]["pid"]), psutil.Process(la.proc.pid)
    marks = []
    for i in range(100):
        model = ckpts["b"] if i % 2 == 0 else ckpts["a"]
        r = swap(la, model, "--mode", ("double", "in-place")[i // 2 % 2])
        assert r.returncode == 0, r.stderr + la.text()
        if i in (9, 99):
            marks.append((rank.num_fds(), launcher.num_fds(),
                          rank.memory_full_info().uss, launcher.memory_full_info().uss))
    (rf0, lf0, rm0, lm0), (rf1, lf1, rm1, lm1) = marks
    assert rf1 <= rf0 + 2 and lf1 <= lf0 + 2, marks
    assert rm1 <= rm0 + (16 << 20) and lm1 <= lm0 + (16 << 20), marks
    assert served(la)["swap"]["version"] == 100
    la.proc.send_signal(signal.SIGTERM)
    assert la.wait_exit() == 0
