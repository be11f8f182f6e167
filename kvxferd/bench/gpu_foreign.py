"""Foreign memory in the GPU check: memory one process (the "engine") allocated, opened in
another (the "daemon") by legacy CUDA IPC handle or by CUDA VMM fd.

The `export` role is the engine side; start_export starts one and open_exported opens what it
shared. The `foreign` role is the daemon side: it copies into and out of that memory on the
device, registers it with NIXL as VRAM and has NIXL write into and from it; FOREIGN_FIGURES
names what it reports. Apart from the other roles (kvxferd.bench.gpu_probes, whose parser
runs these two) because this is the one step with processes of three kinds; the setup role's
IPC and VMM smoke tests use start_export and open_exported from here.
"""

from __future__ import annotations

import argparse
import os
import socket
import traceback
from contextlib import suppress
from typing import Any

import numpy as np

from kvxferd.bench.gpu_buffers import DevBuf, IpcOpened, VmmBuf, cupy_module, sync, time_device
from kvxferd.bench.gpu_nixl import NixlSide
from kvxferd.bench.probe_io import Child, ProbeError, emit, error_text, fill, holds, rate, serve

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
