"""Slabs: few large allocations that hold a rank's tensors, exported as file descriptors.

One interface, two backends. The CPU backend lives here (mmap of a sealed memfd;
`cpubacking` says which page size it gets); the CUDA backend (VMM allocations with the POSIX-fd
handle type) lives in `slabs_cuda`. Either way a slab is a file descriptor: it crosses a Unix
socket with SCM_RIGHTS, and an open fd or a live mapping keeps the memory alive after the
process that allocated it has died.

The rank handles a slab's bytes as a `SlabBytes`: a uint8 numpy array over the mapping on the
CPU backend (a CPU rank never imports torch: it moves bytes, and numpy's strided copies do
that), a uint8 torch tensor on a CUDA device. Engines get torch tensors either way
(`import_fd`, `Slab.tensor`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import warnings
from typing import TYPE_CHECKING, Any, Protocol

from vlaunch.cache.contract.errors import CacheBrokenError, DeviceError

if TYPE_CHECKING:
    import numpy as np
    import torch

SlabBytes = Any
"""A slab's bytes as the rank handles them: np.ndarray (CPU) or torch.Tensor (CUDA), uint8."""

# F_SEAL_FUTURE_WRITE (Linux 5.1): no new writable mapping, while the cache's own stays.
F_SEAL_FUTURE_WRITE = 0x0010


class Slab(Protocol):
    """An allocation owned by this process."""

    size: int

    def export_fd(self) -> int:
        """Return a new file descriptor for the slab; the caller closes it."""

    def buffer(self) -> SlabBytes:
        """The slab's bytes for the rank: a uint8 array (CPU) or tensor (CUDA), the same one
        each call."""

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole slab (the mapping lives as long as it does)."""

    def seal(self) -> None:
        """Make later imports read-only where the backend can enforce it."""

    def release(self) -> None:
        """Drop this process's handle; the memory goes when the last fd and mapping do."""


class Backend(Protocol):
    """Allocates slabs and maps slabs that other processes exported."""

    name: str
    device: str
    alignment: int

    def allocate(self, size: int) -> Slab:
        """Allocate a slab of at least `size` bytes."""

    def import_fd(self, fd: int, size: int, *, readonly: bool) -> torch.Tensor:
        """Map an exported slab; returns a uint8 tensor that owns the mapping."""

    def import_pieces(self, fds: list[int], pieces: tuple[int, ...], size: int, *,
                      readonly: bool) -> torch.Tensor:
        """Map a slab made of several exported allocations (sizes `pieces`) into one range."""

    def import_handed_over(self, fd: int, size: int) -> torch.Tensor:
        """Map, writable and as our own, a slab its rank handed over (copy-release)."""

    def map_fd(self, fd: int, size: int, *, readonly: bool) -> SlabBytes:
        """Map an exported slab for the rank (as `Slab.buffer`); the fd stays open."""


