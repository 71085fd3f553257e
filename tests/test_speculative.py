"""Speculative decoding: a draft model's cache group beside the target's under `vlaunch run`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract.errors import FingerprintMismatchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.reference.config import ModelConfig
from vlaunch.cache.reference.refmodel import TPLlama, greedy, make_checkpoint
from vlaunch.cache.reference.speculative import DraftMismatchError, speculative_greedy
from vlaunch.cache.store.fingerprints import fingerprint
from vlaunch.cache.store.plan import Position
from vlaunch.cache.store.target import Target

from .conftest import eventually, llama_tensors
from .test_launcher import Launcher
from .test_launcher import launch as launch  # the fixture, re-exported by name

ENGINE = r"""
import json, os, signal, socket, sys, time
from vlaunch.cache import load
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
out = {}
for rank in range(2):
    target = load(rank=rank, fallback=False, timeout=30)
    draft = load(rank=rank, role="draft", fallback=False, timeout=30,
                 mode=os.environ.get("DRAFT_MODE", "share"))
    out[rank] = {"target": [target.source, sorted(target)], "draft": [draft.source, sorted(draft)]}
attempt = os.environ["VLAUNCH_ATTEMPT"]
with open(os.path.join(sys.argv[1], f"attempt-{attempt}.json"), "w") as f:
    json.dump(out, f)
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.connect(os.environ["NOTIFY_SOCKET"])
s.send(b"READY=1\nSTATUS=engine up")
while True:
    time.sleep(0.5)
"""
"""Maps both groups' shards of ranks 0 and 1, records where they came from, then serves."""


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Llama-named draft checkpoint (its bytes differ from the target's)."""
    root = tmp_path_factory.mktemp("draft")
    tensors = {k: v * 2 for k, v in llama_tensors(layers=1).items()}
    save_file(tensors, str(root / "model.safetensors"))
    return root


def _engine(tmp: Path) -> list[str]:
    (tmp / "out").mkdir(exist_ok=True)
    return [sys.executable, "-c", ENGINE, str(tmp / "out")]


def _ready(snap: dict, n: int) -> bool:
    return snap["phase"] == "serving" and len(snap["ranks"]) == n


def test_target_and_draft_at_tp2_survive_an_engine_restart_seed_a_replica_and_exit_on_a_rank(
        launch: Callable[..., Launcher], llama_ckpt: Path, draft_ckpt: Path,
        tmp_path: Path) -> None:
    """One launcher with both groups at TP 2: an engine restart maps the same caches, each
    group refuses the other role, a new replica seeds both groups from it, and a draft rank's
    exit ends it (one launcher's start-up, not three)."""
    la = launch(llama_ckpt, "--draft-model", str(draft_ckpt), "--engine-ready", "notify",
                engine=_engine(tmp_path))
    snap = la.wait_for(lambda s: _ready(s, 4))
    roles = sorted((r["role"], r["group_rank"], Path(r["socket"]).name)
                   for r in snap["ranks"].values())
    assert roles == [("draft", 0, "draft-rank-0.sock"), ("draft", 1, "draft-rank-1.sock"),
                     ("target", 0, "rank-0.sock"), ("target", 1, "rank-1.sock")]
    first = json.loads((tmp_path / "out" / "attempt-1.json").read_text())
    for rank in ("0", "1"):
        assert first[rank]["target"][0] == first[rank]["draft"][0] == "cache"
        assert len(first[rank]["draft"][1]) < len(first[rank]["target"][1])  # one layer
    pids = {k: r["pid"] for k, r in snap["ranks"].items()}
    la.proc.send_signal(signal.SIGHUP)  # restart the engine against the same caches
    eventually(lambda: (tmp_path / "out" / "attempt-2.json").exists() or None, 60)
    assert json.loads((tmp_path / "out" / "attempt-2.json").read_text()) == first
    snap = la.wait_for(lambda s: _ready(s, 4))
    assert {k: r["pid"] for k, r in snap["ranks"].items()} == pids  # no rank reloaded
    _role_mismatch_both_ways(la.sockdir, llama_ckpt, draft_ckpt)
    _a_new_replica_seeds_both_groups_from(la, launch, llama_ckpt, draft_ckpt)
    _a_draft_rank_that_exits_is_a_rank_exit(la, snap)


def _a_new_replica_seeds_both_groups_from(source: Launcher, launch: Callable[..., Launcher],
                                          target: Path, draft: Path) -> None:
    """A new replica (caches only) fills both groups from the running one's sockets."""
    seeded = launch(target, "--draft-model", str(draft), "--seed", f"unix:{source.sockdir}")
    seeded.wait_for(lambda s: _ready(s, 4))
    assert seeded.text().count("seeded ") == 4  # two target and two draft ranks
    client = CacheClient(socket_path(seeded.sockdir, 1, "draft"))
    try:
        assert client.status()["fingerprint"]["role"] == "draft"
    finally:
        client.close()
    seeded.proc.terminate()
    assert seeded.wait_exit() == 0


def _a_draft_rank_that_exits_is_a_rank_exit(la: Launcher, snap: dict) -> None:
    """SIGKILL of draft rank 1 ends the launcher with RANK_EXITED, its socket gone."""
    (draft,) = [r for r in snap["ranks"].values() if r["role"] == "draft" and r["group_rank"]]
    os.kill(draft["pid"], signal.SIGKILL)
    assert la.wait_exit() == ExitStatus.RANK_EXITED
    assert not socket_path(la.sockdir, 1, "draft").exists()


def _role_mismatch_both_ways(sockdir: Path, target: Path, draft: Path) -> None:
    position = Position.from_global(0, 2, 1, 1)
    asks = [("draft", target, "llama", "target"), ("target", draft, "replicate", "draft")]
    for group, model, plan, role in asks:
        client = CacheClient(socket_path(sockdir, 0, group))
        try:
            with pytest.raises(FingerprintMismatchError, match=(
                    f"cache role mismatch: this socket serves the {group} model's cache group, "
                    f"the engine asked for the {role} model's")):
                client.hello(fingerprint(Target(str(model), position, "cpu", plan, role=role)))
        finally:
            client.close()


def test_a_draft_that_is_the_targets_checkpoint_is_held_once(
        launch: Callable[..., Launcher], llama_ckpt: Path, tmp_path: Path) -> None:
    la = launch(llama_ckpt, "--draft-model", str(llama_ckpt), "--engine-ready", "notify",
                engine=_engine(tmp_path))
    snap = la.wait_for(lambda s: _ready(s, 2))
    assert {r["role"] for r in snap["ranks"].values()} == {"target"}
    loaded = json.loads((tmp_path / "out" / "attempt-1.json").read_text())
    assert loaded["0"]["draft"] == loaded["0"]["target"]  # mapped from the target's slabs
    assert loaded["0"]["draft"][0] == "cache"
    la.proc.terminate()
    assert la.wait_exit() == 0


# ------------------------------------------------------------ reference engine decoding

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128,
        "vocab": 256}
