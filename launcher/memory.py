"""What each child holds, for /status and /metrics, sampled while it runs (not only at load).

Host memory of each child's process tree (the child and its descendants: an engine's workers)
from psutil: RSS (every resident page it maps, the cache's shared slabs included), USS (pages
only it maps: what stopping it would free) and PSS (shared pages split between their
mappers, so the PSS of every process adds up to what is resident). Device memory from NVML
(`vlaunch.cache.contract.nvml`, no CUDA context): what the driver charges each process, the
figure nvidia-smi shows, with each GPU's total and used memory so that the figures add up.
On the CPU, or where NVML cannot say, the device figure is absent (`null`), not zero.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psutil
from prometheus_client.core import GaugeMetricFamily

from vlaunch.cache.contract.nvml import NVML, DeviceFigure, DeviceSample, attribute

MEMORY_EVERY = 5.0
"""Seconds between two samples (each reads every child's smaps_rollup and NVML, in a thread)."""

Key = tuple[str, int | None]
"""("cache", rank slot), ("engine", None) or ("standby", None)."""


@dataclass(frozen=True)
class HostFigure:
    """A process tree's host memory, in bytes."""

    pids: tuple[int, ...]
    rss: int
    uss: int
    pss: int


def tree_pids(pid: int) -> tuple[int, ...]:
    """`pid` and its live descendants; () once it is gone."""
    try:
        root = psutil.Process(pid)
        return (pid, *(c.pid for c in root.children(recursive=True)))
    except psutil.Error:
        return ()


def host_memory(pids: tuple[int, ...]) -> HostFigure | None:
    """RSS, USS and PSS summed over `pids` (a process gone meanwhile counts nothing); None if
    none of them could be read."""
    rss = uss = pss = 0
    read: list[int] = []
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()  # smaps_rollup
        except psutil.Error:
            continue
        read.append(pid)
        rss, uss, pss = rss + info.rss, uss + info.uss, pss + info.pss
    return HostFigure(tuple(read), rss, uss, pss) if read else None


class MemorySampler:
    """Samples the children's memory; `device`: whether the ranks are on GPUs (NVML asked)."""

    def __init__(self, device: bool) -> None:
        self.device = device

    def sample(self, roots: Mapping[Key, int]) -> dict[str, Any]:
        """The `memory` part of /status for these children (by their root pid)."""
        trees = {key: tree_pids(pid) for key, pid in roots.items()}
        devices: list[DeviceSample] | None = NVML.sample() if self.device else None
        if devices is None:
            figures = dict.fromkeys(trees, DeviceFigure(None))
            absent = NVML.error if self.device else "the caches are on the CPU"
        else:
            figures = attribute(devices, trees)
            absent = None if any(f.bytes is not None for f in figures.values()) or not trees \
                else "NVML lists none of these processes (another PID namespace?)"
        out: dict[str, Any] = {"sampled_at": time.time(), "device_absent": absent,
                               "devices": _devices(devices or [], figures.values()),
                               "ranks": {}, "engine": None, "standby": None}
        for key, pids in trees.items():
            host = host_memory(pids)
            if host is None:
                continue
            entry = {"pid": roots[key], "pids": list(host.pids), "rss": host.rss,
                     "uss": host.uss, "pss": host.pss, **figures[key].to_dict()}
            role, slot = key
            if role == "cache":
                out["ranks"][slot] = entry
            else:
                out[role] = entry
        return out


def _devices(devices: list[DeviceSample], figures: Any) -> list[dict[str, Any]]:
    """Each GPU's total and used bytes, what vlaunch's processes hold there, and the rest."""
    out = []
    for d in devices:
        ours = sum(f.by_device.get(d.uuid, 0) for f in figures)
        out.append({"uuid": d.uuid, "index": d.index, "total_bytes": d.total,
                    "used_bytes": d.used, "vlaunch_bytes": ours, "other_bytes": d.used - ours})
    return out


def memory_metrics(status: Mapping[str, Any]) -> Iterator[GaugeMetricFamily]:
    """Prometheus gauges of the `memory` part of a status (a figure that is absent is left
    out, never reported as 0)."""
    mem = status.get("memory") or {}
    labels = ["process", "rank", "role"]
    host = {kind: GaugeMetricFamily(f"vlaunch_process_{kind}_bytes", doc, labels=labels)
            for kind, doc in (("rss", "Resident memory of a child's process tree."),
                              ("uss", "Memory only this child's process tree maps."),
                              ("pss", "Resident memory, shared pages split between mappers."))}
    device = GaugeMetricFamily("vlaunch_process_device_bytes", "Device memory the driver "
                               "charges a child's process tree on a GPU (NVML).",
                               labels=[*labels, "device"])
    ranks = status.get("ranks") or {}
    entries = [(["cache", str(ranks.get(slot, {}).get("group_rank", slot)),
                 str(ranks.get(slot, {}).get("role", "target"))], e)
               for slot, e in (mem.get("ranks") or {}).items()]
    entries += [([role, "", ""], mem[role]) for role in ("engine", "standby") if mem.get(role)]
    for who, e in entries:
        for kind, gauge in host.items():
            gauge.add_metric(who, float(e[kind]))
        for uuid, nbytes in (e.get("device_by_uuid") or {}).items():  # {} when absent
            device.add_metric([*who, uuid], float(nbytes))
    yield from (*host.values(), device)
    total = GaugeMetricFamily("vlaunch_device_total_bytes", "A GPU's memory (NVML).",
                              labels=["device"])
    used = GaugeMetricFamily("vlaunch_device_used_bytes", "A GPU's used memory, every process "
                             "and the driver's reservations (NVML).", labels=["device"])
    for d in mem.get("devices") or []:
        total.add_metric([d["uuid"]], float(d["total_bytes"]))
        used.add_metric([d["uuid"]], float(d["used_bytes"]))
    yield from (total, used)
