"""Cache ranks and the launcher end with the documented status for each failure (real runs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.exitcodes import EXIT_TABLE, ExitStatus

from .conftest import eventually, spawn_cache
from .test_launcher import Launcher, serving


def _exit(cache) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    status = cache.proc.wait(60)
    return status, cache.proc.stderr.read().decode()


def _every_error_class() -> list[type[VlaunchError]]:
    """VlaunchError and its subclasses, once every vlaunch module (bar the engine
    integrations) is imported; from the source tree, as an editable install hides it."""
    import importlib

    root = Path(__file__).resolve().parents[1]
    for top in ("cache", "launcher"):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__main__" or parts[:2] == ("cache", "integrations"):
                continue
            importlib.import_module(".".join(("vlaunch", *parts)).removesuffix(".__init__"))
    found, todo = [], [VlaunchError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_error_class_has_a_documented_status() -> None:
    """Statuses are named in the class (`exit_status("USAGE")`) and looked up when read: a
    misspelt name would fail only then, so every class's is read here."""
    documented = {info.status for info in EXIT_TABLE}
    classes = _every_error_class()
    assert len(classes) > 15, classes
    for cls in classes:
        assert isinstance(cls.status, ExitStatus) and cls.status in documented, cls
        assert cls.__new__(cls).status is cls.status  # read on an instance too


def test_plan_that_does_not_divide_exits_78(llama_ckpt: Path, sockdir: Path) -> None:
    status, err = _exit(spawn_cache(llama_ckpt, sockdir, tp=3, rank=1))
    assert status == ExitStatus.BAD_PLAN and "does not divide evenly" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_missing_gpu_exits_71(llama_ckpt: Path, sockdir: Path) -> None:
    status, err = _exit(spawn_cache(llama_ckpt, sockdir, "--device", "cuda:0"))
    assert status == ExitStatus.NO_DEVICE, err


def test_read_failure_is_an_io_error_with_status_74(tmp_path: Path) -> None:
    """A read that fails underneath (EIO, EISDIR...) is ReadError: the rank exits 74."""
    from vlaunch.cache.store.reader import ReadError, pread_into

    fd = os.open(tmp_path, os.O_RDONLY)  # reading a directory fails like a bad disk would
    try:
        with pytest.raises(ReadError, match="check the disk") as err:
            pread_into(fd, memoryview(bytearray(16)), 0, "shard.safetensors")
    finally:
        os.close(fd)
    assert err.value.status == ExitStatus.IO_ERROR


def test_usage_error_of_a_cache_rank_exits_64(llama_ckpt: Path, sockdir: Path) -> None:
    status, _ = _exit(spawn_cache(llama_ckpt, sockdir, rank=2, tp=2))
    assert status == ExitStatus.USAGE


def test_broken_escrow_channel_exits_70(llama_ckpt: Path, sockdir: Path) -> None:
    ours, theirs = socket.socketpair()
    ours.sendall(b"this is not a frame at all")
    ours.close()
    cache = spawn_cache(llama_ckpt, sockdir, "--adopt-fd", str(theirs.fileno()), wait=False,
                        extra_fds=[theirs.fileno()])
    theirs.close()
    status, err = _exit(cache)
    assert status == ExitStatus.INTERNAL and "bad magic" in err


def test_an_engine_over_its_memory_budget_stops_the_launcher_with_81(
        tmp_path: Path, llama_ckpt: Path) -> None:
    """The engine refuses its start with WeightBudgetError (its status 78, a configuration
    error); the launcher does not restart it and exits 81, as docs/memory.md says."""
    engine = ("import sys\n"
              "from vlaunch.cache.client.budget import check_external_weights\n"
              "try:\n    check_external_weights(2 << 30, 1 << 30, 0.9, 'cuda:0')\n"
              "except Exception as exc:\n    print(exc, file=sys.stderr)\n"
              "    sys.exit(exc.status)\n")
    la = Launcher(tmp_path, llama_ckpt, engine=[sys.executable, "-c", engine], tp=1)
    try:
        assert la.wait_exit() == ExitStatus.ENGINE_CONFIG
        assert "Externally held weights exceed the engine's memory budget" in la.text()
        assert "status 78" in la.text() or "exited 78" in la.text(), la.text()
    finally:
        la.close()


def test_final_sweep_leaves_no_grandchild(tmp_path: Path, llama_ckpt: Path) -> None:
    marker = tmp_path / "grandchild.pid"
    engine = ("import os, signal, subprocess, sys, time, socket\n"
              f"p = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
              f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
              "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
              "s.connect(os.environ['NOTIFY_SOCKET']); s.send(b'READY=1')\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
              "time.sleep(600)\n")
    la = Launcher(tmp_path, llama_ckpt, "--engine-ready", "notify", "--backoff-initial", "0",
                  engine=[sys.executable, "-c", engine], tp=1)
    try:
        snap = la.wait_for(serving)
        grandchild = int(marker.read_text())
        # the engine's keeper alone, as the OOM killer might: the engine dies with it (its
        # parent-death signal), its daemon re-parents to the launcher, a subreaper
        os.kill(snap["engine"]["pid"], signal.SIGKILL)
        la.wait_for(lambda s: serving(s) and s["engine"]["attempt"] == 2)
        assert not _gone(grandchild)
        second = int(marker.read_text())  # the next engine's daemon, under its keeper
        la.proc.send_signal(signal.SIGTERM)
        assert la.wait_exit() == ExitStatus.OK
        eventually(lambda: _gone(grandchild) and _gone(second), 10, what="both daemons gone")
        # the first by the launcher's final sweep; the second with its engine, by its keeper
        assert "swept 1 leftover" in la.text() and "sleep 600" in la.text()
    finally:
        la.close()


def test_vlaunch_status_shows_a_running_launcher(tmp_path: Path, llama_ckpt: Path) -> None:
    la = Launcher(tmp_path, llama_ckpt, engine=None)
    try:
        la.wait_for(lambda s: s["phase"] == "serving")
        cmd = [sys.executable, "-m", "vlaunch.launcher.cli", "status", "--socket-dir",
               str(la.sockdir)]
        human = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
        assert "phase serving" in human.stdout and "ready" in human.stdout
        js = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=30,
                            check=True)
        import json

        snap = json.loads(js.stdout)
        assert set(snap["ranks"]) == {"0", "1"} and snap["ranks"]["0"]["device"] == "cpu"
        la.proc.send_signal(signal.SIGTERM)
        assert la.wait_exit() == 0
        gone = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert gone.returncode == ExitStatus.USAGE and "no running launcher" in gone.stderr
    finally:
        la.close()


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie waiting for its parent counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
