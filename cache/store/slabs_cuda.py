"""CUDA slabs: VMM allocations (cuMemCreate) exported and imported as POSIX file descriptors.

Driver calls go through `cuda.bindings.driver`, imported lazily like torch, in the primary
context that torch uses, so the tensors over our mappings are ordinary CUDA tensors to torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.errors import CacheBrokenError, DeviceError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_drv: Any = None
# cuMemMap's answers to a mapping longer than the imported allocation.
_TOO_SMALL = ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_SUPPORTED")
# ptr -> live mapping owner, weakly: what this process has mapped (tests and diagnostics).
_mappings: weakref.WeakValueDictionary[int, _Mapping] = weakref.WeakValueDictionary()


class DriverError(DeviceError):
    """A CUDA driver call failed; `error` is the driver's error name."""

    def __init__(self, call: str, error: str) -> None:
        super().__init__(f"{call} failed: {error}")
        self.call = call
        self.error = error


def _driver() -> Any:
    """The `cuda.bindings.driver` module, with the driver initialised."""
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise DeviceError("cuda-bindings is not installed; pip install 'vlaunch[cuda]'") from e
        try:
            _check("cuInit", driver.cuInit(0))
        except RuntimeError as e:  # cuda-bindings raises when libcuda.so is missing
            raise DeviceError(f"the NVIDIA driver library cannot be loaded: {e}; install the "
                              "NVIDIA driver, or give the container the GPUs (--gpus)") from e
        _drv = driver
    return _drv


def _check(call: str, result: tuple[Any, ...]) -> Any:
    """Raise DriverError unless `result[0]` is CUDA_SUCCESS; return the call's one output."""
    err, *values = result
    if int(err) != 0:
        from cuda.bindings import driver

        res, name = driver.cuGetErrorName(err)
        raise DriverError(call, name.decode() if int(res) == 0 else repr(err))
    return values[0] if len(values) == 1 else None


@contextlib.contextmanager
def _current(ctx: Any) -> Iterator[Any]:
    """Make `ctx` current on this thread for the block; yields the driver module."""
    d = _driver()
    cur = _check("cuCtxGetCurrent", d.cuCtxGetCurrent())
    if cur is not None and int(cur) == int(ctx):
        yield d
        return
    _check("cuCtxPushCurrent", d.cuCtxPushCurrent(ctx))
    try:
        yield d
    finally:
        _check("cuCtxPopCurrent", d.cuCtxPopCurrent())


def _round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def _granularity(d: Any, prop: Any, which: str) -> int:
    """cuMemGetAllocationGranularity with CU_MEM_ALLOC_GRANULARITY_{which}."""
    flag = getattr(d.CUmemAllocationGranularity_flags, f"CU_MEM_ALLOC_GRANULARITY_{which}")
    return int(_check("cuMemGetAllocationGranularity",
                      d.cuMemGetAllocationGranularity(prop, flag)))


