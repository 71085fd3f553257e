"""Where a CPU slab's memory lives: a memfd, or an unnamed file on a disk filesystem.

A CPU share handoff costs what the engine pays to fault the slab's pages into its mapping,
so the page size decides it. A 4 KiB page costs the kernel work per page, whoever faults it
(populating in one call does not help); a 2 MiB folio is mapped by one page-table entry when
the mapping is 2 MiB aligned, which the kernel arranges for shmem and for ext4/XFS files.

- A memfd (shmem) gets 2 MiB pages through `MADV_HUGEPAGE` only where the host's shmem THP
  policy allows it (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`: `advise`, `always`,
  `within_size`); many hosts say `never`, and only root can change that.
- The page cache of a disk filesystem with large folios (XFS; ext4 on recent kernels) gets
  2 MiB folios when it is filled through a `MADV_HUGEPAGE` mapping, whatever the shmem policy.
  Its costs: the kernel writes the dirty pages to disk (the slab's size in disk space, reserved
  up front, and in writes; a fill larger than the dirty limit runs at the disk's write speed),
  and clean pages can be reclaimed under memory pressure and read back from disk later. The
  file is `O_TMPFILE | O_EXCL`: it has no name, cannot be given one, and its blocks are freed
  with its last descriptor and mapping.

So `auto` takes the memfd where it gets huge pages, else the file where it does, else the
memfd. A 4 MiB probe of each decides, once per process. `VLAUNCH_CPU_SLABS=memfd|file`
overrides the choice; `VLAUNCH_CPU_SLAB_DIR` names the file's directory (default /var/tmp).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path

from vlaunch.cache.contract.errors import DeviceError

log = logging.getLogger(__name__)

CHOICES = ("auto", "memfd", "file")
DEFAULT_DIR = "/var/tmp"
HUGE = 2 << 20
PROBE_BYTES = 2 * HUGE  # holds one aligned 2 MiB folio wherever the mapping starts
COUNTER = {"memfd": "ShmemHugePages:", "file": "FileHugePages:"}  # /proc/meminfo, kB


def new_memfd(size: int) -> int:
    """A memfd of `size` bytes that allows sealing."""
    fd = os.memfd_create("vlaunch-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


def new_file(size: int, directory: str) -> int:
    """An unnamed file of `size` bytes in `directory`, its blocks reserved, mode 0600."""
    fd = os.open(directory, os.O_TMPFILE | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def slab_dir() -> str:
    """The directory of file-backed slabs (VLAUNCH_CPU_SLAB_DIR, default /var/tmp)."""
    return os.environ.get("VLAUNCH_CPU_SLAB_DIR") or DEFAULT_DIR


def new_slab_fd(size: int) -> tuple[int, str]:
    """A descriptor for a new slab of `size` bytes and its backing ("memfd" or "file")."""
    backing = chosen()
    if backing == "file":
        try:
            return new_file(size, slab_dir()), "file"
        except OSError as exc:
            if requested() == "file":
                raise DeviceError(f"cannot create a CPU slab file in {slab_dir()}: "
                                  f"{exc.strerror}; free space there, set "
                                  "VLAUNCH_CPU_SLAB_DIR to a directory on a disk filesystem, "
                                  "or unset VLAUNCH_CPU_SLABS") from None
            log.warning("cannot create a CPU slab file in %s (%s); this slab is a memfd "
                        "instead (4 KiB pages: a slower share handoff)", slab_dir(),
                        exc.strerror)
    return new_memfd(size), "memfd"


def requested() -> str:
    """VLAUNCH_CPU_SLABS: auto (the default), memfd or file."""
    value = os.environ.get("VLAUNCH_CPU_SLABS") or "auto"
    if value not in CHOICES:
        raise DeviceError(f"VLAUNCH_CPU_SLABS must be auto, memfd or file, not {value!r}")
    return value


@functools.cache
def chosen() -> str:
    """The backing this process gives its CPU slabs (probed once when auto)."""
    want = requested()
    if want != "auto":
        return want
    if gets_huge_pages("memfd", new_memfd):
        backing, pages = "memfd", "2 MiB pages"
    elif gets_huge_pages("file", lambda n: new_file(n, slab_dir())):
        backing, pages = "file", f"2 MiB folios in {slab_dir()}; memfds get 4 KiB pages here"
    else:
        backing, pages = "memfd", "4 KiB pages: no backing gets 2 MiB pages on this host"
    log.info("CPU slabs: %s (%s)", backing, pages)
    return backing


def gets_huge_pages(backing: str, make: Callable[[int], int]) -> bool:
    """Whether a slab of this backing, filled as the cache fills one, gets a 2 MiB folio and a
    2 MiB-aligned mapping (False where it cannot even be made).

    The counter is host-wide: huge pages that another process gains or frees in the same
    microseconds could mislead the probe, and a wrong answer costs handoff speed only."""
    try:
        fd = make(PROBE_BYTES)
    except OSError:
        return False
    try:
        before = huge_kb(backing)
        m = mmap.mmap(fd, PROBE_BYTES)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
            view = ctypes.c_char.from_buffer(m)
            aligned = ctypes.addressof(view) % HUGE == 0
            del view
            for offset in range(0, PROBE_BYTES, mmap.PAGESIZE):  # write faults, as a fill
                m[offset] = 1
            grew = huge_kb(backing) - before >= HUGE >> 10
        finally:
            m.close()
        return aligned and grew
    except OSError:
        return False
    finally:
        os.close(fd)


def huge_kb(backing: str) -> int:
    """kB of this backing's memory in 2 MiB folios, host-wide (/proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(COUNTER[backing]):
            return int(line.split()[1])
    return 0
