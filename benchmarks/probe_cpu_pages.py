"""Probe: which CPU slab backing maps fastest in a second process, every page touched.

The CPU share handoff is bounded by what it costs another process to map the slab and fault
every page in. That depends on the backing (memfd, a file on a disk filesystem), on the page
sizes the kernel gave it (4 KiB shmem pages, large page-cache folios, 2 MiB huge pages) and on
whether the reader's mapping is 2 MiB aligned (only then can a 2 MiB folio be mapped by one
PMD). This script fills each candidate the way the cache fills a slab (preadv from a file into
its own mapping), passes the fd to a long-lived second process over a Unix socket, and prints
the median of "map + touch every page + unmap" there, against safetensors' load_file of a file
of the same size (page cache warm) in that same process.

    python benchmarks/probe_cpu_pages.py [--size-mb 256] [--repeats 5] [--dir /var/tmp]

The product no longer offers file-backed slabs (a file cannot be sealed against its owner's
writes: cache/store/cpubacking.py); the probe stays as the record of that measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HUGE = 2 << 20
MFD_HUGETLB = 0x0004

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value


def map_fd(fd: int, size: int, *, aligned: bool, advise: bool) -> int:
    """mmap(fd) read-only, shared; at a 2 MiB-aligned address if asked; returns the address."""
    prot, flags = mmap.PROT_READ, mmap.MAP_SHARED
    hint = None
    if aligned:  # reserve size + 2 MiB, then place the mapping on the first aligned address
        res = _libc.mmap(None, size + HUGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        start = (res + HUGE - 1) & ~(HUGE - 1)
        hint = start
        flags |= 0x10  # MAP_FIXED over our own reservation
    addr = _libc.mmap(hint, size, prot, flags, fd, 0)
    if addr == MAP_FAILED:
        raise OSError(ctypes.get_errno(), "mmap")
    if aligned:
        if start > res:
            _libc.munmap(res, start - res)
        tail = res + size + HUGE - (start + size)
        if tail:
            _libc.munmap(start + size, tail)
    if advise:
        _libc.madvise(addr, size, mmap.MADV_HUGEPAGE)
    return addr


def touch_addr(addr: int, size: int) -> int:
    """Read one byte of every 4 KiB page and sum them (numpy: one thread, no pool to wake)."""
    import numpy as np

    buf = (ctypes.c_uint8 * size).from_address(addr)
    return int(np.frombuffer(buf, dtype=np.uint8)[::4096].sum())


def pmd_mapped_kb(addr: int) -> int:
    """FilePmdMapped + ShmemPmdMapped of the mapping that starts at addr (from smaps)."""
    found, kb = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            found = int(head.split("-")[0], 16) == addr
        elif found and head in ("FilePmdMapped:", "ShmemPmdMapped:"):
            kb += int(line.split()[1])
    return kb


def child(sock_fd: int) -> None:
    """The second process: map each fd it is sent, touch every page, report."""
    import torch
    from safetensors.torch import load_file

    sock = socket.socket(fileno=sock_fd)
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1024, 1)
        if not msg:
            return
        words = msg.decode().split()
        if words[0] == "st":
            t = time.perf_counter()
            tensors = load_file(words[1])
            for v in tensors.values():
                v.reshape(-1).view(torch.uint8).numpy()[::4096].sum()
            ms = (time.perf_counter() - t) * 1e3
            del tensors
            sock.sendall(f"{ms:.3f} 0 0".encode())
            continue
        size, aligned, advise = int(words[1]), words[2] == "1", words[3] == "1"
        t = time.perf_counter()
        addr = map_fd(fds[0], size, aligned=aligned, advise=advise)
        touch_addr(addr, size)
        ms = (time.perf_counter() - t) * 1e3
        pmd = pmd_mapped_kb(addr)
        _libc.munmap(addr, size)
        os.close(fds[0])
        sock.sendall(f"{ms:.3f} {addr % HUGE} {pmd}".encode())


def fill(fd: int, size: int, src: Path, *, advise: bool) -> None:
    """Fill the backing the way the cache does: preadv from a file into a shared mapping."""
    m = mmap.mmap(fd, size)
    if advise:
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(m)
    with open(src, "rb") as f:
        got = 0
        while got < size:
            got += os.preadv(f.fileno(), [view[got:got + (64 << 20)]], got)
    view.release()
    m.close()


def memfd(size: int, src: Path, *, flags: int = 0, advise: bool) -> int:
    """A memfd of `size`, filled."""
    fd = os.memfd_create("probe", os.MFD_CLOEXEC | flags)
    os.ftruncate(fd, size)
    fill(fd, size, src, advise=advise)
    return fd


def tmpfile(size: int, src: Path, directory: str, *, advise: bool, sync: bool = False) -> int:
    """An O_TMPFILE on `directory`, space reserved, filled; synced to disk if asked."""
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.posix_fallocate(fd, 0, size)
    fill(fd, size, src, advise=advise)
    if sync:
        os.fsync(fd)
    return fd


def file_folios_kb() -> int:
    """FileHugePages + ShmemHugePages from /proc/meminfo (memory in PMD-sized folios)."""
    kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(("FileHugePages:", "ShmemHugePages:")):
            kb += int(line.split()[1])
    return kb


def main() -> None:
    """Build every candidate, time it in the second process, print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp", help="disk directory for the O_TMPFILE cases")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    size = args.size_mb << 20
    import torch
    from safetensors.torch import save_file

    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()])
    theirs.close()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src.bin"
        src.write_bytes(os.urandom(size))
        st = Path(tmp) / "m.safetensors"
        n = max(1, args.size_mb // 8)
        save_file({f"w{i}": torch.randint(0, 255, (8 << 20,), dtype=torch.uint8)
                   for i in range(n)}, str(st))

        def run(msg: str, fd: int | None) -> tuple[float, int, int]:
            results = []
            for _ in range(args.repeats + 1):  # the first is a warm-up
                fds = [] if fd is None else [os.dup(fd)]
                socket.send_fds(ours, [msg.encode()], fds)
                for f in fds:
                    os.close(f)
                ms, misalign, pmd = ours.recv(64).decode().split()
                results.append((float(ms), int(misalign), int(pmd)))
            med = statistics.median(r[0] for r in results[1:])
            return med, results[-1][1], results[-1][2]

        st_ms = run(f"st {st}", None)[0]
        cases = [
            ("memfd, 4 KiB pages", lambda: memfd(size, src, advise=False), False, False),
            ("memfd + MADV_HUGEPAGE", lambda: memfd(size, src, advise=True), False, True),
            ("memfd + MADV_HUGEPAGE, reader aligned", lambda: memfd(size, src, advise=True),
             True, True),
            ("memfd MFD_HUGETLB", lambda: memfd(size, src, flags=MFD_HUGETLB, advise=False),
             False, False),
            (f"O_TMPFILE on {args.dir}", lambda: tmpfile(size, src, args.dir, advise=False),
             False, False),
            (f"O_TMPFILE on {args.dir}, reader aligned",
             lambda: tmpfile(size, src, args.dir, advise=False), True, False),
            ("O_TMPFILE + MADV_HUGEPAGE fill, reader aligned",
             lambda: tmpfile(size, src, args.dir, advise=True), True, False),
            ("same, after fsync",
             lambda: tmpfile(size, src, args.dir, advise=True, sync=True), True, False),
        ]
        for label, make, aligned, advise in cases:
            before = file_folios_kb()
            t = time.perf_counter()
            try:
                fd = make()
            except OSError as e:
                rows.append((label, f"fails: {e.strerror}", "", "", ""))
                continue
            fill_ms = (time.perf_counter() - t) * 1e3
            huge = file_folios_kb() - before
            ms, misalign, pmd = run(f"map {size} {int(aligned)} {int(advise)}", fd)
            os.close(fd)
            rows.append((label, f"{fill_ms:.0f}", f"{huge >> 10}", f"{pmd >> 10}",
                         f"{ms:.2f}", f"{st_ms / ms:.2f}x", "yes" if misalign == 0 else "no"))
    ours.close()
    proc.wait()
    print(f"\n{args.size_mb} MiB, median of {args.repeats}, second process; baseline: "
          f"safetensors load_file + touch, page cache warm: {st_ms:.2f} ms")
    head = ("backing", "fill ms", "huge MiB", "PMD MiB", "map+touch ms", "vs st", "aligned")
    print(f"{head[0]:<46} " + " ".join(f"{h:>12}" for h in head[1:]))
    for r in rows:
        print(f"{r[0]:<46} " + " ".join(f"{c:>12}" for c in r[1:]))


if __name__ == "__main__":
    main()
