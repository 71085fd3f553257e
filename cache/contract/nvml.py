"""Device memory per process as the driver counts it: NVML, through nvidia-ml-py (`pynvml`).

The figure is the one nvidia-smi shows per process: everything the driver charges to it on a
GPU (its CUDA context, its allocations, the VMM slabs it created; not what it only maps from
another process). NVML needs no CUDA context, so the launcher, which holds none, reads it for
every child. Light: no torch; pynvml is imported on first use.

The driver names processes by their PID in the PID namespace it sees (the host's): inside a
container with its own PID namespace, the PIDs it lists are not ours. So a figure is *absent*
(None), never zero, when NVML cannot be loaded, when it lists no process of ours at all (a
foreign PID namespace, or no GPU work), or when it reports a process's memory as not
available (some virtualised GPUs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger("vlaunch.nvml")

K = TypeVar("K")


@dataclass(frozen=True)
class DeviceSample:
    """One GPU as NVML reports it: its memory and the compute processes on it."""

    uuid: str
    index: int
    total: int
    used: int
    processes: tuple[tuple[int, int | None], ...] = ()  # (pid, bytes or None: not available)


@dataclass(frozen=True)
class DeviceFigure:
    """A group of processes' device memory: None where it cannot be known."""

    bytes: int | None
    by_device: dict[str, int] = field(default_factory=dict)  # uuid -> bytes, where known

    def to_dict(self) -> dict[str, Any]:
        """JSON for /status."""
        return {"device_bytes": self.bytes, "device_by_uuid": dict(self.by_device)}


ABSENT = DeviceFigure(None)


def attribute(devices: Iterable[DeviceSample], groups: Mapping[K, Collection[int]]
              ) -> dict[K, DeviceFigure]:
    """Each group of PIDs' device bytes, summed over its processes and the GPUs.

    A PID that NVML does not list holds nothing on the device, provided NVML lists at least
    one of the PIDs of `groups`; if it lists none of them, every figure is absent (another PID
    namespace, or nothing of ours on a GPU). A process whose bytes NVML cannot say makes its
    group's figure absent."""
    devices = list(devices)
    ours = {pid for pids in groups.values() for pid in pids}
    if not any(pid in ours for d in devices for pid, _ in d.processes):
        return dict.fromkeys(groups, ABSENT)
    out: dict[K, DeviceFigure] = {}
    for key, pids in groups.items():
        by_device: dict[str, int] = {}
        unknown = False
        for d in devices:
            for pid, used in d.processes:
                if pid not in pids:
                    continue
                if used is None:
                    unknown = True
                else:
                    by_device[d.uuid] = by_device.get(d.uuid, 0) + used
        out[key] = ABSENT if unknown else DeviceFigure(sum(by_device.values()), by_device)
    return out


def used_bytes(raw: Any) -> int | None:
    """A process's usedGpuMemory as pynvml gives it: None for "not available" (pynvml's None,
    or NVML's NVML_VALUE_NOT_AVAILABLE, all ones, from a raw structure)."""
    if raw is None or not isinstance(raw, int) or raw < 0 or raw >= (1 << 63):
        return None
    return raw


class Nvml:
    """NVML, initialised once on first use; `error` says why it is unavailable."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._tried = False
        self._lock = threading.Lock()
        self.error = ""

    def _load(self) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                self._lib = self._init()
            return self._lib

    def _init(self) -> Any:
        try:
            import pynvml
        except ImportError:
            self.error = ("nvidia-ml-py is not installed (pip install nvidia-ml-py, or vlaunch "
                          "with its dependencies)")
            log.info("no device memory figures: %s", self.error)
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:  # no driver library (a CPU host), or no GPU
            self.error = f"NVML cannot start: {exc}"
            log.info("no device memory figures: %s", self.error)
            return None
        return pynvml

    @property
    def available(self) -> bool:
        """Whether NVML is loaded and initialised (loads it on first use)."""
        return self._load() is not None

    def sample(self) -> list[DeviceSample] | None:
        """Every GPU's memory and compute processes now; None without NVML."""
        nv = self._load()
        if nv is None:
            return None
        out = []
        try:
            for index in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
                out.append(DeviceSample(_text(nv.nvmlDeviceGetUUID(handle)), index,
                                        int(mem.total), int(mem.used),
                                        tuple(_processes(nv, handle))))
        except nv.NVMLError as exc:  # a GPU fell off the bus, a driver reload
            log.warning("NVML failed while sampling device memory: %s", exc)
            return None
        return out

    def process_bytes(self, pid: int, uuid: str) -> int | None:
        """What the driver charges process `pid` on the GPU `uuid` (GPU-...), or None."""
        for d in self.sample() or []:
            if d.uuid == uuid:
                return attribute([d], {0: {pid}})[0].bytes
        return None


def _processes(nv: Any, handle: Any) -> Iterable[tuple[int, int | None]]:
    """(pid, bytes) of the compute processes on a GPU; on a MIG GPU, over its instances."""
    try:
        migs = nv.nvmlDeviceGetMigMode(handle)[0] == nv.NVML_DEVICE_MIG_ENABLE
    except nv.NVMLError:  # NotSupported: no MIG on this GPU
        migs = False
    handles = [handle]
    if migs:
        handles = []
        for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                handles.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
            except nv.NVMLError:  # NotFound: an empty slot
                continue
    for h in handles:
        for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
            yield int(p.pid), used_bytes(p.usedGpuMemory)


def _text(value: str | bytes) -> str:
    """pynvml returns str, older versions bytes."""
    return value.decode() if isinstance(value, bytes) else value


NVML = Nvml()
"""The process's NVML (one initialisation per process)."""
