"""`vlaunch verify`'s work: every byte each rank serves, hashed per tensor, against the files.

The ranks hash their own slabs (a `digest` request; CUDA slabs are copied to host in chunks),
this process hashes the same slices of the checkpoint files (store.identity), both in
parallel; any tensor whose digests differ is listed. Exit 0 when every tensor of every rank
matches, VERIFY_FAILED (79) when one does not, USAGE (64) when it cannot check.

The launcher's `vlaunch verify` parses the command line and execs this module with its
parameters as one JSON argument, so that the launcher itself imports only the contract.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract.engine_env import DEFAULT_PLAN
from vlaunch.cache.contract.errors import UsageError, VlaunchError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.contract.logs import setup_logging
from vlaunch.cache.contract.sockdir import default_socket_dir
from vlaunch.cache.store.identity import compare_digests, expected_digests
from vlaunch.cache.store.plan import Position

log = logging.getLogger("vlaunch.verify")
PAGE = 1024
MAX_TENSORS = 1_000_000  # as a manifest
_SOCKET = re.compile(r"rank-(\d+)\.sock")


def verify_rank(socket: Path, model: str = "", threads: int = 8,
                timeout: float = 600.0) -> dict[str, Any]:
    """Compare one rank's slabs with the files: {rank, model, tensors, changed, mismatches}.
    A published version (docs/swap.md) has no files: its slabs are compared with the digests
    the rank took when the trainer committed it."""
    client = CacheClient(socket, client="vlaunch verify", io_timeout=timeout)
    try:
        status = client.status()
        checkpoint = status.get("checkpoint") or {}
        if checkpoint.get("published"):
            recorded = _held(client, "published_digests")
            held = _held(client)
            return {"rank": int(status["rank"]),
                    "model": f"published {checkpoint['published']}", "tensors": len(held),
                    "changed": [], "mismatches": compare_digests(held, recorded)}
        fp = status["fingerprint"]
        position = Position(**{k: int(fp[k]) for k in ("tp_size", "tp_rank", "pp_size", "pp_rank",
                                                   "dp_size", "dp_rank")})
        path = model or checkpoint.get("model") or ""
        if not path:
            raise UsageError(f"the cache at {socket} does not say which checkpoint it read; "
                             "pass --model")
        with ThreadPoolExecutor(1) as pool:
            expected = pool.submit(expected_digests, path, checkpoint.get("plan") or DEFAULT_PLAN,
                                   position, threads=threads)
            held = _held(client)
            bad = compare_digests(held, expected.result())
    finally:
        client.close()
    return {"rank": int(status["rank"]), "model": path, "tensors": len(held),
            "changed": checkpoint.get("changed") or [], "mismatches": bad}


def _held(client: CacheClient, op: str = "digest") -> dict[str, str]:
    """The rank's digests, a page at a time (the first request computes them); `op`
    published_digests: those it took of a published version at its commit."""
    out: dict[str, str] = {}
    total = None
    while total is None or len(out) < total:
        reply, _ = client.request({"op": op, "start": len(out), "count": PAGE})
        try:
            total, rows = int(reply["total"]), reply["digests"]
            if not 0 <= total <= MAX_TENSORS or not isinstance(rows, list) or len(rows) > PAGE:
                raise ValueError("out of bounds")
            page = {str(n): str(d) for n, d in rows}
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"cache at {client.path} sent a malformed digest reply ({exc}); "
                             "run the same vlaunch version on both sides") from None
        if not page and len(out) < total:
            raise UsageError(f"cache at {client.path} sent an empty digest page")
        out.update(page)
    return out


def rank_sockets(socket_dir: Path) -> list[Path]:
    """The rank sockets in a socket directory, by rank."""
    try:
        found = [(int(m.group(1)), p) for p in socket_dir.iterdir()
                 if (m := _SOCKET.fullmatch(p.name))]
    except OSError as exc:
        raise UsageError(f"cannot list the socket directory {socket_dir}: {exc.strerror}; pass "
                         "--socket-dir") from None
    if not found:
        raise UsageError(f"no cache rank is serving in {socket_dir}; pass the launcher's "
                         "--socket-dir")
    return [p for _, p in sorted(found)]


def run(socket_dir: str = "", model: str = "", threads: int = 8, timeout: float = 600.0,
        as_json: bool = False) -> int:
    """Verify every rank in the socket directory; print one line per rank; the exit status."""
    try:
        sockets = rank_sockets(Path(socket_dir or default_socket_dir()))
        with ThreadPoolExecutor(len(sockets)) as pool:
            results = list(pool.map(lambda s: verify_rank(s, model, threads, timeout), sockets))
    except VlaunchError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return int(ExitStatus.USAGE)
    for r in results:
        for line in r["mismatches"]:
            log.error("rank %d: %s", r["rank"], line)
        if r["changed"]:
            log.warning("rank %d: the checkpoint changed on disk since the rank read it: %s",
                        r["rank"], ", ".join(r["changed"]))
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            state = f"{len(r['mismatches'])} MISMATCH(ES)" if r["mismatches"] else "ok"
            print(f"rank {r['rank']}: {r['tensors']} tensors {state}")
    return int(ExitStatus.VERIFY_FAILED) if any(r["mismatches"] for r in results) else 0


def main(argv: list[str]) -> int:
    """Entry point of the exec: one JSON object of run()'s parameters."""
    setup_logging("vlaunch-verify")
    return run(**json.loads(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
