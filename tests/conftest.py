"""Shared fixtures: small real checkpoints and real cache processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from hypothesis import settings
from safetensors.torch import save_file

from vlaunch.cache.contract import progress
from vlaunch.cache.contract.waiting import until

# Shared CI machines are noisy: no per-example deadline, fixed example counts.
settings.register_profile("vlaunch", deadline=None, print_blob=True)
settings.load_profile("vlaunch")

T = TypeVar("T")


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Iterator[object]:
    """One worker per core (pytest-xdist, work stealing) for a run of whole directories (the
    suite, `tests/faults`) unless `-n` was given; files and single tests run in one process,
    where workers' start-up (each imports torch) costs more than they save.

    Not an addopts line: the FlashInfer venv has no pytest-xdist, and there the suite runs in
    one process. `-n 0` runs it in one process anywhere. A run that selects the GPU tests
    (`-m gpu`) stays in one process too: they measure the device's free memory, which tests
    on other workers would move.
    """
    option = config.option
    if not hasattr(config, "workerinput"):
        _byte_compile_vlaunch()
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and option.numprocesses is None and not option.usepdb
            and not _selects_gpu_tests(option.markexpr or "")
            and all(Path(arg).is_dir() for arg in config.args)):
        option.numprocesses = "auto"
        if option.dist == "no":
            option.dist = "worksteal"
    return (yield)


def _selects_gpu_tests(markexpr: str) -> bool:
    """Whether a -m expression asks for the gpu marker (not only excludes it)."""
    return "gpu" in markexpr.replace("not gpu", "")


def _byte_compile_vlaunch() -> None:
    """Byte-compile vlaunch's sources once, as pip does for an installed package.

    The suite starts about 300 Python processes (ranks, launchers, engines), and an editable
    install is never compiled: where bytecode is not written (PYTHONDONTWRITEBYTECODE=1, as
    on these machines), each of them compiled every vlaunch module it imported, 27 of the
    suite's 312 CPU seconds (benchmarks/results/cpu.md). Up-to-date files cost a stat each.
    """
    import compileall

    root = Path(__file__).resolve().parent.parent
    for package in ("cache", "launcher"):
        compileall.compile_dir(str(root / package), quiet=1)


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """One torch intra-op thread here and in every child (OMP_NUM_THREADS=1).

    The suite runs several torch processes at once on a few cores; each one's default pool
    (a thread per core) spins against the others: a tiny model's forward pass took 144 ms with
    two threads on a busy 2-core machine, 6 ms with one. The vLLM suite keeps its own setting.
    """
    if any(item.get_closest_marker("vllm") for item in request.session.items):
        yield
        return
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(check: Callable[[], T | None], timeout: float = 60.0, *,
               what: str | Callable[[], str] = "", interval: float = 0.02) -> T:
    """Poll `check` until it returns something truthy (returned) or `timeout` passes (fail).

    The one wait of the suite: no sleep stands in for synchronisation. `timeout=0` checks
    exactly once, for a test that expects a miss. An exception from `check` propagates.
    """
    try:
        return until(check, timeout, what=what, interval=interval)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


LLAMA_SHAPES = {
    "q_proj": (64, 32), "k_proj": (32, 32), "v_proj": (32, 32), "o_proj": (32, 64),
    "gate_proj": (128, 32), "up_proj": (128, 32), "down_proj": (32, 128),
}


def llama_tensors(layers: int = 2, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random Llama-named tensors whose split dims divide by 1, 2 and 4."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(256, 32, generator=g)}
    for i in range(layers):
        for name, shape in LLAMA_SHAPES.items():
            mod = "self_attn" if name[0] in "qkvo" else "mlp"
            out[f"model.layers.{i}.{mod}.{name}.weight"] = torch.randn(shape, generator=g)
        out[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(32, generator=g)
    out["model.norm.weight"] = torch.randn(32, generator=g)
    out["lm_head.weight"] = torch.randn(256, 32, generator=g)
    return {k: v.to(dtype) for k, v in out.items()}


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-shard Llama-named checkpoint with an index file."""
    root = tmp_path_factory.mktemp("llama")
    tensors = llama_tensors()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(root / fname))
        weight_map.update({n: fname for n in part})
    import json

    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `vlaunch demo` checkpoint, made once as the demo makes it (a child process)."""
    root = tmp_path_factory.mktemp("demo-cache")
    subprocess.run([sys.executable, "-c", "from vlaunch.launcher.demo import "
                    "ensure_demo_checkpoint as e; e()"], check=True, timeout=120,
                   env={**os.environ, "VLAUNCH_CACHE_DIR": str(root)})
    return root / "demo-llama"


@dataclass
class CacheProc:
    """A running cache rank started by a test."""

    proc: subprocess.Popen[bytes]
    ready: dict
    escrow: list[int]
    socket_dir: Path

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        for fd in self.escrow:
            os.close(fd)
        self.escrow = []
        return self.proc.wait(20)


def spawn_cache(model: Path | str, socket_dir: Path, *args: str, rank: int = 0,
                tp: int = 1, wait: bool = True, extra_fds: list[int] | None = None,
                prefix: Sequence[str] = (), python: str = sys.executable,
                **popen: object) -> CacheProc:
    """Start `python -m vlaunch.cache` (after `prefix`: a wrapper such as unshare; `python`:
    another environment's, an engine's) and wait for its ready frame on a socketpair."""
    ours, theirs = socket.socketpair()
    cmd = [*prefix, python, "-m", "vlaunch.cache", "--model", str(model), "--socket-dir",
           str(socket_dir), "--rank", str(rank), "--tensor-parallel-size", str(tp),
           "--ready-fd", str(theirs.fileno()), *args]
    proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno(), *(extra_fds or [])],
                            stderr=subprocess.PIPE,
                            **popen)  # type: ignore[call-overload]
    theirs.close()
    ready: dict = {}
    fds: list[int] = []
    if wait:
        ours.settimeout(60)
        try:
            ready, fds = progress.recv_ready(ours)  # loaded bytes come before the ready frame
        except EOFError:
            proc.wait(30)
    ours.close()
    return CacheProc(proc, ready, fds, socket_dir)


def rank_status(socket_dir: Path, rank: int = 0) -> dict:
    """A rank's `status` reply, on a connection of its own."""
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.contract.sockdir import socket_path

    client = CacheClient(socket_path(socket_dir, rank))
    try:
        return client.status()
    finally:
        client.close()


@pytest.fixture
def notify_reader(tmp_path: Path) -> Iterator[socket.socket]:
    """A bound, non-blocking datagram socket standing in for systemd's NOTIFY_SOCKET; tests
    read it, or leave it unread."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0)
    yield sock
    sock.close()


@pytest.fixture
def sockdir(tmp_path: Path) -> Path:
    """A fresh 0700 socket directory."""
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def caches() -> Iterator[list[CacheProc]]:
    """Collects caches started by a test and stops them afterwards."""
    started: list[CacheProc] = []
    yield started
    for c in started:
        c.stop()
