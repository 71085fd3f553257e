"""`vlaunch doctor`: each check against faked hosts (their files under a root, the cache-side
probe's answers), then the real command on this machine, whose findings must agree with what
the product itself picks."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vlaunch.cache.contract.exitcodes import EXIT_TABLE, ExitStatus
from vlaunch.cache.contract.nvml import DeviceSample
from vlaunch.cache.contract.sockdir import LauncherLock, socket_path
from vlaunch.launcher import doctor_checks as dc
from vlaunch.launcher import doctor_gpu as dg
from vlaunch.launcher.children import own_cgroup
from vlaunch.launcher.doctor import report

VLAUNCH = [sys.executable, "-m", "vlaunch.launcher.cli"]


def probe(**over: Any) -> dict[str, Any]:
    """A healthy host's probe answers, with `over` replacing whole sections."""
    base = {
        "slab_pages": {"requested": "auto", "page": "2M", "error": ""},
        "memfd": {"created": True, "sealed": True, "error": ""},
        "nofile": {"soft_before": 1024, "soft": 65536, "hard": 65536, "given": None,
                   "bound": 4096, "default": 4096, "reserve": 64, "error": ""},
        "shard": {"available_host": 64 << 30, "ranks": {}, "slabs": {}, "error": ""},
        "staging": {"reader": "staging", "pinned": 96 << 20, "memlock": -1},
        "cuda": {"loaded": False, "error": "no libcuda.so.1", "devices": [],
                 "nvml_sees_us": None}}
    base.update(over)
    return base


def host(tmp: Path, files: dict[str, str] | None = None, **kw: Any) -> dc.Host:
    for rel, text in (files or {}).items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    return dc.Host(tmp, kw.pop("probe", probe()), **kw)


@pytest.mark.parametrize("policy,page,requested,device,severity", [
    ("always within_size advise [never] deny force", "4k", "auto", "cpu", dc.WARNING),
    ("always within_size advise [never] deny force", "4k", "auto", "cuda", dc.OK),
    ("always within_size [advise] never deny force", "2M", "auto", "cpu", dc.OK),
    ("always within_size advise [never] deny force", "4k", "4k", "cpu", dc.OK),
])
def test_slab_pages_follow_the_ranks_own_choice(tmp_path: Path, policy: str, page: str,
                                                requested: str, device: str,
                                                severity: str) -> None:
    h = host(tmp_path, {dc.THP: policy + "\n"},
             probe=probe(slab_pages={"requested": requested, "page": page, "error": ""}))
    f = dc.slab_pages(h, device)
    assert f.severity == severity
    assert f.data["shmem_enabled"] == policy.split("[")[1].split("]")[0]
    assert ("2 MiB" if page == "2M" else "4 KiB") in f.choice
    if severity == dc.WARNING:
        assert "shmem_enabled" in f.fix


def test_a_bad_slab_setting_and_unsealable_memfds(tmp_path: Path) -> None:
    bad = probe(slab_pages={"requested": "", "page": "", "error": "VLAUNCH_CPU_SLAB_PAGES"},
                memfd={"created": False, "sealed": False, "error": "ENOSYS"})
    h = host(tmp_path, probe=bad)
    assert dc.slab_pages(h, "cpu").severity == dc.BLOCKER
    assert dc.memfd_seals(h, "cpu").severity == dc.BLOCKER
    assert dc.memfd_seals(h, "cuda").severity == dc.WARNING
    old = host(tmp_path, probe=probe(memfd={"created": True, "sealed": False, "error": ""}))
    assert dc.memfd_seals(old, "cpu").severity == dc.WARNING


