"""Checkpoint identity: sampled bytes, the cache's record of what it read, changes, verify."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaunch.cache.client.loader import load
from vlaunch.cache.contract.errors import CheckpointChangedError, FingerprintMismatchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.store import identity
from vlaunch.cache.store.checkpoint import open_checkpoint

from .conftest import CacheProc, eventually, llama_tensors, rank_status, spawn_cache
from .test_launcher import Launcher

NAME = "model.safetensors"


def _write(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A one-file checkpoint in `root`, written beside it and renamed into place."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, root / NAME)
    return root


def _fine_tune(scale: float = 1e-2) -> dict[str, torch.Tensor]:
    """The same names, dtypes and shapes as llama_tensors(), other values."""
    g = torch.Generator().manual_seed(1)
    return {k: (v.float() + scale * torch.randn(v.shape, generator=g)).to(v.dtype)
            for k, v in llama_tensors().items()}


# ----------------------------------------------------------------------- the identity itself


def test_two_fine_tunes_share_the_header_identity_not_the_sampled_one(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", llama_tensors())
    b = _write(tmp_path / "b", _fine_tune())
    ra, _ = identity.record(a)
    rb, _ = identity.record(b)
    assert ra.header == rb.header  # names, dtypes, shapes, offsets: the same
    assert ra.data != rb.data
    c = _write(tmp_path / "c", llama_tensors())  # the same bytes elsewhere: the same identity
    assert identity.record(c)[0].data == ra.data


def test_samples_are_bounded_whatever_the_tensor_count(tmp_path: Path) -> None:
    many = {f"t{i}": torch.full((300,), float(i)) for i in range(4000)}
    root = _write(tmp_path / "m", many)
    regions = identity.sample_regions(open_checkpoint(root))
    assert len(regions) <= identity.MAX_REGIONS
    assert sum(n for _, _, n in regions) <= identity.SAMPLE_BUDGET
    small = identity.sample_regions(open_checkpoint(_write(tmp_path / "s", llama_tensors())))
    assert len(small) == 3 * len(llama_tensors())  # head, tail and one inside each tensor


def test_engine_reuses_the_memo_only_while_every_stat_matches(tmp_path: Path) -> None:
    root = _write(tmp_path / "a", llama_tensors())
    rec, _ = identity.record(root)
    memo = tmp_path / "rank-0.identity.json"
    identity.write_memo(memo, rec)
    rec = rec._replace(data="from-the-memo")  # a memo hit returns the memo's value
    identity.write_memo(memo, rec)
    identity._SEEN.clear()
    assert identity.identities(root, memo) == (rec.header, "from-the-memo")
    st = os.stat(root / NAME)
    os.utime(root / NAME, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: read again
    identity._SEEN.clear()
    assert identity.identities(root, memo)[1] not in ("from-the-memo", "")
    assert rec.restat() == [NAME]


@pytest.mark.parametrize("single", [False, True])
def test_the_memo_is_found_from_the_socket_whatever_the_path_spelling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, single: bool) -> None:
    """The rank's memo sits by its socket; relative and trailing-slash paths hit it."""
    root = _write(tmp_path / "a", llama_tensors())
    model = root / NAME if single else root
    rec, _ = identity.record(model)
    identity.write_memo(identity.memo_path(tmp_path / "rank-0.sock"),
                        rec._replace(data="from-the-memo"))
    monkeypatch.chdir(tmp_path)
    spellings = ["a/" + NAME, f"./a/{NAME}"] if single else ["a", "a/", "./a//"]
    for spelling in spellings:
        identity._SEEN.clear()
        assert identity.identities(spelling, socket=tmp_path / "rank-0.sock") == (
            rec.header, "from-the-memo"), spelling
    shutil.copytree(root, tmp_path / "c")  # the same bytes in other files: read, not memo
    identity._SEEN.clear()
    other = "c/" + NAME if single else "c"
    assert identity.identities(other, socket=tmp_path / "rank-0.sock")[1] != "from-the-memo"

# ------------------------------------------------------------------------- real cache ranks


def test_same_header_other_values_is_a_mismatch_not_a_handoff(tmp_path: Path, sockdir: Path,
                                                              caches: list[CacheProc],
                                                              caplog: pytest.LogCaptureFixture
                                                              ) -> None:
    a = _write(tmp_path / "a", llama_tensors())
    b = _write(tmp_path / "b", _fine_tune())
    cache = spawn_cache(a, sockdir, "--plan", "replicate")
    caches.append(cache)
    assert cache.ready, cache.proc.stderr.read().decode() if cache.proc.stderr else ""
    good = load(str(a), socket_dir=str(sockdir), fallback=False, device="cpu", plan="replicate")
    assert good.source == "cache"
    with pytest.raises(FingerprintMismatchError) as err:
        load(str(b), socket_dir=str(sockdir), fallback=False, device="cpu", plan="replicate")
    assert [m[0] for m in err.value.mismatches] == ["checkpoint_data"]
    assert "checkpoint_data" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="vlaunch.cache"):
        w = load(str(b), socket_dir=str(sockdir), fallback=True, device="cpu", plan="replicate")
    assert w.source == "disk" and "mismatched" in caplog.text
    expected = load_file(str(b / NAME))
    assert all(torch.equal(w[k], expected[k]) for k in expected)


