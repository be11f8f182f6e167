"""Device memory and device timing for the GPU check's probes (kvxferd.bench.gpu_probes).

Memory from cudaMalloc itself (DevBuf), a CUDA VMM allocation exported or imported as a POSIX
fd (VmmBuf), another process's allocation opened by its legacy IPC handle (IpcOpened), each
seen as a uint8 cupy array; and time_device, which times a function on a stream of its own by
CUDA events. Apart from the roles (kvxferd.bench.gpu_probes, gpu_foreign), which all allocate
and time through these, so that benchmarks/gpu_rows.py times its copies as the check does
without the probes.

cupy and cuda.bindings are imported inside the functions: this module imports on a host
without either.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any


def cupy_module() -> Any:
    return importlib.import_module("cupy")


class DevBuf:
    """Device memory from cudaMalloc itself (not cupy's pool), so that an IPC handle names
    exactly this allocation at offset 0, viewed as a 1-D uint8 cupy array."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        cp = cupy_module()
        self.nbytes = nbytes
        self.device = device
        with cp.cuda.Device(device):
            self.ptr = int(cp.cuda.runtime.malloc(nbytes))
            self.arr = wrap(self.ptr, nbytes, self, device)

    def close(self) -> None:
        if self.ptr:
            cupy_module().cuda.runtime.free(self.ptr)
            self.ptr = 0


def wrap(ptr: int, nbytes: int, owner: object, device: int) -> Any:
    """A uint8 cupy array over device memory cupy did not allocate (kept alive by owner)."""
    cp = cupy_module()
    mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, device)
    return cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))


def driver_module() -> Any:
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError:
        # cuda-python before 12.6 named the driver module cuda.cuda.
        return importlib.import_module("cuda.cuda")


def _ck(cu: Any, what: str, result: Any) -> Any:
    """cuda.bindings returns (CUresult, values...): raise on an error, return the values."""
    err, *values = result
    if int(err) != 0:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values)


class VmmBuf:
    """A CUDA VMM allocation mapped into this process: created exportable as a POSIX fd, or
    imported from such an fd (the route by which a daemon maps an engine's memory into its
    own address space)."""

    def __init__(self, nbytes: int, device: int = 0, fd: int | None = None) -> None:
        cp = cupy_module()
        cu = driver_module()
        self._cu = cu
        self.device = device
        self.fd = -1
        posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        with cp.cuda.Device(device):
            cp.cuda.runtime.free(0)  # makes the primary context current for the driver API
            _ck(cu, "cuInit", cu.cuInit(0))
            prop = cu.CUmemAllocationProp()
            prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = device
            prop.requestedHandleTypes = posix
            gran = int(
                _ck(
                    cu,
                    "cuMemGetAllocationGranularity",
                    cu.cuMemGetAllocationGranularity(
                        prop,
                        cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                    ),
                )
            )
            self.size = -(-nbytes // gran) * gran
            if fd is None:
                self.handle = _ck(cu, "cuMemCreate", cu.cuMemCreate(self.size, prop, 0))
            else:
                self.handle = _ck(
                    cu,
                    "cuMemImportFromShareableHandle",
                    cu.cuMemImportFromShareableHandle(fd, posix),
                )
            self._va = _ck(cu, "cuMemAddressReserve", cu.cuMemAddressReserve(self.size, gran, 0, 0))
            _ck(cu, "cuMemMap", cu.cuMemMap(self._va, self.size, 0, self.handle, 0))
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _ck(cu, "cuMemSetAccess", cu.cuMemSetAccess(self._va, self.size, [access], 1))
            if fd is None:
                self.fd = int(
                    _ck(
                        cu,
                        "cuMemExportToShareableHandle",
                        cu.cuMemExportToShareableHandle(self.handle, posix, 0),
                    )
                )
        self.ptr = int(self._va)
        self.nbytes = nbytes
        self.arr = wrap(self.ptr, nbytes, self, device)

    def close(self) -> None:
        cu = self._cu
        if self.ptr:
            cupy_module().cuda.runtime.deviceSynchronize()
            _ck(cu, "cuMemUnmap", cu.cuMemUnmap(self._va, self.size))
            _ck(cu, "cuMemAddressFree", cu.cuMemAddressFree(self._va, self.size))
            _ck(cu, "cuMemRelease", cu.cuMemRelease(self.handle))
            self.ptr = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class IpcOpened:
    """Another process's cudaMalloc allocation, opened from its legacy IPC handle.

    CUDA opens a given handle once per context, so each is opened once per process."""

    def __init__(self, handle: bytes, nbytes: int, device: int = 0, offset: int = 0) -> None:
        cp = cupy_module()
        self.device = device
        with cp.cuda.Device(device):
            # cudaIpcMemLazyEnablePeerAccess (1): the only flag CUDA defines.
            flags = getattr(cp.cuda.runtime, "cudaIpcMemLazyEnablePeerAccess", 1)
            self._base = int(cp.cuda.runtime.ipcOpenMemHandle(handle, flags))
        self.ptr = self._base + offset
        self.nbytes = nbytes
        self.arr = wrap(self.ptr, nbytes, self, device)

    def close(self) -> None:
        if self._base:
            cp = cupy_module()
            cp.cuda.runtime.deviceSynchronize()
            cp.cuda.runtime.ipcCloseMemHandle(self._base)
            self._base = 0


def sync() -> None:
    cupy_module().cuda.runtime.deviceSynchronize()


def time_device(fn: Callable[[], None], warm: int, reps: int) -> list[float]:
    """Milliseconds of `fn` on a stream of its own, by CUDA events (host overhead excluded
    except what delays the launch)."""
    cp = cupy_module()
    stream = cp.cuda.Stream(non_blocking=True)
    out: list[float] = []
    with stream:
        for i in range(warm + reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            if i >= warm:
                out.append(float(cp.cuda.get_elapsed_time(start, end)))
    return out
