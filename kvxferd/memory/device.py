"""KV pools and regions in GPU memory, through cupy, imported only when used.

kvxferd must import, start and serve host pools on hosts without CUDA (CI, this project's
own machines): nothing here imports cupy (or the CUDA driver bindings) at module import.
`probe()` says once, without raising, whether a device is usable and why not; every other
call that needs a device raises DeviceUnavailableError carrying that reason, so a device
pool on a host without a GPU is refused with a message that says what to install or fix.

The daemon side opens an engine's VRAM (`DeviceRegion.open_ipc`, `.import_vmm`) and
allocates its own staging (`DeviceRegion.allocate`); the engine side (reference engine,
client helpers, gpu-check) creates and shares a pool (`DevicePool`). Devices are named by
UUID between processes (`uuid_of`, `ordinal_of`): engine and daemon may see different
CUDA_VISIBLE_DEVICES, so an ordinal means nothing outside its process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvxferd.errors import KvxferdError

#: The memory kinds a pool can declare (RegisterPool.memory, PoolInfo.memory).
POOL_MEMORY = ("host", "vram")

#: Where a device region's memory came from (LocalPool.sharing uses the first two).
SHARING = ("cuda_ipc", "cuda_vmm", "owned")

_NO_CUPY = "cupy is not installed: pip install cupy-cuda12x or cupy-cuda13x"


class DeviceError(KvxferdError):
    """A CUDA call failed on a device that exists (the message names the call and error)."""


class DeviceUnavailableError(DeviceError):
    """No usable CUDA device here (no cupy, no driver, no device, or not this one)."""


@dataclass(frozen=True)
class DeviceProbe:
    """What this process can do with CUDA: `available`, or `why` not."""

    available: bool
    why: str = ""  # "" when available
    count: int = 0
    runtime_version: int = 0  # cudaRuntimeGetVersion, e.g. 12090
    driver_version: int = 0  # cudaDriverGetVersion (0: none)
    cupy_version: str = ""


_probe_lock = threading.Lock()
_probed: DeviceProbe | None = None


def probe(*, refresh: bool = False) -> DeviceProbe:
    """Whether a CUDA device is usable here, probed once per process (refresh: again).

    Never raises: a status page and the refusal of a device pool both need the reason."""
    global _probed
    with _probe_lock:
        if _probed is None or refresh:
            _probed = _probe()
        return _probed


def _probe() -> DeviceProbe:
    try:
        import cupy
    except ImportError:
        return DeviceProbe(False, _NO_CUPY)
    except Exception as exc:
        # A cupy built for another CUDA, or a broken install, fails with its own errors.
        return DeviceProbe(False, f"cupy does not import: {type(exc).__name__}: {exc}")
    version = str(getattr(cupy, "__version__", ""))
    runtime = cupy.cuda.runtime
    try:
        count = int(runtime.getDeviceCount())
    except Exception as exc:  # cupy's CUDARuntimeError, e.g. cudaErrorInsufficientDriver
        return DeviceProbe(False, f"no usable CUDA device: {exc}", cupy_version=version)
    runtime_version = _version(runtime, "runtimeGetVersion")
    driver_version = _version(runtime, "driverGetVersion")
    if count < 1:
        return DeviceProbe(
            False,
            "no usable CUDA device: the CUDA runtime sees none (CUDA_VISIBLE_DEVICES?)",
            0,
            runtime_version,
            driver_version,
            version,
        )
    return DeviceProbe(True, "", count, runtime_version, driver_version, version)


def _version(runtime: Any, name: str) -> int:
    try:
        return int(getattr(runtime, name)())
    except Exception:  # a version is informative only; its absence must not hide a device
        return 0


def _cupy(device: int | None = None) -> Any:
    """cupy, once the probe found a device (and `device` is one of them), or why not."""
    found = probe()
    if not found.available:
        raise DeviceUnavailableError(found.why)
    if device is not None and not 0 <= device < found.count:
        raise DeviceUnavailableError(
            f"CUDA device {device} does not exist here: this process sees {found.count} "
            f"(ordinals 0..{found.count - 1}; CUDA_VISIBLE_DEVICES?)"
        )
    import cupy

    return cupy


def _uuid_text(raw: object) -> str:
    """nvidia-smi's form, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, from 16 bytes or text."""
    if isinstance(raw, (bytes, bytearray)):
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    text = str(raw)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _canonical(device_uuid: str) -> str:
    text = device_uuid.strip().lower()
    return text[4:] if text.startswith(("gpu-", "mig-")) else text


