"""The `vlaunch` command line."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from vlaunch.cache.contract.cliopt import SourceOption
from vlaunch.cache.contract.errors import VlaunchError
from vlaunch.cache.contract.exitcodes import EXIT_TABLE, ExitStatus, markdown_table
from vlaunch.cache.contract.launch import DEFAULT_PLAN, READER_THREADS, RankArgs, rank_command
from vlaunch.cache.contract.logs import setup_logging

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("vlaunch.launcher")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="vlaunch")
def cli() -> None:
    """Keep LLM weights resident across inference-engine restarts."""


@cli.command("exit-codes")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--markdown", is_flag=True, help="The table of docs/exit-codes.md.")
def exit_codes(as_json: bool, markdown: bool) -> None:
    """Print the exit-status table of vlaunch processes."""
    if as_json:
        click.echo(json.dumps([{"status": int(i.status), "name": i.status.name, "who": i.who,
                                "meaning": i.meaning, "retry": i.retry, "todo": i.todo}
                               for i in EXIT_TABLE], indent=2))
        return
    if markdown:
        click.echo(markdown_table())
        return
    for info in EXIT_TABLE:
        click.echo(f"{int(info.status):>3}  {info.status.name:<18} {info.meaning}")


def _config_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """--config: a TOML file's keys become defaults (command line and env vars win)."""
    if value:
        from .options import load_config

        try:
            config = load_config(value)
        except VlaunchError as exc:
            raise click.BadParameter(str(exc)) from None
        known = {p.name for p in ctx.command.params if p.name}
        unknown = sorted(set(config) - known)
        if unknown:
            raise click.BadParameter(f"unknown key(s) in {value}: {', '.join(unknown)}; use "
                                     "the option names shown by vlaunch run --help")
        ctx.default_map = {**(ctx.default_map or {}), **config}


def _opt(name: str, env: str, **kw: Any) -> Callable[[F], F]:
    return click.option(name, cls=SourceOption, envvar=f"VLAUNCH_{env}", show_envvar=True,
                        show_default=True, **kw)


@cli.command("run", context_settings={"ignore_unknown_options": False})
@click.option("--config", envvar="VLAUNCH_CONFIG", is_eager=True, expose_value=False,
              callback=_config_callback, type=click.Path(dir_okay=False),
              help="TOML file whose keys (option names) set defaults.")
@_opt("--model", "MODEL", default="",
      help="Checkpoint: a .safetensors file or a directory [default: the embedded demo model].")
@_opt("--device", "DEVICE", default="cpu", type=click.Choice(["cpu", "cuda"]),
      help="Where the cache ranks hold the weights.")
@_opt("--tensor-parallel-size", "TENSOR_PARALLEL_SIZE", default=1, type=click.IntRange(1),
      help="Tensor-parallel ranks (each holds 1/N of the split tensors).")
@_opt("--pipeline-parallel-size", "PIPELINE_PARALLEL_SIZE", default=1, type=click.IntRange(1),
      help="Pipeline stages (each holds its stage's layers).")
@_opt("--data-parallel-size", "DATA_PARALLEL_SIZE", default=1, type=click.IntRange(1),
      help="Data-parallel replicas (each holds the same shards as its peers).")
@_opt("--devices", "DEVICES", default="",
      help="Comma list, one per local rank: GPU index, cuda:N or a GPU UUID (GPU-...).")
@_opt("--nnodes", "NNODES", default=1, type=click.IntRange(1), help="Nodes in the job.")
@_opt("--node-rank", "NODE_RANK", default=0, type=click.IntRange(0),
      help="This node's index: it serves global ranks [i*R/n, (i+1)*R/n).")
@_opt("--socket-dir", "SOCKET_DIR", default="",
      help="Directory of the rank sockets, mode 0700 [default: $XDG_RUNTIME_DIR/vlaunch or "
           "/tmp/vlaunch-UID].")
@_opt("--plan", "PLAN", default=DEFAULT_PLAN,
      help="Shard plan: llama, llama-ep, gpt-oss, replicate, a plan file, or module:callable.")
@_opt("--draft-model", "DRAFT_MODEL", default="",
      help="A speculative-decoding draft model's checkpoint: its own cache group beside the "
           "target's; the engine loads it with load(role='draft').")
