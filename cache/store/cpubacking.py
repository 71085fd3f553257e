"""Where a CPU slab's memory lives: a sealed memfd, with 2 MiB pages where the host allows them.

A memfd is the only backing: it can be sealed, so that once the rank has filled it no other
process can write to it, through any path (a second mapping, `write()`, `fallocate`, a reopen
through `/proc/<pid>/fd/N`), and share mode's read-only promise holds on every host. (A file
on a disk filesystem got 2 MiB page-cache folios on hosts whose shmem huge-page policy is
`never`, but it cannot be sealed: its owner, or root, can always reopen it for writing.)

A CPU share handoff costs what the engine pays to fault the slab's pages into its mapping, so
the page size decides its speed. A memfd gets 2 MiB pages through `MADV_HUGEPAGE` only where
the host's shmem THP policy allows it (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`:
`advise`, `always`, `within_size`); many hosts say `never`, and only root can change that.
`VLAUNCH_CPU_SLAB_PAGES=auto` (the default) asks for them; `4k` never does (the slab then
behaves as on a `never` host wherever it runs). A 4 MiB probe, once per process, says which
page size the slabs get; the rank reports it (`page_size()`, its status and log).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
from pathlib import Path

from vlaunch.cache.contract import settings

log = logging.getLogger(__name__)

HUGE = 2 << 20
PROBE_BYTES = 2 * HUGE  # holds one aligned 2 MiB folio wherever the mapping starts
_COUNTER = "ShmemHugePages:"  # /proc/meminfo, kB


def new_memfd(size: int) -> int:
    """A memfd of `size` bytes that allows sealing."""
    fd = os.memfd_create("vlaunch-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


def requested_pages() -> str:
    """VLAUNCH_CPU_SLAB_PAGES: auto (ask for 2 MiB pages; the default) or 4k (never ask)."""
    return str(settings.get("VLAUNCH_CPU_SLAB_PAGES"))


def check_environment() -> None:
    """Refuse the file backing that earlier versions offered, with the reason and the fix."""
    settings.get("VLAUNCH_CPU_SLABS")


def advise_huge() -> bool:
    """Whether slabs ask for 2 MiB pages (`MADV_HUGEPAGE`) when they are filled."""
    return requested_pages() == "auto"


@functools.cache
def page_size() -> int:
    """The page size this process's CPU slabs get: 2 MiB or 4 KiB (probed once)."""
    check_environment()
    huge = advise_huge() and gets_huge_pages()
    if advise_huge():
        why = "" if huge else ": the host's shmem huge-page policy gives 4 KiB pages"
    else:
        why = ": VLAUNCH_CPU_SLAB_PAGES=4k"
    log.info("CPU slabs: sealed memfds, %s pages%s", "2 MiB" if huge else "4 KiB", why)
    return HUGE if huge else mmap.PAGESIZE


def page_label() -> str:
    """`page_size()` as the status shows it: "2M" or "4k"."""
    return "2M" if page_size() == HUGE else f"{mmap.PAGESIZE >> 10}k"


def gets_huge_pages() -> bool:
    """Whether a memfd filled as the cache fills one gets a 2 MiB folio (False where it cannot
    even be made).

    The counter is host-wide: huge pages that another process gains or frees in the same
    microseconds could mislead the probe, and a wrong answer costs handoff speed only."""
    try:
        fd = new_memfd(PROBE_BYTES)
    except OSError:
        return False
    try:
        before = huge_kb()
        m = mmap.mmap(fd, PROBE_BYTES)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
            for offset in range(0, PROBE_BYTES, mmap.PAGESIZE):  # write faults, as a fill
                m[offset] = 1
            return huge_kb() - before >= HUGE >> 10
        finally:
            m.close()
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def huge_kb() -> int:
    """kB of shmem in 2 MiB folios, host-wide (/proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(_COUNTER):
            return int(line.split()[1])
    return 0
