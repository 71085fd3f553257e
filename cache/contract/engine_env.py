"""What `vlaunch run` tells its engine: the VLAUNCH_* variables (`EngineEnv`).

Apart from the rank's command line (launch.py, which needs click) so that an engine's
`vlaunch.cache.load()` reads them without importing click: the handoff's import is part of
every engine start. Light: no torch, nothing from the rest of `vlaunch.cache`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from vlaunch.cache.contract import settings
from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.roles import check_role

DEFAULT_PLAN = "llama"
"""The shard plan used when nobody names one (the launcher, a rank, `load()`)."""
READER_THREADS = 12
"""Reader threads of a first load (a rank's `--threads`, an engine's disk fallback): on an
H200 host (16 cores) 12 beat 8 in every alternated round, and 16 was no better than 12
(benchmarks/results/gpu_2026-12-01.md)."""
PREFIX = "VLAUNCH_"


def env_name(name: str) -> str:
    """The VLAUNCH_* variable of a field."""
    return PREFIX + name.upper()


class EngineEnv(NamedTuple):
    """What `vlaunch run` tells its engine; an unset field is "" / None / () (not given).
    Each field is the registered setting VLAUNCH_<FIELD> (settings.py)."""

    model: str = ""
    socket_dir: str = ""
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    ranks: tuple[int, ...] = ()
    device: str = ""  # cpu or cuda: where the caches hold the weights
    engine_devices: tuple[str, ...] = ()  # per local rank: cpu, cuda:N or cuda:GPU-<uuid>
    plan: str = ""
    kernel_backends: str = ""
    attempt: int | None = None
    preload: bool = False
    draft_model: str = ""  # a speculative-decoding draft model's checkpoint (its own group)
    draft_plan: str = ""
    checkpoint_data: tuple[str, ...] = ()  # per rank: a published version's identity (swap)

    def to_env(self) -> dict[str, str]:
        """The VLAUNCH_* variables of the fields that are set."""
        out = {}
        for name, value in self._asdict().items():
            if value in ("", None, (), False):
                continue
            if isinstance(value, tuple):
                value = ",".join(map(str, value))
            out[env_name(name)] = "1" if value is True else str(value)
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineEnv:
        """The fields from VLAUNCH_* variables (settings.py reads and types them); a malformed
        one raises UsageError naming it."""
        return cls(*(settings.get(env_name(name), env) for name in cls._fields))

    def for_role(self, role: str) -> EngineEnv:
        """The view of one cache group: the draft's model and plan stand in for the target's."""
        if role == "target":
            return self
        check_role(role)
        if not self.draft_model:
            raise UsageError("role='draft' needs a draft model: run under vlaunch run "
                             "--draft-model PATH, or pass model= to load()")
        if self.model and os.path.realpath(self.draft_model) == os.path.realpath(self.model):
            return self  # the target's own checkpoint (MTP): its group serves the draft
        return self._replace(model=self.draft_model, plan=self.draft_plan or "replicate")

    def engine_device(self, rank: int) -> str:
        """The device global rank `rank`'s cache holds it on ("" when vlaunch run says none)."""
        if rank not in self.ranks or self.ranks.index(rank) >= len(self.engine_devices):
            return ""
        return self.engine_devices[self.ranks.index(rank)]

    def published_identity(self, rank: int) -> str:
        """The identity of the published version rank `rank` serves ("" for a checkpoint's
        files): set by the launcher after a trainer published (docs/swap.md)."""
        if not self.checkpoint_data or rank not in self.ranks:
            return ""
        index = self.ranks.index(rank)
        return self.checkpoint_data[index] if index < len(self.checkpoint_data) else ""

    @property
    def plan_or_default(self) -> str:
        """The plan, or DEFAULT_PLAN when the launcher named none."""
        return self.plan or DEFAULT_PLAN
