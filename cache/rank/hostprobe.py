"""The cache rank's own host probes, run for `vlaunch doctor` (which may import only the
contract): the page size CPU slabs get, whether a slab memfd can be made and sealed, the
connection bound after the rank raises its fd limit, each rank's shard size from the plan, the
pinned staging a CUDA rank allocates, and the CUDA driver's VMM and POSIX-fd export.

`python -m vlaunch.cache.rank.hostprobe '{json}'` prints one JSON object. No torch.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from ctypes import byref, c_int, c_size_t, c_ulonglong, c_void_p
from typing import Any

VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
POSIX_FD_SUPPORTED = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED


def slab_pages() -> dict[str, Any]:
    """What cpubacking picks, as the rank's status reports it."""
    from vlaunch.cache.store import cpubacking

    try:
        return {"requested": cpubacking.requested_pages(), "page": cpubacking.page_label(),
                "error": ""}
    except Exception as exc:  # a bad VLAUNCH_CPU_SLAB_PAGES / VLAUNCH_CPU_SLABS: exit 64
        return {"requested": "", "page": "", "error": str(exc)}


def memfd() -> dict[str, Any]:
    """A CPU slab made and sealed as a rank makes and seals one."""
    from vlaunch.cache.store.slabs import CpuSlab

    try:
        slab = CpuSlab(4096)
    except Exception as exc:
        return {"created": False, "sealed": False, "error": str(exc)}
    try:
        slab.seal()
        return {"created": True, "sealed": slab.sealed, "error": ""}
    finally:
        slab.release()


def nofile(reserved: int) -> dict[str, Any]:
    """The fd limit before and after the rank raises it, and the connection bound it keeps."""
    from vlaunch.cache.contract import settings
    from vlaunch.cache.rank import connections

    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = connections.raise_nofile_limit()
    try:
        given = settings.get("VLAUNCH_MAX_CONNECTIONS")
        bound = connections.connection_bound(os.environ, reserved)
    except Exception as exc:
        return {"soft_before": before, "soft": soft, "hard": hard, "error": str(exc)}
    infinite = soft == resource.RLIM_INFINITY
    return {"soft_before": before, "soft": -1 if infinite else soft,
            "hard": -1 if hard == resource.RLIM_INFINITY else hard, "given": given,
            "bound": bound, "default": connections.MAX_CONNECTIONS,
            "reserve": connections.FD_RESERVE + reserved, "error": ""}


def shard(p: dict[str, Any]) -> dict[str, Any]:
    """Each local rank's slab bytes, planned and packed as the rank would (nothing read)."""
    from vlaunch.cache.rank.staging import available_host_bytes
    from vlaunch.cache.store.checkpoint import open_checkpoint
    from vlaunch.cache.store.manifest import pack
    from vlaunch.cache.store.plan import HookPlan, load_plan, plan_rank
    from vlaunch.cache.store.ranks import Position
    from vlaunch.cache.store.shard import MAX_SLAB
    from vlaunch.cache.store.slabs import CpuBackend
    from vlaunch.cache.store.slabs_cuda import CudaBackend

    out: dict[str, Any] = {"available_host": available_host_bytes(), "ranks": {},
                           "slabs": {}, "error": ""}
    if not p.get("model"):
        return out
    try:
        ckpt = open_checkpoint(p["model"])
        plan = load_plan(p["plan"])
        if isinstance(plan, HookPlan):
            out["error"] = "a hook plan builds its tensors itself: no size before it runs"
            return out
        kind = CudaBackend if p["device"] == "cuda" else CpuBackend
        backend, align = kind.name, kind.alignment
        for rank in p["ranks"]:
            pos = Position.from_global(rank, p["tp"], p["pp"], p["dp"])
            specs = plan_rank(ckpt, plan, pos)
            man = pack([(s.name, s.dtype, s.shape) for s in specs], backend=backend,
                       alignment=align, max_slab=MAX_SLAB)
            out["ranks"][str(rank)] = sum(man.slab_sizes)
            out["slabs"][str(rank)] = len(man.slab_sizes)
    except Exception as exc:
        out["error"] = str(exc)
    return out


