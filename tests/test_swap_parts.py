"""The swap's pieces without processes: the control request, the staging checks and copies,
the published tensors' check, the engine's environment for a published version."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vlaunch.cache.contract import control
from vlaunch.cache.contract.engine_env import EngineEnv
from vlaunch.cache.contract.errors import ProtocolError
from vlaunch.cache.rank import staging
from vlaunch.cache.rank.publishing import tensors_difference
from vlaunch.cache.store.manifest import pack
from vlaunch.launcher.core.events import SwapPolicy


def test_a_swap_request_is_checked_field_by_field() -> None:
    req = control.swap_request("/models/b", mode="in-place", lease_wait=2.5)
    assert req["lease_wait_ms"] == 2500 and control.validate(dict(req)) == req
    for bad, why in (({**req, "extra": 1}, "exactly the fields"),
                     ({**req, "mode": "sideways"}, "swap.mode must be one of"),
                     ({**req, "attempts": 0}, "at least 1"),
                     ({**req, "margin": -1}, "out of range"),
                     ({**req, "standby": 1}, "expected bool"),
                     ({**req, "model": ""}, "characters"),
                     ({**req, "op": "reboot"}, "unknown control request")):
        with pytest.raises(ProtocolError, match=why):
            control.validate(bad)
    answer = control.answer(final=True, status=85, message="x" * 10_000, version=3)
    assert answer["ok"] is False and len(answer["message"]) == 4096
    assert len(json.dumps(answer)) < control.MAX_BODY


def test_the_core_and_the_client_name_the_cutover_alike() -> None:
    from vlaunch.launcher.core import swap

    assert swap.CUTTING_OVER == control.CUTTING_OVER  # vlaunch swap tells a cutover by it


def test_a_swap_policy_names_every_bad_field() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of.*on_failure.*attempts"):
        SwapPolicy(mode="x", on_failure="retry", attempts=0)


def manifest(shapes: dict[str, tuple[int, ...]], dtype: str = "BF16"):
    return pack([(n, dtype, s) for n, s in shapes.items()], backend="cpu", alignment=256,
                max_slab=1 << 30)


def test_the_new_shard_must_sit_where_the_served_one_does() -> None:
    served = manifest({"a": (4, 8), "b": (8,)})
    assert staging.manifest_difference(served, manifest({"a": (4, 8), "b": (8,)})) == ""
    assert "tensor 'a' is BF16[4, 8] in the served weights, F16[4, 8] in the new one" in \
        staging.manifest_difference(served, manifest({"a": (4, 8), "b": (8,)}, "F16"))
    assert "tensor 'b' (BF16[8]) is served, the new checkpoint has none" in \
        staging.manifest_difference(served, manifest({"a": (4, 8)}))
    assert "the new checkpoint has tensor 'c' (BF16[2])" in staging.manifest_difference(
        served, manifest({"a": (4, 8), "b": (8,), "c": (2,)}))
    assert "tensor 'a' is BF16[4, 8] in the served weights, BF16[5, 8]" in \
        staging.manifest_difference(served, manifest({"a": (5, 8), "b": (8,)}))


def test_config_keys_of_the_architecture_must_match(tmp_path: Path) -> None:
    a, b, plain = tmp_path / "a", tmp_path / "b", tmp_path / "plain"
    for d in (a, b, plain):
        d.mkdir()
    (a / "config.json").write_text(json.dumps({"hidden_size": 64, "rope_theta": 1e4}))
    (b / "config.json").write_text(json.dumps({"hidden_size": 64, "rope_theta": 5e5}))
    assert staging.config_difference(str(a), str(b)) == ""  # not an architecture key
    (b / "config.json").write_text(json.dumps({"hidden_size": 128}))
    assert "hidden_size is 64 served, 128" in staging.config_difference(str(a), str(b))
    assert staging.config_difference(str(a), str(plain)) == ""  # nothing to compare


def test_host_buffers_and_copies_move_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "COPY_CHUNK", 4096)  # several chunks, and a partial one
    sizes = (3 * 4096 + 5, 3)
    src, free_src = staging.host_buffers(sizes, pinned=False)
    dst, free_dst = staging.host_buffers(sizes, pinned=False)
    rng = np.random.default_rng(0)
    for b in src:
        b[:] = rng.integers(0, 256, len(b), dtype=np.uint8)
    staging.copy_bytes(dst, src)
    assert all(np.array_equal(d, s) for d, s in zip(dst, src, strict=True))
    with pytest.raises(ValueError, match="bytes into a slab of"):
        staging.copy_bytes(dst[:1], src[1:])
    src.clear()
    dst.clear()
    free_src()
    free_dst()


def test_published_tensors_must_be_exactly_the_shard() -> None:
    m = manifest({"a": (4, 8), "b": (8,)})
    good = [["a", "BF16", [4, 8]], ["b", "BF16", [8]]]
    assert tensors_difference(m, good) == ""
    assert "'c' is not a tensor" in tensors_difference(m, [["c", "BF16", [1]]])
    assert "'a' is BF16[8, 4]" in tensors_difference(m, [["a", "BF16", [8, 4]], good[1]])
    assert "1 tensor(s) not published, first 'b'" in tensors_difference(m, good[:1])
    assert "named twice" in tensors_difference(m, [good[0], good[0]])
    assert "3 tensors named" in tensors_difference(m, [*good, good[0]])


def test_an_engine_takes_its_ranks_published_identity() -> None:
    env = EngineEnv.from_env({"VLAUNCH_RANKS": "2,3",
                              "VLAUNCH_CHECKPOINT_DATA": "published-x,published-y"})
    assert env.published_identity(3) == "published-y" and env.published_identity(0) == ""
    assert EngineEnv.from_env({"VLAUNCH_RANKS": "0"}).published_identity(0) == ""
    assert env.to_env()["VLAUNCH_CHECKPOINT_DATA"] == "published-x,published-y"


def test_vlaunch_status_says_when_the_engine_did_not_take_its_weights_from_the_caches() -> None:
    from vlaunch.launcher.status import format_status

    engine = {"state": "ready", "pid": 9, "restarts": 1, "hangs": 0, "last_exit": 0,
              "weights": {"0": "cache", "1": "not the cache: fingerprint mismatch: dtype"}}
    text = format_status({"phase": "serving", "caches_ready": True, "engine_ready": True,
                          "ranks": {}, "engine": engine})
    assert "engine: rank 1's weights not the cache: fingerprint mismatch: dtype" in text
    assert "rank 0's weights" not in text


def test_a_respawn_follows_the_openers_its_predecessor_named(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    from vlaunch.cache.contract import protocol, wire
    from vlaunch.cache.rank.openers import Openers, start_time
    from vlaunch.launcher.escrow import Escrow

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_time(child.pid)
        # the launcher's escrow keeps what the rank named, and hands it to the respawn
        escrow, fd = Escrow(), os.memfd_create("slab")
        escrow.keep(0, {"manifest": {}, "fingerprint": {}}, [fd])
        escrow.keep_opener(0, protocol.event("openers", pid=child.pid, started=started))
        escrow.keep_opener(0, protocol.event("openers", pid=1 << 22, started=1.0))
        ours, theirs = socket.socketpair()
        escrow.hand_over(0, ours)
        frame, fds = wire.recv_frame(theirs)
        wire.close_fds(fds)
        assert frame["opened"] == [[child.pid, started], [1 << 22, 1.0]]
        # a GPU rank lists no importers: it follows those still the same processes
        openers = Openers(0)
        openers.adopt([], "cuda", opened=[tuple(r) for r in frame["opened"]], incomplete=False)
        assert openers.alive() and not openers.unknown
        assert openers.describe().startswith(f"pid {child.pid}, which opened them before")
        child.kill()
        child.wait()
        assert not openers.alive()  # gone: an in-place swap may overwrite the slabs
        escrow.keep_opener(0, protocol.event("openers", incomplete=True))
        escrow.hand_over(0, ours)
        frame, fds = wire.recv_frame(theirs)
        wire.close_fds(fds)
        assert frame["incomplete"] is True and "opened" not in frame
        gone = Openers(0)
        gone.adopt([], "cuda", opened=[], incomplete=True)
        assert gone.alive() and "could not name every process that opened them" in gone.unknown
        ours.close()
        theirs.close()
        escrow.close()
    finally:
        child.kill()
        child.wait()
