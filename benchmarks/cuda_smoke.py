"""Smoke test and timing of the CUDA slab backend on one GPU; one PASS/FAIL line per step.

    python benchmarks/cuda_smoke.py [--device cuda:0] [--big-gib 16] [--repeats 5]

Every step runs even when an earlier one failed; the exit status is the number of failures.
Needs torch with CUDA and numpy. Runs from a checkout: when `vlaunch` is not
installed it is made importable through a temporary `vlaunch/cache` link to the repo's `cache/`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
FAILURES: list[str] = []


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Run one step, print PASS or FAIL with the traceback, and keep going."""
    t0 = time.perf_counter()
    try:
        yield
    except Exception:
        FAILURES.append(name)
        print(f"FAIL {name} ({time.perf_counter() - t0:.2f} s)")
        print(textwrap.indent(traceback.format_exc(), "    "), flush=True)
    else:
        print(f"PASS {name} ({time.perf_counter() - t0:.2f} s)", flush=True)


def ensure_importable() -> None:
    """Make `vlaunch.cache` importable here and in children, from the checkout if need be."""
    try:
        import vlaunch.cache.store.slabs_cuda  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="vlaunch-shim-"))
        (shim / "vlaunch").mkdir()
        (shim / "vlaunch" / "cache").symlink_to(Path(__file__).resolve().parents[1] / "cache")
        sys.path.insert(0, str(shim))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)


# Child: receive (fd, "size repeats write"), import it `repeats` times and time each
# import+map and unmap, print the sha256 of the bytes and the timings; with write=1, try a
# write through the read-only mapping and report whether it faulted.
IMPORTER = textwrap.dedent("""
    import hashlib, json, os, socket, sys, time
    t0 = time.perf_counter()
    import torch
    from vlaunch.cache.store.slabs import get_backend
    b = get_backend(sys.argv[2])
    torch.cuda.synchronize()
    init_s = time.perf_counter() - t0
    sock = socket.socket(fileno=int(sys.argv[1]))
    msg, fds, _, _ = socket.recv_fds(sock, 256, 1)
    size, repeats, write = (int(x) for x in msg.split())
    imports, unmaps = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t = b.import_fd(fds[0], size, readonly=True)
        imports.append(time.perf_counter() - t0)
        if len(imports) < repeats:
            t0 = time.perf_counter()
            del t
            unmaps.append(time.perf_counter() - t0)
    os.close(fds[0])
    if size <= 256 << 20:
        digest = hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
    else:
        ends = torch.cat([t[: 64 << 20], t[-(64 << 20):]])
        digest = hashlib.sha256(ends.cpu().numpy().tobytes()).hexdigest()
    t0 = time.perf_counter()
    copy = t.clone()
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    del copy
    fault = None
    if write:
        try:
            t[:1 << 20].fill_(1)
            torch.cuda.synchronize()
            fault = "no fault: the write went through"
        except Exception as e:
            fault = "faulted: " + str(e).splitlines()[0]
    print(json.dumps({"digest": digest, "imports": imports, "unmaps": unmaps,
                      "init_s": init_s, "copy_s": copy_s, "fault": fault}), flush=True)
    os._exit(0)
""")

# A child that allocates, fills and exports a slab, then waits (benchmarks/slab_exporter.py).
EXPORTER = (Path(__file__).resolve().parents[1] / "benchmarks"
            / "slab_exporter.py").read_text()


