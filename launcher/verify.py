"""`vlaunch verify`: every byte each cache rank serves, hashed per tensor, against the files.

The command line is parsed here; the work (talking to the ranks, hashing the files) runs in
`vlaunch.cache.client.verify`, exec'd in this process's place, so that the launcher package
imports nothing beyond the contract. Exit 0 when every tensor matches, 79 when one does not.
"""

from __future__ import annotations

import json
import os
import sys

import click


@click.command("verify")
@click.option("--socket-dir", envvar="VLAUNCH_SOCKET_DIR", show_envvar=True, default="",
              help="The caches' socket directory [default: as vlaunch run].")
@click.option("--model", default="", help="The checkpoint as this machine sees it [default: the "
              "path each rank read].")
@click.option("--threads", default=8, type=click.IntRange(1), show_default=True,
              help="Hashing threads per rank, on each side.")
@click.option("--timeout", default=600.0, type=click.FloatRange(1), show_default=True,
              help="Seconds a rank may take to hash its slabs.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def verify(socket_dir: str, model: str, threads: int, timeout: float, as_json: bool) -> None:
    """Hash every byte each cache rank serves and compare it with the checkpoint files."""
    params = {"socket_dir": socket_dir, "model": model, "threads": threads, "timeout": timeout,
              "as_json": as_json}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "vlaunch.cache.client.verify",
                              json.dumps(params)])
