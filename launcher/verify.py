"""`vlaunch verify`: every byte each rank serves, hashed per tensor, against the files.

The ranks hash their own slabs (a `digest` request; CUDA slabs are copied to host in chunks),
this process hashes the same slices of the checkpoint files with the light store modules (no
torch), both in parallel; any tensor whose digests differ is listed. Exit 0 when every tensor
of every rank matches, VERIFY_FAILED (79) when one does not.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click

from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.sockdir import default_socket_dir

log = logging.getLogger("vlaunch.launcher")
PAGE = 1024
MAX_TENSORS = 1_000_000  # as a manifest
_SOCKET = re.compile(r"rank-(\d+)\.sock")


def verify_rank(socket: Path, model: str = "", threads: int = 8,
                timeout: float = 600.0) -> dict[str, Any]:
    """Compare one rank's slabs with the files: {rank, tensors, bytes, mismatches}."""
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.store.identity import compare_digests, expected_digests
    from vlaunch.cache.store.plan import Layout

    client = CacheClient(socket, client="vlaunch verify", io_timeout=timeout)
    try:
        status = client.status()
        checkpoint = status.get("checkpoint") or {}
        fp = status["fingerprint"]
        layout = Layout(**{k: int(fp[k]) for k in ("tp_size", "tp_rank", "pp_size", "pp_rank",
                                                   "dp_size", "dp_rank")})
        path = model or checkpoint.get("model") or ""
        if not path:
            raise VlaunchError(f"the cache at {socket} does not say which checkpoint it read; "
                               "pass --model")
        with ThreadPoolExecutor(1) as pool:
            expected = pool.submit(expected_digests, path, checkpoint.get("plan") or "llama",
                                   layout, threads=threads)
            held = _held(client)
            bad = compare_digests(held, expected.result())
    finally:
        client.close()
    return {"rank": int(status["rank"]), "model": path, "tensors": len(held),
            "changed": checkpoint.get("changed") or [], "mismatches": bad}


def _held(client: Any) -> dict[str, str]:
    """The rank's digests, a page at a time (the first request computes them)."""
    out: dict[str, str] = {}
    total = None
    while total is None or len(out) < total:
        reply, _ = client.request({"op": "digest", "start": len(out), "count": PAGE})
        try:
            total, rows = int(reply["total"]), reply["digests"]
            if not 0 <= total <= MAX_TENSORS or not isinstance(rows, list) or len(rows) > PAGE:
                raise ValueError("out of bounds")
            page = {str(n): str(d) for n, d in rows}
        except (KeyError, TypeError, ValueError) as exc:
            raise VlaunchError(f"cache at {client.path} sent a malformed digest reply ({exc}); "
                               "run the same vlaunch version on both sides") from None
        if not page and len(out) < total:
            raise VlaunchError(f"cache at {client.path} sent an empty digest page")
        out.update(page)
    return out


def rank_sockets(socket_dir: Path) -> list[Path]:
    """The rank sockets in a socket directory, by rank."""
    found = [(int(m.group(1)), p) for p in socket_dir.iterdir()
             if (m := _SOCKET.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


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
    directory = Path(socket_dir or default_socket_dir())
    try:
        sockets = rank_sockets(directory)
    except OSError as exc:
        raise click.ClickException(f"cannot list the socket directory {directory}: "
                                   f"{exc.strerror}; pass --socket-dir") from None
    if not sockets:
        raise click.ClickException(f"no cache rank is serving in {directory}; pass the "
                                   "launcher's --socket-dir")
    try:
        with ThreadPoolExecutor(len(sockets)) as pool:
            results = list(pool.map(lambda s: verify_rank(s, model, threads, timeout), sockets))
    except VlaunchError as exc:
        raise click.ClickException(str(exc)) from None
    for r in results:
        for line in r["mismatches"]:
            log.error("rank %d: %s", r["rank"], line)
        if r["changed"]:
            log.warning("rank %d: the checkpoint changed on disk since the rank read it: %s",
                        r["rank"], ", ".join(r["changed"]))
    failed = [r for r in results if r["mismatches"]]
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        for r in results:
            state = f"{len(r['mismatches'])} MISMATCH(ES)" if r["mismatches"] else "ok"
            click.echo(f"rank {r['rank']}: {r['tensors']} tensors {state}")
    sys.exit(int(ExitStatus.VERIFY_FAILED) if failed else 0)
