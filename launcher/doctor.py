"""`vlaunch doctor`: a preflight of this host for what changes vlaunch's behaviour or breaks a
deployment, each with what was found, what vlaunch will do because of it, and the fix.

The checks use the product's own probes, so that doctor reports what a run would choose: the
cache rank's (page size, memfd seals, fd limit and connection bound, shard sizes, pinned
staging, the CUDA driver) in a subprocess (vlaunch.cache.rank.hostprobe: the launcher imports
only the contract), the launcher's (cgroup, /proc, socket directory) here. Exit 0 when nothing
blocks (warnings allowed), HOST_BLOCKED (77) when something does, 64 for a bad command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # imported when the command runs: `vlaunch` itself starts without them
    from . import doctor_checks as dc

PROBE_TIMEOUT = 120.0


def probe(params: dict[str, Any]) -> dict[str, Any]:
    """The cache rank's probes, in a child process (as a rank would run them)."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "vlaunch.cache.rank.hostprobe",
                           json.dumps(params)], capture_output=True, text=True,
                          timeout=PROBE_TIMEOUT, check=False)
    if done.returncode != 0:
        raise click.ClickException(f"the cache-side host probe failed ({done.returncode}): "
                                   f"{done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


def nvml_state() -> tuple[list[Any] | None, dict[str, bool], str]:
    """NVML's GPUs (contract nvml) and each one's persistence mode."""
    from vlaunch.cache.contract.nvml import NVML

    gpus = NVML.sample()
    if gpus is None:
        return None, {}, NVML.error
    import pynvml

    modes = {}
    for g in gpus:
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(g.index)
            modes[g.uuid] = pynvml.nvmlDeviceGetPersistenceMode(h) == 1
        except pynvml.NVMLError:
            continue
    return gpus, modes, ""


def docker_info() -> tuple[int, str]:
    """`docker info` as JSON, or its error."""
    import subprocess

    try:
        done = subprocess.run(["docker", "info", "--format", "{{json .}}"], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, f"docker: {exc}"
    text = done.stdout if done.returncode == 0 else (done.stderr or done.stdout)
    return done.returncode, text


def try_listen(value: str) -> str:
    """Bind --listen `value` as vlaunch run would, and let it go at once: "" when it can be,
    else the error (a Unix socket file made here is removed again)."""
    from vlaunch.cache.contract.errors import VlaunchError

    from .listen import ListenAddress, bind

    try:
        address = ListenAddress.parse(value)
        existed = bool(address.path) and os.path.lexists(address.path)
        sock = bind(address)
    except VlaunchError as exc:
        return str(exc)
    sock.close()
    if address.path and not existed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address.path)
    return ""


def run_checks(o: dict[str, Any], host: dc.Host, directory: Path,
               own_cgroup: Callable[[str, str], Path | None], proc_ours: bool
               ) -> list[dc.Finding]:
    """Every check, in the order they print."""
    from vlaunch.cache.contract.sockdir import socket_path

    from . import doctor_checks as dc
    from . import doctor_gpu as dg

    world = o["tp"] * o["pp"] * o["dp"]
    device = o["device"]
    return [
        dc.slab_pages(host, device), dc.memfd_seals(host, device), dc.nofile(host),
        dc.cgroup(host, own_cgroup), dc.proc(host, proc_ours),
        dc.socket_dir(directory, lambda d: socket_path(d, world - 1)),
        dg.memory(host, device, o["rank_devices"]), dg.cuda_vmm(host, device),
        dg.persistence(host), dg.nvml_pidns(host), dg.memlock(host, device),
        dg.docker(host, device), dc.listen(o["listen"], try_listen)]


def report(findings: list[dc.Finding]) -> dict[str, Any]:
    """The JSON document: counts, the exit status, every finding."""
    from vlaunch.cache.contract.exitcodes import ExitStatus

    from .doctor_checks import BLOCKER, WARNING

    blockers = sum(f.severity == BLOCKER for f in findings)
    return {"blockers": blockers, "warnings": sum(f.severity == WARNING for f in findings),
            "status": int(ExitStatus.HOST_BLOCKED) if blockers else 0,
            "checks": [{"check": f.check, "severity": f.severity, "found": f.found,
                        "choice": f.choice, "fix": f.fix, "data": f.data} for f in findings]}


def format_text(doc: dict[str, Any]) -> str:
    """One line per check; the choice and the fix indented under warnings and blockers."""
    lines = [f"vlaunch doctor: {doc['blockers']} blocker(s), {doc['warnings']} warning(s)"]
    for c in doc["checks"]:
        lines.append(f"{c['severity'].upper():<8} {c['check']:<12} {c['found']}")
        if c["choice"]:
            lines.append(f"{'':<21} vlaunch: {c['choice']}")
        if c["fix"] and c["severity"] in ("warning", "blocker"):
            lines.append(f"{'':<21} fix: {c['fix']}")
    return "\n".join(lines)


@click.command("doctor")
@click.option("--model", default="", help="A checkpoint: check free memory against each local "
              "rank's shard.")
@click.option("--plan", default="", help="Its shard plan [default: as vlaunch run].")
@click.option("--device", default="cpu", type=click.Choice(["cpu", "cuda"]),
              envvar="VLAUNCH_DEVICE", show_default=True,
              help="The device the cache ranks would use.")
@click.option("--tensor-parallel-size", "tp", default=1, type=click.IntRange(1), show_default=True)
@click.option("--pipeline-parallel-size", "pp", default=1, type=click.IntRange(1),
              show_default=True)
@click.option("--data-parallel-size", "dp", default=1, type=click.IntRange(1), show_default=True)
@click.option("--nnodes", default=1, type=click.IntRange(1), show_default=True)
@click.option("--node-rank", default=0, type=click.IntRange(0), show_default=True)
@click.option("--devices", default="", help="As vlaunch run's --devices.")
@click.option("--threads", default=0, type=click.IntRange(0),
              help="Reader threads per rank [default: as vlaunch run].")
@click.option("--socket-dir", envvar="VLAUNCH_SOCKET_DIR", default="",
              help="The socket directory [default: as vlaunch run].")
@click.option("--listen", multiple=True, help="As vlaunch run's --listen: can it be bound here?")
@click.option("--docker", "with_docker", is_flag=True, help="Also check the Docker daemon.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(as_json: bool, with_docker: bool, **o: Any) -> None:
    """Check this host for what changes vlaunch's behaviour or breaks a deployment.

    Exit 0 when nothing blocks (warnings allowed), 77 when a blocker was found.
    """
    from vlaunch.cache.contract.errors import VlaunchError
    from vlaunch.cache.contract.launch import DEFAULT_PLAN, READER_THREADS
    from vlaunch.cache.contract.peers import proc_is_ours
    from vlaunch.cache.contract.sockdir import default_socket_dir

    from . import doctor_checks as dc
    from .children import own_cgroup
    from .options import node_ranks, rank_devices

    try:
        ranks = node_ranks(o["tp"], o["pp"], o["dp"], o["nnodes"], o["node_rank"])
        o["rank_devices"] = rank_devices(ranks, o["device"], o["devices"])
        directory = Path(o["socket_dir"]) if o["socket_dir"] else default_socket_dir()
    except VlaunchError as exc:
        raise click.UsageError(str(exc)) from None
    params = {"device": o["device"], "model": o["model"], "plan": o["plan"] or DEFAULT_PLAN,
              "tp": o["tp"], "pp": o["pp"], "dp": o["dp"], "ranks": list(ranks),
              "threads": o["threads"] or READER_THREADS}
    gpus, modes, nvml_error = nvml_state()
    host = dc.Host(Path("/"), probe(params), gpus, modes, nvml_error,
                   docker_info if with_docker else None)
    doc = report(run_checks(o, host, directory, own_cgroup, proc_is_ours()))
    click.echo(json.dumps(doc, indent=2) if as_json else format_text(doc))
    sys.exit(doc["status"])
