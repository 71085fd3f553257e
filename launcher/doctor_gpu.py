"""`vlaunch doctor`'s checks of the GPUs, the memory a model's shard needs, and Docker."""

from __future__ import annotations

from typing import Any

from .doctor_checks import BLOCKER, OK, SKIPPED, WARNING, Finding, Host

GiB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n >> 20} MiB"


def cuda_vmm(host: Host, device: str) -> Finding:
    """The driver (ctypes, the ranks' own bindings): VMM, POSIX-fd handles, an export."""
    got = host.probe["cuda"]
    miss = BLOCKER if device == "cuda" else SKIPPED
    if not got["loaded"]:
        return Finding("cuda_vmm", miss, f"no CUDA driver: {got['error']}",
                       "CUDA cache ranks exit 71" if device == "cuda" else "CPU slabs only",
                       "install the NVIDIA driver, or give the container the GPUs (--gpus)"
                       if device == "cuda" else "", got)
    devs = got["devices"]
    if not devs:
        return Finding("cuda_vmm", miss, f"driver {got['driver']}, no GPU visible",
                       "CUDA cache ranks exit 71" if device == "cuda" else "CPU slabs only",
                       "check CUDA_VISIBLE_DEVICES and the container's --gpus", got)
    bad = [d for d in devs if not (d["vmm"] and d["posix_fd"])]
    found = f"driver {got['driver']}, {len(devs)} GPU(s)"
    sev = BLOCKER if device == "cuda" else WARNING
    if bad:
        return Finding("cuda_vmm", sev, found + f"; GPU {bad[0]['index']} lacks VMM or POSIX-fd "
                       "handles", "its CUDA cache ranks cannot export slabs (they exit)",
                       "a GPU and driver with virtual memory management (not every vGPU has "
                       "it)", got)
    if got.get("export"):
        return Finding("cuda_vmm", sev, found + f"; a VMM export/import failed: {got['export']}",
                       "CUDA cache ranks cannot hand slabs over",
                       "check the driver and the container's device access", got)
    return Finding("cuda_vmm", OK, found + ", VMM and POSIX-fd handles work",
                   "CUDA slabs are VMM allocations handed over as fds", "", got)


def persistence(host: Host) -> Finding:
    """NVML's persistence mode per GPU."""
    if host.gpus is None:
        return Finding("persistence", SKIPPED, f"no NVML: {host.nvml_error}", "no device figures")
    off = [u for u, on in host.persistence.items() if not on]
    data = {"persistence": host.persistence}
    if off:
        return Finding("persistence", WARNING, f"persistence mode off on {len(off)} GPU(s)",
                       "the driver tears the GPUs down whenever no process holds them: the "
                       "first start (and every start with no rank alive) pays its init",
                       "as root: nvidia-smi -pm 1, or run nvidia-persistenced", data)
    return Finding("persistence", OK, "persistence mode on", "the driver stays initialised", "",
                   data)


def nvml_pidns(host: Host) -> Finding:
    """Whether NVML numbers our processes as we do (device figures in /status, /metrics)."""
    sees = host.probe["cuda"].get("nvml_sees_us")
    if sees is None:
        return Finding("nvml_pidns", SKIPPED, "no GPU context to look for",
                       "no device figures")
    if not sees:
        return Finding("nvml_pidns", WARNING, "NVML does not list this process under its pid: "
                       "it numbers processes in another PID namespace",
                       "device_bytes in /status and /metrics are null (absent), not measured",
                       "for device figures run the container with --pid=host (hostPID); "
                       "nothing else needs it", {"nvml_sees_us": False})
    return Finding("nvml_pidns", OK, "NVML lists this process under its own pid",
                   "/status and /metrics report each process's device bytes", "",
                   {"nvml_sees_us": True})


def memlock(host: Host, device: str) -> Finding:
    """RLIMIT_MEMLOCK against the pinned staging buffers a CUDA rank allocates."""
    got = host.probe["staging"]
    limit = got["memlock"]
    found = f"RLIMIT_MEMLOCK {'unlimited' if limit < 0 else _gib(limit)}; pinned staging " \
            f"{_gib(got['pinned'])} per loading rank (VLAUNCH_READER={got['reader']})"
    if device != "cuda":
        return Finding("memlock", SKIPPED, found, "no pinned staging on CPU", "", got)
    if 0 <= limit < got["pinned"]:
        return Finding("memlock", OK, found,
                       "pinned staging is not charged to this limit (the NVIDIA driver pins "
                       "outside it: 1 GiB pinned under ulimit -l 64 on an H200, driver 580); "
                       "what locks memory through the kernel in the engine (RDMA, mlock) "
                       "stops at it", "LimitMEMLOCK=infinity / ulimit -l unlimited / docker "
                       "--ulimit memlock=-1 where the engine uses RDMA", got)
    return Finding("memlock", OK, found, "pinned staging fits the limit", "", got)


