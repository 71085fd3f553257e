"""The status surface's data: each rank's own report (asked over its socket) merged into the
supervisor's snapshot."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlaunch.cache.contract import wire
from vlaunch.cache.contract.roles import unseat
from vlaunch.cache.contract.sockdir import check_peer, socket_path

QUERY_TIMEOUT = 2.0


def query_rank(path: Path, timeout: float = QUERY_TIMEOUT) -> dict[str, Any]:
    """A cache rank's own status (bytes held, leases), asked on its socket; OSError if none."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        check_peer(sock)
        wire.send_frame(sock, {"op": "status"})
        reply, fds = wire.recv_frame(sock)
    wire.close_fds(fds)  # a status reply carries none; never leak what a broken peer sends
    if reply.get("ok") is not True or not isinstance(reply.get("status"), dict):
        raise OSError(f"rank at {path} answered {reply.get('error')!r} to status")
    return reply["status"]


def rank_bytes(detail: Mapping[str, Any]) -> int:
    """Slab bytes a rank's status says it holds, over its devices."""
    held = detail.get("bytes_held", {})
    return sum(v for v in held.values() if isinstance(v, int)) if isinstance(held, dict) else 0


def merge(snapshot: dict[str, Any], *, socket_dir: Path, devices: Mapping[int, str],
          details: Mapping[int, Mapping[str, Any]], launcher: dict[str, Any],
          world: int = 0) -> dict[str, Any]:
    """The supervisor's snapshot with each rank's device, bytes, leases and socket; `world`:
    the group size when a draft group runs (its slots follow the target's: roles.seat)."""
    ranks = {}
    for r in snapshot["ranks"]:
        rank = r["rank"]
        detail = details.get(rank, {})
        role, group_rank = unseat(rank, world) if world else ("target", rank)
        held = rank_bytes(detail) if detail else r.get("loaded_bytes", 0)  # loading: so far
        ranks[rank] = {**r, "device": devices.get(rank), "bytes": held,
                       "leases": detail.get("leases", []),
                       "copies": detail.get("copies", {"in_flight": 0, "bytes": 0}),
                       "checkpoint": detail.get("checkpoint"),
                       "handover_blocked": detail.get("handover_blocked", ""),
                       **({"slab_pages": detail["slab_pages"]} if "slab_pages" in detail
                          else {}),
                       "role": role, "group_rank": group_rank,
                       "socket": str(socket_path(socket_dir, group_rank, role))}
    return {**snapshot, "ranks": ranks, "launcher": launcher}