def staging(threads: int) -> dict[str, Any]:
    """Pinned bytes a CUDA rank's staging reader holds while it loads, and the memlock limit."""
    from vlaunch.cache.store import reader

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return {"reader": reader.reader_mode(),
            "pinned": (threads + reader.SPARE_BUFFERS) * reader.CUDA_CHUNK,
            "memlock": -1 if soft == resource.RLIM_INFINITY else soft}


def cuda() -> dict[str, Any]:
    """The driver, each GPU's VMM and POSIX-fd attributes, one export/import round trip on
    GPU 0, and whether NVML numbers this process as it numbers itself (its PID namespace)."""
    from vlaunch.cache.store import cudadrv as cu

    out: dict[str, Any] = {"loaded": False, "error": "", "devices": [], "nvml_sees_us": None}
    try:
        out["driver"] = cu.out("cuDriverGetVersion", c_int)
        out["loaded"] = True
        index = 0
        while True:
            try:
                dev = cu.out("cuDeviceGet", c_int, index)
            except cu.DriverError:
                break
            out["devices"].append({"index": index, "uuid": cu.uuid(dev),
                                   "vmm": bool(cu.out("cuDeviceGetAttribute", c_int,
                                                      VMM_SUPPORTED, dev)),
                                   "posix_fd": bool(cu.out("cuDeviceGetAttribute", c_int,
                                                           POSIX_FD_SUPPORTED, dev))})
            index += 1
    except Exception as exc:
        out["error"] = str(exc)
        return out
    if out["devices"]:
        out["export"] = _round_trip(cu)
        out["nvml_sees_us"], out["nvml_error"] = _nvml_sees_us()
    return out


def _round_trip(cu: Any) -> str:
    """"" when GPU 0 makes, exports (POSIX fd) and re-imports one VMM allocation, else why."""
    try:
        ctx = cu.out("cuDevicePrimaryCtxRetain", c_void_p, cu.out("cuDeviceGet", c_int, 0))
        cu.call("cuCtxPushCurrent_v2", ctx)
        prop = cu.allocation_prop(0)
        size = int(cu.out("cuMemGetAllocationGranularity", c_size_t, byref(prop),
                          cu.MEM_ALLOC_GRANULARITY_MINIMUM))
        handle = cu.out("cuMemCreate", c_ulonglong, size, byref(prop), 0)
        fd = c_int(-1)
        try:
            cu.call("cuMemExportToShareableHandle", byref(fd), handle,
                    cu.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            again = cu.out("cuMemImportFromShareableHandle", c_ulonglong, c_void_p(fd.value),
                           cu.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            cu.call("cuMemRelease", again)
        finally:
            if fd.value >= 0:
                os.close(fd.value)
            cu.call("cuMemRelease", handle)
    except Exception as exc:
        return str(exc)
    return ""


def _nvml_sees_us() -> tuple[bool | None, str]:
    """Whether NVML lists this process (it holds a CUDA context now) under our own pid."""
    from vlaunch.cache.contract.nvml import NVML, attribute

    if not NVML.available:
        return None, NVML.error
    for _ in range(10):
        found = attribute(NVML.sample() or [], {0: {os.getpid()}})[0].bytes
        if found is not None:
            return True, ""
        time.sleep(0.1)
    return False, ""


def main(raw: str) -> dict[str, Any]:
    """Every probe that `raw` (JSON: device, model, plan, tp, pp, dp, ranks, threads) asks for."""
    p = json.loads(raw)
    logging.disable(logging.CRITICAL)  # the probes' own log lines are the product's, not ours
    found = shard(p)
    reserved = max((int(n) for n in found["slabs"].values()), default=0)
    return {"slab_pages": slab_pages(), "memfd": memfd(), "nofile": nofile(reserved),
            "shard": found, "staging": staging(int(p.get("threads", 4))),
            "cuda": cuda() if p.get("cuda", True) else {"loaded": False, "error": "not asked",
                                                         "devices": []}}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "{}")))
