"""`vlaunch swap`: ask a running launcher for new weights over its control socket, and wait
for the outcome (docs/swap.md). The exit status says how it ended (docs/exit-codes.md): 0 the
new weights serve; a cache status (65, 66, 67, 74, 78, 84) for a checkpoint refused before
anything was touched; 85 rolled back; 86 the launcher stopped; 87 no swap was made."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import click

from vlaunch.cache.contract import control, wire
from vlaunch.cache.contract.errors import VlaunchError, exit_status
from vlaunch.cache.contract.logs import setup_logging
from vlaunch.cache.contract.sockdir import check_peer, default_socket_dir, ensure_socket_dir

log = logging.getLogger("vlaunch.swap")
GIB = 1 << 30


class SwapUnavailable(VlaunchError):
    """No outcome: no launcher answered, or none in time (87)."""

    status = exit_status("SWAP_UNAVAILABLE")


@click.command("swap")
@click.option("--model", required=True, help="The new checkpoint (a directory or a "
              ".safetensors file) as the cache ranks see it; same architecture and plan.")
@click.option("--socket-dir", envvar="VLAUNCH_SOCKET_DIR", show_envvar=True, default="",
              help="The launcher's socket directory [default: as vlaunch run].")
@click.option("--mode", type=click.Choice(control.MODES), default="auto", show_default=True,
              help="double: new slabs beside the old ones; in-place: staged in host memory, "
                   "copied into the slabs once the engine is gone; auto: double where every "
                   "device has room for both (with --margin-gib to spare).")
@click.option("--on-failure", type=click.Choice(control.ON_FAILURE), default="rollback",
              show_default=True, help="The new engine never became ready: restore the old "
                                      "weights (85), or stop the launcher (86).")
@click.option("--standby/--no-standby", default=True, show_default=True,
              help="Cut over to a standby engine parked for the new weights, when the "
                   "launcher runs with --standby.")
@click.option("--margin-gib", type=click.FloatRange(0), default=1.0, show_default=True,
              help="Device memory that must stay free beside both shards for auto to pick "
                   "double.")
@click.option("--lease-wait", type=click.FloatRange(0), default=10.0, show_default=True,
              help="Seconds an in-place copy waits for other processes mapping the old "
                   "weights (a second engine, vlaunch verify, a seed stream) to let go.")
@click.option("--attempts", type=click.IntRange(1), default=3, show_default=True,
              help="Exits of the new engine before it is ready, then --on-failure.")
@click.option("--ready-timeout", type=click.FloatRange(1), default=300.0, show_default=True,
              help="Seconds the new engine may take to be ready, then --on-failure.")
@click.option("--timeout", type=click.FloatRange(1), default=3600.0, show_default=True,
              help="Seconds to wait for the outcome (the swap goes on past it: 87).")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def swap(model: str, socket_dir: str, mode: str, on_failure: str, standby: bool,
         margin_gib: float, lease_wait: float, attempts: int, ready_timeout: float,
         timeout: float, as_json: bool) -> None:
    """Replace the weights a running launcher serves, with a second or less of downtime."""
    setup_logging("vlaunch-swap", "INFO")
    request = control.swap_request(os.path.abspath(model), mode=mode, on_failure=on_failure,
                                   standby=standby, margin=int(margin_gib * GIB),
                                   lease_wait=lease_wait, attempts=attempts,
                                   ready_timeout=ready_timeout)
    try:
        outcome = request_swap(Path(socket_dir or default_socket_dir()), request, timeout)
    except VlaunchError as exc:
        log.error("%s", exc)
        sys.exit(int(exc.status))
    if as_json:
        click.echo(json.dumps(outcome, indent=2))
    elif outcome["status"] == 0:
        click.echo(outcome["message"])
    else:
        log.error("%s", outcome["message"])
    sys.exit(int(outcome["status"]))


def request_swap(directory: Path, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send a swap request to the launcher owning `directory`; its final answer."""
    path = control.control_path(ensure_socket_dir(directory, create=False))
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(10.0)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise SwapUnavailable(f"no launcher answers on {path} ({exc.strerror}); start "
                                  "vlaunch run, or pass its --socket-dir") from None
        check_peer(sock)
        wire.send_frame(sock, request)
        step = ""  # the last step the launcher said the swap reached
        while True:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                answer, fds = wire.recv_frame(sock, max_body=control.MAX_BODY)
            except TimeoutError:
                raise SwapUnavailable(f"no outcome within --timeout ({timeout:g} s); the swap "
                                      "goes on: see vlaunch status") from None
            except EOFError:
                raise SwapUnavailable(_gone(step)) from None
            wire.close_fds(fds)
            if not isinstance(answer.get("status"), int):
                raise SwapUnavailable(f"the launcher sent a malformed answer ({str(answer)[:200]})")
            if answer.get("final"):
                return answer
            if step:
                log.info("swap to version %s: %s (%s)", answer.get("version"),
                         answer.get("message"), answer.get("mode"))
            else:
                log.info("swap to version %s accepted: %s", answer.get("version"),
                         answer.get("message"))
            step = str(answer.get("message", ""))


def _gone(step: str) -> str:
    """Why there is no outcome when the launcher closed the connection, and whether the
    ranks had begun to cut over (the launcher says "cutting over" when it asks them)."""
    if step == control.CUTTING_OVER:
        return ("the launcher closed the control connection after the ranks began to cut "
                "over (it stopped?): they may hold the new weights, or some of them; no engine "
                "serves them, and a new vlaunch run loads its --model: see the launcher's log")
    return ("the launcher closed the control connection before the ranks began to cut over "
            "(it stopped?): the old weights were never touched; see the launcher's log")
