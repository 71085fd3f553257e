"""The reference engine's command line: every option, its default and its check, in one place."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.launch import EngineEnv
from vlaunch.cache.contract.protocol import MODES

EX_CONFIG = 78
MAX_WARMUP_TOKENS = 256
"""The longest warm-up prompt: http.MAX_PROMPT_TOKENS, the longest a request may send."""
TP_BACKENDS = ("auto", "nccl", "gloo")
"""The values of --tp-backend (backend.py chooses for auto)."""


class ConfigError(Exception):
    """A bad option or environment variable: exit status 78."""


@dataclass(frozen=True)
class EngineOptions:
    """The engine's command line."""

    model: str
    tp_size: int = 1
    device: str = "cpu"
    mode: str = "share"
    fallback: bool = True
    timeout: float = 60.0
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str = ""
    socket_dir: str = ""
    log_level: str = "INFO"
    engine_layout: bool = True
    worker_rank: int | None = None
    store_port: int = 0
    parent_pid: int = 0
    draft_model: str = ""  # speculative decoding: the draft's checkpoint (its own cache group)
    speculative_tokens: int = 4
    tp_backend: str = "auto"  # backend.py: nccl, gloo, or chosen from the ranks' devices
    warmup_tokens: int = 8  # warmup.py: the dummy prompt's length; 0: no warm-up
    standby_keep_memory: bool = False  # a parked standby keeps the warm-up's cached blocks

    def worker_argv(self, rank: int, store_port: int) -> list[str]:
        """The command line that starts worker `rank`."""
        argv = [sys.executable, "-m", "vlaunch.cache.reference.engine", "--model", self.model,
                "--tensor-parallel-size", str(self.tp_size), "--device", self.device,
                "--mode", self.mode, "--timeout", str(self.timeout),
                "--log-level", self.log_level, "--worker-rank", str(rank),
                "--store-port", str(store_port), "--parent-pid", str(os.getpid()),
                "--tp-backend", self.tp_backend]
        if not self.fallback:
            argv.append("--no-fallback")
        if not self.engine_layout:
            argv.append("--no-engine-layout")
        if self.socket_dir:
            argv += ["--socket-dir", self.socket_dir]
        if self.draft_model:
            argv += ["--draft-model", self.draft_model, "--speculative-tokens",
                     str(self.speculative_tokens)]
        return argv


def _launcher_env() -> EngineEnv:
    """What vlaunch run told this engine (contract.launch); a malformed variable is 78."""
    try:
        return EngineEnv.from_env()
    except UsageError as exc:
        raise ConfigError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse's own exit status, 2, would tell the launcher that a restart may help
        raise ConfigError(f"{message}; see --help")


def parse_args(argv: Sequence[str] | None) -> EngineOptions:
    """Parse the command line; ConfigError on a bad one."""
    env = _launcher_env()  # under vlaunch run, no flag needs repeating
    p = _Parser(prog="python -m vlaunch.cache.reference.engine",
                description="The vlaunch reference engine: greedy generation over HTTP.")
    p.add_argument("--model", required=not env.model, default=env.model,
                   help="checkpoint directory (config.json + safetensors) [default: "
                   "$VLAUNCH_MODEL]")
    p.add_argument("--tensor-parallel-size", type=int, dest="tp_size",
                   default=env.tensor_parallel_size or 1)
    p.add_argument("--device", choices=("cpu", "cuda"), default=env.device or "cpu")
    p.add_argument("--mode", choices=MODES, default="share")
    p.add_argument("--no-fallback", action="store_false", dest="fallback",
                   help="fail instead of reading the disk when the cache is missing or wrong")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the cache "
                   "with --no-fallback")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port; 0 picks a free one")
    p.add_argument("--port-file", default="", help="write the HTTP port to this file")
    p.add_argument("--socket-dir", default=env.socket_dir, help="cache sockets (default: "
                   "$VLAUNCH_SOCKET_DIR)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--no-engine-layout", action="store_false", dest="engine_layout",
                   help="take the raw (checkpoint-shaped) tensors and fuse them on every start, "
                   "instead of handing the fused layout back to the cache (share mode)")
    p.add_argument("--draft-model", default=env.draft_model, help="decode speculatively with "
                   "this draft checkpoint (greedy; the same tokens) [default: "
                   "$VLAUNCH_DRAFT_MODEL]")
    p.add_argument("--speculative-tokens", type=int, default=4,
                   help="tokens the draft proposes per target forward pass")
    p.add_argument("--tp-backend", choices=TP_BACKENDS, default="auto",
                   help="torch.distributed backend at tensor-parallel size > 1: auto picks gloo "
                   "on the CPU or when two ranks share a GPU (NCCL refuses that), else nccl")
    p.add_argument("--warmup-tokens", type=int, default=8, help="before it reports ready (or "
                   "parked, as a standby) the engine generates 2 tokens from a dummy prompt of "
                   "this many tokens, so that its first request finds every kernel loaded; 0: "
                   "no warm-up")
    p.add_argument("--standby-keep-memory", action="store_true", help="a parked standby keeps "
                   "the blocks torch cached during its warm-up instead of returning them to "
                   "the device")
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    opts = EngineOptions(**vars(p.parse_args(argv)))
    if opts.tp_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {opts.tp_size}")
    if not 0 <= opts.port < 65536:
        raise ConfigError(f"--port must be in 0..65535, got {opts.port}")
    if opts.speculative_tokens < 1:
        raise ConfigError(f"--speculative-tokens must be >= 1, got {opts.speculative_tokens}")
    if not 0 <= opts.warmup_tokens <= MAX_WARMUP_TOKENS:
        raise ConfigError(f"--warmup-tokens must be in 0..{MAX_WARMUP_TOKENS} (the longest "
                          f"prompt a request may send), got {opts.warmup_tokens}")
    if not opts.timeout >= 0:
        raise ConfigError(f"--timeout must be >= 0, got {opts.timeout}")
    return opts
