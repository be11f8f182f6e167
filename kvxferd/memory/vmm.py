"""CUDA VMM allocations shared between processes as POSIX file descriptors.

The other route for an engine's VRAM besides a CUDA IPC handle: the engine creates an
allocation with cuMemCreate (exportable as a POSIX fd), maps it into its own address space
and exports the fd, which travels over the engine socket with SCM_RIGHTS (a PoolHandoff of
kind "cuda_vmm"); the daemon imports the fd and maps the same physical memory into ITS
address space. Unlike an IPC mapping, that mapping is the daemon's own, which is why it may
be registrable with NIXL (unproven until scripts/gpu-check.sh has run; ../shared/GPU.md).

This module is the only one that uses the CUDA driver API (`cuda.bindings.driver`, from the
cuda-bindings package); it imports it on first use, never at import, so that kvxferd imports
and runs on hosts without CUDA. Every call raises DeviceUnavailableError there, naming why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvxferd.memory.device import DeviceError, DeviceUnavailableError


@dataclass
class VmmExport:
    """An engine-side VMM allocation: mapped at `address` in this process, `nbytes` rounded
    up to the device's allocation granularity, exported as the POSIX fd `fd` (owned here:
    hand a copy over, close() closes it)."""

    address: int
    nbytes: int
    fd: int
    device: int
    _release: Callable[[], None] = field(repr=False)
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._release()
        finally:
            os.close(self.fd)


def _driver() -> Any:
    """cuda.bindings.driver, initialised, or DeviceUnavailableError saying why not."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DeviceUnavailableError(
            "CUDA VMM pools need the CUDA driver API: pip install cuda-bindings "
            f"(cuda.bindings does not import: {exc})"
        ) from exc
    try:
        result = driver.cuInit(0)
    except Exception as exc:
        # Without an NVIDIA driver, cuda-bindings cannot even load libcuda and raises its
        # own loader error rather than a CUresult.
        raise DeviceUnavailableError(f"no usable CUDA driver: {exc}") from exc
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise DeviceUnavailableError(f"no usable CUDA driver: cuInit: {_name(driver, result[0])}")
    return driver


def _name(driver: Any, err: Any) -> str:
    try:
        ok, name = driver.cuGetErrorName(err)
        if ok == driver.CUresult.CUDA_SUCCESS:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # the error text must never hide the error
        pass
    return str(err)


def _ok(driver: Any, result: Any, what: str) -> Any:
    """The value of a driver call's (CUresult, value...) tuple, or DeviceError naming it."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DeviceError(f"{what} failed: {_name(driver, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _prop(driver: Any, device: int) -> Any:
    """An allocation pinned on `device`, exportable as a POSIX fd."""
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = (
        driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    return prop


def _rounded(driver: Any, prop: Any, nbytes: int) -> int:
    flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    granularity = int(_ok(driver, driver.cuMemGetAllocationGranularity(prop, flag), "granularity"))
    return -(-nbytes // granularity) * granularity


def _map(driver: Any, handle: Any, nbytes: int, device: int) -> tuple[int, Callable[[], None]]:
    """Reserve an address range, map `handle` there read-write for `device`; the unmap."""
    ptr = _ok(driver, driver.cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve")
    try:
        _ok(driver, driver.cuMemMap(ptr, nbytes, 0, handle, 0), "cuMemMap")
        try:
            access = driver.CUmemAccessDesc()
            access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device
            access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _ok(driver, driver.cuMemSetAccess(ptr, nbytes, [access], 1), "cuMemSetAccess")
        except BaseException:
            driver.cuMemUnmap(ptr, nbytes)
            raise
    except BaseException:
        driver.cuMemAddressFree(ptr, nbytes)
        raise

    def unmap() -> None:
        # Unmapping and releasing the handle frees the memory once every process did.
        _ok(driver, driver.cuMemUnmap(ptr, nbytes), "cuMemUnmap")
        _ok(driver, driver.cuMemAddressFree(ptr, nbytes), "cuMemAddressFree")
        _ok(driver, driver.cuMemRelease(handle), "cuMemRelease")

    return int(ptr), unmap


def _on_device(driver: Any, device: int) -> Any:
    """Make `device`'s primary context current (the one cupy and the runtime use), so the
    mapping lands in the same context the copies run in; returns it for the caller to pop."""
    dev = _ok(driver, driver.cuDeviceGet(device), f"cuDeviceGet({device})")
    ctx = _ok(driver, driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _ok(driver, driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    return dev


def _off_device(driver: Any, dev: Any) -> None:
    driver.cuCtxPopCurrent()
    driver.cuDevicePrimaryCtxRelease(dev)


def create_exportable(nbytes: int, device: int) -> VmmExport:
    """A new VMM allocation of at least `nbytes` on `device`, mapped here, exported as a fd."""
    driver = _driver()
    dev = _on_device(driver, device)
    try:
        prop = _prop(driver, device)
        size = _rounded(driver, prop, nbytes)
        handle = _ok(driver, driver.cuMemCreate(size, prop, 0), "cuMemCreate")
        try:
            ptr, unmap = _map(driver, handle, size, device)
        except BaseException:
            driver.cuMemRelease(handle)
            raise
        try:
            kind = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            fd = int(
                _ok(
                    driver,
                    driver.cuMemExportToShareableHandle(handle, kind, 0),
                    "cuMemExportToShareableHandle",
                )
            )
        except BaseException:
            unmap()
            raise
    finally:
        _off_device(driver, dev)
    return VmmExport(ptr, size, fd, device, unmap)


def import_fd(fd: int, nbytes: int, device: int) -> tuple[int, Callable[[], None]]:
    """Map the VMM allocation behind `fd` (exported by another process) on `device`.

    Returns its address in this process and the unmap to call once no copy can touch it.
    `nbytes` is rounded up to the granularity, as the exporter's size was. `fd` stays open
    (the caller's to close; the mapping keeps the memory)."""
    driver = _driver()
    dev = _on_device(driver, device)
    try:
        kind = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle = _ok(
            driver,
            driver.cuMemImportFromShareableHandle(fd, kind),
            "cuMemImportFromShareableHandle",
        )
        try:
            size = _rounded(driver, _prop(driver, device), nbytes)
            return _map(driver, handle, size, device)
        except BaseException:
            driver.cuMemRelease(handle)
            raise
    finally:
        _off_device(driver, dev)