class CpuSlab:
    """A sealed memfd with a shared mapping: the CPU backend's slab (`cpubacking` says why a
    memfd, and which page size it gets)."""

    def __init__(self, size: int) -> None:
        from vlaunch.cache.store import cpubacking

        self.size = size
        self.page_size = cpubacking.page_size()  # probed once per process; logged there
        self._fd = cpubacking.new_memfd(max(size, 1))
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self._map: mmap.mmap | None = mmap.mmap(self._fd, max(size, 1))
        # 2 MiB pages for what the fill faults in: a client then maps 2 MiB per page fault
        # instead of 4 KiB. This takes effect only where the host's shmem THP policy allows it
        # (cpubacking); a client maps them populated (CpuBackend.import_fd).
        if cpubacking.advise_huge():
            with contextlib.suppress(AttributeError, OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.sealed = False
        self._array: np.ndarray | None = None
        self._tensor: torch.Tensor | None = None

    def export_fd(self) -> int:
        """Return a new descriptor for the slab."""
        return os.dup(self._fd)

    def buffer(self) -> np.ndarray:
        """A writable uint8 numpy array over the mapping (no torch)."""
        if self._array is None:
            self._array = _array_over(self._map, self.size)
        return self._array

    def tensor(self) -> torch.Tensor:
        """A writable uint8 tensor over the mapping (imports torch)."""
        if self._tensor is None:
            self._tensor = _tensor_over(self._map, self.size)
        return self._tensor

    def seal(self) -> None:
        """Forbid every later write but the cache's own mapping's: no writable mapping, no
        write(), no hole punched, through any descriptor (a reopen through /proc included)."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
            self.sealed = True
        except OSError as exc:  # kernels before 5.1 lack FUTURE_WRITE (docs/requirements.md)
            _warn_unsealed(exc)

    def release(self) -> None:
        """Close the descriptor and drop the cache's own mapping reference."""
        self._array = self._tensor = None
        self._map = None
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1


_unsealed_said: list[bool] = []


def _warn_unsealed(exc: OSError) -> None:
    """Say once that this kernel cannot seal slabs against importers' writes."""
    if _unsealed_said:
        return
    _unsealed_said.append(True)
    logging.getLogger(__name__).warning(
        "cannot seal CPU slabs against writes (%s): this kernel lacks F_SEAL_FUTURE_WRITE "
        "(Linux 5.1+), so a share-mode engine that maps a slab writable itself could change "
        "the cache's weights", exc.strerror)


class CpuBackend:
    """Sealed memfd + mmap: the same protocol as CUDA, on any Linux machine."""

    name = "cpu"
    device = "cpu"
    alignment = 256

    def allocate(self, size: int) -> CpuSlab:
        """Allocate a CPU slab (a size-sealed memfd)."""
        return CpuSlab(size)

    def import_fd(self, fd: int, size: int, *, readonly: bool) -> torch.Tensor:
        """Map a slab another process sent, populated; refuses one smaller than announced.

        Populated: the page tables are filled in the mmap call (MAP_POPULATE) rather than by
        one fault per page as the engine first reads each. With 2 MiB pages (a memfd under
        `MADV_HUGEPAGE`) the map costs a little more and the first read of every page saves
        more than that; with 4 KiB pages the two cost the same (benchmarks/results/cpu.md).
        An engine reads every weight on its first step.
        """
        return _tensor_over(_mapping(fd, size, readonly, populate=True), size)

    def import_handed_over(self, fd: int, size: int) -> torch.Tensor:
        """Map a slab its rank handed over (copy-release) writable: privately, copy on write,
        since the slab is sealed against shared writes;
        the engine's writes stay its own, and nothing is copied until it writes."""
        return _tensor_over(_mapping(fd, size, False, populate=True, private=True), size)

    def import_pieces(self, fds: list[int], pieces: tuple[int, ...], size: int, *,
                      readonly: bool) -> torch.Tensor:
        """Refused: a CPU rank sends each slab as one fd (only a GPU rank makes copies)."""
        raise CacheBrokenError(f"cache sent a CPU slab as {len(fds)} pieces; a CPU rank "
                               "sends one fd per slab (is the cache of another version?)")

    def map_fd(self, fd: int, size: int, *, readonly: bool) -> np.ndarray:
        """The same as a uint8 numpy array (the rank's own use: no torch)."""
        return _array_over(_mapping(fd, size, readonly), size)

    def device_info(self) -> dict[str, str]:
        """Fingerprint fields of the device."""
        return {"device_uuid": "cpu", "compute_capability": "", "driver": ""}


def _mapping(fd: int, size: int, readonly: bool, *, populate: bool = False,
             private: bool = False) -> mmap.mmap:
    """Map a slab fd (`populate`: page tables filled now; `private`: copy on write); refuses
    one smaller than announced."""
    actual = os.fstat(fd).st_size
    if actual < size:
        raise CacheBrokenError(f"slab fd holds {actual} bytes, manifest says {size}")
    prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
    flags = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED) | \
        (_MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, max(size, 1), flags=flags, prot=prot)


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only, as memfd is