@_opt("--draft-plan", "DRAFT_PLAN", default="replicate",
      help="The draft group's shard plan (as --plan).")
@_opt("--threads", "THREADS", default=READER_THREADS, type=click.IntRange(1),
      help="Reader threads per rank.")
@_opt("--verify", "VERIFY", is_flag=True, default=False,
      help="After each rank's first load, hash every tensor against the checkpoint files "
           "before serving; a mismatch ends the run with 79.")
@_opt("--health-host", "HEALTH_HOST", default="127.0.0.1", help="HTTP health address.")
@_opt("--health-port", "HEALTH_PORT", default=0, type=int,
      help="HTTP health port (0: pick a free one, written to SOCKET_DIR/launcher.json; "
           "-1: off).")
@_opt("--engine-ready", "ENGINE_READY", default="auto",
      type=click.Choice(["auto", "notify", "http", "none"]),
      help="Engine readiness: its sd_notify READY=1, its health URL, or none (ready once it "
           "has run 1 s); auto: http when --engine-health-url is set, else none.")
@_opt("--engine-health-url", "ENGINE_HEALTH_URL", default="",
      help="URL that answers 2xx when the engine is ready (e.g. vLLM's /health).")
@_opt("--engine-unhealthy-after", "ENGINE_UNHEALTHY_AFTER", default=120.0,
      type=click.FloatRange(0),
      help="Seconds a ready engine's health URL, liveness request or watchdog may fail without "
           "a break before it counts as hung: stopped (SIGTERM, SIGKILL after --stop-timeout) "
           "and restarted (0: never; failing only makes it not ready).")
@_opt("--engine-hang-kill-after", "ENGINE_HANG_KILL_AFTER", default=None,
      type=click.FloatRange(0),
      help="Seconds a hung engine gets between its SIGTERM and its SIGKILL [default: "
           "--stop-timeout]; 0: SIGKILL at once, so that a standby is promoted without "
           "waiting (a hung engine rarely handles SIGTERM).")
@_opt("--engine-liveness-request", "ENGINE_LIVENESS_REQUEST", default="",
      help="A request that only a working engine answers with 2xx, sent once it is ready: "
           "'METHOD URL [BODY]' (a JSON body), e.g. a one-token completion (docs/health.md).")
@_opt("--engine-liveness-deadline", "ENGINE_LIVENESS_DEADLINE", default=10.0,
      type=click.FloatRange(0.1),
      help="Seconds the liveness request may take; later is a failure.")
@_opt("--engine-liveness-interval", "ENGINE_LIVENESS_INTERVAL", default=10.0,
      type=click.FloatRange(0.1),
      help="Seconds between two liveness requests.")
@_opt("--engine-watchdog", "ENGINE_WATCHDOG", default=0.0, type=click.FloatRange(0),
      help="Give the engine WATCHDOG_USEC (these seconds) and a NOTIFY_SOCKET: once it is "
           "ready it must send WATCHDOG=1 at least this often, or its watchdog fails (0: off).")
@_opt("--restart-max", "RESTART_MAX", default=5, type=click.IntRange(0),
      help="Engine restarts allowed within --restart-window.")
@_opt("--restart-window", "RESTART_WINDOW", default=300.0, type=click.FloatRange(0),
      help="Seconds over which engine restarts are counted.")
@_opt("--stable-after", "STABLE_AFTER", default=60.0, type=click.FloatRange(0),
      help="Seconds of engine readiness that reset the budget and the backoff.")
@_opt("--backoff-initial", "BACKOFF_INITIAL", default=0.5, type=click.FloatRange(0),
      help="First restart delay in seconds (doubles each time).")
@_opt("--backoff-max", "BACKOFF_MAX", default=30.0, type=click.FloatRange(0),
      help="Longest restart delay in seconds.")
@_opt("--stop-timeout", "STOP_TIMEOUT", default=30.0, type=click.FloatRange(0),
      help="Seconds a graceful stop may take before SIGKILL.")
@_opt("--start-timeout", "START_TIMEOUT", default=0.0, type=click.FloatRange(0),
      help="Seconds the launcher may take to be serving, at start and after each engine "
           "restart or rank respawn, before it stops with 83 (0: no deadline).")