@pytest.mark.parametrize("nofile,severity", [
    ({}, dc.OK),
    ({"soft": 1024, "hard": 1024, "bound": 960}, dc.WARNING),  # a low hard limit
    ({"given": 100000}, dc.WARNING),  # more connections than fds
    ({"error": "VLAUNCH_MAX_CONNECTIONS: not a count"}, dc.BLOCKER),
])
def test_nofile_against_the_connection_bound(tmp_path: Path, nofile: dict[str, Any],
                                             severity: str) -> None:
    got = {**probe()["nofile"], **nofile}
    f = dc.nofile(host(tmp_path, probe=probe(nofile=got)))
    assert f.severity == severity
    if severity == dc.WARNING:
        assert "LimitNOFILE" in f.fix or "ulimit" in f.fix


MOUNTINFO = "29 1 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


@pytest.mark.parametrize("group,files,severity", [
    ("0::/svc\n", ("cgroup.procs", "cgroup.kill"), dc.OK),
    ("0::/svc\n", ("cgroup.procs",), dc.WARNING),  # no cgroup.kill: before Linux 5.14
    ("0::/\n", (), dc.WARNING),  # the hierarchy's root: not ours
    ("4:memory:/x\n", (), dc.WARNING),  # cgroup v1 only
])
def test_cgroup_delegation(tmp_path: Path, group: str, files: tuple[str, ...],
                           severity: str) -> None:
    mount = tmp_path / "cg"
    (mount / "svc").mkdir(parents=True)
    for name in files:
        (mount / "svc" / name).write_text("")
    h = host(tmp_path, {"proc/self/mountinfo": MOUNTINFO.format(mount=mount),
                        "proc/self/cgroup": group})
    f = dc.cgroup(h, own_cgroup)
    assert f.severity == severity
    if severity == dc.WARNING:
        assert "Delegate=yes" in f.fix


@pytest.mark.parametrize("mounts,ours,severity", [
    ("proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n", True, dc.OK),
    ("proc /proc proc rw,nosuid,relatime,hidepid=invisible 0 0\n", True, dc.WARNING),
    ("proc /proc proc rw,relatime 0 0\n", False, dc.BLOCKER),
])
def test_proc_namespace_and_hidepid(tmp_path: Path, mounts: str, ours: bool,
                                    severity: str) -> None:
    f = dc.proc(host(tmp_path, {"proc/self/mounts": mounts}), ours)
    assert f.severity == severity


def _longest(d: Path) -> Path:
    return socket_path(d, 7)


def test_socket_dir_variations(tmp_path: Path) -> None:
    assert dc.socket_dir(tmp_path / "new", _longest).severity == dc.OK
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    f = dc.socket_dir(loose, _longest)
    assert f.severity == dc.BLOCKER and "chmod 700" in f.found
    tight = tmp_path / "tight"
    tight.mkdir(mode=0o700)
    assert dc.socket_dir(tight, _longest).severity == dc.OK
    lock = LauncherLock(tight)
    lock.acquire()
    try:
        f = dc.socket_dir(tight, _longest)
        assert f.severity == dc.WARNING and str(os.getpid()) in f.found
    finally:
        lock.release()
    long = tmp_path / ("x" * 110)
    assert dc.socket_dir(long, _longest).severity == dc.BLOCKER


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_socket_dir_of_another_user_blocks(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 4242, 4242)
    f = dc.socket_dir(other, _longest)
    assert f.severity == dc.BLOCKER and "owned by uid 4242" in f.found


def test_memory_against_the_shard(tmp_path: Path) -> None:
    shard = {"available_host": 10 << 30, "ranks": {"0": 6 << 30, "1": 6 << 30},
             "slabs": {"0": 1, "1": 1}, "error": ""}
    h = host(tmp_path, probe=probe(shard=shard))
    assert dg.memory(h, "cpu", {0: "cpu", 1: "cpu"}).severity == dc.BLOCKER  # 12 > 10 GiB
    gpus = [DeviceSample("GPU-a", 0, 80 << 30, 10 << 30), DeviceSample("GPU-b", 1, 80 << 30,
                                                                       76 << 30)]
    h = host(tmp_path, probe=probe(shard=shard), gpus=gpus)
    assert dg.memory(h, "cuda", {0: "cuda:0", 1: "cuda:0"}).severity == dc.OK
    f = dg.memory(h, "cuda", {0: "cuda:0", 1: "cuda:1"})
    assert f.severity == dc.BLOCKER and "GPU 1" in f.found
    assert dg.memory(h, "cuda", {0: "cuda:0", 1: "cuda:5"}).severity == dc.BLOCKER
    assert dg.memory(host(tmp_path), "cpu", {0: "cpu"}).severity == dc.SKIPPED


