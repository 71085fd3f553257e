"""The launcher's control socket, one definition for both ends: `vlaunch swap` asks a running
launcher for new weights (docs/swap.md).

`SOCKET_DIR/launcher.sock`, mode 0600 inside the 0700 socket directory, bound by the launcher
alone; each side checks the other's uid (SO_PEERCRED) and refuses symlinked or foreign-owned
paths (sockdir.py). Frames are the wire protocol's (protocol.py): JSON, bounded, never pickled.
The client sends one `swap` request; the launcher answers `accepted` (not final) as soon as
the swap begins, then its outcome once (final: an exit status and a message). Never over the
HTTP health port, which has no authentication.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlaunch.cache.contract.errors import ProtocolError
from vlaunch.cache.contract.protocol import MAX_STRING

SOCKET = "launcher.sock"
MAX_BODY = 64 << 10
"""Largest control frame either way."""
MODES = ("auto", "double", "in-place")
ON_FAILURE = ("rollback", "stop")
CUTTING_OVER = "cutting over"
"""The progress answer's message once the launcher asks the ranks to cut over: from then on
they may hold the new weights, should the launcher die (the core's own copy, core/swap.py,
is checked equal by tests/test_swap_parts.py)."""
REQUEST: dict[str, type] = {"op": str, "model": str, "mode": str, "on_failure": str,
                            "standby": bool, "margin": int, "lease_wait_ms": int,
                            "attempts": int, "ready_timeout_ms": int}
"""Every field of a swap request, all required."""


def control_path(directory: Path | str) -> Path:
    """The control socket of the launcher that owns `directory`."""
    return Path(directory) / SOCKET


def swap_request(model: str, *, mode: str = "auto", on_failure: str = "rollback",
                 standby: bool = True, margin: int = 1 << 30, lease_wait: float = 10.0,
                 attempts: int = 3, ready_timeout: float = 300.0) -> dict[str, Any]:
    """A swap request, checked."""
    return validate({"op": "swap", "model": model, "mode": mode, "on_failure": on_failure,
                     "standby": standby, "margin": margin,
                     "lease_wait_ms": round(lease_wait * 1000), "attempts": attempts,
                     "ready_timeout_ms": round(ready_timeout * 1000)})


def validate(msg: dict[str, Any]) -> dict[str, Any]:
    """Check a swap request: every field present, of its type, in range; ProtocolError."""
    if set(msg) != set(REQUEST):
        raise ProtocolError(f"a swap request has exactly the fields {sorted(REQUEST)}")
    for key, kind in REQUEST.items():
        value = msg[key]
        if type(value) is not kind:
            raise ProtocolError(f"swap.{key}: expected {kind.__name__}")
        if kind is str and not 0 < len(value) <= MAX_STRING:
            raise ProtocolError(f"swap.{key}: 1..{MAX_STRING} characters")
        if kind is int and not 0 <= value < 1 << 50:
            raise ProtocolError(f"swap.{key}: out of range")
    if msg["op"] != "swap":
        raise ProtocolError(f"unknown control request {msg['op'][:64]!r}")
    if msg["mode"] not in MODES or msg["on_failure"] not in ON_FAILURE:
        raise ProtocolError(f"swap.mode must be one of {', '.join(MODES)} and on_failure one "
                            f"of {', '.join(ON_FAILURE)}")
    if msg["attempts"] < 1:
        raise ProtocolError("swap.attempts must be at least 1")
    return msg


def answer(*, final: bool, status: int, message: str, version: int,
           mode: str = "") -> dict[str, Any]:
    """The launcher's answer to a swap request."""
    return {"ok": status == 0, "final": final, "status": status, "message": message[:MAX_STRING],
            "version": version, "mode": mode}