def fill(t, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Fill a uint8 CUDA tensor with seeded random bytes, in 1 GiB pieces."""
    import torch

    g = torch.Generator(t.device).manual_seed(seed)
    for start in range(0, t.numel(), GiB):
        piece = t[start:start + GiB]
        piece.copy_(torch.randint(0, 256, piece.shape, dtype=torch.uint8, generator=g,
                                  device=t.device))


def sha256(t) -> str:  # type: ignore[no-untyped-def]
    """sha256 of a tensor's bytes."""
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def run_importer(device: str, fd: int, size: int, repeats: int, write: bool) -> dict:
    """Send `fd` to an importing child over a Unix socket; return its JSON report."""
    import json

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        proc = subprocess.Popen([sys.executable, "-c", IMPORTER, str(theirs.fileno()), device],
                                pass_fds=[theirs.fileno()], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        socket.send_fds(ours, [f"{size} {repeats} {int(write)}".encode()], [fd])
        out, err = proc.communicate(timeout=300)
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"importer exited {proc.returncode}:\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def ms(seconds: list[float]) -> str:
    """Median and range of durations, in milliseconds."""
    if not seconds:
        return "n/a"
    return (f"median {statistics.median(seconds) * 1e3:.3f} ms "
            f"(min {min(seconds) * 1e3:.3f}, max {max(seconds) * 1e3:.3f}, n={len(seconds)})")


def main() -> int:
    """Run every step."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--big-gib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = args.device
    ensure_importable()
    small = 64 * MiB
    print(f"python {platform.python_version()} on {platform.platform()}")

    with step("import torch and the backend module (driver calls through ctypes)"):
        import torch

        from vlaunch.cache.contract.errors import CacheBrokenError
        from vlaunch.cache.store import slabs_cuda
        from vlaunch.cache.store.slabs import get_backend

        print(f"    torch {torch.__version__} (cuda {torch.version.cuda}), "
              f"gpus {torch.cuda.device_count()}")

    backend = None
    with step(f"backend {dev}: device_info, uuid_to_index"):
        backend = get_backend(dev)
        info = backend.device_info()
        print(f"    {info}; granularity {backend.granularity}, min {backend.min_granularity}")
        print(f"    uuid_to_index {slabs_cuda.uuid_to_index()}")
        assert all(info.values()) and info["device_uuid"].startswith("GPU-"), info
    if backend is None:
        print("FAIL no backend: later steps cannot run")
        return len(FAILURES) + 1

    slab = None
    with step("allocate 64 MiB, fill through tensor(), export two fds"):
        slab = backend.allocate(small)
        t = slab.tensor()
        assert slab.tensor() is t and t.shape == (small,) and t.device == torch.device(dev)
        fill(t, 1)
        fd1, fd2 = slab.export_fd(), slab.export_fd()
        assert fd1 != fd2
        os.close(fd1)
        os.close(fd2)

    with step("import in the same process: same bytes, writes show through"):
        fd = slab.export_fd()
        view = backend.import_fd(fd, small, readonly=False)
        os.close(fd)
        assert view.data_ptr() != slab.tensor().data_ptr()
        assert torch.equal(view, slab.tensor())
        view[:4096].fill_(0x5A)
        torch.cuda.synchronize()
        assert bool((slab.tensor()[:4096] == 0x5A).all())
        del view

    with step("import read-only in another process (fd over a Unix socket): same sha256"):
        fd = slab.export_fd()
        try:
            rep = run_importer(dev, fd, small, 1, write=False)
        finally:
            os.close(fd)
        assert rep["digest"] == sha256(slab.tensor()), rep
        print(f"    child torch+CUDA init {rep['init_s']:.2f} s, import+map {ms(rep['imports'])}")

    with step("read-only import refuses writes (child process)"):
        fd = slab.export_fd()
        try:
            rep = run_importer(dev, fd, small, 1, write=True)
        finally:
            os.close(fd)
        print(f"    write through PROT_READ mapping: {rep['fault']}")
        assert rep["fault"].startswith("faulted"), rep["fault"]

    with step("exporter releases its slab and is SIGKILLed; the fd still maps intact data"):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            proc = subprocess.Popen(
                [sys.executable, "-c", EXPORTER, str(theirs.fileno()), dev, str(small)],
                pass_fds=[theirs.fileno()], stderr=subprocess.PIPE, text=True)
            try:
                ours.settimeout(120)
                msg, fds, _, _ = socket.recv_fds(ours, 256, 1)
            finally:
                proc.send_signal(signal.SIGKILL)
                _, err = proc.communicate(timeout=30)
        assert fds, f"no fd from exporter: {err}"
        size, digest = msg.decode().split()
        t = backend.import_fd(fds[0], int(size), readonly=True)
        os.close(fds[0])
        assert proc.returncode == -signal.SIGKILL, proc.returncode
        assert sha256(t) == digest
        del t

    with step("mapping lives exactly as long as its last view"):
        fd = slab.export_fd()
        t = backend.import_fd(fd, small, readonly=True)
        os.close(fd)
        owner = slabs_cuda._mappings[t.data_ptr()]
        ref, fin = weakref.ref(owner), owner.finalizer
        del owner
        tail = t[small // 2:]
        expected = int(slab.tensor()[small // 2:].sum())
        del t
        gc.collect()
        assert ref() is not None and fin.alive
        assert int(tail.sum()) == expected
        del tail
        gc.collect()
        assert ref() is None and not fin.alive

    with step("import of an fd announced larger than it is -> CacheBrokenError"):
        fd = slab.export_fd()
        try:
            backend.import_fd(fd, small + backend.granularity, readonly=True)
            raise AssertionError("import of a too-small slab succeeded")
        except CacheBrokenError as e:
            print(f"    {e}")
        finally:
            os.close(fd)

    with step("import of a memfd (not CUDA) -> CacheBrokenError"):
        fd = os.memfd_create("not-cuda")
        os.ftruncate(fd, small)
        try:
            backend.import_fd(fd, small, readonly=True)
            raise AssertionError("import of a memfd succeeded")
        except CacheBrokenError as e:
            print(f"    {e}")
        finally:
            os.close(fd)

    with step("release is idempotent"):
        slab.release()
        slab.release()

    big = args.big_gib * GiB
    with step(f"{args.big_gib} GiB slab: allocate, fill, import+map in another process"):
        t0 = time.perf_counter()
        bslab = backend.allocate(big)
        alloc_s = time.perf_counter() - t0
        bt = bslab.tensor()
        fill(bt, 3)
        torch.cuda.synchronize()
        ends = sha256(torch.cat([bt[:64 * MiB], bt[-64 * MiB:]]))
        del bt
        fd = bslab.export_fd()
        try:
            rep = run_importer(dev, fd, big, args.repeats, write=False)
            local, local_unmap = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                m = backend.import_fd(fd, big, readonly=True)
                local.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                del m
                local_unmap.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
            bslab.release()
        assert rep["digest"] == ends, "child read different bytes"
        print(f"    allocate+map {alloc_s * 1e3:.1f} ms")
        print(f"    other process: import+map {ms(rep['imports'])}; unmap {ms(rep['unmaps'])}")
        print(f"    other process: clone {args.big_gib} GiB after mapping "
              f"{rep['copy_s'] * 1e3:.1f} ms")
        print(f"    same process:  import+map {ms(local)}; unmap {ms(local_unmap)}")

    print(f"{'PASS' if not FAILURES else 'FAIL'}: {len(FAILURES)} step(s) failed"
          + (f": {', '.join(FAILURES)}" if FAILURES else ""))
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