def test_cuda_driver_variations(tmp_path: Path) -> None:
    none = host(tmp_path)
    assert dg.cuda_vmm(none, "cuda").severity == dc.BLOCKER
    assert dg.cuda_vmm(none, "cpu").severity == dc.SKIPPED
    assert dg.nvml_pidns(none).severity == dc.SKIPPED
    dev = {"index": 0, "uuid": "GPU-a", "vmm": True, "posix_fd": False}
    vgpu = host(tmp_path, probe=probe(cuda={"loaded": True, "driver": 12080, "error": "",
                                            "devices": [dev], "export": "",
                                            "nvml_sees_us": False}))
    assert dg.cuda_vmm(vgpu, "cuda").severity == dc.BLOCKER
    f = dg.nvml_pidns(vgpu)
    assert f.severity == dc.WARNING and "--pid=host" in f.fix
    gpus = [DeviceSample("GPU-a", 0, 80 << 30, 0)]
    assert dg.persistence(host(tmp_path, gpus=gpus, persistence={"GPU-a": False})
                          ).severity == dc.WARNING
    low = host(tmp_path, probe=probe(staging={"reader": "staging", "pinned": 96 << 20,
                                              "memlock": 8 << 20}))
    f = dg.memlock(low, "cuda")  # the NVIDIA driver's pinning is not charged to it
    assert f.severity == dc.OK and "RDMA" in f.choice
    assert dg.memlock(low, "cpu").severity == dc.SKIPPED


def test_docker_variations(tmp_path: Path) -> None:
    assert dg.docker(host(tmp_path), "cpu").severity == dc.SKIPPED
    down = host(tmp_path, docker=lambda: (1, "Cannot connect to the Docker daemon"))
    assert dg.docker(down, "cpu").severity == dc.BLOCKER
    info = json.dumps({"ServerVersion": "26.1", "DefaultRuntime": "runc",
                       "Runtimes": {"runc": {}}, "CgroupVersion": "2"})
    up = host(tmp_path, docker=lambda: (0, info))
    assert dg.docker(up, "cpu").severity == dc.OK
    assert dg.docker(up, "cuda").severity == dc.WARNING


def test_listen_variations() -> None:
    assert dc.listen((), lambda v: "").severity == dc.SKIPPED
    ok = dc.listen(("127.0.0.1:8000", "unix:/run/x.sock"), lambda v: "")
    assert ok.severity == dc.OK and "127.0.0.1:8000, unix:/run/x.sock" in ok.found
    bad = dc.listen(("a:1", "b:2"),
                    lambda v: f"vlaunch: --listen {v}: in use" if v == "b:2" else "")
    assert bad.severity == dc.BLOCKER and bad.found == "vlaunch: --listen b:2: in use"
    assert "64" in bad.choice and bad.data["problems"] == ["vlaunch: --listen b:2: in use"]


def test_the_status_is_77_only_for_a_blocker() -> None:
    warn = dc.Finding("x", dc.WARNING, "f", "c", "fix")
    block = dc.Finding("y", dc.BLOCKER, "f", "c", "fix")
    assert report([warn])["status"] == 0
    assert report([warn, block])["status"] == int(ExitStatus.HOST_BLOCKED) == 77
    assert any(i.status == ExitStatus.HOST_BLOCKED and "doctor" in i.who for i in EXIT_TABLE)


# ------------------------------------------------------------------ the real command, here

