"""What the launcher hands its children: a cache rank's arguments and an engine's environment.

One definition for both ends. The launcher builds a `RankArgs` and spawns
`python -m vlaunch.cache` with `to_argv()`; the rank's command line is made from the same
fields (`rank_command`). The launcher sets `EngineEnv.to_env()` in the engine's environment;
`vlaunch.cache.load()`, the vLLM load format and the reference engine read `from_env()` for
whatever their caller did not pass, so an engine under `vlaunch run` repeats no flags.
Light: no torch, nothing from the rest of `vlaunch.cache`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import click

from vlaunch.cache.contract.cliopt import SourceOption
from vlaunch.cache.contract.engine_env import (
    DEFAULT_PLAN,
    PREFIX,
    READER_THREADS,
    EngineEnv,
    env_name,
)
from vlaunch.cache.contract.errors import UsageError

# The engine's side lives in engine_env.py (an engine's load() must not import click).
__all__ = ["DEFAULT_PLAN", "PREFIX", "READER_THREADS", "EngineEnv", "RankArgs",
           "check_seed_listening", "rank_command"]


def _opt(flag: str, help: str, *, type: Any = None, env: bool = True,
         secret: bool = False) -> dict[str, Any]:
    """Field metadata: the option's flag, help, click type; env: read VLAUNCH_<FIELD> too."""
    return {"flag": flag, "help": help, "type": type, "env": env, "secret": secret}


@dataclass(frozen=True)
class RankArgs:
    """One cache rank's arguments: `vlaunch cache` / `python -m vlaunch.cache` options."""

    model: str = field(metadata=_opt("--model", "Checkpoint: a .safetensors file or a "
                                     "directory."))
    rank: int = field(default=0, metadata=_opt("--rank", "Global rank of this cache.",
                                               type=click.IntRange(0)))
    tensor_parallel_size: int = field(default=1, metadata=_opt(
        "--tensor-parallel-size", "Tensor-parallel ranks.", type=click.IntRange(1)))
    pipeline_parallel_size: int = field(default=1, metadata=_opt(
        "--pipeline-parallel-size", "Pipeline stages.", type=click.IntRange(1)))
    data_parallel_size: int = field(default=1, metadata=_opt(
        "--data-parallel-size", "Data-parallel replicas.", type=click.IntRange(1)))
    device: str = field(default="cpu", metadata=_opt("--device", "cpu, cuda or cuda:N."))
    socket_dir: str = field(default="", metadata=_opt(
        "--socket-dir", "Directory of the rank sockets (0700)."))
    plan: str = field(default=DEFAULT_PLAN, metadata=_opt(
        "--plan", "Shard plan: builtin name, plan file or module:fn."))
    threads: int = field(default=READER_THREADS, metadata=_opt("--threads", "Reader threads.",
                                                  type=click.IntRange(1)))
    checksum: bool | None = field(default=None, metadata=_opt(
        "--checksum/--no-checksum", "crc32 per tensor in the manifest [default: on for cpu, "
        "off for cuda]."))
    kernel_backends: str = field(default="", metadata=_opt(
        "--kernel-backends", "Fingerprint field set by integrations."))
    loader: str = field(default="vlaunch", metadata=_opt(
        "--loader", "Loader identity (fingerprint field)."))
    ready_fd: int = field(default=-1, metadata=_opt(
        "--ready-fd", "Unix socket fd to report ready (and release) on.", type=int, env=False))
    adopt_fd: int = field(default=-1, metadata=_opt(
        "--adopt-fd", "Unix socket fd carrying escrowed slabs.", type=int, env=False))
    artifact_dir: str = field(default="", metadata=_opt(
        "--artifact-dir", "Directory (a volume) where artifacts persist across restarts."))
    seed: str = field(default="", metadata=_opt(
        "--seed", "Fill from a running replica: unix:/source/socket-dir or tcp://HOST:BASE."))
    seed_token: str = field(default="", repr=False, metadata=_opt(
        "--seed-token", "Shared secret for seeding over TCP (both sides; prefer the env var).",
        secret=True))
    seed_fallback: bool = field(default=False, metadata=_opt(
        "--seed-fallback/--no-seed-fallback", "A failed seed loads from disk with a warning "
        "instead of exiting 76."))
    seed_listen_host: str = field(default="127.0.0.1", metadata=_opt(
        "--seed-listen-host", "Address the seed source binds."))
    seed_listen_port: int = field(default=0, metadata=_opt(
        "--seed-listen-port", "Serve seeding over TCP on this port + rank (needs --seed-token; "
        "0: off).", type=click.IntRange(0, 65535)))
    seed_streams: int = field(default=4, metadata=_opt(
        "--seed-streams", "TCP connections a seeding rank receives its slabs on.",
        type=click.IntRange(1, 16)))
    seed_timeout: float = field(default=30.0, metadata=_opt(
        "--seed-timeout", "Seconds any one seeding read or write may wait.",
        type=click.FloatRange(0.1)))
    role: str = field(default="target", metadata=_opt(
        "--role", "Cache group: target, or draft (a speculative-decoding draft model).",
        type=click.Choice(["target", "draft"])))
    verify: bool = field(default=False, metadata=_opt(
        "--verify/--no-verify", "After loading, hash every tensor against the checkpoint "
        "files before serving; exit 79 on a mismatch."))

    def to_argv(self) -> list[str]:
        """Every option spelled out (so no inherited variable changes it); never the token,
        which travels in the environment (`secret_env`), out of sight of ps."""
        argv: list[str] = []
        for f in fields(self):
            value, flag = getattr(self, f.name), f.metadata["flag"]
            if f.metadata["secret"] or value is None:
                continue
            if "/" in flag:
                on, off = flag.split("/")
                argv.append(on if value else off)
            else:
                argv += [flag, str(value)]
        return argv

    def secret_env(self) -> dict[str, str]:
        """The variables that carry what `to_argv` leaves out."""
        return {env_name(f.name): getattr(self, f.name) for f in fields(self)
                if f.metadata["secret"] and getattr(self, f.name)}

    @classmethod
    def parse(cls, argv: Sequence[str]) -> RankArgs:
        """Parse a rank's command line (and its VLAUNCH_* variables); UsageError if bad."""
        command = rank_command("cache", lambda args: args)
        try:
            return cls(**command.make_context("cache", list(argv)).params)
        except click.ClickException as exc:
            raise UsageError(exc.format_message()) from None


def check_seed_listening(port: int, token: str) -> None:
    """A seed source (a listening port) needs a token: UsageError naming the fix otherwise.
    `vlaunch run` checks its options with it, and a rank its own."""
    if port and not token:
        raise UsageError("--seed-listen-port needs a seed token: set VLAUNCH_SEED_TOKEN (or "
                         "--seed-token) to a long secret, or drop --seed-listen-port")


def rank_command(name: str, run: Callable[[RankArgs], Any], help: str = "") -> click.Command:
    """A click command taking RankArgs' options; `run` gets the parsed RankArgs."""

    def callback(**params: Any) -> Any:
        return run(RankArgs(**params))

    params = []
    for f in fields(RankArgs):
        meta = f.metadata
        required = f.default is MISSING
        params.append(SourceOption(
            [meta["flag"], f.name],
            type=meta["type"], required=required, help=meta["help"],
            default=None if required else f.default, show_default=not meta["secret"],
            envvar=env_name(f.name) if meta["env"] else None, show_envvar=meta["env"]))
    return click.Command(name, params=params, callback=callback,
                         help=help or "Run one cache rank: load its shard, then serve it on "
                                      "its socket until SIGTERM.",
                         context_settings={"help_option_names": ["-h", "--help"]})
