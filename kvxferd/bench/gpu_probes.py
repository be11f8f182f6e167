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

The roles draw on modules of their own: kvxferd.bench.probe_io (the result lines, the helper
processes' protocol, byte patterns and figures), gpu_buffers (device memory and its timing),
gpu_nixl (NIXL, driven as kvxferd/backends/nixl.py drives it) and gpu_foreign (the `export`
and `foreign` roles). cupy, cuda.bindings and NIXL are imported inside the functions: these
modules import on a host without any of them, so the check can say why it measured nothing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np

from kvxferd.bench.gpu_buffers import DevBuf, IpcOpened, VmmBuf, cupy_module, sync, time_device
from kvxferd.bench.gpu_foreign import open_exported, role_export, role_foreign, start_export
from kvxferd.bench.gpu_nixl import NixlSide, nixl_module, nixl_version
from kvxferd.bench.probe_io import Child, emit, error_text, fill, holds, rate, serve

MIB = 1 << 20
GIB = 1 << 30


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