def uuid_of(ordinal: int) -> str:
    """The UUID of this process's CUDA device `ordinal`, as nvidia-smi -L prints it."""
    cupy = _cupy(ordinal)
    props = cupy.cuda.runtime.getDeviceProperties(ordinal)
    raw = props.get("uuid") if isinstance(props, dict) else None
    if not raw:
        raise DeviceUnavailableError(
            f"cupy {probe().cupy_version} does not report device UUIDs; cupy 14 or later does"
        )
    return _uuid_text(raw)


def ordinal_of(device_uuid: str) -> int:
    """This process's ordinal of the device `device_uuid` names ("GPU-" prefix optional)."""
    found = probe()
    if not found.available:
        raise DeviceUnavailableError(found.why)
    wanted = _canonical(device_uuid)
    seen = []
    for ordinal in range(found.count):
        uuid = uuid_of(ordinal)
        if _canonical(uuid) == wanted:
            return ordinal
        seen.append(uuid)
    raise DeviceUnavailableError(
        f"CUDA device {device_uuid!r} is not visible to this process (it sees "
        f"{', '.join(seen) or 'none'}; CUDA_VISIBLE_DEVICES?)"
    )


def _allocation_base(pointer: int) -> int:
    """The start of the allocation `pointer` lies in (what an IPC handle names)."""
    from kvxferd.memory import vmm

    driver = vmm._driver()
    base, _size = vmm._ok(driver, driver.cuMemGetAddressRange(pointer), "cuMemGetAddressRange")
    return int(base)


def export_ipc(pointer: int, base: int | None = None) -> tuple[bytes, int]:
    """The CUDA IPC handle of the allocation holding `pointer`, and `pointer`'s offset in it.

    A handle names a whole allocation, and allocators (torch's, cupy's pools) hand out
    sub-allocations, hence the offset. Pass `base` when the allocation's start is known
    (one's own cudaMalloc); otherwise the driver is asked."""
    cupy = _cupy()
    start = _allocation_base(pointer) if base is None else base
    handle = cupy.cuda.runtime.ipcGetMemHandle(start)
    return bytes(handle), pointer - start


def _array(cupy: Any, pointer: int, nbytes: int, device: int, owner: object) -> Any:
    """A 1-D uint8 cupy array over memory cupy does not own (freed by its owner only)."""
    memory = cupy.cuda.UnownedMemory(pointer, nbytes, owner, device_id=device)
    return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))


def _malloc(
    cupy: Any, nbytes: int, device: int, what: str, *, zero: bool
) -> tuple[int, Callable[[], None]]:
    """cudaMalloc `nbytes` on `device` (zeroed, or freed again if zeroing fails, with
    `zero`); the pointer and the call that frees it. A failure is a DeviceError naming the
    size, the device and `what` (the end of that message: " (label)" or ""), for staging
    and engine pools alike."""
    runtime = cupy.cuda.runtime
    try:
        with cupy.cuda.Device(device):
            pointer = int(runtime.malloc(nbytes))
            if zero:
                try:
                    runtime.memset(pointer, 0, nbytes)
                    # cudaMemset runs on the legacy default stream, which the copiers'
                    # non-blocking streams do not wait for: the zeros land before any use.
                    runtime.streamSynchronize(0)
                except BaseException:
                    runtime.free(pointer)
                    raise
    except Exception as exc:
        raise DeviceError(
            f"cudaMalloc of {nbytes} bytes on device {device}{what} failed: {exc}"
        ) from exc

    def free() -> None:
        with cupy.cuda.Device(device):
            runtime.free(pointer)

    return pointer, free


