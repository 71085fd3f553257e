"""CPU slab backings: the per-host choice, and file-backed slabs end to end (unnamed, read-only
for importers once sealed, mapped by other processes, served by a real rank bit-exactly)."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import spawn_cache
from vlaunch.cache import load
from vlaunch.cache.contract.errors import DeviceError
from vlaunch.cache.store import cpubacking
from vlaunch.cache.store.slabs import CpuBackend, CpuSlab


@pytest.fixture(autouse=True)
def fresh_choice() -> Iterator[None]:
    """Each test probes (or reads the environment) anew."""
    cpubacking.chosen.cache_clear()
    yield
    cpubacking.chosen.cache_clear()


@pytest.fixture
def file_slabs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Force file-backed slabs in a fresh directory; returns it."""
    d = tmp_path / "slabs"
    d.mkdir()
    monkeypatch.setenv("VLAUNCH_CPU_SLABS", "file")
    monkeypatch.setenv("VLAUNCH_CPU_SLAB_DIR", str(d))
    return d


@pytest.mark.parametrize(("huge", "want"), [({"memfd", "file"}, "memfd"), ({"file"}, "file"),
                                            (set(), "memfd")])
def test_auto_takes_the_backing_that_gets_huge_pages(monkeypatch: pytest.MonkeyPatch,
                                                     huge: set[str], want: str) -> None:
    monkeypatch.delenv("VLAUNCH_CPU_SLABS", raising=False)
    monkeypatch.setattr(cpubacking, "gets_huge_pages", lambda backing, make: backing in huge)
    assert cpubacking.chosen() == want


def test_the_probe_answers_on_this_host_and_an_unknown_choice_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLAUNCH_CPU_SLABS", raising=False)
    assert cpubacking.chosen() in ("memfd", "file")
    cpubacking.chosen.cache_clear()
    monkeypatch.setenv("VLAUNCH_CPU_SLABS", "hugetlb")
    with pytest.raises(DeviceError, match="VLAUNCH_CPU_SLABS must be auto, memfd or file"):
        cpubacking.chosen()


def test_a_file_slab_is_unnamed_and_read_only_for_importers(file_slabs: Path) -> None:
    slab = CpuSlab(3 << 20)
    assert slab.backing == "file"
    data = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
    slab.tensor().copy_(data)
    slab.seal()
    fd = slab.export_fd()
    try:
        assert list(file_slabs.iterdir()) == []
        assert os.fstat(fd).st_nlink == 0 and os.fstat(fd).st_mode & 0o777 == 0o400
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 3 << 20, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):  # O_EXCL: it can never be given a name
            os.link(f"/proc/self/fd/{fd}", file_slabs / "named", follow_symlinks=True)
        if os.geteuid() != 0:  # root may reopen anything for writing
            with pytest.raises(PermissionError):
                os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        code = ("import mmap, zlib; "  # another process maps it (no torch: a fast child)
                f"print(zlib.crc32(mmap.mmap({fd}, {3 << 20}, prot=mmap.PROT_READ)))")
        out = subprocess.run([sys.executable, "-c", code], pass_fds=[fd], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        assert int(out) == zlib.crc32(data.numpy().tobytes())
        assert torch.equal(CpuBackend().import_fd(fd, 3 << 20, readonly=True), data)
    finally:
        os.close(fd)
        slab.release()


def test_a_forced_file_in_a_bad_directory_fails_and_auto_falls_back_to_a_memfd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    monkeypatch.setenv("VLAUNCH_CPU_SLAB_DIR", str(tmp_path / "missing"))
    monkeypatch.setenv("VLAUNCH_CPU_SLABS", "file")
    with pytest.raises(DeviceError, match="cannot create a CPU slab file in"):
        CpuSlab(4096)
    monkeypatch.setenv("VLAUNCH_CPU_SLABS", "auto")
    monkeypatch.setattr(cpubacking, "chosen", lambda: "file")  # as if the probe had said so
    caplog.set_level(logging.WARNING, "vlaunch.cache")
    slab = CpuSlab(4096)
    assert slab.backing == "memfd"
    assert any("this slab is a memfd instead" in r.getMessage() for r in caplog.records)
    slab.release()


def test_a_rank_serves_file_slabs_bit_exactly(llama_ckpt: Path, sockdir: Path, caches,
                                              file_slabs: Path) -> None:
    cache = spawn_cache(llama_ckpt, sockdir, env=dict(os.environ))
    caches.append(cache)
    assert cache.ready, cache.proc.stderr.read().decode() if cache.proc.stderr else ""
    targets = [os.readlink(f"/proc/{cache.proc.pid}/fd/{fd}")
               for fd in os.listdir(f"/proc/{cache.proc.pid}/fd")]
    assert any(t.startswith(f"{file_slabs}/#") for t in targets), targets
    assert not any(t.startswith("/memfd:") for t in targets)
    got = load(str(llama_ckpt), socket_dir=str(sockdir), fallback=False, timeout=10)
    assert got.source == "cache"
    ref = {}
    for f in sorted(llama_ckpt.glob("*.safetensors")):
        ref.update(load_file(str(f)))
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    got.client.close()


def _resident_kb(address: int) -> int:
    """Rss of this process's mapping that holds `address` (its pages with page-table entries)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("backing", ["memfd", "file"])
def test_an_engine_maps_a_slab_populated(backing: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every page is mapped by the import itself, before any read (no fault per page)."""
    monkeypatch.setenv("VLAUNCH_CPU_SLABS", backing)
    monkeypatch.setenv("VLAUNCH_CPU_SLAB_DIR", str(tmp_path))
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


def _anon_huge_kb(address: int, size: int) -> int:
    """AnonHugePages of this process's mappings that overlap [address, address + size)."""
    inside, kb = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < address + size and address < end
        elif inside and head == "AnonHugePages:":
            kb += int(line.split()[1])
    return kb


def test_a_cpu_copy_of_a_slab_is_made_in_huge_pages() -> None:
    """The engine's own copy asks for 2 MiB pages before the copy faults them in (on a host
    whose THP policy is `madvise`, where nothing else would give them)."""
    policy = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[madvise]" not in policy:
        pytest.skip(f"THP policy is not madvise here ({policy.strip()})")
    from vlaunch.cache.store.slabs import empty_for_copy

    size = 64 << 20
    copy = empty_for_copy(size, "cpu")
    copy.fill_(1)  # the first write faults the pages in
    assert _anon_huge_kb(copy.data_ptr(), size) >= (size >> 10) // 2
    assert int(copy.sum()) == size
