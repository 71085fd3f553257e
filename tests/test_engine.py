"""The reference model, its checkpoints, and the reference engine as real processes (CPU, gloo)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from vlaunch.cache.client.loader import load_from_disk
from vlaunch.cache.reference.refmodel import (
    INDEX_NAME,
    ModelConfig,
    ModelConfigError,
    TPLlama,
    greedy,
    make_checkpoint,
    tensor_shapes,
)
from vlaunch.cache.store.checkpoint import open_checkpoint
from vlaunch.cache.store.plan import Position
from vlaunch.cache.store.target import Target

from .conftest import eventually

TINY: dict[str, Any] = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                        "intermediate": 128, "vocab": 256}
PROMPTS = ([1, 2, 3], [200, 7, 7, 7, 42, 0, 255], list(range(40)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", **TINY)


# --- make_checkpoint ---------------------------------------------------------------------------


def read_all(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_make_checkpoint_round_trips(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", **TINY, shards=3)
    b = make_checkpoint(tmp_path / "b", **TINY, shards=3)
    ta, tb = read_all(a), read_all(b)
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert all(t.dtype == torch.bfloat16 for t in ta.values())

    index = json.loads((a / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(ta)
    for name, file in index["weight_map"].items():
        assert name in load_file(a / file)
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ta.values())

    cfg = ModelConfig.from_dir(a)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (64, 2, 256)
    assert {n: tuple(t.shape) for n, t in ta.items()} == tensor_shapes(cfg)
    assert open_checkpoint(a).tensors.keys() == ta.keys()  # vlaunch's own validation accepts it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary left


def test_make_checkpoint_is_idempotent(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", **TINY)
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert make_checkpoint(tmp_path / "m", **TINY) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes
    with pytest.raises(FileExistsError, match="remove it or choose another path"):
        make_checkpoint(tmp_path / "m", **{**TINY, "seed": 1})
    other = read_all(make_checkpoint(tmp_path / "s1", **{**TINY, "seed": 1}))
    assert not torch.equal(other["lm_head.weight"], read_all(path)["lm_head.weight"])


def test_make_checkpoint_target_bytes_picks_the_layer_count(tmp_path: Path) -> None:
    shapes = {**TINY, "layers": 1}
    one = sum(t.nbytes for t in read_all(make_checkpoint(tmp_path / "one", **shapes)).values())
    two = sum(t.nbytes for t in read_all(make_checkpoint(tmp_path / "two", **{
        **shapes, "layers": 2})).values())
    layer = two - one
    path = make_checkpoint(tmp_path / "t", **shapes, target_bytes=one + 5 * layer + layer // 3)
    assert ModelConfig.from_dir(path).num_hidden_layers == 6
    with pytest.raises(ValueError, match="pick smaller shapes"):
        make_checkpoint(tmp_path / "small", **shapes, target_bytes=layer)


# --- the model ---------------------------------------------------------------------------------


def test_config_names_the_field_that_does_not_divide(tiny: Path) -> None:
    cfg = ModelConfig.from_dir(tiny)
    cfg.check_tp(2)
    with pytest.raises(ModelConfigError, match=r"num_attention_heads 4 .* tensor-parallel size 3"):
        cfg.check_tp(3)
    with pytest.raises(ModelConfigError, match="does not exist"):
        ModelConfig.from_dir(tiny / "nowhere")
    with pytest.raises(ModelConfigError, match="num_attention_heads 4 does not divide by "
                                               "num_key_value_heads 3"):
        ModelConfig(64, 128, 2, 4, 3, 256)


class ThreadGroup:
    """Collectives between threads of one process: ranks meet at a barrier, sum in rank order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor] = [torch.empty(0)] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def rank(self, rank: int) -> ThreadRank:
        return ThreadRank(self, rank)


@dataclass
class ThreadRank:
    group: ThreadGroup
    rank: int

    @property
    def size(self) -> int:
        return self.group.size

    def _exchange(self, t: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]
                  ) -> torch.Tensor:
        self.group.slots[self.rank] = t.clone()
        self.group.barrier.wait()
        out = combine(list(self.group.slots))
        self.group.barrier.wait()
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t.copy_(self._exchange(t, lambda parts: torch.stack(parts).sum(0)))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return self._exchange(t, lambda parts: torch.cat(parts, dim=-1))


