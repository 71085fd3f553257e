"""What `vlaunch run` starts, and what each child is told: rank arguments, engine environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vlaunch.cache.contract.launch import DEFAULT_PLAN, EngineEnv, RankArgs

from . import events


@dataclass(frozen=True)
class RunSpec:
    """What `vlaunch run` starts: the ranks of this node, the engine, and the surfaces."""

    model: str
    socket_dir: Path
    ranks: tuple[int, ...]
    devices: Mapping[int, str]
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    plan: str = DEFAULT_PLAN
    threads: int = 8
    engine: tuple[str, ...] = ()
    engine_health_url: str = ""
    health_host: str = "127.0.0.1"
    health_port: int | None = 0
    kernel_backends: str = ""
    supervisor: events.SupervisorConfig | None = None
    artifact_dir: str = ""
    seed: str = ""
    seed_token: str = ""
    seed_fallback: bool = False
    seed_listen_host: str = "127.0.0.1"
    seed_listen_port: int = 0
    preload: tuple[str, ...] = ()
    preload_timeout: float = 600.0
    verify: bool = False  # each rank checks every byte against the files after its first load

    def rank_args(self, rank: int, ready_fd: int, adopt_fd: int = -1) -> RankArgs:
        """The arguments of cache rank `rank`, reporting on `ready_fd`."""
        return RankArgs(model=self.model, rank=rank, **self._sizes(),
                        device=self.devices[rank], socket_dir=str(self.socket_dir),
                        plan=self.plan, threads=self.threads,
                        kernel_backends=self.kernel_backends, ready_fd=ready_fd,
                        adopt_fd=adopt_fd, artifact_dir=self.artifact_dir, seed=self.seed,
                        seed_token=self.seed_token, seed_fallback=self.seed_fallback,
                        seed_listen_host=self.seed_listen_host,
                        seed_listen_port=self.seed_listen_port, verify=self.verify)

    def engine_env(self, attempt: int, devices: Mapping[int, str],
                   preload: bool = False) -> EngineEnv:
        """What the engine is told; `devices` overrides a rank's device (GPU UUIDs)."""
        kind = "cuda" if any(d.startswith("cuda") for d in self.devices.values()) else "cpu"
        return EngineEnv(model=self.model, socket_dir=str(self.socket_dir), **self._sizes(),
                         ranks=self.ranks, device=kind,
                         engine_devices=tuple(devices.get(r, self.devices[r])
                                              for r in self.ranks),
                         plan=self.plan, kernel_backends=self.kernel_backends,
                         attempt=attempt, preload=preload)

    def _sizes(self) -> dict[str, int]:
        """The parallel sizes, spelled as everywhere else."""
        return {"tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "data_parallel_size": self.data_parallel_size}