def empty_for_copy(size: int, device: str) -> torch.Tensor:
    """Uninitialised memory of our own for the copy of a slab (copy modes, engine side).

    On CPU its pages are asked to be 2 MiB (`MADV_HUGEPAGE`) before the copy faults them in:
    with 4 KiB pages a copy-mode load spent half its time in page faults
    (benchmarks/results/figures.md).
    Where the host's THP policy is `never` the advice does nothing; the memory is torch's
    own either way."""
    import torch

    out = torch.empty(size, dtype=torch.uint8, device=device)
    if out.device.type == "cpu":
        _advise_huge_pages(out.data_ptr(), size)
    return out


_HUGE = 2 << 20
_libc: Any = None


def _advise_huge_pages(address: int, size: int) -> None:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside [address, address + size)."""
    global _libc
    start, end = -(-address // _HUGE) * _HUGE, (address + size) // _HUGE * _HUGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if end <= start or advice is None:
        return
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.madvise(start, end - start, advice)  # a refusal leaves 4 KiB pages: no harm


def _array_over(buf: mmap.mmap | None, size: int) -> np.ndarray:
    """A uint8 numpy array over a mapping (read-only where the mapping is); it holds the
    mapping alive."""
    import numpy as np

    if buf is None:
        raise CacheBrokenError("slab was released")
    return np.frombuffer(buf, dtype=np.uint8, count=max(size, 1))[:size]


def on_device(b: SlabBytes) -> bool:
    """Whether slab bytes live on a CUDA device (else in host memory)."""
    return bool(getattr(b, "is_cuda", False))


def host_array(b: SlabBytes) -> np.ndarray:
    """Host slab bytes as a numpy array (a CPU tensor, the disk fallback's, is wrapped)."""
    return b.numpy() if hasattr(b, "numpy") else b


def _tensor_over(buf: mmap.mmap | None, size: int) -> torch.Tensor:
    """A uint8 tensor over a mapping; the tensor holds the mapping alive."""
    import torch

    if buf is None:
        raise CacheBrokenError("slab was released")
    with warnings.catch_warnings():  # read-only share mappings are intended
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8, count=max(size, 1))[:size]


_BACKENDS: dict[str, Backend] = {}


def backend_for(device: str) -> Backend:
    """The slab backend of `device`, made once per process and reused by every handoff."""
    backend = _BACKENDS.get(device)
    if backend is None:
        backend = _BACKENDS[device] = get_backend(device)
    return backend


def get_backend(device: str) -> Backend:
    """A new backend for `cpu`, `cuda` or `cuda:N` (`backend_for`: the process's own)."""
    if device == "cpu":
        return CpuBackend()
    if device == "cuda" or device.startswith("cuda:"):
        from vlaunch.cache.store.slabs_cuda import CudaBackend

        return CudaBackend(cuda_index(device))
    raise DeviceError(f"unknown device {device!r}; use cpu, cuda, cuda:N or cuda:GPU-<uuid>")


def cuda_index(device: str) -> int:
    """The local torch index of cuda, cuda:N or cuda:GPU-<uuid> (GPUs are paired by UUID)."""
    spec = device.partition(":")[2] or "0"
    if spec.isdigit():
        return int(spec)
    if spec.startswith("GPU-"):
        from vlaunch.cache.store.slabs_cuda import uuid_to_index

        index = uuid_to_index().get(spec)
        if index is None:
            raise DeviceError(f"GPU {spec} is not visible to this process; make it visible "
                              "(CUDA_VISIBLE_DEVICES) or run on the host that has it")
        return index
    raise DeviceError(f"unknown device {device!r}; use cpu, cuda, cuda:N or cuda:GPU-<uuid>")