def run_ranks(tiny: Path, tp: int, fn: Callable[[TPLlama], Any]) -> list[Any]:
    """Run `fn` on every rank of a tp-way model, one thread per rank."""
    cfg = ModelConfig.from_dir(tiny)
    group = ThreadGroup(tp)
    models = [TPLlama(load_from_disk(Target(str(tiny), Position.from_global(r, tp), "cpu")), cfg,
                      group.rank(r)) for r in range(tp)]
    results: list[Any] = [None] * tp

    def target(r: int) -> None:
        results[r] = fn(models[r])

    threads = [threading.Thread(target=target, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_tp1_and_tp2_give_close_logits_and_equal_greedy_tokens(tiny: Path) -> None:
    tokens = torch.tensor(PROMPTS[1])
    (ref,) = run_ranks(tiny, 1, lambda m: m.forward(tokens))
    assert ref.shape == (len(PROMPTS[1]), 256) and ref.dtype == torch.float32
    for logits in run_ranks(tiny, 2, lambda m: m.forward(tokens)):
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
    (ref_tokens,) = run_ranks(tiny, 1, lambda m: greedy(m, PROMPTS[0], 12))
    assert run_ranks(tiny, 2, lambda m: greedy(m, PROMPTS[0], 12)) == [ref_tokens] * 2
    assert len(set(ref_tokens)) > 1


def test_model_refuses_weights_that_do_not_fit_the_config(tiny: Path) -> None:
    cfg = ModelConfig.from_dir(tiny)
    weights = dict(load_from_disk(Target(str(tiny), Position.from_global(0, 2), "cpu")))
    with pytest.raises(ModelConfigError, match=r"has shape \[128, 64\] on rank 0 of 1"):
        TPLlama(weights, cfg)
    del weights["model.norm.weight"]
    with pytest.raises(ModelConfigError, match=r"no tensor 'model\.norm\.weight'"):
        TPLlama(weights, cfg, ThreadGroup(2).rank(0))


# --- the engine as real processes ---------------------------------------------------------------


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    log: Path
    port_file: Path

    @property
    def port(self) -> int:
        return int(self.port_file.read_text())

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=body,
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def generate(self, tokens: Any, max_new: Any = 8) -> tuple[int, Any]:
        return self.request("POST", "/generate", json.dumps(
            {"tokens": tokens, "max_new_tokens": max_new}).encode())

    def alive(self) -> bool:
        """True while the engine runs; fails the test with its log once it has exited."""
        assert self.proc.poll() is None, self.log.read_text()
        return True

    def wait_port(self, timeout: float = 30) -> None:
        eventually(lambda: self.alive() and self.port_file.exists(), timeout,
                   what="the port file", interval=0.05)

    def wait_healthy(self, timeout: float = 60) -> None:
        self.wait_port(timeout)
        eventually(lambda: self.alive() and self.request("GET", "/health")[0] == 200, timeout,
                   what="/health", interval=0.05)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)


@contextlib.contextmanager
def engine(tmp_path: Path, name: str, model: Path, *args: str,
           env: dict[str, str] | None = None) -> Iterator[Engine]:
    """Run the reference engine with its log in a file; killed if left running."""
    log, port_file = tmp_path / f"{name}.log", tmp_path / f"{name}.port"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vlaunch.cache.reference.engine", "--model",
                                 str(model), "--port-file", str(port_file), *args],
                                stdout=out, stderr=out, env={**os.environ, **(env or {})})
    try:
        yield Engine(proc, log, port_file)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def test_engine_tp1_and_tp2_serve_the_same_tokens_and_stop_cleanly(
        tiny: Path, sockdir: Path, tmp_path: Path) -> None:
    """Same tokens at TP 1 and 2, stats, bad requests refused, SIGINT / SIGTERM stop cleanly."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(30)
    with engine(tmp_path, "tp1", tiny, "--socket-dir", str(sockdir),
                env={"NOTIFY_SOCKET": str(tmp_path / "notify")}) as tp1, \
            engine(tmp_path, "tp2", tiny, "--socket-dir", str(sockdir),
                   "--tensor-parallel-size", "2") as tp2:
        tp1.wait_healthy()
        tp2.wait_healthy()
        assert notify.recv(4096) == b"READY=1\nSTATUS=serving"
        for prompt in PROMPTS:
            s1, r1 = tp1.generate(prompt, 10)
            s2, r2 = tp2.generate(prompt, 10)
            assert s1 == s2 == 200
            assert r1 == r2 and len(r1["tokens"]) == 10
        (expected,) = run_ranks(tiny, 1, lambda m: greedy(m, PROMPTS[0], 10))
        assert tp1.generate(PROMPTS[0], 10)[1]["tokens"] == expected

        status, stats = tp2.request("GET", "/stats")
        assert status == 200 and stats["tp_size"] == 2 and stats["source"] == "disk"
        assert stats["pid"] == tp2.proc.pid and stats["weights_ms"] > 0
        split = sum(t.nbytes for n, t in read_all(tiny).items() if not n.endswith("norm.weight"))
        replicated = sum(t.nbytes for n, t in read_all(tiny).items() if n.endswith("norm.weight"))
        assert stats["bytes"] == split + 2 * replicated
        assert stats["started_at"] <= stats["ready_at"] <= time.time()

        _refuses_bad_requests(tp1)

        children = psutil.Process(tp2.proc.pid).children(recursive=True)
        assert len(children) == 1
        tp1.proc.send_signal(signal.SIGINT)  # Ctrl-C stops it as SIGTERM does
        tp2.proc.send_signal(signal.SIGTERM)
        assert tp1.wait() == 0, tp1.log.read_text()
        assert tp2.wait() == 0, tp2.log.read_text()
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
        assert notify.recv(4096) == b"STOPPING=1"

    log1, log2 = tp1.log.read_text(), tp2.log.read_text()
    assert "rank 0: weights from disk in " in log1 and " GB)" in log1
    assert "weights ready in " in log1 and "(source: disk)" in log1
    assert "rank 1: weights from disk in " in log2 and "vlaunch-engine[rank 1 pid" in log2
    assert "tensor-parallel backend gloo (ranks on the CPU)" in log2
    for rank in (0, 1):  # every rank warms up before rank 0 reports ready
        assert log2.index(f"rank {rank}: warm-up (prefill 8 tokens + 1 decode step)") < \
            log2.index("weights ready in ")
    assert "received SIGTERM; stopping" in log2 and log2.rstrip().endswith("INFO stopped")


def _refuses_bad_requests(e: Engine) -> None:
    """A serving engine answers bad requests with 400/404/413 and keeps serving."""
    assert e.request("GET", "/health") == (200, {"status": "ok"})
    cases = [([256], 1, "integers in 0..255"), ([], 1, "1..256 integers"),
             (list(range(257)), 1, "1..256"), ([True], 1, "integers"),
             ([1], 65, "0..64"), ([1], "8", "0..64")]
    for tokens, max_new, message in cases:
        status, body = e.generate(tokens, max_new)
        assert status == 400 and message in body["error"], (tokens, max_new, body)
    assert e.request("POST", "/generate", b"{")[0] == 400
    assert e.request("POST", "/generate", b'{"tokens": [1], "n": 2}')[1] == {
        "error": "unknown field(s) n"}
    assert e.request("POST", "/generate", b" " * ((64 << 10) + 1))[0] == 413
    assert e.request("GET", "/nope")[0] == 404
    assert e.generate([1], 0) == (200, {"tokens": []})


def test_engine_exits_78_on_configuration_errors(tiny: Path, sockdir: Path,
                                                 tmp_path: Path) -> None:
    runs = {"tp3": (tiny, "--tensor-parallel-size", "3"),
            "nomodel": (tmp_path / "nowhere",),
            "badopt": (tiny, "--mode", "borrow"),
            "nccl_cpu": (tiny, "--tensor-parallel-size", "2", "--tp-backend", "nccl")}
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(engine(tmp_path, name, m, *a,
                                                    "--socket-dir", str(sockdir)))
                   for name, (m, *a) in runs.items()}
        for e in engines.values():
            assert e.wait() == 78, e.log.read_text()
    assert "num_attention_heads 4 does not divide by tensor-parallel size 3" in \
        engines["tp3"].log.read_text()
    assert "config.json does not exist" in engines["nomodel"].log.read_text()
    assert "invalid choice: 'borrow'" in engines["badopt"].log.read_text()
    assert "--tp-backend nccl needs CUDA devices, but the ranks run on the CPU" in \
        engines["nccl_cpu"].log.read_text()


def test_engine_is_unhealthy_while_waiting_for_its_cache(tiny: Path, sockdir: Path,
                                                         tmp_path: Path) -> None:
    with engine(tmp_path, "wait", tiny, "--socket-dir", str(sockdir), "--no-fallback",
                "--timeout", "60") as waiting, \
            engine(tmp_path, "gone", tiny, "--socket-dir", str(sockdir), "--no-fallback",
                   "--timeout", "0.5") as gone:
        waiting.wait_port()
        assert waiting.request("GET", "/health") == (503, {"status": "loading"})
        assert waiting.generate([1])[0] == 503
        assert waiting.request("GET", "/stats")[1]["ready_at"] is None
        waiting.proc.send_signal(signal.SIGTERM)
        assert waiting.wait() == 0, waiting.log.read_text()
        assert gone.wait() == 1, gone.log.read_text()
    assert "stopped before serving (loading" in waiting.log.read_text()
    assert "no cache is serving" in gone.log.read_text()


def test_engine_exits_when_a_worker_dies(tiny: Path, sockdir: Path, tmp_path: Path) -> None:
    with engine(tmp_path, "e", tiny, "--socket-dir", str(sockdir),
                "--tensor-parallel-size", "2") as e:
        e.wait_healthy()
        (worker,) = psutil.Process(e.proc.pid).children()
        worker.send_signal(signal.SIGTERM)  # a worker leaves stopping to rank 0
        assert e.generate([1, 2], 2)[0] == 200
        worker.kill()
        assert e.wait() == 1, e.log.read_text()
    assert f"rank 1 (pid {worker.pid}) exited with status -9" in e.log.read_text()


def test_workers_die_with_rank_0(tiny: Path, sockdir: Path, tmp_path: Path) -> None:
    with engine(tmp_path, "e", tiny, "--socket-dir", str(sockdir),
                "--tensor-parallel-size", "2") as e:
        e.wait_healthy()
        (worker,) = psutil.Process(e.proc.pid).children()
        e.proc.kill()
        assert e.wait() == -signal.SIGKILL
        worker.wait(10)  # the parent-death signal, not the test's cleanup, ends it