def test_checkpoint_rewritten_under_a_serving_cache(tmp_path: Path, sockdir: Path,
                                                   caches: list[CacheProc]) -> None:
    model = _write(tmp_path / "m", llama_tensors())
    cache = spawn_cache(model, sockdir, "--plan", "replicate",
                        env={**os.environ, "VLAUNCH_WATCH_EVERY": "0.1"})
    caches.append(cache)
    assert cache.ready
    held = load(str(model), socket_dir=str(sockdir), fallback=False, device="cpu",
                plan="replicate")
    assert held.source == "cache" and rank_status(sockdir)["checkpoint"]["changed"] == []
    _write(model, _fine_tune())  # a new checkpoint of the same architecture, replaced in place
    changed = eventually(lambda: rank_status(sockdir)["checkpoint"]["changed"], 30,
                         what="the change in the rank's status")
    assert changed == [NAME]
    with pytest.raises(FingerprintMismatchError) as err:
        load(str(model), socket_dir=str(sockdir), fallback=False, device="cpu", plan="replicate")
    assert [m[0] for m in err.value.mismatches] == ["checkpoint_data"]
    assert "changed on disk since loaded" in str(err.value)
    fresh = load(str(model), socket_dir=str(sockdir), device="cpu", plan="replicate")
    new = load_file(str(model / NAME))
    assert fresh.source == "disk" and all(torch.equal(fresh[k], new[k]) for k in new)
    cache.proc.terminate()
    cache.proc.wait(20)
    log = cache.proc.stderr.read().decode() if cache.proc.stderr else ""
    assert f"the checkpoint changed under the serving cache ({NAME})" in log


def _verify(sockdir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "verify",
                           "--socket-dir", str(sockdir), "--threads", "2"],
                          capture_output=True, text=True, timeout=120)


