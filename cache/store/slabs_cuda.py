"""CUDA slabs: VMM allocations (cuMemCreate) exported and imported as POSIX file descriptors.

Driver calls go through `cudadrv` (ctypes on libcuda.so.1), in the primary context that torch
uses, so the tensors over our mappings are ordinary CUDA tensors to torch.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import weakref
from collections.abc import Iterator
from ctypes import byref, c_int, c_size_t, c_ulonglong, c_void_p
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.errors import CacheBrokenError, DeviceError
from vlaunch.cache.store import cudadrv as cu
from vlaunch.cache.store.cudadrv import DriverError

if TYPE_CHECKING:
    import torch

__all__ = ["CudaBackend", "CudaSlab", "DriverError", "uuid_to_index"]

log = logging.getLogger(__name__)

# cuMemMap's answers to a mapping longer than the imported allocation.
_TOO_SMALL = ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_SUPPORTED")
# ptr -> live mapping owner, weakly: what this process has mapped (tests and diagnostics).
_mappings: weakref.WeakValueDictionary[int, _Mapping] = weakref.WeakValueDictionary()


@contextlib.contextmanager
def _current(ctx: int) -> Iterator[None]:
    """Make `ctx` current on this thread for the block."""
    if cu.out("cuCtxGetCurrent", c_void_p) == ctx:
        yield
        return
    cu.call("cuCtxPushCurrent_v2", ctx)
    try:
        yield
    finally:
        cu.out("cuCtxPopCurrent_v2", c_void_p)


def _round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def _granularity(prop: cu.MemAllocationProp, which: int) -> int:
    """cuMemGetAllocationGranularity with the given CU_MEM_ALLOC_GRANULARITY_* flag."""
    return int(cu.out("cuMemGetAllocationGranularity", c_size_t, byref(prop), which))


def _unmap(ctx: int, ptr: int, length: int) -> None:
    """Finaliser of a mapping: wait for the device, then unmap and free the address range."""
    try:
        with _current(ctx):
            # torch frees from_blob memory without stream tracking: kernels queued on any stream
            # may still read this range, and unmapping under them is a fatal fault.
            cu.call("cuCtxSynchronize")
            cu.call("cuMemUnmap", ptr, length)
            cu.call("cuMemAddressFree", ptr, length)
    except DeviceError as e:  # a finaliser must not raise; the range is lost, not corrupted
        log.warning("could not unmap slab mapping at %#x (%d bytes): %s", ptr, length, e)


class _Mapping:
    """Owns one mapped address range; the tensors over it keep it, their last one unmaps it."""

    def __init__(self, ctx: int, ptr: int, length: int, size: int) -> None:
        self.ptr, self.length, self.size = ptr, length, size
        self.finalizer = weakref.finalize(self, _unmap, ctx, ptr, length)
        # At exit the process's address space goes with it; no driver calls during teardown.
        self.finalizer.atexit = False
        _mappings[ptr] = self

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The range as a 1-D uint8 CUDA array (torch.as_tensor keeps a reference to self)."""
        return {"version": 3, "shape": (self.size,), "typestr": "|u1",
                "data": (self.ptr, False), "strides": None, "stream": None}

    def tensor(self, device: str) -> torch.Tensor:
        """A uint8 tensor over the range that holds this owner alive."""
        import torch

        try:
            t = torch.as_tensor(self, device=device)
        except RuntimeError as e:
            if "Numpy is not available" in str(e):
                raise DeviceError("torch needs numpy to wrap CUDA memory; pip install numpy") from e
            raise
        if self.size and t.data_ptr() != self.ptr:  # as_tensor copies on a device mismatch
            raise DeviceError(f"tensor over slab mapping {self.ptr:#x} landed at "
                              f"{t.data_ptr():#x} on {t.device}, expected {device}")
        return t


