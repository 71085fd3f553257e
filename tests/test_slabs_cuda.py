"""CUDA slab backend: VMM slabs exported as fds, imported here and in other processes."""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vlaunch.cache.contract.errors import CacheBrokenError, DeviceError  # noqa: E402
from vlaunch.cache.store import cudadrv, slabs_cuda  # noqa: E402
from vlaunch.cache.store.slabs import get_backend  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MiB = 1 << 20
SIZE = 64 * MiB
DEVICE = "cuda:0"

# A child that receives one fd and a size over a Unix socket, maps it read-only and prints
# the sha256 of its bytes.
IMPORTER = textwrap.dedent("""
    import hashlib, os, socket, sys
    from vlaunch.cache.store.slabs import get_backend
    sock = socket.socket(fileno=int(sys.argv[1]))
    msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
    t = get_backend(sys.argv[2]).import_fd(fds[0], int(msg), readonly=True)
    os.close(fds[0])
    print(hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest(), flush=True)
""")

# A child that allocates, fills and exports a slab, then waits (benchmarks/slab_exporter.py).
EXPORTER = (Path(__file__).resolve().parents[1] / "benchmarks"
            / "slab_exporter.py").read_text()


def _fill(t: torch.Tensor, seed: int) -> None:
    """Fill a uint8 CUDA tensor with seeded random bytes."""
    g = torch.Generator(t.device).manual_seed(seed)
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g, device=t.device))


