"""What an engine asks its cache for and gets: the fingerprint a cache must have for this
rank (with what `vlaunch run` supplies when the caller leaves it out), and `Weights`.

Shared by `load()` (loader.py) and the engine-layout client (layout.py), which import it;
it imports neither of them.
"""

from __future__ import annotations

import os

from vlaunch.cache.client.connection import CacheClient, backend_for
from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.contract.engine_env import DEFAULT_PLAN, EngineEnv
from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.store import identity
from vlaunch.cache.store.builtin_plans import builtin_identity
from vlaunch.cache.store.ranks import Layout

_DEVICE_INFO: dict[str, dict[str, str]] = {}  # device -> its fingerprint fields, per process



class Weights(dict):  # type: ignore[type-arg]
    """Named tensors, plus where they came from and the bytes held outside the engine."""

    source: str = "disk"
    client: CacheClient | None = None
    bytes_outside: int = 0
    reason: str = ""
    layout: str = ""  # the engine layout's key when these are the engine's own tensors
    copied: frozenset[str] = frozenset()  # engine layout tensors that are private copies
    layout_miss: str = ""  # why load(layout=...) got the raw tensors instead


def default_device() -> str:
    """$VLAUNCH_DEVICE (set by vlaunch run), else cuda when torch sees a GPU, else cpu."""
    device = EngineEnv.from_env().device
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_args(model: str | None, tensor_parallel_size: int | None,
                pipeline_parallel_size: int | None, data_parallel_size: int | None,
                plan: str | None, kernel_backends: str | None, role: str = "target"
                ) -> tuple[str, int, int, int, str, str]:
    """What the caller left out (None) from what `vlaunch run` told the engine (EngineEnv);
    for role "draft", the draft model and plan (a caller's model needs no draft env)."""
    env = EngineEnv.from_env()
    if role != "target":
        # a draft named by the caller alone (no vlaunch run): the draft plan's default
        env = env.for_role(role) if not model or env.draft_model else \
            env._replace(plan=env.draft_plan or "replicate")
    if not (model or env.model):
        raise UsageError("load() has no model: pass it, or start the engine under vlaunch run "
                         "(which sets VLAUNCH_MODEL)")
    return (model or env.model, tensor_parallel_size or env.tensor_parallel_size or 1,
            pipeline_parallel_size or env.pipeline_parallel_size or 1,
            data_parallel_size or env.data_parallel_size or 1, plan or env.plan_or_default,
            env.kernel_backends if kernel_backends is None else kernel_backends)


def group_role(model: str, role: str) -> str:
    """The group that serves `role`: a draft that is the target's own checkpoint (MTP layers,
    shared embeddings) is served by the target's group, not held twice."""
    if role == "draft":
        target = EngineEnv.from_env().model
        if target and os.path.realpath(target) == os.path.realpath(model):
            return "target"
    return role


def expected_fingerprint(model: str, layout: Layout, device: str, plan: str = DEFAULT_PLAN,
                         kernel_backends: str = "", loader: str = "vlaunch",
                         socket: os.PathLike[str] | None = None,
                         identities: tuple[str, str] | None = None,
                         quantization: str | None = None,
                         role: str = "target") -> fp.Fingerprint:
    """The fingerprint a cache must have for this engine rank (`socket`: the rank's, whose
    identity memo spares reading samples of files that did not change; `identities`: the
    checkpoint's (header, data) identities when they are known already; `quantization`: the
    engine's method, else $VLAUNCH_QUANTIZATION, else config.json's)."""
    from vlaunch.cache.store import quant

    backend = backend_for(device)
    info = _DEVICE_INFO.get(device)
    if info is None:
        info = _DEVICE_INFO[device] = backend.device_info()
    header, data = identities or identity.identities(model, socket=socket)
    if role == "target":  # a version a trainer published: no files hold it (docs/swap.md)
        data = EngineEnv.from_env().published_identity(layout.global_rank) or data
    return fp.build(checkpoint=header, checkpoint_data=data, plan=plan_identity(plan),
                    layout=layout.as_dict(), dtype="checkpoint", backend=backend.name,
                    device=info, kernel_backends=kernel_backends, loader=loader,
                    quantization=quant.fingerprint_fields(
                        model, quantization or os.environ.get("VLAUNCH_QUANTIZATION")),
                    role=role)


def plan_identity(spec: str) -> str:
    """The identity of plan `spec` as the fingerprint carries it; a built-in plan's is computed
    from its rules' text (plan.py, which compiles them and reads plan files, is not imported)."""
    found = builtin_identity(spec)
    if found:
        return found
    from vlaunch.cache.store.plan import load_plan

    return load_plan(spec).identity