class CudaSlab:
    """A VMM allocation owned by this process, mapped read-write on its device."""

    def __init__(self, backend: CudaBackend, handle: int, mapping: _Mapping) -> None:
        self.size = mapping.size
        self._backend = backend
        self._handle: int | None = handle
        self._mapping: _Mapping | None = mapping
        self._tensor: torch.Tensor | None = None

    def export_fd(self) -> int:
        """Return a new POSIX fd for the allocation; the caller closes it."""
        if self._handle is None:
            raise CacheBrokenError("slab was released")
        fd = c_int(-1)
        with _current(self._backend.ctx):
            cu.call("cuMemExportToShareableHandle", byref(fd), self._handle,
                    cu.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        os.set_inheritable(fd.value, False)
        return fd.value

    @property
    def ptr(self) -> int:
        """The device address the slab is mapped at in this process."""
        if self._mapping is None:
            raise CacheBrokenError("slab was released")
        return self._mapping.ptr

    def tensor(self) -> torch.Tensor:
        """A writable uint8 tensor over the whole slab (the same one each call)."""
        if self._tensor is None:
            if self._mapping is None:
                raise CacheBrokenError("slab was released")
            self._tensor = self._mapping.tensor(self._backend.device)
        return self._tensor

    def buffer(self) -> torch.Tensor:
        """The slab's bytes for the rank: its tensor (`Slab.buffer`)."""
        return self.tensor()

    def seal(self) -> None:
        """No-op: a VMM export cannot be made read-only for importers."""
        # The fd grants whatever access the importer asks cuMemSetAccess for; share-mode
        # importers map read-only themselves (import_fd(readonly=True)).

    def release(self) -> None:
        """Drop this process's handle and mapping; exported fds and importers keep the memory."""
        # The mapping goes as soon as no tensor over it is left: at once, unless a caller
        # still holds a view, which is then unmapped with the view rather than under it.
        alive = weakref.ref(self._mapping) if self._mapping is not None else None
        self._tensor = None
        self._mapping = None
        if alive is not None and alive() is not None:
            # Views caught in a reference cycle (a traceback, a closure) would keep the range
            # mapped until the cyclic collector runs, which an idle rank may never trigger.
            gc.collect()
            if alive() is not None:
                log.warning("slab mapping at %#x is still referenced after its release: its "
                            "device memory stays in use until that view is dropped",
                            alive().ptr)  # type: ignore[union-attr]
        if self._handle is not None:
            handle, self._handle = self._handle, None
            with _current(self._backend.ctx):
                cu.call("cuMemRelease", handle)


class CudaBackend:
    """VMM allocations on one CUDA device, shared as POSIX file descriptors."""

    name = "cuda"
    alignment = 256

    def __init__(self, index: int) -> None:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not 0 <= index < count:
            raise DeviceError(
                f"no CUDA device {index}: torch sees {count} device(s); check nvidia-smi, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')} "
                f"and that torch is a CUDA build (torch.version.cuda={torch.version.cuda})")
        torch.cuda.init()
        self.index = index
        self.device = f"cuda:{index}"
        self.dev = int(cu.out("cuDeviceGet", c_int, index))
        # torch's runtime uses this same primary context; retained for the process's life.
        self.ctx = int(cu.out("cuDevicePrimaryCtxRetain", c_void_p, self.dev))
        self._prop = cu.allocation_prop(index)
        self.min_granularity = _granularity(self._prop, cu.MEM_ALLOC_GRANULARITY_MINIMUM)
        try:
            self.granularity = _granularity(self._prop, cu.MEM_ALLOC_GRANULARITY_RECOMMENDED)
        except DriverError:
            self.granularity = self.min_granularity

    def _map(self, handle: int, length: int, size: int, readonly: bool) -> _Mapping:
        """Reserve an address range, map `handle` into it and grant this device access."""
        ptr = int(cu.out("cuMemAddressReserve", c_ulonglong, length, self.granularity, 0, 0))
        try:
            cu.call("cuMemMap", ptr, length, 0, handle, 0)
            try:
                cu.call("cuMemSetAccess", ptr, length,
                        byref(cu.access_desc(self.index, readonly)), 1)
            except DeviceError:
                _quietly("cuMemUnmap", ptr, length)
                raise
        except DeviceError:
            _quietly("cuMemAddressFree", ptr, length)
            raise
        return _Mapping(self.ctx, ptr, length, size)

    def allocate(self, size: int) -> CudaSlab:
        """Allocate a slab of `size` bytes, rounded up to the allocation granularity."""
        if size < 0:
            raise ValueError(f"slab size must be >= 0, got {size}")
        length = _round_up(max(size, 1), self.granularity)
        with _current(self.ctx):
            try:
                handle = int(cu.out("cuMemCreate", c_ulonglong, length, byref(self._prop), 0))
            except DriverError as e:
                raise DeviceError(f"cannot allocate a {length}-byte slab on {self.device}: "
                                  f"{e}; free memory on that GPU (nvidia-smi) or use more "
                                  "tensor-parallel ranks") from e
            try:
                mapping = self._map(handle, length, size, readonly=False)
            except DeviceError:
                _quietly("cuMemRelease", handle)
                raise
        return CudaSlab(self, handle, mapping)

    def map_fd(self, fd: int, size: int, *, readonly: bool) -> torch.Tensor:
        """Map a slab for the rank's own use (`Backend.map_fd`): the same as import_fd."""
        return self.import_fd(fd, size, readonly=readonly)

    def import_fd(self, fd: int, size: int, *, readonly: bool) -> torch.Tensor:
        """Map a slab another process exported; the fd stays open (the caller closes it)."""
        with _current(self.ctx):
            handle, prop = self._import(fd)
            try:
                # The exporter rounded up to a multiple of at least this: mapping no more.
                length = _round_up(max(size, 1),
                                   _granularity(prop, cu.MEM_ALLOC_GRANULARITY_MINIMUM))
                try:
                    mapping = self._map(handle, length, size, readonly)
                except DriverError as e:  # H200, driver 580: NOT_SUPPORTED past the end
                    if not _past_the_end(e):
                        raise
                    raise _too_small(e, size) from e
            finally:
                _quietly("cuMemRelease", handle)  # the mapping keeps the allocation alive
        return mapping.tensor(self.device)

    def import_handed_over(self, fd: int, size: int) -> torch.Tensor:
        """Map a slab its rank handed over (copy-release) writable: once the rank has dropped
        its handle, this mapping is all that holds the allocation."""
        return self.import_fd(fd, size, readonly=False)

    def import_pieces(self, fds: list[int], pieces: tuple[int, ...], size: int, *,
                      readonly: bool) -> torch.Tensor:
        """Map a slab made of several allocations (a rank's copy for the engine: rank/copies.py)
        one after another into one range, with one access call for all of them; the fds stay
        open."""
        length = sum(pieces)
        if len(fds) != len(pieces) or length < size or any(k % self.min_granularity
                                                            for k in pieces):
            raise CacheBrokenError(f"slab pieces {list(pieces)[:8]} (for {len(fds)} fds) do "
                                   f"not make a slab of {size} bytes")
        with _current(self.ctx):
            ptr = int(cu.out("cuMemAddressReserve", c_ulonglong, length, self.granularity, 0,
                             0))
            at = 0
            try:
                for fd, k in zip(fds, pieces, strict=True):
                    handle, _ = self._import(fd)
                    try:
                        cu.call("cuMemMap", ptr + at, k, 0, handle, 0)
                    except DriverError as e:
                        if not _past_the_end(e):
                            raise
                        raise _too_small(e, k) from e
                    finally:
                        _quietly("cuMemRelease", handle)  # the mapping keeps it alive
                    at += k
                cu.call("cuMemSetAccess", ptr, length,
                        byref(cu.access_desc(self.index, readonly)), 1)
            except BaseException:  # a driver error, or a piece that is not ours to map
                if at:
                    _quietly("cuMemUnmap", ptr, at)
                _quietly("cuMemAddressFree", ptr, length)
                raise
        return _Mapping(self.ctx, ptr, length, size).tensor(self.device)

    def _import(self, fd: int) -> tuple[int, cu.MemAllocationProp]:
        """Import an exported allocation of this backend's device: its handle (the caller
        releases it) and its properties. The context is current."""
        try:
            # For a POSIX fd the void* osHandle is the fd itself: (void*)(intptr_t)fd.
            handle = int(cu.out("cuMemImportFromShareableHandle", c_ulonglong,
                                c_void_p(fd), cu.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        except DriverError as e:
            raise CacheBrokenError(f"slab fd {fd} is not an importable CUDA allocation: "
                                   f"{e}") from e
        try:
            prop = cu.MemAllocationProp()
            cu.call("cuMemGetAllocationPropertiesFromHandle", byref(prop), handle)
            on_device = prop.location.type == cu.MEM_LOCATION_TYPE_DEVICE
            if not on_device or prop.location.id != self.index:
                where = f"cuda:{prop.location.id}" if on_device else \
                    f"location type {prop.location.type}"
                raise CacheBrokenError(f"slab fd holds memory on {where}, but this backend "
                                       f"maps {self.device}; pair ranks by device UUID")
        except DeviceError:
            _quietly("cuMemRelease", handle)
            raise
        return handle, prop

    def device_info(self) -> dict[str, str]:
        """Fingerprint fields of the device."""
        import torch

        major = cu.out("cuDeviceGetAttribute", c_int,
                       cu.DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev)
        minor = cu.out("cuDeviceGetAttribute", c_int,
                       cu.DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev)
        return {"device_uuid": cu.uuid(self.dev), "compute_capability": f"{major}.{minor}",
                "driver": _driver_version(), "cuda": torch.version.cuda or ""}


def _past_the_end(e: DriverError) -> bool:
    """Whether cuMemMap failed the way it does for a mapping longer than the allocation."""
    return e.call == "cuMemMap" and e.error in _TOO_SMALL


def _too_small(e: DriverError, size: int) -> CacheBrokenError:
    """A slab fd that holds fewer bytes than announced."""
    return CacheBrokenError(f"slab fd holds fewer than the {size} bytes the manifest says ({e})")


def _quietly(name: str, *args: Any) -> None:
    """A clean-up call on an error path: its own failure must not hide the first one."""
    with contextlib.suppress(DeviceError):
        cu.call(name, *args)


def _driver_version() -> str:
    """The kernel module's version (as nvidia-smi shows it), else the driver's CUDA version."""
    with contextlib.suppress(OSError), open("/proc/driver/nvidia/version") as f:
        # "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
        found = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", f.readline())
        if found:
            return found.group(1)
    version = int(cu.out("cuDriverGetVersion", c_int))
    return f"{version // 1000}.{version % 1000 // 10}"


def uuid_to_index() -> dict[str, int]:
    """Each visible device's UUID (nvidia-smi form) mapped to its torch index."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {cu.uuid(int(cu.out("cuDeviceGet", c_int, i))): i
            for i in range(torch.cuda.device_count())}