def test_verify_passes_on_a_good_cache_and_names_a_tampered_tensor(
        tmp_path: Path, sockdir: Path, caches: list[CacheProc], llama_ckpt: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(llama_ckpt, model)
    for rank in (0, 1):  # tensor parallel 2: each rank holds half of the split tensors
        caches.append(spawn_cache(model, sockdir, tp=2, rank=rank))
        assert caches[-1].ready
    ok = _verify(sockdir)
    assert ok.returncode == 0, ok.stderr
    assert "rank 0: 19 tensors ok" in ok.stdout and "rank 1: 19 tensors ok" in ok.stdout
    ckpt = open_checkpoint(model)
    victim = ckpt.tensors["model.layers.1.mlp.down_proj.weight"]
    with open(victim.file, "r+b") as f:  # one value, same size: only a full check sees it
        f.seek(victim.begin + victim.nbytes // 2)  # row 16, column 0: rank 0's half
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    bad = _verify(sockdir)
    assert bad.returncode == ExitStatus.VERIFY_FAILED, bad.stdout + bad.stderr
    assert "model.layers.1.mlp.down_proj.weight" in bad.stderr
    assert "rank 0: 19 tensors 1 MISMATCH(ES)" in bad.stdout
    assert "rank 1: 19 tensors ok" in bad.stdout


# ------------------------------------------------------------------ a change during the load


def test_bytes_changed_during_the_load_are_read_again_then_refused(tmp_path: Path) -> None:
    from vlaunch.cache.rank.integrity import checked_load
    from vlaunch.cache.store.plan import Position
    from vlaunch.cache.store.shard import load_shard
    from vlaunch.cache.store.slabs import get_backend

    model = _write(tmp_path / "m", llama_tensors())
    backend = get_backend("cpu")
    loads = []

    def load_then_rewrite(times: int):  # type: ignore[no-untyped-def]
        def run():  # type: ignore[no-untyped-def]
            shard = load_shard(str(model), "replicate", Position(1, 0), backend)
            loads.append(shard)
            if len(loads) <= times:  # the file is replaced after the read, before the re-stat
                _write(model, _fine_tune(scale=len(loads)))
            return shard
        return run

    shard = checked_load(str(model), 0, load_then_rewrite(1))
    assert len(loads) == 2 and shard is loads[-1]
    new = load_file(str(model / NAME))
    assert all(torch.equal(shard.named()[k], new[k]) for k in new)
    loads.clear()
    with pytest.raises(CheckpointChangedError,
                       match=rf"changed while rank 0 read it, twice \({NAME} in ") as e:
        checked_load(str(model), 0, load_then_rewrite(2))
    assert e.value.status == ExitStatus.CHECKPOINT_CHANGED and len(loads) == 2


def test_verify_after_the_load_names_a_tensor_whose_bytes_differ(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from vlaunch.cache.contract.errors import VerifyError
    from vlaunch.cache.rank.integrity import verify_loaded
    from vlaunch.cache.store.plan import Position
    from vlaunch.cache.store.shard import load_shard
    from vlaunch.cache.store.slabs import get_backend

    model = _write(tmp_path / "m", llama_tensors())
    position = Position(2, 1)
    shard = load_shard(str(model), "llama", position, get_backend("cpu"))
    verify_loaded(str(model), "llama", position, shard.manifest, shard.tensors, 1, threads=2)
    shard.named()["model.layers.0.self_attn.o_proj.weight"][3, 5] += 1  # a bit flip, say
    with caplog.at_level(logging.ERROR, logger="vlaunch.cache"), \
            pytest.raises(VerifyError, match="verify found tensors of rank 1") as err:
        verify_loaded(str(model), "llama", position, shard.manifest, shard.tensors, 1, threads=2)
    assert err.value.status == ExitStatus.VERIFY_FAILED
    assert "model.layers.0.self_attn.o_proj.weight" in caplog.text
    assert caplog.text.count("tensor '") == 1


def test_a_rank_started_with_verify_checks_before_it_is_ready(
        llama_ckpt: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    cache = spawn_cache(llama_ckpt, sockdir, "--verify", tp=2, rank=1)
    caches.append(cache)
    assert cache.ready
    assert cache.stop() == 0
    log = cache.proc.stderr.read().decode() if cache.proc.stderr else ""
    assert "rank 1: verify:" in log and "match the checkpoint files" in log


def test_run_verifies_then_reports_a_changed_checkpoint_in_status_and_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vlaunch run --verify`, caches only: verified before ready; a rewrite shows in /status
    and /metrics."""
    import urllib.request

    monkeypatch.setenv("VLAUNCH_WATCH_EVERY", "0.1")
    model = _write(tmp_path / "m", llama_tensors())
    (tmp_path / "l").mkdir()
    la = Launcher(tmp_path / "l", model, "--verify", "--plan", "replicate", tp=1)
    try:
        la.wait_for(lambda s: s["caches_ready"])
        assert "rank 0: verify:" in la.text() and "match the checkpoint files" in la.text()
        _write(model, _fine_tune())
        snap = la.wait_for(lambda s: (s["ranks"]["0"].get("checkpoint") or {}).get("changed"))
        assert snap["ranks"]["0"]["checkpoint"]["changed"] == [NAME]
        with urllib.request.urlopen(la.url + "/metrics", timeout=5) as r:
            assert 'vlaunch_checkpoint_changed{rank="0",role="target"} 1.0' in r.read().decode()
        shown = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "status",
                                "--socket-dir", str(la.sockdir)], capture_output=True,
                               text=True, timeout=30)
        assert f"rank 0: checkpoint changed on disk since loaded: {NAME}" in shown.stdout
        la.proc.terminate()
        assert la.wait_exit() == 0, la.text()
    finally:
        la.close()


@pytest.mark.parametrize("rewritten", [False, True])
def test_a_rank_adopted_from_escrow_checks_the_files_it_did_not_read(
        rewritten: bool, tmp_path: Path, sockdir: Path, caches: list[CacheProc]) -> None:
    import socket

    from vlaunch.cache.contract import wire

    model = _write(tmp_path / "m", llama_tensors())
    first = spawn_cache(model, sockdir, "--plan", "replicate")
    ready, slabs = first.ready, first.escrow
    first.escrow = []  # we hold the slabs now, as the launcher's escrow does
    assert first.stop() == 0
    if rewritten:
        _write(model, _fine_tune())
    ours, theirs = socket.socketpair()
    with ours:
        wire.send_frame(ours, {"event": "escrow", "manifest": ready["manifest"],
                               "fingerprint": ready["fingerprint"]}, slabs)
    for fd in slabs:
        os.close(fd)
    second = spawn_cache(model, sockdir, "--plan", "replicate", "--adopt-fd",
                         str(theirs.fileno()), extra_fds=[theirs.fileno()])
    theirs.close()
    caches.append(second)
    assert second.ready
    changed = rank_status(sockdir)["checkpoint"]["changed"]
    if not rewritten:
        assert changed == []
        got = load(str(model), socket_dir=str(sockdir), fallback=False, device="cpu",
                   plan="replicate")
        assert got.source == "cache"
    else:
        assert len(changed) == 1 and "differs from the escrowed slabs" in changed[0]
        with pytest.raises(FingerprintMismatchError, match="checkpoint_data"):
            load(str(model), socket_dir=str(sockdir), fallback=False, device="cpu",
                 plan="replicate")