def memory(host: Host, device: str, ranks: dict[int, str]) -> Finding:
    """Free memory against each local rank's shard (the plan, packed as the rank packs it)."""
    got = host.probe["shard"]
    if got["error"]:
        return Finding("memory", BLOCKER, f"the model cannot be planned: {got['error']}",
                       "vlaunch run exits (64-66, 78)", "fix --model / --plan", got)
    sizes = {int(r): n for r, n in got["ranks"].items()}
    if not sizes:
        return Finding("memory", SKIPPED, "no --model given", "", "", got)
    if device == "cpu":
        need, free = sum(sizes.values()), got["available_host"]
        return _fits("host", need, free, got)
    if host.gpus is None:
        return Finding("memory", SKIPPED, f"no NVML to read free GPU memory: {host.nvml_error}",
                       "", "", got)
    need_by: dict[str, int] = {}
    for rank, name in ranks.items():
        need_by[name] = need_by.get(name, 0) + sizes.get(rank, 0)
    worst: Finding | None = None
    for name, need in need_by.items():
        gpu = _gpu(host.gpus, name.removeprefix("cuda:"))
        if gpu is None:
            return Finding("memory", BLOCKER, f"{name} is not a visible GPU",
                           "vlaunch run exits 71", "fix --devices", got)
        f = _fits(f"GPU {gpu.index}", need, gpu.total - gpu.used, got)
        if worst is None or f.severity == BLOCKER or (f.severity == WARNING
                                                      and worst.severity == OK):
            worst = f
    return worst or Finding("memory", SKIPPED, "no local rank", "", "", got)


def _gpu(gpus: list[Any], which: str) -> Any:
    for g in gpus:
        if which in (str(g.index), g.uuid):
            return g
    return None


def _fits(where: str, need: int, free: int, data: dict[str, Any]) -> Finding:
    found = f"the shard needs {_gib(need)} on {where}, {_gib(free)} free"
    data = {**data, "need": need, "free": free}
    if need > free:
        return Finding("memory", BLOCKER, found, "the rank cannot allocate its slabs (84)",
                       "free memory, more tensor-parallel ranks, or a bigger device", data)
    if need > 0.9 * free:
        return Finding("memory", WARNING, found, "the ranks fit, with little left for the "
                       "engine (its first start peaks above one copy: engine-layout.md)",
                       "leave room for the engine's activations and KV cache", data)
    return Finding("memory", OK, found, "the ranks fit", "", data)


def docker(host: Host, device: str) -> Finding:
    """`docker info`: a daemon that answers, its runtimes (nvidia for GPU containers)."""
    import json

    if host.docker is None:
        return Finding("docker", SKIPPED, "not asked (--docker)", "")
    rc, text = host.docker()
    if rc != 0:
        return Finding("docker", BLOCKER, f"no Docker daemon answers: {text.strip()[:200]}",
                       "the Docker and Compose recipes cannot run",
                       "install and start dockerd (Debian: apt-get install docker.io)")
    try:
        info = json.loads(text)
    except ValueError:
        return Finding("docker", BLOCKER, "docker info printed no JSON", "", "check the client")
    runtimes = sorted(info.get("Runtimes") or {})
    data = {"server": info.get("ServerVersion"), "runtime": info.get("DefaultRuntime"),
            "runtimes": runtimes, "cgroup": info.get("CgroupVersion")}
    found = f"dockerd {data['server']}, runtime {data['runtime']} (of {', '.join(runtimes)}), " \
            f"cgroup v{data['cgroup']}"
    if device == "cuda" and "nvidia" not in runtimes and not info.get("CDISpecDirs"):
        return Finding("docker", WARNING, found, "containers get no GPUs (--gpus fails)",
                       "install the NVIDIA Container Toolkit and nvidia-ctk runtime configure",
                       data)
    return Finding("docker", OK, found, "the Docker recipes run here", "", data)
