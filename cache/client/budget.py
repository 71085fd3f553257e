"""The engine's memory budget and the weights a share-mode engine holds outside it."""

from __future__ import annotations

import logging

from vlaunch.cache.contract.errors import VlaunchError, exit_status

log = logging.getLogger("vlaunch.cache")
GiB = 1 << 30


class WeightBudgetError(VlaunchError):
    """The weights mapped from the cache do not fit the engine's memory budget."""

    status = exit_status("BAD_PLAN")  # 78: a configuration error; vlaunch run does not restart it


def check_external_weights(external: int, total: int, utilization: float,
                           device: str = "the device") -> int:
    """Raise if `external` bytes (mapped weights) exceed total x utilization; else log the
    figures and return the bytes the budget leaves for activations and the KV cache."""
    budget = int(total * utilization)
    if external > budget:
        raise WeightBudgetError(
            f"Externally held weights exceed the engine's memory budget on {device}: "
            f"{external / GiB:.2f} GiB mapped from the vlaunch cache, budget "
            f"{budget / GiB:.2f} GiB ({utilization:g} x {total / GiB:.2f} GiB); raise "
            "--gpu-memory-utilization, use more tensor-parallel ranks, or load with mode "
            "copy-release")
    left = budget - external
    log.info("weights held outside the engine on %s: %.2f GiB of a %.2f GiB budget; %.2f GiB "
             "left for activations and the KV cache", device, external / GiB, budget / GiB,
             left / GiB)
    return left
