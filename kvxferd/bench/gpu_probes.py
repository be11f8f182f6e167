"""The GPU check's probes: each measurement in processes of its own (run by kvxferd.bench.gpucheck).

`python -m kvxferd.bench.gpu_probes ROLE [options]`. A probe prints its result as lines
`@@gpucheck {json}` on stdout, the whole result so far after each measurement, so that a probe
killed at its time cap still leaves what it measured; the driver reads the last such line.
Other output (UCX, NIXL, cupy warnings) goes where it goes and is kept in the logs.

Top-level roles (one per step of the check):

* `setup`: versions, the CUDA device, NIXL's module, and two smoke tests: a 64 MiB buffer
  shared with a child process by a legacy CUDA IPC handle, and one shared as a CUDA VMM
  allocation whose POSIX fd crosses a Unix socket (SCM_RIGHTS); each read and written on the
  device from the other side.
* `device_copy`: device-to-device memcpy of 1 GiB, and the batched gather/scatter of 4 KiB
  and 64 KiB segments at random pool positions both ways kvxferd's device copier can make
  it: one `cupy.take` / one indexed assignment over uint64 rows, and its row kernel
  (`kvxferd.transceiver.device_rows.RowKernel`, which it runs for rows of 512 B or more).
* `nixl_vram`: bare NIXL between two processes on the GPU, each with its own 1 GiB of VRAM
  registered as "VRAM": 64 MiB and 1 GiB writes, each write's bytes checked by the target.
* `foreign --kind ipc|vmm`: memory one process (the "engine") allocated, opened in another (the
  "daemon") by IPC handle or VMM fd: copied into and out of on the device, then registered with
  NIXL as VRAM and written by NIXL into and from; NIXL's refusal is a result, recorded as text.

Helper roles, started by those: `export` (the engine side of a shared allocation) and
`nixl-peer` (a NIXL agent with its own VRAM that writes, fills and checks on command).

cupy, cuda.bindings and NIXL are imported inside the functions: this module imports on a host
without any of them, so the check can say why it measured nothing. NIXL is driven through its
Python API exactly as kvxferd/backends/nixl.py does (agent with the UCX backend and no listen
thread, register_memory([(addr, len, dev, "")], mem), metadata by value, get_xfer_descs on
(N, 3) uint64 arrays, initialize_xfer("WRITE"), transfer, check_xfer_state, release).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import select
import shutil
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import IO, Any

import numpy as np

#: Prefix of a result line on a probe's stdout.
RESULT = "@@gpucheck "
MIB = 1 << 20
GIB = 1 << 30
#: The NIXL Python modules, preferred first: the GPU machine has CUDA 13.
NIXL_MODULES = ("nixl_cu13", "nixl_cu12")
#: The figures a `foreign` probe reports for one kind of foreign memory, null until measured
#: (the driver's JSON has each of them under foreign_memory.ipc and .vmm).
FOREIGN_FIGURES = (
    "copy_into_gbps",
    "copy_from_gbps",
    "gather_from_gbps",
    "scatter_into_gbps",
    "copy_verified",
    "register",
    "write_into_gbps",
    "write_into_verified",
    "write_from_gbps",
    "write_from_verified",
)
#: Odd, so word index -> pattern word is a bijection mod 2**64: every word of a buffer differs.
_MULT = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def emit(result: dict[str, Any], out: IO[str] | None = None) -> None:
    stream = out or sys.stdout
    stream.write(RESULT + json.dumps(result, default=str) + "\n")
    stream.flush()


def error_text(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- content ---------------------------------------------------------------------------------


def pattern(xp: Any, nwords: int, seed: int) -> Any:
    """The expected uint64 words of a buffer filled with `seed` (numpy or cupy alike)."""
    words = xp.arange(nwords, dtype=xp.uint64)
    words *= xp.uint64(_MULT)
    words ^= xp.uint64((seed * 0xD1B54A32D192ED03 + 1) & _MASK)
    return words


def fill(xp: Any, buf: Any, seed: int, nbytes: int | None = None) -> None:
    n = buf.size if nbytes is None else nbytes
    buf[:n].view(xp.uint64)[...] = pattern(xp, n // 8, seed)


def holds(xp: Any, buf: Any, seed: int, nbytes: int | None = None) -> bool:
    """Whether the first `nbytes` of a uint8 buffer hold `seed`'s pattern (compared where the
    buffer lives: on the device for cupy)."""
    n = buf.size if nbytes is None else nbytes
    return bool(xp.array_equal(buf[:n].view(xp.uint64), pattern(xp, n // 8, seed)))


# -- figures ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the same convention as kvxferd.bench.stats)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(np.ceil(q / 100.0 * len(ordered)))))
    return float(ordered[rank - 1])


def rate(nbytes: int, times_ms: Sequence[float]) -> dict[str, Any]:
    """GB/s (1e9 bytes/s) of the median run, with the runs' latencies; bytes count once
    (a copy of N bytes is N, not the 2N of read + write)."""
    if not times_ms:
        return {"gbps": None, "best_gbps": None, "p50_ms": None, "p99_ms": None, "runs": 0}
    p50 = percentile(times_ms, 50)
    best = min(times_ms)
    return {
        "gbps": _sig(nbytes / (p50 * 1e6)) if p50 > 0 else None,
        "best_gbps": _sig(nbytes / (best * 1e6)) if best > 0 else None,
        "p50_ms": _sig(p50),
        "p99_ms": _sig(percentile(times_ms, 99)),
        "runs": len(times_ms),
    }


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


# -- child processes with a line protocol ----------------------------------------------------


class ProbeError(RuntimeError):
    """A helper process broke the protocol, failed, or did not answer in time."""


class Child:
    """A helper process: JSON commands on its stdin, `@@gpucheck` answers on its stdout.

    Lines that are not answers (UCX and NIXL write to stdout too) are passed to our stderr,
    so they land in the probe's log instead of confusing the protocol."""

    def __init__(self, name: str, argv: list[str], *, pass_fds: Sequence[int] = ()) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            pass_fds=tuple(pass_fds),
        )
        self._buf = ""

    @classmethod
    def probe(cls, name: str, role: str, *args: str, pass_fds: Sequence[int] = ()) -> Child:
        argv = [sys.executable, "-m", "kvxferd.bench.gpu_probes", role, *args]
        return cls(name, argv, pass_fds=pass_fds)

    def _lines(self, deadline: float) -> Iterator[str]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                yield line
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProbeError(f"{self.name}: no answer in time")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.poll()
                raise ProbeError(f"{self.name}: exited (status {code}) before answering")
            self._buf += chunk.decode(errors="replace")

    def answer(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        for line in self._lines(deadline):
            if line.startswith(RESULT):
                out: dict[str, Any] = json.loads(line[len(RESULT) :])
                if out.get("error"):
                    raise ProbeError(f"{self.name}: {out['error']}")
                return out
            sys.stderr.write(f"[{self.name}] {line}\n")
        raise ProbeError(f"{self.name}: no answer")  # pragma: no cover (the loop raises)

    def ask(self, command: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise ProbeError(f"{self.name}: gone ({exc})") from exc
        return self.answer(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            with suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with suppress(OSError, ValueError):
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def commands() -> Iterator[dict[str, Any]]:
    """A helper's commands, one JSON object a line on stdin, until "quit" or end of input."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        command: dict[str, Any] = json.loads(line)
        if command.get("cmd") == "quit":
            return
        yield command


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    for command in commands():
        try:
            emit(handle(command))
        except Exception as exc:
            traceback.print_exc()
            emit({"error": error_text(exc)})


# -- CUDA through cupy, and VMM through cuda.bindings ----------------------------------------


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


# -- NIXL ------------------------------------------------------------------------------------


def nixl_module() -> tuple[Any, str]:
    """The NIXL Python module that imports here, cu13 first."""
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name), name
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("no NIXL module imports (" + "; ".join(errors) + ")")


def nixl_version(module_name: str) -> str | None:
    try:
        return importlib.metadata.version(module_name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def descs(addr: int, nbytes: int, device: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.array([[addr, nbytes, device]], dtype=np.uint64)


class NixlSide:
    """A NIXL agent with one registered region, as kvxferd's NixlBackend drives it."""

    def __init__(self, name: str, ptr: int, nbytes: int, device: int, mem: str = "VRAM") -> None:
        nixl, self.module = nixl_module()
        conf = nixl.nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
        self.agent = nixl.nixl_agent(name, conf)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL agent has no UCX backend ({self.agent.get_plugin_list()})")
        self.name = name
        self.ptr, self.nbytes, self.device, self.mem = ptr, nbytes, device, mem
        self.registration: Any = None

    def register(self) -> None:
        self.registration = self.agent.register_memory(
            [(self.ptr, self.nbytes, self.device, "")], self.mem
        )

    def metadata(self) -> str:
        return bytes(self.agent.get_agent_metadata()).hex()

    def add_peer(self, metadata_hex: str) -> str:
        name = self.agent.add_remote_agent(bytes.fromhex(metadata_hex))
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self.agent.make_connection(peer)
        return peer

    def write(
        self, peer: str, remote_addr: int, remote_device: int, nbytes: int, timeout_s: float = 30.0
    ) -> float:
        """One WRITE of our first `nbytes` to the peer's `remote_addr`, busy-polled; returns
        milliseconds from building the transfer to DONE (what kvxferd.bench.raw times)."""
        agent = self.agent
        t0 = time.perf_counter_ns()
        local = agent.get_xfer_descs(descs(self.ptr, nbytes, self.device), self.mem)
        remote = agent.get_xfer_descs(descs(remote_addr, nbytes, remote_device), "VRAM")
        handle = agent.initialize_xfer("WRITE", local, remote, peer, b"")
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL write of {nbytes} bytes not done in {timeout_s} s")
                state = agent.check_xfer_state(handle)
            t1 = time.perf_counter_ns()
            if state != "DONE":
                raise RuntimeError(f"NIXL write ended in state {state!r}")
        finally:
            agent.release_xfer_handle(handle)
        return (t1 - t0) / 1e6

    def close(self) -> None:
        if self.registration is not None:
            with suppress(Exception):
                self.agent.deregister_memory(self.registration)
            self.registration = None


# -- role: export (the engine side of shared memory) -----------------------------------------


def role_export(args: argparse.Namespace) -> None:
    """Allocate, fill with --seed, share (IPC handle on stdout, or VMM fd over --sock-fd),
    then fill and check on command until told to quit."""
    cp = cupy_module()
    buf: DevBuf | VmmBuf
    if args.kind == "ipc":
        buf = DevBuf(args.nbytes, args.device)
    else:
        buf = VmmBuf(args.nbytes, args.device)
    try:
        fill(cp, buf.arr, args.seed)
        sync()
        ready: dict[str, Any] = {"ready": True, "nbytes": args.nbytes, "kind": args.kind}
        if isinstance(buf, DevBuf):
            ready["handle"] = bytes(cp.cuda.runtime.ipcGetMemHandle(buf.ptr)).hex()
            ready["offset"] = 0
        else:
            sock = socket.socket(fileno=args.sock_fd)
            socket.send_fds(sock, [b"f"], [buf.fd])
            sock.close()
            ready["size"] = buf.size
        emit(ready)

        def handle(command: dict[str, Any]) -> dict[str, Any]:
            n = int(command.get("nbytes", args.nbytes))
            if command["cmd"] == "fill":
                fill(cp, buf.arr, int(command["seed"]), n)
                sync()
                return {"filled": True}
            if command["cmd"] == "check":
                sync()
                return {"ok": holds(cp, buf.arr, int(command["seed"]), n)}
            raise ValueError(f"unknown command {command['cmd']!r}")

        serve(handle)
    finally:
        buf.close()


def start_export(
    name: str, kind: str, nbytes: int, seed: int, device: int
) -> tuple[Child, socket.socket | None]:
    """An `export` child that allocates nbytes, fills them with seed and shares them by kind
    (ipc | vmm); for vmm, with our end of the Unix socket its fd comes over."""
    extra: list[str] = []
    fds: list[int] = []
    parent_sock = child_sock = None
    if kind == "vmm":
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        extra, fds = ["--sock-fd", str(child_sock.fileno())], [child_sock.fileno()]
    args = ["--kind", kind, "--nbytes", str(nbytes), "--seed", str(seed), "--device", str(device)]
    try:
        child = Child.probe(name, "export", *args, *extra, pass_fds=fds)
    except BaseException:
        if parent_sock is not None:
            parent_sock.close()
        raise
    finally:
        if child_sock is not None:
            # The child holds its own copy now; ours would keep the socket open past its exit.
            child_sock.close()
    return child, parent_sock


def open_exported(
    kind: str,
    ready: dict[str, Any],
    sock: socket.socket | None,
    nbytes: int,
    device: int,
    timeout_s: float,
) -> IpcOpened | VmmBuf | None:
    """Open here what an export child shared (its `ready` answer in hand): by its IPC handle,
    or by the VMM fd that comes over sock; None when no fd came."""
    if kind == "ipc":
        return IpcOpened(bytes.fromhex(ready["handle"]), nbytes, device, ready["offset"])
    assert sock is not None
    # The child sends the fd before it answers, so this does not wait; bounded all the same.
    sock.settimeout(timeout_s)
    _, got, _, _ = socket.recv_fds(sock, 16, 1)
    if not got:
        return None
    try:
        return VmmBuf(nbytes, device, fd=got[0])
    finally:
        os.close(got[0])


# -- role: nixl-peer -------------------------------------------------------------------------


def role_nixl_peer(args: argparse.Namespace) -> None:
    """A NIXL agent with --nbytes of its own VRAM, registered; then on command: add_peer
    (metadata), write (to a peer's address, timed), fill, check."""
    cp = cupy_module()
    buf = DevBuf(args.nbytes, args.device)
    side: NixlSide | None = None
    try:
        cp.cuda.Device(args.device).use()
        buf.arr.fill(0)
        sync()
        side = NixlSide(args.name, buf.ptr, args.nbytes, args.device)
        side.register()
        emit(
            {
                "ready": True,
                "metadata": side.metadata(),
                "addr": buf.ptr,
                "device": args.device,
                "nbytes": args.nbytes,
                "module": side.module,
            }
        )
        peers: dict[str, str] = {}
        nixl = side

        def handle(command: dict[str, Any]) -> dict[str, Any]:
            cmd = command["cmd"]
            n = int(command.get("nbytes", args.nbytes))
            if cmd == "add_peer":
                peer = nixl.add_peer(command["metadata"])
                peers[command.get("as", peer)] = peer
                return {"agent": peer}
            if cmd == "write":
                ms = nixl.write(
                    peers[command["peer"]], int(command["addr"]), int(command["device"]), n
                )
                return {"ms": ms}
            if cmd == "fill":
                fill(cp, buf.arr, int(command["seed"]), n)
                sync()
                return {"filled": True}
            if cmd == "check":
                sync()
                return {"ok": holds(cp, buf.arr, int(command["seed"]), n)}
            raise ValueError(f"unknown command {cmd!r}")

        serve(handle)
    finally:
        if side is not None:
            side.close()
        buf.close()


# -- role: setup -----------------------------------------------------------------------------


def _package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in (
        "msgspec",
        "pydantic",
        "pydantic-core",
        "numpy",
        "cupy-cuda13x",
        "cupy-cuda12x",
        "cuda-bindings",
        "torch",
        "uvloop",
        "nixl-cu13",
        "nixl-cu12",
    ):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _imports() -> dict[str, str]:
    """Whether the packages a daemon needs import (found is not enough: a wheel for the
    wrong Python or CUDA installs and then fails here)."""
    out = {}
    for name in ("msgspec", "pydantic", "yaml", "uvloop", "prometheus_client", "kvxferd.cli"):
        try:
            importlib.import_module(name)
            out[name] = "ok"
        except Exception as exc:
            out[name] = "error: " + error_text(exc, 300)
    return out


def _uuid_text(raw: Any) -> str | None:
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    return None if raw is None else str(raw)


def probe_cuda(result: dict[str, Any], device: int) -> bool:
    """Fill in what cupy says about CUDA; True when a device is usable."""
    try:
        cp = cupy_module()
    except Exception as exc:
        result["why"] = f"cupy does not import ({error_text(exc, 300)})"
        return False
    result["cupy"] = getattr(cp, "__version__", None)
    rt = cp.cuda.runtime
    try:
        count = int(rt.getDeviceCount())
    except Exception as exc:
        result["why"] = f"no usable CUDA device: {error_text(exc, 300)}"
        return False
    result["device_count"] = count
    if count <= device:
        result["why"] = f"no CUDA device {device} (getDeviceCount() = {count})"
        return False
    with suppress(Exception):
        result["cuda_runtime"] = int(rt.runtimeGetVersion())
    with suppress(Exception):
        result["cuda_driver"] = int(rt.driverGetVersion())
    try:
        props = rt.getDeviceProperties(device)
        name = props.get("name")
        result["gpu"] = name.decode() if isinstance(name, bytes) else name
        result["gpu_uuid"] = _uuid_text(props.get("uuid"))
        result["gpu_memory_bytes"] = props.get("totalGlobalMem")
        result["compute_capability"] = f"{props.get('major')}.{props.get('minor')}"
        with cp.cuda.Device(device):
            x = cp.arange(1024, dtype=cp.uint64)
            if int(x.sum()) != 1023 * 1024 // 2:
                raise RuntimeError("a 1024-element sum on the device came out wrong")
    except Exception as exc:
        result["why"] = f"CUDA device {device} does not compute: {error_text(exc, 300)}"
        return False
    return True


def smoke(kind: str, device: int, nbytes: int = 64 * MIB, timeout_s: float = 20.0) -> str:
    """Share nbytes from a child by `kind` (ipc | vmm); read its pattern here on the device,
    write another, and have the child check it. "ok" or what failed."""
    cp = cupy_module()
    child: Child | None = None
    opened: IpcOpened | VmmBuf | None = None
    parent_sock: socket.socket | None = None
    try:
        child, parent_sock = start_export(f"{kind}-export", kind, nbytes, 11, device)
        opened = open_exported(
            kind, child.answer(timeout_s), parent_sock, nbytes, device, timeout_s
        )
        if opened is None:
            return "error: no file descriptor arrived over the socket"
        with cp.cuda.Device(device):
            if not holds(cp, opened.arr, 11):
                return "error: the other process's bytes read wrong here"
            fill(cp, opened.arr, 12)
            sync()
        if not child.ask({"cmd": "check", "seed": 12}, timeout_s)["ok"]:
            return "error: bytes written here read wrong in the other process"
        return "ok"
    except Exception as exc:
        traceback.print_exc()
        return "error: " + error_text(exc)
    finally:
        if opened is not None:
            with suppress(Exception):
                opened.close()
        if child is not None:
            child.close()
        if parent_sock is not None:
            parent_sock.close()


def role_setup(args: argparse.Namespace) -> None:
    result: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": False,
        "why": "",
        "cupy": None,
        "gpu": None,
        "gpu_uuid": None,
        "cuda_runtime": None,
        "cuda_driver": None,
        "nixl_module": None,
        "nixl": None,
        "ipc_smoke": None,
        "vmm_smoke": None,
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    result["packages"] = _package_versions()
    result["imports"] = _imports()
    try:
        from kvxferd import __version__

        result["kvxferd"] = __version__
    except Exception as exc:
        result["kvxferd"] = "error: " + error_text(exc)
    try:
        _, module = nixl_module()
        result["nixl_module"] = module
        result["nixl"] = nixl_version(module)
    except Exception as exc:
        result["nixl_error"] = error_text(exc)
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
            result["nvidia_smi"] = out.stdout.strip().splitlines()
        except Exception as exc:
            result["nvidia_smi"] = ["error: " + error_text(exc)]
    emit(result)
    result["cuda"] = probe_cuda(result, args.device)
    emit(result)
    if not result["cuda"]:
        return
    # The daemon's own view, when the GPU-pool code this check was written beside is here.
    try:
        device_mod = importlib.import_module("kvxferd.memory.device")
        result["kvxferd_device_probe"] = repr(device_mod.probe())
    except Exception as exc:
        result["kvxferd_device_probe"] = "unavailable: " + error_text(exc, 200)
    if result["nixl_module"]:
        try:
            buf = DevBuf(MIB, args.device)
            try:
                side = NixlSide("gpucheck-setup", buf.ptr, MIB, args.device)
                side.register()
                side.close()
                result["nixl_vram_register"] = "ok"
            finally:
                buf.close()
        except Exception as exc:
            traceback.print_exc()
            result["nixl_vram_register"] = "error: " + error_text(exc)
    emit(result)
    result["ipc_smoke"] = smoke("ipc", args.device)
    emit(result)
    result["vmm_smoke"] = smoke("vmm", args.device)
    emit(result)


# -- role: device_copy -----------------------------------------------------------------------


def _memcpy_rate(cp: Any, n: int, warm: int, reps: int) -> dict[str, Any]:
    src = cp.empty(n, dtype=cp.uint8)
    dst = cp.empty(n, dtype=cp.uint8)
    fill(cp, src, 1)
    sync()
    d2d = cp.cuda.runtime.memcpyDeviceToDevice

    def memcpy() -> None:
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, d2d, stream.ptr)

    out = rate(n, time_device(memcpy, warm, reps))
    out["verified"] = bool(cp.array_equal(src, dst))
    return out


def _row_rates(
    cp: Any,
    pool: Any,
    packed: Any,
    out_pool: Any,
    idx: Any,
    seg: int,
    kernels: Any,
    warm: int,
    reps: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gather (pool rows idx -> packed) and scatter (packed -> out_pool rows idx) of `seg`-byte
    rows: cupy's take / indexed assignment, then the daemon's row kernel (`kernels`, a
    device_rows.RowKernel, or the text of why it could not be made)."""
    words, rows = seg // 8, int(idx.size)
    n = rows * seg
    pool2d = pool.view(cp.uint64).reshape(-1, words)
    packed2d = packed[:n].view(cp.uint64).reshape(-1, words)
    out2d = out_pool.view(cp.uint64).reshape(-1, words)
    sync()
    g: dict[str, Any] = {"segments": rows}
    s: dict[str, Any] = {"segments": rows}

    def gather() -> None:
        cp.take(pool2d, idx, axis=0, out=packed2d)

    def scatter() -> None:
        out2d[idx] = packed2d

    g["cupy"] = rate(n, time_device(gather, warm, reps))
    g["cupy"]["verified"] = bool(cp.array_equal(packed2d, pool2d[idx]))
    s["cupy"] = rate(n, time_device(scatter, warm, reps))
    s["cupy"]["verified"] = bool(cp.array_equal(out2d[idx], packed2d))
    if isinstance(kernels, str):
        g["kernel"] = s["kernel"] = kernels
        return g, s
    try:
        packed2d[...] = 0
        out2d[...] = 0
        sync()

        def kgather() -> None:
            if not kernels(pool, packed[:n], idx, seg, False):
                raise RuntimeError(f"the row kernel declined {seg}-byte rows")

        def kscatter() -> None:
            if not kernels(out_pool, packed[:n], idx, seg, True):
                raise RuntimeError(f"the row kernel declined {seg}-byte rows")

        g["kernel"] = rate(n, time_device(kgather, warm, reps))
        g["kernel"]["verified"] = bool(cp.array_equal(packed2d, pool2d[idx]))
        s["kernel"] = rate(n, time_device(kscatter, warm, reps))
        s["kernel"]["verified"] = bool(cp.array_equal(out2d[idx], packed2d))
    except Exception as exc:
        traceback.print_exc()
        g.setdefault("kernel", "error: " + error_text(exc, 300))
        s.setdefault("kernel", "error: " + error_text(exc, 300))
    return g, s


def role_device_copy(args: argparse.Namespace) -> None:
    cp = cupy_module()
    cp.cuda.Device(args.device).use()
    n = args.nbytes
    result: dict[str, Any] = {"nbytes": n, "memcpy": None, "gather": {}, "scatter": {}}
    result["memcpy"] = _memcpy_rate(cp, n, args.warm, args.reps)
    emit(result)
    cp.get_default_memory_pool().free_all_blocks()

    # The pool is twice the request, so a request's rows are a random half of it, as a
    # request's blocks are a random subset of an engine's pool.
    pool = cp.empty(2 * n, dtype=cp.uint8)
    fill(cp, pool, 2)
    packed = cp.empty(n, dtype=cp.uint8)
    out_pool = cp.zeros(2 * n, dtype=cp.uint8)
    # Timed copies run on a non-blocking stream, which does not wait for the default stream's
    # fills: every set-up on the default stream is followed by a device-wide sync.
    sync()
    kernels: Any
    try:
        from kvxferd.transceiver.device_rows import RowKernel

        kernels = RowKernel(cp)
        kernels.warm()
    except Exception as exc:
        kernels = "error: " + error_text(exc, 300)
    rng = np.random.default_rng(args.seed)
    for seg in args.segments:
        rows = n // seg
        idx = cp.asarray(rng.permutation(2 * n // seg)[:rows].astype(np.int64))
        g, s = _row_rates(cp, pool, packed, out_pool, idx, seg, kernels, args.warm, args.reps)
        result["gather"][str(seg)], result["scatter"][str(seg)] = g, s
        emit(result)


# -- role: nixl_vram -------------------------------------------------------------------------


def role_nixl_vram(args: argparse.Namespace) -> None:
    """Two nixl-peer processes; the initiator writes into the target, every write checked."""
    result: dict[str, Any] = {"module": None, "writes": {}}
    dev = str(args.device)
    target = initiator = None
    try:
        n = str(args.nbytes)
        target = Child.probe(
            "target", "nixl-peer", "--name", "gpucheck-target", "--nbytes", n, "--device", dev
        )
        initiator = Child.probe(
            "initiator", "nixl-peer", "--name", "gpucheck-initiator", "--nbytes", n, "--device", dev
        )
        t = target.answer(60)
        i = initiator.answer(60)
        result["module"] = i["module"]
        initiator.ask({"cmd": "add_peer", "metadata": t["metadata"], "as": "target"}, 60)
        seed = 100
        for label, nbytes, reps in (("64MiB", 64 * MIB, args.reps_small), ("1GiB", GIB, args.reps)):
            nbytes = min(nbytes, args.nbytes)
            times: list[float] = []
            verified = True
            # One untimed write first: the first write of a size pays UCX's set-up.
            for k in range(1 + reps):
                seed += 1
                initiator.ask({"cmd": "fill", "seed": seed, "nbytes": nbytes})
                ms = initiator.ask(
                    {
                        "cmd": "write",
                        "peer": "target",
                        "addr": t["addr"],
                        "device": t["device"],
                        "nbytes": nbytes,
                    },
                    60,
                )["ms"]
                ok = target.ask({"cmd": "check", "seed": seed, "nbytes": nbytes})["ok"]
                verified = verified and bool(ok)
                if k > 0:
                    times.append(ms)
            entry = rate(nbytes, times)
            entry["bytes"] = nbytes
            entry["verified"] = verified
            result["writes"][label] = entry
            emit(result)
    except Exception as exc:
        traceback.print_exc()
        result["error"] = error_text(exc)
    finally:
        for child in (initiator, target):
            if child is not None:
                child.close()
        emit(result)


# -- role: foreign ---------------------------------------------------------------------------


def role_foreign(args: argparse.Namespace) -> None:
    """This process is the "daemon": it maps the engine's memory, copies into and out of it,
    registers it with NIXL, and writes with NIXL from it and (by a peer) into it."""
    cp = cupy_module()
    cp.cuda.Device(args.device).use()
    kind, n, dev = args.kind, args.nbytes, args.device
    result: dict[str, Any] = {
        "kind": kind,
        "opened": None,
        "read_ok": None,
        **dict.fromkeys(FOREIGN_FIGURES),
    }
    engine = peer = None
    foreign: IpcOpened | VmmBuf | None = None
    side: NixlSide | None = None
    parent_sock: socket.socket | None = None
    stage: Any = None
    try:
        engine, parent_sock = start_export("engine", kind, n, 21, dev)
        foreign = open_exported(kind, engine.answer(60), parent_sock, n, dev, 60)
        if foreign is None:
            raise ProbeError("no file descriptor arrived from the engine")
        result["opened"] = "ok"
        result["read_ok"] = holds(cp, foreign.arr, 21)
        emit(result)

        # The daemon's copies: its own staging <-> the engine's memory, on the device.
        stage = cp.empty(n, dtype=cp.uint8)
        fill(cp, stage, 22)
        sync()
        d2d = cp.cuda.runtime.memcpyDeviceToDevice
        fa = foreign.arr

        def into() -> None:
            s = cp.cuda.get_current_stream().ptr
            cp.cuda.runtime.memcpyAsync(fa.data.ptr, stage.data.ptr, n, d2d, s)

        def out_of() -> None:
            s = cp.cuda.get_current_stream().ptr
            cp.cuda.runtime.memcpyAsync(stage.data.ptr, fa.data.ptr, n, d2d, s)

        result["copy_into_gbps"] = rate(n, time_device(into, 2, args.reps))["gbps"]
        result["copy_from_gbps"] = rate(n, time_device(out_of, 2, args.reps))["gbps"]
        seg = 65536
        words, rows = seg // 8, n // seg // 2
        idx = cp.asarray(np.random.default_rng(5).permutation(n // seg)[:rows].astype(np.int64))
        f2d = fa.view(cp.uint64).reshape(-1, words)
        s2d = stage[: rows * seg].view(cp.uint64).reshape(-1, words)

        def gather() -> None:
            cp.take(f2d, idx, axis=0, out=s2d)

        def scatter() -> None:
            f2d[idx] = s2d

        sync()
        result["gather_from_gbps"] = rate(rows * seg, time_device(gather, 2, args.reps))["gbps"]
        result["scatter_into_gbps"] = rate(rows * seg, time_device(scatter, 2, args.reps))["gbps"]
        fill(cp, stage, 23)
        into()
        sync()
        result["copy_verified"] = bool(engine.ask({"cmd": "check", "seed": 23})["ok"])
        emit(result)

        try:
            side = NixlSide(f"gpucheck-daemon-{kind}", foreign.ptr, n, dev)
            side.register()
            result["register"] = "ok"
        except Exception as exc:
            traceback.print_exc()
            result["register"] = "error: " + error_text(exc)
            return
        emit(result)

        peer = Child.probe(
            "peer",
            "nixl-peer",
            "--name",
            f"gpucheck-peer-{kind}",
            "--nbytes",
            str(n),
            "--device",
            str(dev),
        )
        p = peer.answer(60)
        # NIXL writing into the engine's memory: the peer initiates, the engine checks.
        peer.ask({"cmd": "add_peer", "metadata": side.metadata(), "as": "daemon"}, 60)
        times, verified = [], True
        for k in range(1 + args.nixl_reps):
            seed = 30 + k
            peer.ask({"cmd": "fill", "seed": seed})
            ms = peer.ask(
                {"cmd": "write", "peer": "daemon", "addr": foreign.ptr, "device": dev, "nbytes": n},
                60,
            )["ms"]
            verified = verified and bool(engine.ask({"cmd": "check", "seed": seed})["ok"])
            if k:
                times.append(ms)
        result["write_into_gbps"] = rate(n, times)["gbps"]
        result["write_into_verified"] = verified
        emit(result)
        # NIXL writing from the engine's memory: this process initiates, the peer checks.
        remote = side.add_peer(p["metadata"])
        times, verified = [], True
        for k in range(1 + args.nixl_reps):
            seed = 40 + k
            engine.ask({"cmd": "fill", "seed": seed})
            ms = side.write(remote, int(p["addr"]), int(p["device"]), n)
            verified = verified and bool(peer.ask({"cmd": "check", "seed": seed})["ok"])
            if k:
                times.append(ms)
        result["write_from_gbps"] = rate(n, times)["gbps"]
        result["write_from_verified"] = verified
    except Exception as exc:
        traceback.print_exc()
        result["error"] = error_text(exc)
    finally:
        if side is not None:
            side.close()
        for child in (peer, engine):
            if child is not None:
                child.close()
        stage = None
        if foreign is not None:
            with suppress(Exception):
                foreign.close()
        if parent_sock is not None:
            parent_sock.close()
        emit(result)


# -- entry -----------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvxferd.bench.gpu_probes")
    sub = p.add_subparsers(dest="role", required=True)

    def role(name: str, fn: Callable[[argparse.Namespace], None]) -> argparse.ArgumentParser:
        r = sub.add_parser(name)
        r.add_argument("--device", type=int, default=0)
        r.set_defaults(fn=fn)
        return r

    role("setup", role_setup)
    r = role("device_copy", role_device_copy)
    r.add_argument("--nbytes", type=int, default=GIB)
    r.add_argument("--segments", type=_sizes, default=[4096, 65536])
    r.add_argument("--warm", type=int, default=3)
    r.add_argument("--reps", type=int, default=10)
    r.add_argument("--seed", type=int, default=1)
    r = role("nixl_vram", role_nixl_vram)
    r.add_argument("--nbytes", type=int, default=GIB)
    r.add_argument("--reps", type=int, default=5, help="timed 1 GiB writes")
    r.add_argument("--reps-small", type=int, default=20, help="timed 64 MiB writes")
    r = role("foreign", role_foreign)
    r.add_argument("--kind", choices=("ipc", "vmm"), required=True)
    r.add_argument("--nbytes", type=int, default=GIB)
    r.add_argument("--reps", type=int, default=5, help="timed device copies")
    r.add_argument("--nixl-reps", type=int, default=3, help="timed NIXL writes each way")
    r = role("export", role_export)
    r.add_argument("--kind", choices=("ipc", "vmm"), required=True)
    r.add_argument("--nbytes", type=int, required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--sock-fd", type=int, default=-1)
    r = role("nixl-peer", role_nixl_peer)
    r.add_argument("--name", required=True)
    r.add_argument("--nbytes", type=int, required=True)
    return p


@contextmanager
def _result_on_error(role: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        traceback.print_exc()
        emit({"error": f"{role}: {error_text(exc)}"})
        raise SystemExit(1) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with _result_on_error(args.role):
        args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
