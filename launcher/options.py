"""Turn `vlaunch run`'s options into a RunSpec: ranks of this node, devices, policies."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import tomllib

from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.launch import check_seed_listening
from vlaunch.cache.contract.roles import DRAFT, seat
from vlaunch.cache.contract.sockdir import default_socket_dir, socket_path

from .core.events import SupervisorConfig
from .executor import RunSpec
from .listen import ListenAddress, activated
from .notify import watchdog_interval
from .preflight import check_command
from .probes import HttpProbe

ENGINE_SETTLE = 1.0
"""Seconds an engine without a readiness check (--engine-ready none) must stay up before it
counts as ready: one that exits at once is never reported ready."""


def load_config(path: str) -> dict[str, Any]:
    """Read a TOML config file: option names as keys (dashes or underscores), or a [run] table."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read config file {path}: {exc}; fix the file or drop "
                         "--config") from None
    data = data.get("run", data)
    return {k.replace("-", "_"): v for k, v in data.items()}


def node_ranks(tp: int, pp: int, dp: int, nnodes: int, node_rank: int) -> tuple[int, ...]:
    """The block of global ranks this node serves."""
    world = tp * pp * dp
    if world % nnodes:
        raise UsageError(f"{world} ranks (tp {tp} x pp {pp} x dp {dp}) do not divide over "
                         f"{nnodes} nodes; change --nnodes")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} is not in 0..{nnodes - 1}")
    per = world // nnodes
    return tuple(range(node_rank * per, (node_rank + 1) * per))


def rank_devices(ranks: tuple[int, ...], device: str, devices: str) -> dict[int, str]:
    """Each rank's device: cpu, or cuda:N / cuda:GPU-uuid from --devices, else by position."""
    if device == "cpu":
        if devices:
            raise UsageError("--devices needs --device cuda")
        return dict.fromkeys(ranks, "cpu")
    items = [d.strip() for d in devices.split(",") if d.strip()] if devices else []
    if items and len(items) != len(ranks):
        raise UsageError(f"--devices lists {len(items)} devices for {len(ranks)} local ranks; "
                         "give one per rank")
    names = [i if i.startswith("cuda") else f"cuda:{i}" for i in items] or \
        [f"cuda:{n}" for n in range(len(ranks))]
    return dict(zip(ranks, names, strict=True))


def build_spec(o: dict[str, Any], engine: tuple[str, ...], model: str) -> RunSpec:
    """Validate the options and assemble the launcher's RunSpec."""
    ranks = node_ranks(o["tensor_parallel_size"], o["pipeline_parallel_size"],
                       o["data_parallel_size"], o["nnodes"], o["node_rank"])
    readiness = o["engine_ready"]
    if readiness == "auto":
        readiness = "http" if o["engine_health_url"] else "none"
    if readiness == "http" and not o["engine_health_url"]:
        raise UsageError("--engine-ready http needs --engine-health-url")
    check_seed_listening(o["seed_listen_port"], o["seed_token"])
    check_command(engine, "engine command", "the command after --")
    liveness = (HttpProbe.parse(o["engine_liveness_request"], o["engine_liveness_deadline"])
                if o.get("engine_liveness_request") else None)
    preload = _preload(o["preload_autotune"])
    check_command(preload, "preload command", "--preload-autotune")
    draft = _draft(o, model, ranks)
    listen = tuple(o.get("listen") or ())
    for value in listen:
        ListenAddress.parse(value)  # bad syntax, a path too long: 64 now; binding comes later
    if listen and not engine:
        raise UsageError("--listen needs an engine command (after --): the launcher holds "
                         "the engine's sockets")
    try:
        config = SupervisorConfig(
            ranks=ranks + draft, has_engine=bool(engine), restart_max=o["restart_max"],
            restart_window=o["restart_window"], stable_after=o["stable_after"],
            backoff_initial=o["backoff_initial"], backoff_max=o["backoff_max"],
            stop_timeout=o["stop_timeout"],
            engine_config_error_statuses=frozenset(o["engine_config_error_status"]),
            on_rank_exit=o["on_rank_exit"], engine_readiness=readiness,
            engine_settle=ENGINE_SETTLE if readiness == "none" else 0.0,
            stop_on_engine_success=o["stop_on_engine_success"],
            standby=bool(o["standby"]) and bool(engine),
            standby_park_timeout=o["standby_park_timeout"],
            watchdog_interval=watchdog_interval(os.environ),
            preload=bool(o["preload_autotune"]),
            start_timeout=o.get("start_timeout") or None, model=model, swap_ranks=ranks,
            unhealthy_after=o.get("engine_unhealthy_after") or None,
            engine_watchdog=o.get("engine_watchdog") or None,
            hang_kill_after=o.get("engine_hang_kill_after"),
            listening=bool(engine) and (bool(listen) or activated(os.environ)),
            drain_timeout=o.get("drain_timeout"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    port = o["health_port"]
    return RunSpec(model=model, socket_dir=Path(o["socket_dir"] or default_socket_dir()),
                   ranks=ranks, devices=rank_devices(ranks, o["device"], o["devices"]),
                   tensor_parallel_size=o["tensor_parallel_size"],
                   pipeline_parallel_size=o["pipeline_parallel_size"],
                   data_parallel_size=o["data_parallel_size"], plan=o["plan"],
                   threads=o["threads"],
                   engine=engine, engine_health_url=o["engine_health_url"],
                   health_host=o["health_host"], health_port=None if port < 0 else port,
                   kernel_backends=o["kernel_backends"], supervisor=config,
                   artifact_dir=o["artifact_dir"], seed=o["seed"], seed_token=o["seed_token"],
                   seed_fallback=o["seed_fallback"], seed_listen_host=o["seed_listen_host"],
                   seed_listen_port=o["seed_listen_port"], seed_streams=o["seed_streams"],
                   preload=preload,
                   preload_timeout=o["preload_timeout"], verify=o["verify"],
                   draft_model=o.get("draft_model") or "",
                   draft_plan=o.get("draft_plan") or "replicate",
                   liveness=liveness, liveness_interval=o.get("engine_liveness_interval", 10.0),
                   listen=listen)


def _draft(o: dict[str, Any], model: str, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The draft group's supervisor slots (roles.seat): none without --draft-model, or when
    the draft is the target's own checkpoint (served by the target's group, held once)."""
    draft = o.get("draft_model") or ""
    if not draft or os.path.realpath(draft) == os.path.realpath(model):
        return ()
    world = o["tensor_parallel_size"] * o["pipeline_parallel_size"] * o["data_parallel_size"]
    directory = o["socket_dir"] or default_socket_dir()
    for rank in ranks:
        socket_path(directory, rank, DRAFT)  # too long for a Unix socket: 73 now
    return tuple(seat(DRAFT, r, world) for r in ranks)


def _preload(command: str) -> tuple[str, ...]:
    """The preload command, split like a shell would (no shell runs it)."""
    try:
        return tuple(shlex.split(command))
    except ValueError as exc:
        raise UsageError(f"--preload-autotune cannot be split into words: {exc}") from None