@_opt("--engine-config-error-status", "ENGINE_CONFIG_ERROR_STATUS", default=[78, 126, 127],
      multiple=True, type=int,
      help="Engine exit statuses that mean a configuration error: no restart, exit 81 "
           "(126/127: the engine command cannot be executed or is not found).")
@_opt("--on-rank-exit", "ON_RANK_EXIT", default="shutdown",
      type=click.Choice(["shutdown", "respawn"]),
      help="A cache rank exited: shut everything down (69), or respawn it from the escrowed "
           "slabs while the engine keeps serving.")
@_opt("--standby", "STANDBY", is_flag=True, default=False,
      help="Keep a standby engine parked (started ahead, weights mapped) and promote it the "
           "moment the engine exits; see docs/standby.md.")
@_opt("--standby-park-timeout", "STANDBY_PARK_TIMEOUT", default=300.0,
      type=click.FloatRange(0.1),
      help="Seconds a standby engine may take to park; past it standbys are given up (a "
           "warning) and restarts are ordinary.")
@_opt("--listen", "LISTEN", multiple=True, default=(),
      help="Bind the engine's socket here, before any rank starts, and hand it to every "
           "engine and standby by socket activation (LISTEN_FDS, fds from 3), so that clients "
           "wait in the backlog while engines change: [NAME=]HOST:PORT, [NAME=][IPV6]:PORT or "
           "[NAME=]unix:PATH; repeatable (NAME: LISTEN_FDNAMES, default http). Under systemd's "
           "vlaunch@.socket its sockets are taken instead.")
@_opt("--drain-timeout", "DRAIN_TIMEOUT", default=None, type=click.FloatRange(0),
      help="Seconds an engine replaced on purpose (a swap, a rollback's new engine, SIGHUP, a "
           "standby taking over) has "
           "to finish its requests after its SIGTERM, before SIGKILL [default: --stop-timeout].")
@_opt("--stop-on-engine-success", "STOP_ON_ENGINE_SUCCESS", is_flag=True, default=False,
      help="An engine that exits 0 ends the launcher with 0 instead of being restarted.")
@_opt("--kernel-backends", "KERNEL_BACKENDS", default="",
      help="Fingerprint field for the kernel backends (set by engine integrations).")
@_opt("--artifact-dir", "ARTIFACT_DIR", default="",
      help="Directory (a volume) where each rank keeps its artifacts (autotune tables) across "
           "restarts; empty: in memory only.")
@_opt("--preload-autotune", "PRELOAD_AUTOTUNE", default="",
      help="A throwaway engine command run once after the caches are ready and before the "
           "engine, so that the engine finds the tuned tables (split like a shell would).")
@_opt("--preload-timeout", "PRELOAD_TIMEOUT", default=600.0, type=click.FloatRange(0.1),
      help="Seconds the preload command may run before it is killed (then a warning).")
@_opt("--seed", "SEED", default="",
      help="Fill the caches from a running replica instead of the disk: "
           "unix:/its/socket-dir or tcp://HOST:BASE_PORT.")
@_opt("--seed-token", "SEED_TOKEN", default="",
      help="Shared secret for seeding over TCP, on the source and the new replica (prefer the "
           "environment variable).")
@_opt("--seed-fallback", "SEED_FALLBACK", is_flag=True, default=False,
      help="A failed seed loads from disk with a warning instead of exiting 76.")
@_opt("--seed-listen-host", "SEED_LISTEN_HOST", default="127.0.0.1",
      help="Address the seed source listens on.")
@_opt("--seed-listen-port", "SEED_LISTEN_PORT", default=0, type=click.IntRange(0, 65535),
      help="Serve seeding over TCP: rank N listens on this port + N (needs --seed-token; "
           "0: off).")
@_opt("--seed-streams", "SEED_STREAMS", default=4, type=click.IntRange(1, 16),
      help="TCP connections each seeding rank receives its slabs on.")
@_opt("--log-level", "LOG_LEVEL", default="INFO",
      type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="Launcher log level.")