def _uuid(d: Any, dev: Any) -> str:
    """The device's UUID the way nvidia-smi prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)."""
    h = bytes(_check("cuDeviceGetUuid", d.cuDeviceGetUuid(dev)).bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _unmap(ctx: Any, ptr: int, length: int) -> None:
    """Finaliser of a mapping: wait for the device, then unmap and free the address range."""
    try:
        with _current(ctx) as d:
            # torch frees from_blob memory without stream tracking: kernels queued on any stream
            # may still read this range, and unmapping under them is a fatal fault.
            _check("cuCtxSynchronize", d.cuCtxSynchronize())
            _check("cuMemUnmap", d.cuMemUnmap(ptr, length))
            _check("cuMemAddressFree", d.cuMemAddressFree(ptr, length))
    except DeviceError as e:  # a finaliser must not raise; the range is lost, not corrupted
        log.warning("could not unmap slab mapping at %#x (%d bytes): %s", ptr, length, e)


class _Mapping:
    """Owns one mapped address range; the tensors over it keep it, their last one unmaps it."""

    def __init__(self, ctx: Any, ptr: int, length: int, size: int) -> None:
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

    def __init__(self, backend: CudaBackend, handle: Any, mapping: _Mapping) -> None:
        self.size = mapping.size
        self._backend = backend
        self._handle: Any = handle
        self._mapping: _Mapping | None = mapping
        self._tensor: torch.Tensor | None = None

    def export_fd(self) -> int:
        """Return a new POSIX fd for the allocation; the caller closes it."""
        if self._handle is None:
            raise CacheBrokenError("slab was released")
        with _current(self._backend.ctx) as d:
            kind = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            fd = int(_check("cuMemExportToShareableHandle",
                            d.cuMemExportToShareableHandle(self._handle, kind, 0)))
        os.set_inheritable(fd, False)
        return fd

    def tensor(self) -> torch.Tensor:
        """A writable uint8 tensor over the whole slab (the same one each call)."""
        if self._tensor is None:
            if self._mapping is None:
                raise CacheBrokenError("slab was released")
            self._tensor = self._mapping.tensor(self._backend.device)
        return self._tensor

    def seal(self) -> None:
        """No-op: a VMM export cannot be made read-only for importers."""
        # The fd grants whatever access the importer asks cuMemSetAccess for; share-mode
        # importers map read-only themselves (import_fd(readonly=True)).

    def release(self) -> None:
        """Drop this process's handle and mapping; exported fds and importers keep the memory."""
        # The mapping goes as soon as no tensor over it is left: at once, unless a caller
        # still holds a view, which is then unmapped with the view rather than under it.
        self._tensor = None
        self._mapping = None
        if self._handle is not None:
            handle, self._handle = self._handle, None
            with _current(self._backend.ctx) as d:
                _check("cuMemRelease", d.cuMemRelease(handle))


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
        d = _driver()
        self.index = index
        self.device = f"cuda:{index}"
        self.dev = _check("cuDeviceGet", d.cuDeviceGet(index))
        # torch's runtime uses this same primary context; retained for the process's life.
        self.ctx = _check("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(self.dev))
        self._prop = self._allocation_prop(d)
        self.min_granularity = _granularity(d, self._prop, "MINIMUM")
        try:
            self.granularity = _granularity(d, self._prop, "RECOMMENDED")
        except DriverError:
            self.granularity = self.min_granularity

    def _allocation_prop(self, d: Any) -> Any:
        """Pinned device memory on this device, exportable as a POSIX fd."""
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.index
        prop.requestedHandleTypes = (
            d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return prop

    def _map(self, d: Any, handle: Any, length: int, size: int, readonly: bool) -> _Mapping:
        """Reserve an address range, map `handle` into it and grant this device access."""
        ptr = _check("cuMemAddressReserve",
                     d.cuMemAddressReserve(length, self.granularity, 0, 0))
        try:
            _check("cuMemMap", d.cuMemMap(ptr, length, 0, handle, 0))
            access = d.CUmemAccessDesc()
            access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.index
            access.flags = (d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly
                            else d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            try:
                _check("cuMemSetAccess", d.cuMemSetAccess(ptr, length, [access], 1))
            except DeviceError:
                d.cuMemUnmap(ptr, length)
                raise
        except DeviceError:
            d.cuMemAddressFree(ptr, length)
            raise
        return _Mapping(self.ctx, int(ptr), length, size)

    def allocate(self, size: int) -> CudaSlab:
        """Allocate a slab of `size` bytes, rounded up to the allocation granularity."""
        if size < 0:
            raise ValueError(f"slab size must be >= 0, got {size}")
        length = _round_up(max(size, 1), self.granularity)
        with _current(self.ctx) as d:
            try:
                handle = _check("cuMemCreate", d.cuMemCreate(length, self._prop, 0))
            except DriverError as e:
                raise DeviceError(f"cannot allocate a {length}-byte slab on {self.device}: "
                                  f"{e}; free memory on that GPU (nvidia-smi) or use more "
                                  "tensor-parallel ranks") from e
            try:
                mapping = self._map(d, handle, length, size, readonly=False)
            except DeviceError:
                d.cuMemRelease(handle)
                raise
        return CudaSlab(self, handle, mapping)

    def import_fd(self, fd: int, size: int, *, readonly: bool) -> torch.Tensor:
        """Map a slab another process exported; the fd stays open (the caller closes it)."""
        with _current(self.ctx) as d:
            kind = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            try:
                # The binding passes an int as the void* osHandle itself: (void*)(intptr_t)fd.
                handle = _check("cuMemImportFromShareableHandle",
                                d.cuMemImportFromShareableHandle(fd, kind))
            except DriverError as e:
                raise CacheBrokenError(f"slab fd {fd} is not an importable CUDA allocation: "
                                       f"{e}") from e
            try:
                prop = _check("cuMemGetAllocationPropertiesFromHandle",
                              d.cuMemGetAllocationPropertiesFromHandle(handle))
                on_device = prop.location.type == d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                if not on_device or int(prop.location.id) != self.index:
                    where = f"cuda:{prop.location.id}" if on_device else str(prop.location.type)
                    raise CacheBrokenError(f"slab fd holds memory on {where}, but this backend "
                                           f"maps {self.device}; pair ranks by device UUID")
                # The exporter rounded up to a multiple of at least this: mapping no more.
                length = _round_up(max(size, 1), _granularity(d, prop, "MINIMUM"))
                try:
                    mapping = self._map(d, handle, length, size, readonly)
                except DriverError as e:  # H200, driver 580: NOT_SUPPORTED past the end
                    if e.call != "cuMemMap" or e.error not in _TOO_SMALL:
                        raise
                    raise CacheBrokenError(f"slab fd holds fewer than the {size} bytes the "
                                           f"manifest says ({e})") from e
            finally:
                d.cuMemRelease(handle)  # the mapping keeps the allocation alive
        return mapping.tensor(self.device)

    def device_info(self) -> dict[str, str]:
        """Fingerprint fields of the device."""
        import torch

        d = _driver()
        attr = d.CUdevice_attribute
        major = _check("cuDeviceGetAttribute", d.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev))
        minor = _check("cuDeviceGetAttribute", d.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev))
        return {"device_uuid": _uuid(d, self.dev), "compute_capability": f"{major}.{minor}",
                "driver": _driver_version(d), "cuda": torch.version.cuda or ""}


def _driver_version(d: Any) -> str:
    """The kernel module's version (as nvidia-smi shows it), else the driver's CUDA version."""
    with contextlib.suppress(OSError), open("/proc/driver/nvidia/version") as f:
        # "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
        found = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", f.readline())
        if found:
            return found.group(1)
    version = int(_check("cuDriverGetVersion", d.cuDriverGetVersion()))
    return f"{version // 1000}.{version % 1000 // 10}"


def uuid_to_index() -> dict[str, int]:
    """Each visible device's UUID (nvidia-smi form) mapped to its torch index."""
    import torch

    if not torch.cuda.is_available():
        return {}
    d = _driver()
    return {_uuid(d, _check("cuDeviceGet", d.cuDeviceGet(i))): i
            for i in range(torch.cuda.device_count())}
