"""A Target's fingerprint, from what the Target names: the checkpoint's files (or the identity
memo of the rank at its socket), its plan, and the device's driver fields.

Both ends fingerprint a Target: an engine from the files it would read, a cache rank from what
it read. This is where that reading is; a Target itself is a plain value that does no I/O.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from vlaunch.cache.contract import fingerprint as fp
from vlaunch.cache.store import identity
from vlaunch.cache.store.builtin_plans import builtin_identity

if TYPE_CHECKING:
    from vlaunch.cache.store.target import Target


def fingerprint(target: Target, checkpoint: identity.CheckpointIdentity | None = None,
                plan: str = "") -> fp.Fingerprint:
    """The fingerprint of a cache that serves `target`: of the files at its model (or the
    identity memo of the rank at its socket), unless `checkpoint` says whose (what a rank
    read, what an engine layout recorded); `plan`: the plan's identity when known (a rank's
    shard has it), else that of the spec. A published version's identity stands for the
    files' data (docs/swap.md)."""
    from vlaunch.cache.store import quant
    from vlaunch.cache.store.slabs import backend_for

    header, data = checkpoint or identity.identities(target.model, socket=target.socket)
    plan = plan or plan_identity(target.plan)  # every file and driver read first
    device = device_fields(target.device)
    quantization = quant.fingerprint_fields(target.model, target.quantization or None)
    return fp.build(checkpoint=header, checkpoint_data=target.published or data, plan=plan,
                    position=target.position.as_dict(), dtype="checkpoint",
                    backend=backend_for(target.device).name, device=device,
                    kernel_backends=target.kernel_backends, loader=target.loader,
                    quantization=quantization, role=target.role)


@functools.cache
def device_fields(device: str) -> dict[str, str]:
    """The device's fingerprint fields (driver, model, capability), asked of its backend once
    per process: they do not change while it runs."""
    from vlaunch.cache.store.slabs import backend_for

    return backend_for(device).device_info()


def plan_identity(spec: str) -> str:
    """The identity of plan `spec` as the fingerprint carries it; a built-in plan's is computed
    from its rules' text (plan.py, which compiles them and reads plan files, is not imported)."""
    found = builtin_identity(spec)
    if found:
        return found
    from vlaunch.cache.store.plan import load_plan

    return load_plan(spec).identity
