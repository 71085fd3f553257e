"""Device memory figures (issue 30, item 7): NVML's process lists turned into per-child
figures, absent (never 0) where they cannot be known; the CPU path of the launcher's sampler;
the /metrics gauges."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vlaunch.cache.contract.nvml import (
    ABSENT,
    DeviceFigure,
    DeviceSample,
    Nvml,
    attribute,
    used_bytes,
)
from vlaunch.launcher.health import MetricsCollector
from vlaunch.launcher.memory import MemorySampler, host_memory, tree_pids

from .conftest import eventually

GiB = 1 << 30
A, B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def gpus(*procs_per_gpu: tuple[tuple[int, int | None], ...]) -> list[DeviceSample]:
    uuids = (A, B)
    return [DeviceSample(uuids[i], i, 80 * GiB, 40 * GiB, p)
            for i, p in enumerate(procs_per_gpu)]


def test_figures_sum_each_group_over_its_processes_and_gpus() -> None:
    devices = gpus(((100, 17 * GiB), (200, 4 * GiB), (999, GiB)),  # 999: not ours
                   ((101, 16 * GiB), (201, 3 * GiB)))
    got = attribute(devices, {"rank 0": {100}, "rank 1": {101}, "engine": {200, 201, 202},
                              "standby": {300}})
    assert got["rank 0"] == DeviceFigure(17 * GiB, {A: 17 * GiB})
    assert got["rank 1"] == DeviceFigure(16 * GiB, {B: 16 * GiB})
    assert got["engine"] == DeviceFigure(7 * GiB, {A: 4 * GiB, B: 3 * GiB})
    # NVML lists processes of ours, just not this one: it holds nothing on a GPU
    assert got["standby"] == DeviceFigure(0, {})


def test_figures_are_absent_when_nvml_lists_none_of_ours() -> None:
    # a foreign PID namespace: the driver's PIDs are the host's, none match
    got = attribute(gpus(((4100, 17 * GiB), (4200, 4 * GiB))),
                    {"rank 0": {100}, "engine": {200}})
    assert got == {"rank 0": ABSENT, "engine": ABSENT}
    assert got["rank 0"].to_dict() == {"device_bytes": None, "device_by_uuid": {}}
    assert attribute([], {"rank 0": {100}}) == {"rank 0": ABSENT}


def test_a_process_whose_bytes_nvml_cannot_say_makes_its_group_absent() -> None:
    got = attribute(gpus(((100, None), (200, 4 * GiB))), {"rank 0": {100}, "engine": {200}})
    assert got["rank 0"] is ABSENT and got["engine"].bytes == 4 * GiB


def test_used_bytes_reads_nvmls_not_available() -> None:
    assert used_bytes(5 * GiB) == 5 * GiB and used_bytes(0) == 0
    assert used_bytes(None) is None  # pynvml's "not available"
    assert used_bytes((1 << 64) - 1) is None  # NVML_VALUE_NOT_AVAILABLE in a raw structure
    assert used_bytes(-1) is None


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="checks the no-GPU path")
def test_without_a_driver_nvml_is_absent_and_says_why() -> None:
    nv = Nvml()
    assert nv.sample() is None and not nv.available
    assert "NVML cannot start" in nv.error or "nvidia-ml-py is not installed" in nv.error
    assert nv.process_bytes(os.getpid(), A) is None


def test_the_cpu_sampler_reports_host_memory_of_each_tree_and_no_device_figure() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run("
                              "[sys.executable, '-c', 'import time; time.sleep(60)'])"])
    try:
        grandchild = eventually(lambda: psutil.Process(child.pid).children(), 30)
        assert tree_pids(child.pid) == (child.pid, grandchild[0].pid)
        got = MemorySampler(device=False).sample({("cache", 0): os.getpid(),
                                                  ("engine", None): child.pid})
    finally:
        for p in psutil.Process(child.pid).children(recursive=True):
            p.kill()
        child.kill()
        child.wait()
    assert got["device_absent"] == "the caches are on the CPU" and got["devices"] == []
    engine = got["engine"]
    assert engine["pids"] == [child.pid, grandchild[0].pid]
    assert engine["device_bytes"] is None
    assert 0 < engine["uss"] <= engine["pss"] <= engine["rss"]
    assert got["ranks"][0]["pid"] == os.getpid() and got["standby"] is None
    assert tree_pids(child.pid) == () and host_memory(()) is None


def test_metrics_leave_an_absent_device_figure_out() -> None:
    status = {"ranks": {0: {"group_rank": 0, "role": "target"}}, "memory": {
        "devices": [{"uuid": A, "index": 0, "total_bytes": 80 * GiB, "used_bytes": 22 * GiB,
                     "vlaunch_bytes": 21 * GiB, "other_bytes": GiB}],
        "ranks": {0: {"rss": 3, "uss": 2, "pss": 1, "device_bytes": 17 * GiB,
                      "device_by_uuid": {A: 17 * GiB}}},
        "engine": {"rss": 6, "uss": 5, "pss": 4, "device_bytes": None, "device_by_uuid": {}},
        "standby": None}}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(lambda: status))  # type: ignore[arg-type]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    cache = (("process", "cache"), ("rank", "0"), ("role", "target"))
    engine = (("process", "engine"), ("rank", ""), ("role", ""))
    assert samples[("vlaunch_process_device_bytes", (("device", A), *cache))] == 17 * GiB
    assert samples[("vlaunch_process_uss_bytes", engine)] == 5
    assert samples[("vlaunch_process_pss_bytes", cache)] == 1
    # the engine's device figure is absent: no sample at all, not a 0
    assert not [k for k in samples if k[0] == "vlaunch_process_device_bytes"
                and ("process", "engine") in k[1]]
    assert samples[("vlaunch_device_used_bytes", (("device", A),))] == 22 * GiB
    assert samples[("vlaunch_device_total_bytes", (("device", A),))] == 80 * GiB
    assert not [k for k in samples if ("process", "standby") in k[1]]


def test_the_status_table_shows_each_childs_memory() -> None:
    from vlaunch.launcher.status import format_status

    entry = {"rss": 3 * 10**9, "uss": 10**9, "pss": 2 * 10**9}
    mem = {"ranks": {"1": {**entry, "device_bytes": 17 * 10**9},
                     "0": {**entry, "device_bytes": 16 * 10**9}},
           "engine": {**entry, "device_bytes": None}, "standby": None,
           "devices": [{"uuid": A, "index": 0, "total_bytes": 141 * 10**9,
                        "used_bytes": 40 * 10**9, "vlaunch_bytes": 33 * 10**9}],
           "device_absent": None}
    text = format_status({"phase": "serving", "caches_ready": True, "engine_ready": True,
                          "ranks": {}, "memory": mem})
    lines = text.splitlines()
    assert "memory rank 0   rss 3.00 GB  uss 1.00 GB  pss 2.00 GB  device 16.00 GB" in lines
    assert lines.index("memory rank 0   rss 3.00 GB  uss 1.00 GB  pss 2.00 GB  device "
                       "16.00 GB") < lines.index("memory rank 1   rss 3.00 GB  uss 1.00 GB  "
                                                 "pss 2.00 GB  device 17.00 GB")
    assert "memory engine   rss 3.00 GB  uss 1.00 GB  pss 2.00 GB  device absent" in lines
    assert f"gpu 0 {A}: used 40.00 of 141.00 GB, vlaunch 33.00 GB" in lines
    assert "standby" not in text


def test_a_rank_logs_its_memory_again_once_a_figure_moved_64_mib() -> None:
    from vlaunch.cache.reference.memory import LOG_STEP, RankMemory, moved

    first = RankMemory(0, 8 * GiB, 0, 32 << 20, 512 << 20, 0, 600 << 20)
    assert moved(first, None)  # nothing logged yet
    assert not moved(RankMemory(0, 8 * GiB, 0, 40 << 20, 560 << 20, 0, 650 << 20), first)
    # the first request's activations: reserved and device memory grow by gigabytes
    assert moved(RankMemory(0, 8 * GiB, 0, 32 << 20, 2 * GiB, 0, 4 * GiB), first)
    assert moved(RankMemory(0, 8 * GiB, 0, 32 << 20, 512 << 20, 0, (600 << 20) + LOG_STEP),
                 first)
    cpu = RankMemory(0, GiB, 0, 0, 0, 0, None)  # the CPU: no device figure, no torch figures
    assert not moved(cpu, cpu)


def test_the_request_path_reads_the_samplers_device_figure_never_nvml(monkeypatch) -> None:
    """NVML waits while another process pins host memory (a rank staging an in-place swap:
    0.2-0.44 s a query on an H200), so after a request the engine's device figure is a
    sampler thread's; the load's and warm-up's lines still ask NVML themselves."""
    import time

    from vlaunch.cache.reference import memory

    calls: list[str] = []

    def query(device: str) -> int:
        calls.append(device)
        return 1000 + len(calls)

    monkeypatch.setattr(memory, "process_device_bytes", query)
    monkeypatch.setattr(memory, "SAMPLE_S", 0.05)
    monkeypatch.setattr(memory, "_samplers", {})
    first = memory._sampled("cuda:7")
    assert first == 1001 and calls == ["cuda:7"]
    assert memory._sampled("cuda:7") == first  # no query of its own
    deadline = time.monotonic() + 30
    while memory._sampled("cuda:7") == first and time.monotonic() < deadline:
        time.sleep(0.01)
    assert memory._sampled("cuda:7") > first  # the thread took newer ones
    assert set(calls) == {"cuda:7"}
