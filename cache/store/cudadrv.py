"""The CUDA driver calls that vlaunch makes, through ctypes on libcuda.so.1.

Why not cuda-bindings: its import took longer than the whole share handoff it served
(benchmarks/results/figures.md), and every engine paid it at start for about fifteen calls.
torch has already loaded libcuda.so.1 when a handoff runs, so loading it here is a lookup, and
ctypes releases the GIL around each call.
The structures and constants below are the driver API's (cuda.h), which NVIDIA keeps binary
compatible across driver versions.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from typing import Any

from vlaunch.cache.contract.errors import DeviceError

# enum values from cuda.h
MEM_ALLOCATION_TYPE_PINNED = 1
MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
MEM_LOCATION_TYPE_DEVICE = 1
MEM_ACCESS_FLAGS_PROT_READ = 1
MEM_ACCESS_FLAGS_PROT_READWRITE = 3
MEM_ALLOC_GRANULARITY_MINIMUM = 0
MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
MEMORYTYPE_HOST = 1
MEMORYTYPE_DEVICE = 2
MEMHOSTREGISTER_READ_ONLY = 8


class MemLocation(ctypes.Structure):
    """CUmemLocation."""

    _fields_ = [("type", c_int), ("id", c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class MemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""

    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", MemLocation),
                ("win32HandleMetaData", c_void_p), ("allocFlags", _AllocFlags)]


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D."""

    _fields_ = [("srcXInBytes", c_size_t), ("srcY", c_size_t), ("srcMemoryType", c_int),
                ("srcHost", c_void_p), ("srcDevice", c_ulonglong), ("srcArray", c_void_p),
                ("srcPitch", c_size_t), ("dstXInBytes", c_size_t), ("dstY", c_size_t),
                ("dstMemoryType", c_int), ("dstHost", c_void_p), ("dstDevice", c_ulonglong),
                ("dstArray", c_void_p), ("dstPitch", c_size_t), ("WidthInBytes", c_size_t),
                ("Height", c_size_t)]


class MemAccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("location", MemLocation), ("flags", c_int)]


_u64 = c_ulonglong
_PROP = POINTER(MemAllocationProp)
# name -> argument types; every call returns a CUresult (int).
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (c_uint,),
    "cuDriverGetVersion": (POINTER(c_int),),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuDeviceGetAttribute": (POINTER(c_int), c_int, c_int),
    "cuDeviceGetUuid_v2": (POINTER(ctypes.c_char * 16), c_int),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuCtxGetCurrent": (POINTER(c_void_p),),
    "cuCtxPushCurrent_v2": (c_void_p,),
    "cuCtxPopCurrent_v2": (POINTER(c_void_p),),
    "cuCtxSynchronize": (),
    "cuMemGetAllocationGranularity": (POINTER(c_size_t), _PROP, c_int),
    "cuMemCreate": (POINTER(_u64), c_size_t, _PROP, _u64),
    "cuMemRelease": (_u64,),
    "cuMemExportToShareableHandle": (c_void_p, _u64, c_int, _u64),
    "cuMemImportFromShareableHandle": (POINTER(_u64), c_void_p, c_int),
    "cuMemGetAllocationPropertiesFromHandle": (_PROP, _u64),
    "cuMemAddressReserve": (POINTER(_u64), c_size_t, c_size_t, _u64, _u64),
    "cuMemAddressFree": (_u64, c_size_t),
    "cuMemMap": (_u64, c_size_t, c_size_t, _u64, _u64),
    "cuMemUnmap": (_u64, c_size_t),
    "cuMemSetAccess": (_u64, c_size_t, POINTER(MemAccessDesc), c_size_t),
    "cuMemGetAddressRange_v2": (POINTER(_u64), POINTER(c_size_t), _u64),
    "cuMemHostRegister_v2": (c_void_p, c_size_t, c_uint),
    "cuMemHostUnregister": (c_void_p,),
    "cuMemcpy2DAsync_v2": (POINTER(Memcpy2D), c_void_p),
    "cuMemcpyDtoDAsync_v2": (_u64, _u64, c_size_t, c_void_p),
}
_lib: Any = None
_lock = threading.Lock()


class DriverError(DeviceError):
    """A CUDA driver call failed; `error` is the driver's error name."""

    def __init__(self, call: str, error: str) -> None:
        super().__init__(f"{call} failed: {error}")
        self.call = call
        self.error = error


def _load() -> Any:
    """libcuda.so.1 with argument types set and cuInit done (once per process)."""
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise DeviceError(f"the NVIDIA driver library cannot be loaded: {e}; install "
                                  "the NVIDIA driver, or give the container the GPUs "
                                  "(--gpus)") from e
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, c_int
            _check(lib, "cuInit", lib.cuInit(0))
            _lib = lib
    return _lib


def _check(lib: Any, name: str, err: int) -> None:
    """Raise DriverError for a CUresult other than CUDA_SUCCESS."""
    if err:
        text = c_char_p()
        known = lib.cuGetErrorName(err, byref(text)) == 0 and text.value
        raise DriverError(name, text.value.decode() if known else f"CUresult {err}")


def call(name: str, *args: Any) -> None:
    """Call the driver function `name`; DriverError unless it returns CUDA_SUCCESS."""
    lib = _lib or _load()
    _check(lib, name, getattr(lib, name)(*args))


def out(name: str, kind: Any, *args: Any) -> Any:
    """Call `name` with a first output argument of ctypes type `kind`; returns its value."""
    value = kind()
    call(name, byref(value), *args)
    return value.value if hasattr(value, "value") else value


def allocation_prop(index: int) -> MemAllocationProp:
    """Pinned device memory on device `index`, exportable as a POSIX fd."""
    prop = MemAllocationProp()
    prop.type = MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def access_desc(index: int, readonly: bool) -> MemAccessDesc:
    """Read or read-write access for device `index`."""
    desc = MemAccessDesc()
    desc.location.type = MEM_LOCATION_TYPE_DEVICE
    desc.location.id = index
    desc.flags = MEM_ACCESS_FLAGS_PROT_READ if readonly else MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def uuid(dev: int) -> str:
    """The device's UUID the way nvidia-smi prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxx...)."""
    raw = (ctypes.c_char * 16)()
    call("cuDeviceGetUuid_v2", byref(raw), dev)
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