@click.argument("engine", nargs=-1, type=click.UNPROCESSED)
def run(engine: tuple[str, ...], **options: Any) -> None:
    """Start the cache ranks, then ENGINE (after --); supervise until stopped.

    Without an engine command only the cache ranks run (the two-container layout). The exit
    status says what happened: see `vlaunch exit-codes`.
    """
    from .options import build_spec

    setup_logging("vlaunch", options["log_level"])
    try:
        spec = build_spec(options, engine, options["model"] or _embedded_model())
    except VlaunchError as exc:
        if exc.status != ExitStatus.USAGE:
            log.error("%s", exc)
            sys.exit(int(exc.status))
        raise click.UsageError(str(exc)) from None
    sys.exit(_supervise(spec))


def _supervise(spec: Any) -> int:
    """Run the launcher in its socket directory; every failure becomes its exit status."""
    from .executor import run as run_executor
    from .listen import open_listeners
    from .preflight import owned_socket_dir

    try:
        listeners = open_listeners(spec.listen) if spec.engine else None  # before any rank
        with owned_socket_dir(spec.socket_dir, spec.ranks, spec.health_host, spec.health_port):
            return run_executor(spec, listeners)
    except VlaunchError as exc:
        log.error("%s", exc)
        return int(exc.status)
    except Exception:
        log.exception("internal error (a bug: please report it with this traceback)")
        return int(ExitStatus.INTERNAL)


def _embedded_model() -> str:
    """The embedded default checkpoint, created once (in a child: the launcher has no torch)."""
    from .demo import ensure_demo_checkpoint

    return str(ensure_demo_checkpoint())


@cli.command("demo")
@click.option("--tensor-parallel-size", default=2, type=click.IntRange(1), show_default=True)
def demo(tensor_parallel_size: int) -> None:
    """Run the embedded default: caches + reference engine on CPU, restart it, compare."""
    from .demo import run_demo

    setup_logging("vlaunch", "INFO")
    try:
        sys.exit(run_demo(tensor_parallel_size))
    except VlaunchError as exc:
        log.error("%s", exc)
        sys.exit(int(exc.status))


@cli.command("status")
@_opt("--socket-dir", "SOCKET_DIR", default="", help="The launcher's socket directory.")
@click.option("--url", default="", help="The launcher's health URL (instead of --socket-dir).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(socket_dir: str, url: str, as_json: bool) -> None:
    """Show a running launcher's status: phase, ranks, engine."""
    from .status import fetch_status, format_status

    snap = fetch_status(socket_dir, url)
    click.echo(json.dumps(snap, indent=2) if as_json else format_status(snap))


@cli.command("troubleshoot")
@click.argument("lines", nargs=-1)
@click.option("--markdown", is_flag=True, help="The tables of docs/troubleshooting.md.")
def troubleshoot(lines: tuple[str, ...], markdown: bool) -> None:
    """What log lines mean and what to do: LINES given, or a log on stdin (`-` or none).

    Each entry that a line matches is printed once, with the first line that matched it.
    """
    from . import troubleshoot as ts

    if markdown:
        click.echo(ts.markdown(), nl=False)
        return
    text = sys.stdin if not lines or lines == ("-",) else lines
    found = ts.find(text)
    for entry in found:
        click.echo("\n".join(ts.describe(entry)))
    if not found:
        click.echo("no troubleshooting entry matches; search docs/troubleshooting.md for a few "
                   "words of the line", err=True)


def _exec_rank(args: RankArgs) -> None:
    """`vlaunch cache`: become the rank process (same pid, for systemd); the launcher never
    imports the rank's code, only the contract that names its options."""
    os.environ.update(args.secret_env())
    os.execv(sys.executable, [sys.executable, "-m", "vlaunch.cache", *args.to_argv()])


def _add_cache_command() -> None:
    cli.add_command(rank_command("cache", _exec_rank))
    from .doctor import doctor
    from .swapcmd import swap
    from .verify import verify

    cli.add_command(verify)
    cli.add_command(swap)
    cli.add_command(doctor)


_add_cache_command()


def main() -> None:
    """Console-script entry point: usage errors exit with the documented usage status."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.UsageError as exc:
        exc.show()
        sys.exit(int(ExitStatus.USAGE))
    except click.ClickException as exc:
        exc.show()
        sys.exit(int(ExitStatus.USAGE))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # never 1: an unexpected error is INTERNAL, with its traceback
        setup_logging("vlaunch", "WARNING", force=False)
        log.exception("internal error (a bug: please report it with this traceback)")
        sys.exit(int(ExitStatus.INTERNAL))


if __name__ == "__main__":
    main()
