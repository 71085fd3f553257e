"""Every publish request that fails over the protocol is answered with its status, on a real
rank: a commit naming a missing, misshapen or extra tensor (the client library refuses those
itself first), a commit with no begin, and an error while the rank takes the published
version (no host memory for the rollback copy). The connection stays usable and the rank
serves on; nothing ends up in its log as an unretrieved task exception."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest

from vlaunch.cache.contract import wire
from vlaunch.cache.contract.connection import Connection
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.reference.refmodel import make_checkpoint

from .test_swap_rank import SHAPE, Rank

pytestmark = pytest.mark.timeout(360)


def begin(conn: Connection, mode: str = "double") -> list[list[Any]]:
    """publish_begin; the shard's [name, dtype, shape] rows (the staging fds closed)."""
    (reply, fds), = conn.exchange([{"op": "publish_begin", "label": "step-1", "mode": mode,
                                    "margin": 0}])
    wire.close_fds(fds)
    assert reply["ok"] is True, reply
    return [list(t[:3]) for t in reply["manifest"]["tensors"]]


def commit(conn: Connection, rows: list[list[Any]]) -> dict[str, Any]:
    (reply, fds), = conn.exchange([{"op": "publish_commit", "label": "step-1",
                                    "tensors": rows}])
    wire.close_fds(fds)
    return reply


def test_a_wrong_commit_is_answered_with_its_status(tmp_path: Path, sockdir: Path) -> None:
    rank = Rank(make_checkpoint(tmp_path / "a", seed=0, **SHAPE), sockdir, tmp_path / "log")
    try:
        conn = Connection(socket_path(sockdir, 0), client="a trainer")
        rows = begin(conn)
        name, dtype, shape = rows[0]
        for wrong, why in (
                (rows[1:], f"1 tensor(s) not published, first {name!r}"),
                ([[name, dtype, [*shape, 2]], *rows[1:]], f"{name!r} is {dtype}"),
                ([*rows, ["lm_head.extra", dtype, shape]], "tensors named, the shard has"),
                ([["lm_head.extra", dtype, shape], *rows[1:]], "is not a tensor of this rank")):
            reply = commit(conn, wrong)
            assert reply["ok"] is False and reply["status"] == ExitStatus.SWAP_UNAVAILABLE, reply
            assert "published tensors refused" in reply["message"] and why in reply["message"]
            rows = begin(conn)  # the refusal dropped the staging: the same connection begins
        reply = commit(Connection(socket_path(sockdir, 0)), rows)  # another connection's
        assert reply["status"] == ExitStatus.SWAP_UNAVAILABLE
        assert "without a publish_begin on this connection" in reply["message"]
        conn.close()
        assert rank.serves(tmp_path / "a")
    finally:
        rank.close()
    log = (tmp_path / "log").read_text()
    assert "Task exception was never retrieved" not in log and "Traceback" not in log, log


def test_no_memory_while_taking_the_version_is_answered(tmp_path: Path, sockdir: Path) -> None:
    # a shard of ~70 MB: its rollback copy cannot fit under the address-space limit set below
    model = make_checkpoint(tmp_path / "big", seed=0, hidden=256, layers=1, heads=4,
                            kv_heads=2, intermediate=512, vocab=65536, shards=1)
    rank = Rank(model, sockdir, tmp_path / "log")
    proc = psutil.Process(rank.proc.pid)
    try:
        conn = Connection(socket_path(sockdir, 0), client="a trainer")
        rows = begin(conn, mode="in-place")  # staged on the host: the commit keeps a copy
        soft, hard = proc.rlimit(psutil.RLIMIT_AS)
        proc.rlimit(psutil.RLIMIT_AS, (proc.memory_info().vms + (24 << 20), hard))
        try:
            reply = commit(conn, rows)
        finally:
            proc.rlimit(psutil.RLIMIT_AS, (soft, hard))
        assert reply["ok"] is False and reply["status"] == ExitStatus.OUT_OF_MEMORY, reply
        assert "publish_commit failed on rank 0" in reply["message"], reply
        rows = begin(conn)  # the staging was dropped; the connection still answers
        conn.close()
        assert rank.serves(model)
    finally:
        rank.close()
    assert "Task exception was never retrieved" not in (tmp_path / "log").read_text()