SMALL_DRAFT = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 64,
               "vocab": 256, "seed": 7}


def _model(root: Path) -> TPLlama:
    """A reference model from a checkpoint directory, on one rank."""
    tensors: dict = {}
    for file in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(file))
    return TPLlama(tensors, ModelConfig.from_dir(root))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_decoding_gives_the_targets_greedy_tokens(tmp_path: Path, k: int) -> None:
    target = _model(make_checkpoint(tmp_path / "target", **TINY))
    draft = _model(make_checkpoint(tmp_path / "draft", **SMALL_DRAFT))
    for prompt in ([1, 2, 3], [200, 7, 7, 7, 42, 0, 255], list(range(30))):
        plain = greedy(target, prompt, 12)
        assert speculative_greedy(target, draft, prompt, 12, k)[0] == plain
        # the target as its own draft: every proposal is accepted, so each round of k + 1
        # tokens has one token of the target's own
        rounds = -(-12 // (k + 1))
        assert speculative_greedy(target, target, prompt, 12, k) == (plain, 12 - rounds)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    target = _model(make_checkpoint(tmp_path / "target", **TINY))
    draft = _model(make_checkpoint(tmp_path / "draft", **{**SMALL_DRAFT, "vocab": 128}))
    with pytest.raises(DraftMismatchError, match="use a draft model trained with the target"):
        speculative_greedy(target, draft, [1, 2], 4)


def test_reference_engine_decodes_with_its_draft_from_the_draft_group(
        launch: Callable[..., Launcher], tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "target", **TINY)
    draft = make_checkpoint(tmp_path / "draft", **SMALL_DRAFT)
    port_file = tmp_path / "port"
    la = launch(target, "--draft-model", str(draft), "--engine-ready", "notify",
                engine=[sys.executable, "-m", "vlaunch.cache.reference.engine", "--port-file",
                        str(port_file), "--no-fallback", "--speculative-tokens", "3"])
    prompt = [200, 7, 7, 7, 42, 0, 255]
    expected = greedy(_model(target), prompt, 10)
    for attempt in (1, 2):
        la.wait_for(lambda s, a=attempt: _ready(s, 4) and s["engine"]["attempt"] == a)
        body = json.dumps({"tokens": prompt, "max_new_tokens": 10}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port_file.read_text().strip()}/generate",
                                     data=body, method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["tokens"] == expected
        if attempt == 1:
            port_file.unlink()
            la.proc.send_signal(signal.SIGHUP)  # restart the engine: both groups stay
    assert la.text().count("draft model from cache") == 4  # 2 ranks x 2 engine starts
    la.proc.terminate()
    assert la.wait_exit() == 0


def test_a_killed_draft_rank_respawns_from_escrow_without_the_disk(
        launch: Callable[..., Launcher], llama_ckpt: Path, draft_ckpt: Path,
        tmp_path: Path) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(draft_ckpt, draft)
    la = launch(llama_ckpt, "--draft-model", str(draft), "--engine-ready", "notify",
                "--on-rank-exit", "respawn", engine=_engine(tmp_path))
    snap = la.wait_for(lambda s: _ready(s, 4))
    slot = next(k for k, r in snap["ranks"].items() if (r["role"], r["group_rank"]) ==
                ("draft", 0))
    victim, engine_pid = snap["ranks"][slot]["pid"], snap["engine"]["pid"]
    ref = {k: v.clone() for k, v in load_file(str(draft / "model.safetensors")).items()}
    for f in draft.glob("*.safetensors"):  # from now on nobody can read the draft's weights
        f.write_bytes(f.read_bytes()[:8] + b"\0" * 64)
    os.kill(victim, signal.SIGKILL)
    la.wait_for(lambda s: s["ranks"][slot]["pid"] not in (None, victim)
                and s["ranks"][slot]["state"] == "ready")
    assert la.status()["engine"]["pid"] == engine_pid
    client = CacheClient(socket_path(la.sockdir, 0, "draft"))
    try:
        assert client.status()["fingerprint"]["role"] == "draft"
        tensors = client.map(client.manifest())
        assert tensors["model.norm.weight"].view(-1).equal(ref["model.norm.weight"].view(-1))
    finally:
        client.close()
    la.proc.terminate()
    assert la.wait_exit() == 0


def test_seed_ports_and_slots_of_the_draft_group_follow_the_targets_block() -> None:
    from vlaunch.cache.contract.roles import seat, unseat
    from vlaunch.cache.rank.seed import source_port

    assert [seat("target", r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [seat("draft", r, 4) for r in range(4)] == [4, 5, 6, 7]
    assert [unseat(s, 4) for s in (3, 4, 7)] == [("target", 3), ("draft", 0), ("draft", 3)]
    assert source_port(9000, seat("draft", 1, 4)) == 9005


def test_vllm_draft_loads_go_to_the_draft_group() -> None:
    from types import SimpleNamespace as NS

    from vlaunch.cache.integrations.vllm_loader import draft_role

    target, draft = NS(model="/m/big"), NS(model="/m/small")
    config = NS(model_config=target, speculative_config=NS(draft_model_config=draft))
    assert draft_role(config, target) == "target"
    assert draft_role(config, draft) == "draft"
    mtp = NS(model_config=target, speculative_config=NS(draft_model_config=NS(model="/m/big")))
    assert draft_role(mtp, NS(model="/m/big")) == "target"  # the target's own checkpoint
    assert draft_role(NS(model_config=target, speculative_config=None), draft) == "target"


def test_copy_release_of_the_draft_drops_the_draft_groups_copy(
        launch: Callable[..., Launcher], llama_ckpt: Path, draft_ckpt: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFT_MODE", "copy-release")
    la = launch(llama_ckpt, "--draft-model", str(draft_ckpt), "--engine-ready", "notify",
                engine=_engine(tmp_path))
    snap = la.wait_for(lambda s: _ready(s, 4) and all(
        r["bytes"] == 0 for r in s["ranks"].values() if r["role"] == "draft"))
    assert all(r["bytes"] > 0 for r in snap["ranks"].values() if r["role"] == "target")
    assert la.text().count("released its checkpoint slabs") == 2
    la.proc.terminate()
    assert la.wait_exit() == 0