def _sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes."""
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def _child(code: str, sock: socket.socket, *args: str) -> subprocess.Popen[str]:
    """Start `python -c code` with `sock` inherited; argv is (sock fd, device, *args)."""
    return subprocess.Popen([sys.executable, "-c", code, str(sock.fileno()), DEVICE, *args],
                            pass_fds=[sock.fileno()], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def backend() -> slabs_cuda.CudaBackend:
    """The backend of device 0."""
    b = get_backend(DEVICE)
    assert isinstance(b, slabs_cuda.CudaBackend)
    return b


@pytest.mark.parametrize("size", [SIZE, SIZE + 12345, 1 << 30], ids=["64MiB", "odd", "1GiB"])
def test_roundtrip_same_process(backend: slabs_cuda.CudaBackend, size: int) -> None:
    slab = backend.allocate(size)
    t = slab.tensor()
    assert (t.dtype, t.shape, t.device) == (torch.uint8, (size,), torch.device(DEVICE))
    assert slab.tensor() is t
    assert t.data_ptr() % backend.alignment == 0
    _fill(t, seed=1)
    fd = slab.export_fd()
    try:
        other = slab.export_fd()
        assert other != fd
        os.close(other)
        view = backend.import_fd(fd, size, readonly=False)
    finally:
        os.close(fd)  # the mapping, not the fd, keeps the memory from here on
    assert view.data_ptr() != t.data_ptr()
    assert view.shape == (size,)
    assert torch.equal(view, t)
    view[:4096].fill_(0xA5)  # same physical memory: writes through one show in the other
    torch.cuda.synchronize()
    assert bool((t[:4096] == 0xA5).all())
    del view
    slab.release()
    slab.release()
    with pytest.raises(CacheBrokenError):
        slab.export_fd()


def test_import_in_another_process(backend: slabs_cuda.CudaBackend) -> None:
    slab = backend.allocate(SIZE)
    _fill(slab.tensor(), seed=2)
    expected = _sha256(slab.tensor())
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        proc = _child(IMPORTER, theirs)
        fd = slab.export_fd()
        try:
            socket.send_fds(ours, [str(SIZE).encode()], [fd])
        finally:
            os.close(fd)
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert out.strip() == expected
    slab.release()


def test_memory_survives_exporter_sigkill(backend: slabs_cuda.CudaBackend) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        proc = _child(EXPORTER, theirs, str(SIZE))
        try:
            ours.settimeout(90)
            msg, fds, _, _ = socket.recv_fds(ours, 256, 1)
        finally:
            proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=30)
        assert fds, f"exporter sent no fd: {err}"
    assert proc.returncode == -signal.SIGKILL
    size, digest = msg.decode().split()
    try:
        t = backend.import_fd(fds[0], int(size), readonly=True)
    finally:
        os.close(fds[0])
    assert _sha256(t) == digest


def test_mapping_lives_exactly_as_long_as_its_tensors(backend: slabs_cuda.CudaBackend) -> None:
    slab = backend.allocate(SIZE)
    _fill(slab.tensor(), seed=3)
    tail_sum = int(slab.tensor()[SIZE // 2:].sum())
    fd = slab.export_fd()
    t = backend.import_fd(fd, SIZE, readonly=True)
    os.close(fd)
    slab.release()  # from here the import's mapping alone holds the memory
    ptr = t.data_ptr()
    owner = slabs_cuda._mappings[ptr]
    finalizer, ref = owner.finalizer, weakref.ref(owner)
    del owner
    tail = t[SIZE // 2:].view(torch.int16)
    del t
    gc.collect()
    assert ref() is not None and finalizer.alive, "a view is alive: the mapping must be too"
    assert int(tail.view(torch.uint8).sum()) == tail_sum
    del tail
    gc.collect()
    assert ref() is None and not finalizer.alive
    assert ptr not in slabs_cuda._mappings
    with pytest.raises(cudadrv.DriverError):  # the address range is unmapped and freed
        cudadrv.call("cuMemGetAddressRange_v2", ctypes.byref(ctypes.c_ulonglong()),
                     ctypes.byref(ctypes.c_size_t()), ptr)


def test_finaliser_on_a_thread_without_a_context(backend: slabs_cuda.CudaBackend,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    slab = backend.allocate(SIZE)
    fd = slab.export_fd()
    box = [backend.import_fd(fd, SIZE, readonly=True)]
    os.close(fd)
    slab.release()
    finalizer = slabs_cuda._mappings[box[0].data_ptr()].finalizer
    worker = threading.Thread(target=box.clear)  # drops the last tensor there
    worker.start()
    worker.join()
    assert not finalizer.alive
    assert "could not unmap" not in caplog.text


def test_allocation_too_large_is_a_device_error(backend: slabs_cuda.CudaBackend) -> None:
    with pytest.raises(DeviceError, match="cannot allocate"):
        backend.allocate(1 << 50)
    slab = backend.allocate(SIZE)  # the failure left the context usable
    slab.release()


def test_import_smaller_than_announced(backend: slabs_cuda.CudaBackend) -> None:
    slab = backend.allocate(SIZE)
    fd = slab.export_fd()
    try:
        with pytest.raises(CacheBrokenError, match="fewer than"):
            backend.import_fd(fd, SIZE + backend.granularity, readonly=True)
        assert torch.equal(backend.import_fd(fd, SIZE, readonly=True), slab.tensor())
    finally:
        os.close(fd)
        slab.release()


def test_a_slab_in_pieces_maps_as_one_range(backend: slabs_cuda.CudaBackend) -> None:
    """A rank's copy for an engine comes as several allocations per slab (rank/copies.py):
    mapped one after another they read as one slab, and a piece announced larger than its
    allocation is refused with nothing left mapped or reserved."""
    sizes = (SIZE, 2 * SIZE, SIZE)
    slabs = [backend.allocate(k) for k in sizes]
    for i, slab in enumerate(slabs):
        _fill(slab.tensor(), seed=10 + i)
    whole = torch.cat([slab.tensor() for slab in slabs])
    fds = [slab.export_fd() for slab in slabs]
    try:
        size = sum(sizes) - 12345  # the slab's bytes end inside the last piece
        before = set(slabs_cuda._mappings)
        with pytest.raises(CacheBrokenError, match="fewer than"):
            backend.import_pieces(fds, (SIZE, 2 * SIZE + backend.granularity, SIZE), size,
                                  readonly=True)
        assert set(slabs_cuda._mappings) == before
        view = backend.import_pieces(fds, sizes, size, readonly=False)
    finally:
        for fd in fds:
            os.close(fd)
    assert view.shape == (size,) and torch.equal(view, whole[:size])
    view[SIZE - 8:SIZE + 8].fill_(0x5A)  # across a seam: lands in both allocations
    torch.cuda.synchronize()
    assert bool((slabs[0].tensor()[-8:] == 0x5A).all())
    assert bool((slabs[1].tensor()[:8] == 0x5A).all())
    del view
    for slab in slabs:
        slab.release()


def test_import_of_a_non_cuda_fd(backend: slabs_cuda.CudaBackend) -> None:
    fd = os.memfd_create("not-cuda")
    try:
        os.ftruncate(fd, SIZE)
        with pytest.raises(CacheBrokenError):
            backend.import_fd(fd, SIZE, readonly=True)
    finally:
        os.close(fd)


def test_device_info_and_uuids(backend: slabs_cuda.CudaBackend) -> None:
    info = backend.device_info()
    assert set(info) >= {"device_uuid", "compute_capability", "driver", "cuda"}
    assert all(info.values()), info
    assert info["device_uuid"].startswith("GPU-") and len(info["device_uuid"]) == 40
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", info["driver"]), info["driver"]
    major, minor = torch.cuda.get_device_capability(0)
    assert info["compute_capability"] == f"{major}.{minor}"
    assert slabs_cuda.uuid_to_index()[info["device_uuid"]] == 0
    assert backend.granularity % backend.min_granularity == 0


def test_missing_device_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match="no CUDA device 99: torch sees"):
        get_backend("cuda:99")