@dataclass(eq=False)
class DeviceRegion:
    """Device memory the daemon copies to and from: an engine's pool opened by IPC handle or
    imported VMM fd, or the daemon's own staging. Same shape as memory.memfd.HostRegion
    (nbytes, closed, array, address, close) plus where it lives and how it came."""

    # A dataclass for its constructor only: regions compare (and hash) by identity, and
    # the repr leaves out the array (it would print the memory) and the release call.
    _array: Any = field(repr=False)
    address: int
    nbytes: int
    device: int
    sharing: str
    _release: Any = field(repr=False)
    label: str = ""
    closed: bool = field(default=False, init=False)

    @property
    def array(self) -> Any:
        """The region as a 1-D uint8 cupy array."""
        if self.closed:
            raise DeviceError(f"device region {self.label or hex(self.address)} is closed")
        return self._array

    @classmethod
    def open_ipc(cls, handle: bytes, offset: int, nbytes: int, device: int) -> DeviceRegion:
        """Open another process's allocation by its IPC handle; the region starts `offset`
        bytes into it. CUDA opens a handle once per process: open each one once."""
        cupy = _cupy(device)
        runtime = cupy.cuda.runtime
        try:
            with cupy.cuda.Device(device):
                base = int(runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess))
        except Exception as exc:
            raise DeviceError(f"cudaIpcOpenMemHandle on device {device} failed: {exc}") from exc

        def release() -> None:
            with cupy.cuda.Device(device):
                runtime.ipcCloseMemHandle(base)

        region = cls(None, base + offset, nbytes, device, "cuda_ipc", release)
        region._array = _array(cupy, base + offset, nbytes, device, region)
        return region

    @classmethod
    def import_vmm(cls, fd: int, nbytes: int, device: int) -> DeviceRegion:
        """Map another process's VMM allocation, handed over as `fd` (the caller's to close)."""
        cupy = _cupy(device)
        from kvxferd.memory import vmm

        address, unmap = vmm.import_fd(fd, nbytes, device)
        region = cls(None, address, nbytes, device, "cuda_vmm", unmap)
        region._array = _array(cupy, address, nbytes, device, region)
        return region

    @classmethod
    def allocate(cls, nbytes: int, device: int, label: str = "") -> DeviceRegion:
        """Own, zeroed device memory (the daemon's staging), outside cupy's memory pool so
        its address never moves while a backend has it registered."""
        cupy = _cupy(device)
        pointer, release = _malloc(cupy, nbytes, device, f" ({label})", zero=True)
        region = cls(None, pointer, nbytes, device, "owned", release, label)
        region._array = _array(cupy, pointer, nbytes, device, region)
        return region

    def close(self) -> None:
        """Unmap (or free); no copy may touch the region any more."""
        if self.closed:
            return
        self.closed = True
        self._array = None
        self._release()


@dataclass(eq=False)
class DevicePool:
    """An engine's KV pool in device memory, to be shared with its daemon: by IPC handle
    (`ipc()`), or, created with vmm=True, by the VMM allocation's fd (`fd`)."""

    # A dataclass for its constructor only, as DeviceRegion.
    array: Any = field(repr=False)
    address: int
    nbytes: int
    device: int
    device_uuid: str
    fd: int = field(default=-1, init=False)  # the exported VMM fd (vmm pools only)
    closed: bool = field(default=False, init=False)
    _release: Any = field(default=None, init=False, repr=False)

    @classmethod
    def create(cls, nbytes: int, device: int = 0, *, vmm: bool = False) -> DevicePool:
        """Zeroed device memory of `nbytes` on `device`: cudaMalloc, or an exportable VMM
        allocation (vmm=True; its size rounded up to the device's granularity)."""
        cupy = _cupy(device)
        uuid = uuid_of(device)
        runtime = cupy.cuda.runtime
        if vmm:
            from kvxferd.memory import vmm as vmm_api

            export = vmm_api.create_exportable(nbytes, device)
            pool = cls(None, export.address, nbytes, device, uuid)
            pool.fd = export.fd
            pool._release = export.close
        else:
            pointer, free = _malloc(cupy, nbytes, device, "", zero=False)
            pool = cls(None, pointer, nbytes, device, uuid)
            pool._release = free
        try:
            with cupy.cuda.Device(device):
                runtime.memset(pool.address, 0, nbytes)
            pool.array = _array(cupy, pool.address, nbytes, device, pool)
        except BaseException:
            pool.close()
            raise
        return pool

    def ipc(self) -> tuple[bytes, int]:
        """The IPC handle and offset for RegisterPool (ipc_handle, ipc_offset)."""
        # Our own cudaMalloc starts the allocation; a VMM allocation has no IPC handle.
        if self.fd >= 0:
            raise DeviceError("a VMM pool is shared by its fd, not by an IPC handle")
        return export_ipc(self.address, base=self.address)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.array = None
        release, self._release = self._release, None
        if release is not None:
            release()