def _doctor(*args: str) -> tuple[int, str]:
    done = subprocess.run([*VLAUNCH, "doctor", *args], capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode in (0, 77), done.stderr
    return done.returncode, done.stdout


def test_the_real_command_agrees_with_the_product(tmp_path: Path) -> None:
    from vlaunch.cache.rank.connections import FD_RESERVE, MAX_CONNECTIONS
    from vlaunch.cache.store import cpubacking

    rc, out = _doctor("--json", "--socket-dir", str(tmp_path / "s"))
    doc = json.loads(out)
    assert doc["status"] == rc and (rc == 77) == (doc["blockers"] > 0)
    checks = {c["check"]: c for c in doc["checks"]}
    assert set(checks) == {"slab_pages", "memfd_seals", "nofile", "cgroup", "proc",
                           "socket_dir", "memory", "cuda_vmm", "persistence", "nvml_pidns",
                           "memlock", "docker", "listen"}
    for c in doc["checks"]:
        assert c["severity"] in (dc.OK, dc.WARNING, dc.BLOCKER, dc.SKIPPED)
        assert c["found"]
        if c["severity"] in (dc.WARNING, dc.BLOCKER):
            assert c["choice"] and c["fix"], c
    assert checks["slab_pages"]["data"]["page"] == cpubacking.page_label()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and "VLAUNCH_MAX_CONNECTIONS" not in os.environ:
        want = max(1, min(MAX_CONNECTIONS, hard - FD_RESERVE))
        assert checks["nofile"]["data"]["bound"] == want
    assert checks["socket_dir"]["severity"] == dc.OK
    assert own_cgroup() is None or checks["cgroup"]["data"]["cgroup"] == str(own_cgroup())
    rc_text, text = _doctor("--socket-dir", str(tmp_path / "s"))
    assert rc_text == rc and text.startswith("vlaunch doctor: ")
    for name in checks:
        assert f" {name} " in text


def test_a_model_shard_is_planned(tmp_path: Path, llama_ckpt: Path) -> None:
    _, out = _doctor("--json", "--model", str(llama_ckpt), "--tensor-parallel-size", "2",
                     "--socket-dir", str(tmp_path / "s"))
    mem = next(c for c in json.loads(out)["checks"] if c["check"] == "memory")
    assert mem["severity"] == dc.OK
    sizes = mem["data"]["ranks"]
    assert set(sizes) == {"0", "1"} and mem["data"]["need"] == sum(sizes.values()) > 0


@pytest.mark.parametrize("make", ["loose", "long"])
def test_a_blocker_exits_77(tmp_path: Path, make: str) -> None:
    if make == "loose":
        where = tmp_path / "loose"
        where.mkdir()
        where.chmod(0o755)
    else:
        where = tmp_path / ("y" * 120)
    rc, out = _doctor("--json", "--socket-dir", str(where))
    assert rc == 77
    sock = next(c for c in json.loads(out)["checks"] if c["check"] == "socket_dir")
    assert sock["severity"] == dc.BLOCKER and "73" in sock["choice"]


def test_listen_addresses_are_bound_as_vlaunch_run_would(tmp_path: Path) -> None:
    """A port some server holds blocks (77, with vlaunch run's own message); a free port and a
    Unix path pass, and the socket file doctor made is gone again."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = f"127.0.0.1:{held.getsockname()[1]}"
    path = tmp_path / "engine.sock"
    try:
        rc, out = _doctor("--json", "--socket-dir", str(tmp_path / "s"), "--listen", busy,
                          "--listen", f"unix:{path}")
        check = next(c for c in json.loads(out)["checks"] if c["check"] == "listen")
        assert rc == 77 and check["severity"] == dc.BLOCKER
        assert check["data"]["problems"] == [f"vlaunch: --listen {busy}: the address is already "
                                             "in use (another server, or a launcher still "
                                             "running); stop it or pick another"]
    finally:
        held.close()
    rc, out = _doctor("--json", "--socket-dir", str(tmp_path / "s"), "--listen", busy,
                      "--listen", f"unix:{path}")
    check = next(c for c in json.loads(out)["checks"] if c["check"] == "listen")
    assert check["severity"] == dc.OK, check
    assert not path.exists()
