"""What an engine rank wants from its cache, resolved once: `Target`.

    target = Target.resolve(model, rank=r, tensor_parallel_size=tp)   # or Target(...)
    weights = vlaunch.cache.load(target)

`resolve` fills what its caller leaves out from the environment `vlaunch run` gives its
engine (EngineEnv), then from the defaults; the socket, the fingerprint, the disk fallback and
the engine layout calls all read that one value. An integration builds a Target from its
engine's config and calls `load` (docs/integrations.md). A Target is a plain value: its
fingerprint, which reads files and asks the driver, is store/fingerprints.py's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from vlaunch.cache.contract import settings
from vlaunch.cache.contract.engine_env import DEFAULT_PLAN, EngineEnv
from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.roles import DRAFT, TARGET
from vlaunch.cache.contract.sockdir import default_socket_dir, socket_path
from vlaunch.cache.store.ranks import Position

if TYPE_CHECKING:
    from typing import TypedDict, Unpack

    class TargetArgs(TypedDict, total=False):
        """What a caller may say of its target; what it leaves out (or gives as None) comes
        from the environment `vlaunch run` gives its engine, then the defaults. (For type
        checkers only, as ARGS names them at run time: a TypedDict's definition is a cost at
        every engine start.)"""

        model: str | None  # the checkpoint (VLAUNCH_MODEL)
        rank: int  # the global rank (0)
        tensor_parallel_size: int | None  # (VLAUNCH_TENSOR_PARALLEL_SIZE, else 1)
        pipeline_parallel_size: int | None  # (VLAUNCH_PIPELINE_PARALLEL_SIZE, else 1)
        data_parallel_size: int | None  # (VLAUNCH_DATA_PARALLEL_SIZE, else 1)
        socket_dir: str | None  # (VLAUNCH_SOCKET_DIR, else the default directory)
        device: str | None  # where this engine maps (VLAUNCH_DEVICE, else cuda if torch has)
        plan: str | None  # the shard plan (VLAUNCH_PLAN, else DEFAULT_PLAN)
        kernel_backends: str | None  # fingerprint field (VLAUNCH_KERNEL_BACKENDS)
        loader: str  # fingerprint field ("vlaunch")
        quantization: str | None  # the engine's method (VLAUNCH_QUANTIZATION, else config's)
        role: str  # "target", or "draft": a speculative-decoding draft model's group

ARGS = ("model", "rank", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
        "socket_dir", "device", "plan", "kernel_backends", "loader", "quantization", "role")
"""The keyword arguments that name a target (TargetArgs' keys)."""


class Target(NamedTuple):
    """One engine rank's wants: which checkpoint (or published version of it), at which
    position, on which device, shaped how (plan, kernel backends, loader, quantization), from
    which cache group and socket."""

    model: str
    position: Position
    device: str
    plan: str = DEFAULT_PLAN
    kernel_backends: str = ""
    loader: str = "vlaunch"
    quantization: str = ""  # the engine's method; "": config.json's quant_method
    role: str = TARGET  # the cache group that serves it (a draft may be the target's)
    socket: Path | None = None  # the rank's socket, whose identity memo an engine reads
    published: str = ""  # the identity of a published version it serves (docs/swap.md)

    @classmethod
    def resolve(cls, model: str | None = None, /, **given: Unpack[TargetArgs]) -> Target:
        """The target of what the caller gives (TargetArgs), the rest from the environment."""
        unknown = sorted(set(given) - set(ARGS))
        if unknown:
            raise TypeError(f"unexpected argument(s) {', '.join(unknown)} for a vlaunch "
                            f"Target; use {', '.join(ARGS)}")
        env = EngineEnv.from_env()
        model = model or given.get("model")
        role = given.get("role") or TARGET
        group = env if role == TARGET else env.for_role(role) if not model or env.draft_model \
            else env._replace(plan=env.draft_plan or "replicate")  # a draft named here alone
        model = model or group.model
        if not model:
            raise UsageError("load() has no model: pass it, or start the engine under vlaunch "
                             "run (which sets VLAUNCH_MODEL)")
        position = Position.from_global(
            given.get("rank", 0), given.get("tensor_parallel_size") or
            group.tensor_parallel_size or 1, given.get("pipeline_parallel_size") or
            group.pipeline_parallel_size or 1, given.get("data_parallel_size") or
            group.data_parallel_size or 1)
        kernel_backends = given.get("kernel_backends")
        role = serving_group(model, role, env)
        return cls(model, position, given.get("device") or env.device or visible_device(),
                   given.get("plan") or group.plan_or_default,
                   group.kernel_backends if kernel_backends is None else kernel_backends,
                   given.get("loader", "vlaunch"),
                   given.get("quantization") or settings.get("VLAUNCH_QUANTIZATION"), role,
                   socket_path(given.get("socket_dir") or default_socket_dir(),
                               position.global_rank, role),
                   env.published_identity(position.global_rank) if role == TARGET else "")

    @property
    def rank(self) -> int:
        """The global rank."""
        return self.position.global_rank


def as_target(target: Target | str | None, given: TargetArgs) -> Target:
    """`target` itself, or the Target resolved from a model (or none) and `given`."""
    if isinstance(target, Target):
        if given:
            raise TypeError(f"pass a Target or its arguments, not both ({', '.join(given)})")
        return target
    return Target.resolve(target, **given)


def serving_group(model: str, role: str, env: EngineEnv) -> str:
    """The group that serves `role`: a draft that is the target's own checkpoint (MTP layers,
    shared embeddings) is served by the target's group, not held twice."""
    if role == DRAFT and env.model and os.path.realpath(env.model) == os.path.realpath(model):
        return TARGET
    return role


def visible_device() -> str:
    """cuda when torch sees a GPU, else cpu (where neither the caller nor vlaunch run says)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
