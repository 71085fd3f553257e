"""CPU slabs on every host: sealed memfds, with 2 MiB pages where the host allows them.

Each test that depends on the slab's pages runs under both requests the product can make
(`VLAUNCH_CPU_SLAB_PAGES=auto`: 2 MiB pages where the shmem huge-page policy allows them;
`4k`: never asked) and asserts on what the product reports (`cpubacking.page_size()`, the
rank's `slab_pages`), never on the host's policy. A share-mode importer cannot write to a slab
through any path: a writable mapping, `write()`, `fallocate`, `mprotect`, a reopen through
/proc, in this process or another."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import spawn_cache
from vlaunch.cache import load
from vlaunch.cache.client.connection import CacheClient
from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.sockdir import socket_path
from vlaunch.cache.store import cpubacking
from vlaunch.cache.store.slabs import CpuBackend, CpuSlab

PAGES = ["auto", "4k"]


@pytest.fixture(autouse=True)
def fresh_probe() -> Iterator[None]:
    """Each test probes (or reads the environment) anew."""
    cpubacking.page_size.cache_clear()
    yield
    cpubacking.page_size.cache_clear()


@pytest.fixture(params=PAGES)
def pages(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """VLAUNCH_CPU_SLAB_PAGES for this process and the ranks it starts."""
    monkeypatch.setenv("VLAUNCH_CPU_SLAB_PAGES", request.param)
    monkeypatch.delenv("VLAUNCH_CPU_SLABS", raising=False)
    return str(request.param)


@pytest.mark.parametrize(("request_", "host_gives", "want"), [
    ("auto", True, cpubacking.HUGE), ("auto", False, mmap.PAGESIZE),
    ("4k", True, mmap.PAGESIZE), ("4k", False, mmap.PAGESIZE)])
def test_the_page_size_is_what_was_asked_and_what_the_host_gives(
        monkeypatch: pytest.MonkeyPatch, request_: str, host_gives: bool, want: int) -> None:
    monkeypatch.setenv("VLAUNCH_CPU_SLAB_PAGES", request_)
    monkeypatch.setattr(cpubacking, "gets_huge_pages", lambda: host_gives)
    assert cpubacking.page_size() == want
    assert cpubacking.page_label() == ("2M" if want == cpubacking.HUGE else "4k")


def test_the_probe_answers_on_this_host_and_bad_settings_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLAUNCH_CPU_SLAB_PAGES", raising=False)
    assert cpubacking.page_size() in (cpubacking.HUGE, mmap.PAGESIZE)
    cpubacking.page_size.cache_clear()
    monkeypatch.setenv("VLAUNCH_CPU_SLAB_PAGES", "1g")
    with pytest.raises(UsageError, match="VLAUNCH_CPU_SLAB_PAGES must be auto or 4k"):
        cpubacking.page_size()
    cpubacking.page_size.cache_clear()
    monkeypatch.setenv("VLAUNCH_CPU_SLAB_PAGES", "auto")
    monkeypatch.setenv("VLAUNCH_CPU_SLABS", "file")
    with pytest.raises(UsageError, match="file-backed CPU slabs are no longer supported"):
        CpuSlab(4096)


def _smaps_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if inside:
                break
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    if not fields:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def test_a_slab_asks_for_huge_pages_as_requested_and_gets_what_it_reports(pages: str) -> None:
    slab = CpuSlab(8 << 20)
    try:
        slab.buffer()[:] = 3  # the fill faults the pages in
        fields = _smaps_of(slab.buffer().ctypes.data)
        assert ("hg" in fields["VmFlags"].split()) == (pages == "auto")
        huge_kb = int(fields["ShmemPmdMapped"].split()[0])
        if slab.page_size == cpubacking.HUGE:
            assert huge_kb > 0, fields
        else:
            assert huge_kb == 0, fields
    finally:
        slab.release()


_WRITES = textwrap.dedent("""
    import ctypes, mmap, os, sys
    fd, size = int(sys.argv[1]), int(sys.argv[2])
    refused = []
    def attempt(name, fn):
        try:
            fn()
        except OSError:
            refused.append(name)
            return
        print("WROTE", name, flush=True)
    def shared_writable(f):
        m = mmap.mmap(f, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m[0] = (m[0] + 1) % 256
    def reopened():
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    def punch(f):
        if libc.fallocate(f, 3, 0, 4096) != 0:  # PUNCH_HOLE | KEEP_SIZE
            raise OSError(ctypes.get_errno(), "fallocate")
    def upgrade():  # a read-only shared mapping, then ask the kernel for write access
        import numpy
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        arr = numpy.frombuffer(m, dtype=numpy.uint8)
        if libc.mprotect(arr.ctypes.data, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        ctypes.memset(arr.ctypes.data, 0, 1)
    attempt("mmap", lambda: shared_writable(fd))
    attempt("write", lambda: os.pwrite(fd, b"x", 0))
    attempt("punch", lambda: punch(fd))
    attempt("truncate", lambda: os.ftruncate(fd, 0))
    attempt("mprotect", upgrade)
    def via_proc():
        f = reopened()
        try:
            for name, fn in (("proc-mmap", lambda: shared_writable(f)),
                             ("proc-write", lambda: os.pwrite(f, b"x", 0)),
                             ("proc-punch", lambda: punch(f)),
                             ("proc-truncate", lambda: os.ftruncate(f, 0))):
                attempt(name, fn)
        finally:
            os.close(f)
    try:
        via_proc()
    except OSError:
        refused.append("proc-open")
    print("REFUSED", " ".join(refused))
""")


def _try_to_write(fd: int, size: int) -> str:
    """Every way another process could write to a slab fd it was sent; its report."""
    return subprocess.run([sys.executable, "-c", _WRITES, str(fd), str(size)], pass_fds=[fd],
                          check=True, capture_output=True, text=True, timeout=60).stdout


def test_a_sealed_slab_refuses_every_write_path_in_another_process(pages: str) -> None:
    size = 4 << 20
    slab = CpuSlab(size)
    data = torch.randint(0, 255, (size,), dtype=torch.uint8)
    slab.tensor().copy_(data)
    slab.seal()
    assert slab.sealed
    fd = slab.export_fd()
    try:
        out = _try_to_write(fd, size)
        assert "WROTE" not in out, out
        assert torch.equal(slab.tensor(), data)
        assert torch.equal(CpuBackend().import_fd(fd, size, readonly=True), data)
    finally:
        os.close(fd)
        slab.release()


def test_a_share_engine_cannot_change_what_later_engines_get(
        pages: str, llama_ckpt: Path, sockdir: Path, caches) -> None:
    """A real rank: an engine process takes every slab fd it holds from the share handoff and
    tries each write path on it; the next engine still gets the checkpoint's bytes."""
    cache = spawn_cache(llama_ckpt, sockdir, env=dict(os.environ))
    caches.append(cache)
    assert cache.ready, cache.proc.stderr.read().decode() if cache.proc.stderr else ""
    status = CacheClient(socket_path(sockdir, 0))
    assert status.status()["slab_pages"] in ("2M", "4k")
    if pages == "4k":
        assert status.status()["slab_pages"] == "4k"
    status.close()
    engine = textwrap.dedent(f"""
        import os, subprocess, sys
        from vlaunch.cache import load
        got = load({str(llama_ckpt)!r}, socket_dir={str(sockdir)!r}, fallback=False)
        assert got.source == "cache"
        def target(n):
            try:
                return os.readlink("/proc/self/fd/" + n)
            except FileNotFoundError:  # listdir's own descriptor
                return ""
        fds = [int(n) for n in os.listdir("/proc/self/fd") if "memfd:vlaunch-slab" in target(n)]
        for line in open("/proc/self/maps"):  # the mapped slabs, opened again by their range
            if "memfd:vlaunch-slab" in line:
                path = "/proc/self/map_files/" + line.split()[0]
                for how in (os.O_RDWR, os.O_RDONLY):
                    try:
                        fds.append(os.open(path, how))
                        break
                    except PermissionError:
                        print("REFUSED map_files", os.strerror(13))
        assert fds, "no slab mapped or open: nothing to try"
        for fd in fds:
            size = os.fstat(fd).st_size
            out = subprocess.run([sys.executable, "-c", sys.argv[1], str(fd), str(size)],
                                 pass_fds=[fd], capture_output=True, text=True)
            assert out.returncode == 0, out.stderr
            print(out.stdout, end="")
    """)
    run = subprocess.run([sys.executable, "-c", engine, _WRITES], capture_output=True,
                         text=True, timeout=120)
    out = run.stdout
    assert run.returncode == 0, run.stderr
    assert "REFUSED" in out and "WROTE" not in out, out
    got = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, timeout=10)
    ref = {}
    for f in sorted(llama_ckpt.glob("*.safetensors")):
        ref.update(load_file(str(f)))
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    got.client.close()


def _resident_kb(address: int) -> int:
    """Rss of this process's mapping that holds `address` (its pages with page-table entries)."""
    return int(_smaps_of(address)["Rss"].split()[0])


def test_an_engine_maps_a_slab_populated(pages: str) -> None:
    """Every page is mapped by the import itself, before any read (no fault per page)."""
    slab = CpuSlab(4 << 20)
    slab.tensor().fill_(7)
    slab.seal()
    fd = slab.export_fd()
    try:
        mapped = CpuBackend().import_fd(fd, 4 << 20, readonly=True)
        assert _resident_kb(mapped.data_ptr()) == 4 << 10
        assert int(mapped[-1]) == 7
        rank_side = CpuBackend().map_fd(fd, 4 << 20, readonly=True)  # the rank's: not populated
        assert _resident_kb(rank_side.ctypes.data) == 0
    finally:
        os.close(fd)
        slab.release()


def _thp_policy() -> str:
    """The host's anonymous THP policy, as the kernel marks it: always, madvise or never."""
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text.split("[", 1)[1].split("]", 1)[0]


def test_a_cpu_copy_of_a_slab_asks_for_huge_pages() -> None:
    """The engine's own copy asks for 2 MiB pages (`MADV_HUGEPAGE`, VmFlags `hg`) before the
    copy faults them in; where the host's THP policy lets advice count, it gets them."""
    from vlaunch.cache.store.slabs import empty_for_copy

    size = 64 << 20
    copy = empty_for_copy(size, "cpu")
    copy.fill_(1)  # the first write faults the pages in
    fields = _smaps_of(copy.data_ptr() + size // 2)
    assert "hg" in fields["VmFlags"].split(), fields["VmFlags"]
    if _thp_policy() in ("always", "madvise"):
        assert int(fields["AnonHugePages"].split()[0]) > 0, fields
    assert int(copy.sum()) == size


def test_the_handover_is_private_copy_on_write_under_each_page_size(
        pages: str, llama_ckpt: Path, sockdir: Path, caches) -> None:
    """copy-release's handover maps the rank's own sealed slab privately: the engine's writes
    stay its own (under both page requests)."""
    caches.append(spawn_cache(llama_ckpt, sockdir, env=dict(os.environ)))
    ref = load_file(str(sorted(llama_ckpt.glob("*.safetensors"))[0]))
    got = load(str(llama_ckpt), socket_dir=str(sockdir), mode="copy-release", fallback=False,
               device="cpu")
    name = next(iter(ref))
    fields = _smaps_of(got[name].data_ptr())
    assert "mr" in fields["VmFlags"].split() and "sh" not in fields["VmFlags"].split()
    got[name].view(-1)[0] += 1
    assert not torch.equal(got[name].view(torch.uint8), ref[name].view(torch.uint8))


def test_the_warning_path_of_a_kernel_without_future_write(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Where the seal is refused (Linux before 5.1), the slab says so and the log warns."""
    import fcntl

    from vlaunch.cache.store import slabs

    real = fcntl.fcntl

    def no_future_write(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_ADD_SEALS and arg == slabs.F_SEAL_FUTURE_WRITE:
            raise OSError(22, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(slabs.fcntl, "fcntl", no_future_write)
    monkeypatch.setattr(slabs, "_unsealed_said", [])
    slab = CpuSlab(4096)
    slab.seal()
    assert not slab.sealed
    assert "cannot seal CPU slabs against writes" in caplog.text
    slab.release()
