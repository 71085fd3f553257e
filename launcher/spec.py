"""What `vlaunch run` starts, and what each child is told: rank arguments, engine environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vlaunch.cache.contract.launch import DEFAULT_PLAN, READER_THREADS, EngineEnv, RankArgs
from vlaunch.cache.contract.roles import DRAFT, TARGET, seat, unseat
from vlaunch.cache.contract.sockdir import socket_path

from .core import events
from .probes import HttpProbe


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
    threads: int = READER_THREADS
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
    seed_streams: int = 4
    preload: tuple[str, ...] = ()
    preload_timeout: float = 600.0
    verify: bool = False  # each rank checks every byte against the files after its first load
    draft_model: str = ""  # a speculative-decoding draft model: its own group beside the target
    draft_plan: str = "replicate"
    liveness: HttpProbe | None = None  # --engine-liveness-request, sent once the engine is ready
    liveness_interval: float = 10.0  # seconds between two liveness requests
    listen: tuple[str, ...] = ()  # --listen: the engine's sockets, bound by the launcher

    @property
    def world(self) -> int:
        """Ranks in the whole job (every node): the size of one cache group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * \
            self.data_parallel_size

    @property
    def slots(self) -> tuple[int, ...]:
        """The supervisor's cache slots: this node's target ranks, then its draft ranks (each
        rank + world: roles.seat), so that both groups are supervised alike."""
        drafts = tuple(seat(DRAFT, r, self.world) for r in self.ranks) if self.draft_group \
            else ()
        return self.ranks + drafts

    @property
    def draft_group(self) -> bool:
        """Whether a draft group runs: a draft model that is not the target's own checkpoint
        (MTP layers and shared tensors there are served by the target's group, held once)."""
        return bool(self.draft_model) and \
            os.path.realpath(self.draft_model) != os.path.realpath(self.model)

    def slot_role(self, slot: int) -> tuple[str, int]:
        """(role, rank) of a supervisor slot."""
        return unseat(slot, self.world)

    def slot_socket(self, slot: int) -> Path:
        """The socket of a supervisor slot."""
        return socket_path(self.socket_dir, *reversed(self.slot_role(slot)))

    @property
    def slot_devices(self) -> dict[int, str]:
        """Each slot's device: a draft rank sits on its target rank's device."""
        return {s: self.devices[self.slot_role(s)[1]] for s in self.slots}

    def rank_args(self, slot: int, ready_fd: int, adopt_fd: int = -1) -> RankArgs:
        """The arguments of the cache rank in supervisor slot `slot`, reporting on `ready_fd`."""
        role, rank = self.slot_role(slot)
        draft = role == DRAFT
        return RankArgs(model=self.draft_model if draft else self.model, rank=rank,
                        role=role if draft else TARGET, **self._sizes(),
                        device=self.devices[rank], socket_dir=str(self.socket_dir),
                        plan=self.draft_plan if draft else self.plan, threads=self.threads,
                        kernel_backends=self.kernel_backends, ready_fd=ready_fd,
                        adopt_fd=adopt_fd, artifact_dir=self.artifact_dir, seed=self.seed,
                        seed_token=self.seed_token, seed_fallback=self.seed_fallback,
                        seed_listen_host=self.seed_listen_host,
                        seed_listen_port=self.seed_listen_port,
                        seed_streams=self.seed_streams, verify=self.verify)

    def engine_env(self, attempt: int, devices: Mapping[int, str],
                   preload: bool = False) -> EngineEnv:
        """What the engine is told; `devices` overrides a rank's device (GPU UUIDs)."""
        kind = "cuda" if any(d.startswith("cuda") for d in self.devices.values()) else "cpu"
        return EngineEnv(model=self.model, socket_dir=str(self.socket_dir), **self._sizes(),
                         ranks=self.ranks, device=kind,
                         engine_devices=tuple(devices.get(r, self.devices[r])
                                              for r in self.ranks),
                         plan=self.plan, kernel_backends=self.kernel_backends,
                         attempt=attempt, preload=preload, draft_model=self.draft_model,
                         draft_plan=self.draft_plan if self.draft_model else "")

    def _sizes(self) -> dict[str, int]:
        """The parallel sizes, spelled as everywhere else."""
        return {"tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "data_parallel_size": self.data_parallel_size}
