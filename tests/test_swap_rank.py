"""One cache rank driven over its ready channel as the launcher drives it (rank/swap.py): a
checkpoint that changes while it is staged is refused and the old weights serve on; a commit
and a rollback, in both modes, serve each checkpoint's bytes exactly; another architecture
and the checkpoint already served are refused at the prepare."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaunch.cache.contract import protocol, wire
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.progress import recv_ready
from vlaunch.cache.reference.refmodel import make_checkpoint

# Each test starts a rank and several fresh processes that import torch (seconds each on a
# busy 2-core machine): pytest's default 120 s did not cover one test and its teardown with a
# second suite running beside it.
pytestmark = pytest.mark.timeout(360)

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128,
         "vocab": 256}


SERVES = r"""
import sys, torch
from vlaunch.cache.client.loader import load, load_from_disk
from vlaunch.cache.store.plan import Position
from vlaunch.cache.store.target import Target
model, sockdir = sys.argv[1:3]
w = load(model, socket_dir=sockdir, fallback=False, device="cpu")
disk = load_from_disk(Target(model, Position.from_global(0, 1), "cpu"))
print(w.source == "cache" and all(torch.equal(w[k], disk[k]) for k in disk))
"""


class Rank:
    """A cache rank whose ready channel this test holds, as a launcher would."""

    def __init__(self, model: Path, sockdir: Path, log: Path | None = None) -> None:
        self.ours, theirs = socket.socketpair()
        self.log = log
        err = open(log, "w") if log is not None else None  # noqa: SIM115 (the child's)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlaunch.cache", "--model", str(model), "--socket-dir",
             str(sockdir), "--ready-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            stderr=err)
        if err is not None:
            err.close()
        theirs.close()
        self.ours.settimeout(60)
        _, fds = recv_ready(self.ours)
        wire.close_fds(fds)
        self.sockdir = sockdir

    def step(self, name: str, **fields: Any) -> dict[str, Any]:
        """Send a swap step; the rank's answer (other frames, layouts, skipped)."""
        wire.send_frame(self.ours, {"event": f"swap_{name}", **fields})
        while True:
            msg, fds = wire.recv_frame(self.ours)
            wire.close_fds(fds)
            if msg.get("event") == "swap_answer":
                return protocol.validate_event(msg, "swap_answer")

    def serves(self, model: Path) -> bool:
        """Whether a share load from the rank is `model`'s bytes, every one (in a process of
        its own: a process that mapped the slabs holds off an in-place copy while it runs)."""
        r = subprocess.run([sys.executable, "-c", SERVES, str(model), str(self.sockdir)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.split() == ["True"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise
        finally:
            self.ours.close()


@pytest.fixture
def rank(tmp_path: Path, sockdir: Path) -> Any:
    a = make_checkpoint(tmp_path / "a", seed=0, **SHAPE)
    r = Rank(a, sockdir)
    yield r
    r.close()


def prepare(rank: Rank, model: Path, version: int = 1) -> dict[str, Any]:
    return rank.step("prepare", version=version, model=str(model), mode="auto", margin=0,
                     keep=True)


def test_a_checkpoint_changing_while_staged_is_refused_and_the_old_one_serves(
        rank: Rank, tmp_path: Path) -> None:
    a, b = tmp_path / "a", make_checkpoint(tmp_path / "b", seed=1, **SHAPE)
    assert prepare(rank, b)["answer"] == "prepared"
    os.utime(sorted(b.glob("*.safetensors"))[0])  # written again between the two reads
    answer = rank.step("stage", version=1, mode="double")
    assert answer["answer"] == "refused" and answer["status"] == ExitStatus.CHECKPOINT_CHANGED
    assert "changed while rank 0 staged it" in answer["message"]
    assert rank.serves(a)
    # and the next swap goes through, then rolls back, each bit-exact
    for mode in ("double", "in-place"):
        assert prepare(rank, b)["answer"] == "prepared"
        assert rank.step("stage", version=1, mode=mode)["answer"] == "staged"
        committed = rank.step("commit", version=1, mode=mode, lease_wait_ms=1000)
        assert committed["answer"] == "committed", committed
        assert committed["model"] == str(b) and rank.serves(b), mode
        rows, cols = manifests(rank)
        assert rows == cols, mode
        rolled = rank.step("rollback", version=1, status=85, message="test")
        assert rolled["answer"] == "rolled_back" and rank.serves(a), mode
        back = manifests(rank)
        assert back[0] == back[1] != rows, mode  # a's checksums again, in both forms


def manifests(rank: Rank) -> tuple[Any, Any]:
    """The rank's manifest in both forms (rows; columns, as engines and seeding ask), as wire
    dicts: after a cutover or a rollback each is the served checkpoint's, checksums too."""
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.contract.sockdir import socket_path
    from vlaunch.cache.store import columns

    c = CacheClient(socket_path(rank.sockdir, 0))
    try:
        rows = columns.from_wire(c.request({"op": "manifest"})[0]["manifest"]).to_wire()
        cols = c.manifest().to_wire()
    finally:
        c.close()
    return rows, cols


def test_a_refused_prepare_names_the_difference(rank: Rank, tmp_path: Path) -> None:
    c = make_checkpoint(tmp_path / "c", seed=2, **{**SHAPE, "hidden": 128})
    answer = prepare(rank, c)
    assert answer["answer"] == "refused" and answer["status"] == ExitStatus.BAD_PLAN
    assert "cannot replace the weights rank 0 serves" in answer["message"]
    # each refusal names the first tensor that differs, on both sides
    vocab = make_checkpoint(tmp_path / "vocab", seed=2, **{**SHAPE, "vocab": 512})
    assert "tensor 'model.embed_tokens.weight' is BF16[256, 64] in the served weights, " \
           "BF16[512, 64] in the new one" in prepare(rank, vocab)["message"]
    wide = make_checkpoint(tmp_path / "f32", seed=2, dtype=torch.float32, **SHAPE)
    assert "is BF16[256, 64] in the served weights, F32[256, 64] in the new one" in \
        prepare(rank, wide)["message"]
    less = make_checkpoint(tmp_path / "less", seed=2, shards=1, **SHAPE)
    shard, = less.glob("*.safetensors")
    tensors = load_file(shard)
    tensors.pop("model.norm.weight")
    save_file(tensors, shard)
    for index in less.glob("*.index.json"):
        index.unlink()
    answer = prepare(rank, less)
    assert answer["status"] == ExitStatus.BAD_PLAN, answer
    assert "tensor 'model.norm.weight' (BF16[64]) is served, the new checkpoint has none" in \
        answer["message"]
    answer = prepare(rank, tmp_path / "a")
    assert answer["status"] == ExitStatus.SWAP_UNAVAILABLE and "nothing to swap" in \
        answer["message"]
    assert rank.serves(tmp_path / "a")
