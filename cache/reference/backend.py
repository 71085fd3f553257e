"""Which torch.distributed backend the reference engine's tensor-parallel group uses.

NCCL refuses two ranks of one communicator on one GPU (`ncclInvalidUsage`, "Duplicate GPU
detected"), so ranks that share a device (`vlaunch run --devices 0,0`) use gloo, which takes
CUDA tensors for the three collectives the engine needs (broadcast, all-reduce, all-gather) by
staging them through pinned host memory. Ranks on distinct GPUs use nccl, CPU ranks gloo.
A pure function of the ranks' devices: every rank computes the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlaunch.cache.reference.options import TP_BACKENDS, ConfigError


@dataclass(frozen=True)
class BackendChoice:
    """The backend for a group and why (one log line)."""

    backend: str  # "nccl" or "gloo"
    reason: str


def shared_devices(devices: Sequence[str]) -> dict[str, list[int]]:
    """Each CUDA device that more than one rank uses, with those ranks."""
    ranks: dict[str, list[int]] = {}
    for rank, device in enumerate(devices):
        if device.startswith("cuda"):
            ranks.setdefault(device, []).append(rank)
    return {device: r for device, r in ranks.items() if len(r) > 1}


def choose_backend(devices: Sequence[str], requested: str = "auto") -> BackendChoice:
    """The backend for ranks on `devices` (one torch device per rank, in rank order).

    ConfigError when `requested` cannot work there: nccl on CPU ranks, or nccl with two
    ranks on one GPU."""
    if requested not in TP_BACKENDS:
        raise ConfigError(f"--tp-backend must be one of {', '.join(TP_BACKENDS)}, got "
                          f"{requested!r}")
    kinds = {d.partition(":")[0] for d in devices}
    if len(kinds) > 1:
        raise ConfigError(f"the ranks' devices mix CPU and CUDA ({', '.join(devices)}); put "
                          "every rank on a GPU or every rank on the CPU")
    if kinds == {"cpu"}:
        if requested == "nccl":
            raise ConfigError("--tp-backend nccl needs CUDA devices, but the ranks run on the "
                              "CPU; use --tp-backend auto (gloo) or --device cuda")
        return BackendChoice("gloo", "ranks on the CPU")
    shared = shared_devices(devices)
    if shared:
        device, ranks = next(iter(shared.items()))
        who = f"ranks {' and '.join(map(str, ranks))} share {device}"
        if requested == "nccl":
            raise ConfigError(f"--tp-backend nccl: {who}, and NCCL refuses two ranks of one "
                              "group on one GPU; use --tp-backend auto (gloo) or give each "
                              "rank its own GPU (vlaunch run --devices)")
        return BackendChoice("gloo", f"{who}, and NCCL refuses two ranks on one GPU: "
                                     "collectives go through host memory")
    if requested == "gloo":
        return BackendChoice("gloo", "--tp-backend gloo")
    return BackendChoice("nccl", "every rank on its own GPU")
