"""The ctypes CUDA driver layer: the driver API's structure layouts, and a missing driver."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from vlaunch.cache.contract.errors import DeviceError
from vlaunch.cache.store import cudadrv


def test_structures_have_the_driver_api_layout() -> None:
    assert ctypes.sizeof(cudadrv.MemLocation) == 8
    assert ctypes.sizeof(cudadrv.MemAllocationProp) == 32  # cuda.h: CUmemAllocationProp_v1
    assert cudadrv.MemAllocationProp.location.offset == 8
    assert cudadrv.MemAllocationProp.win32HandleMetaData.offset == 16
    assert cudadrv.MemAllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(cudadrv.MemAccessDesc) == 12
    prop = cudadrv.allocation_prop(3)
    assert (prop.type, prop.requestedHandleTypes, prop.location.type, prop.location.id) == \
        (1, 1, 1, 3)
    assert cudadrv.access_desc(1, readonly=True).flags == 1
    assert cudadrv.access_desc(1, readonly=False).flags == 3


def test_every_signature_names_a_driver_symbol_style() -> None:
    for name, argtypes in cudadrv._SIGNATURES.items():
        assert name.startswith("cu") and isinstance(argtypes, tuple)


def test_a_missing_driver_library_is_a_device_error() -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this machine has the NVIDIA driver library")
    with pytest.raises(DeviceError, match="the NVIDIA driver library cannot be loaded"):
        cudadrv.call("cuInit", 0)


def test_the_handoff_modules_import_no_cuda_bindings() -> None:
    code = ("import sys, vlaunch.cache.client.loader, vlaunch.cache.store.slabs_cuda; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cuda'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
