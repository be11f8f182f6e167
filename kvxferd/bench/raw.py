"""The bare NIXL pair: the same bytes with the same segments, no daemon.

Two processes, started by the bench driver:

* `python -m kvxferd.bench.raw target --plan FILE --info-out FILE`: allocates a pool of the
  plan's layout in shared memory, registers it with a NIXL agent, writes its agent metadata,
  pool base and shared memory name to --info-out, and waits until its stdin closes.
* `python -m kvxferd.bench.raw initiator --plan FILE --target-info FILE`: allocates and
  registers its own pool, loads the target's metadata, connects, and runs the plan's request
  sequence: per request it pairs the segments with pair_segments() (the same block ids as the
  daemon run), then times from just before building the transfer (get_xfer_descs +
  initialize_xfer, through kvxferd.backends.nixl.NixlBackend.post_write, as the daemon does)
  to NIXL reporting DONE, busy-polling. `in_flight` transfers are outstanding at a time.
  It prints one JSON object (its records) on stdout.

Content: with one request in flight (sweep mode), every request's source is filled, its
destination zeroed and, after DONE, verified through the target's shared memory, all untimed.
With several in flight (or in small mode) that would stall the other transfers of this single
thread, so each slot is filled and zeroed once per group and verified at the group's end.

With `--memory vram` both pools are DevicePools on CUDA device 0, registered with NIXL as
VRAM, and the writes name VRAM on both sides. The initiator fills its own pool on the device
(and synchronises before each post); the target's pool can be opened only by the target (a
second mapping of it in the initiator would collide with UCX's own CUDA IPC mapping), so the
target zeroes and verifies its blocks on the device when the initiator asks, over a Unix
socket named in the info file (one JSON line per request and per answer, all untimed).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.backends.base import HOST, Backend, Memory, XferHandle, XferStatus, vram
from kvxferd.bench.plan import SWEEP, Group, Item, Plan, pool_huge_pages
from kvxferd.memory.layout import KvLayout, pair_segments
from kvxferd.memory.memfd import MemfdRegion
from kvxferd.memory.shm import ShmRegion
from kvxferd.service.heap_tuning import keep_freed_heap
from kvxferd.sim.content import VerifyResult, request_seed
from kvxferd.sim.engine_pools import HostContent, add_memory_args

#: The CUDA device both pools of a vram run are on (the bench runs on one GPU).
_DEVICE = 0


@dataclass
class RawRecord:
    request_id: str
    slot: int
    tokens: int
    timed: bool
    t_start_ns: int = 0
    t_done_ns: int = 0
    nbytes: int = 0
    descriptors: int = 0


def _backend(role: str) -> Any:
    from kvxferd.backends.nixl import NixlBackend

    return NixlBackend(f"bench-raw-{role}-{os.getpid()}")


def _device_pool(layout: KvLayout) -> Any:
    from kvxferd.memory.device import DevicePool

    return DevicePool.create(layout.pool_bytes, _DEVICE)


def _device_content() -> Any:
    from kvxferd.sim.device_content import DeviceContent

    return DeviceContent(_DEVICE)


def _serve_blocks(server: socket.socket, pool: Any, layout: KvLayout) -> None:
    """The vram target's side of the initiator's clear and verify requests, one
    connection, one JSON line each way per request, until the initiator hangs up."""
    content = _device_content()
    conn, _ = server.accept()
    with conn, conn.makefile("rwb") as f:
        for line in f:
            ask = json.loads(line)
            answer: dict[str, Any] = {"ok": True, "error": ""}
            try:
                if ask["op"] == "clear":
                    content.clear(pool.array, layout, ask["blocks"])
                    content.synchronize()  # zeroed before the initiator's next write
                else:
                    result = content.verify(
                        pool.array, layout, ask["blocks"], ask["seed"], ask["tokens"]
                    )
                    answer = {"ok": result.ok, "error": result.first_mismatch or ""}
            except Exception as exc:  # said to the initiator, which fails the run with it
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            f.write((json.dumps(answer) + "\n").encode())
            f.flush()


def _device_target(args: argparse.Namespace, plan: Plan, backend: Any) -> None:
    layout = plan.layout()
    pool = _device_pool(layout)
    control = args.info_out + ".sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(control)
        server.listen(1)
        reg = backend.register(pool.address, layout.pool_bytes, vram(_DEVICE))
        serving = threading.Thread(target=_serve_blocks, args=(server, pool, layout), daemon=True)
        serving.start()
        info = {
            "agent_name": backend.agent_name,
            "metadata": base64.b64encode(backend.metadata()).decode(),
            "base": pool.address,
            "memory": "vram",
            "device": _DEVICE,
            "control": control,
            "nbytes": layout.pool_bytes,
        }
        _serve_until_closed(args, backend, reg, info)
    finally:
        server.close()
        with contextlib.suppress(OSError):
            os.unlink(control)
        pool.close()


def _serve_until_closed(
    args: argparse.Namespace, backend: Backend, reg: object, info: dict[str, Any]
) -> None:
    """Publish the target's `info` for the driver (written whole, then renamed, so the
    driver never reads half a file) and keep `reg` registered until the driver closes our
    stdin: the host and the vram target end alike."""
    tmp = Path(args.info_out + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.rename(args.info_out)
    sys.stdin.read()
    backend.deregister(reg)


def target(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    layout = plan.layout()
    backend = _backend("target")
    if args.memory == "vram":
        try:
            _device_target(args, plan, backend)
        finally:
            backend.close()
        return 0
    name = f"kvxferd-bench-raw-target-{os.getpid()}"
    region = _host_region(name, layout.pool_bytes)
    try:
        reg = backend.register(region.address, layout.pool_bytes)
        info = {
            "agent_name": backend.agent_name,
            "metadata": base64.b64encode(backend.metadata()).decode(),
            "base": region.address,
            "shm_name": name,
            "nbytes": layout.pool_bytes,
            "pages": region.pages.to_status(),
        }
        if isinstance(region, MemfdRegion):
            # The initiator maps the same memfd (to clear and verify) through /proc.
            info["fd_path"] = f"/proc/{os.getpid()}/fd/{region.fd}"
        _serve_until_closed(args, backend, reg, info)
    finally:
        backend.close()
        if isinstance(region, ShmRegion):
            region.unlink()
        region.close()
    return 0


def _host_region(name: str, nbytes: int) -> ShmRegion | MemfdRegion:
    """A host pool of the raw pair: in shared memory by name, or with `kvxferd bench
    --huge-pages` a memfd on huge pages (the daemon path's engines take the same)."""
    huge_pages = pool_huge_pages()
    if huge_pages == "off":
        return ShmRegion.create(name, nbytes)
    return MemfdRegion.create(nbytes, name, huge_pages=huge_pages)


class _HostDst:
    """The target's pool, mapped here from its shared memory: cleared and verified here."""

    def __init__(self, layout: KvLayout, shm_name: str, nbytes: int, fd_path: str = "") -> None:
        self.layout = layout
        self.region: ShmRegion | MemfdRegion
        if fd_path:
            fd = os.open(fd_path, os.O_RDWR | os.O_CLOEXEC)
            try:
                self.region = MemfdRegion.attach(fd, nbytes, "the raw target's pool")
            finally:
                os.close(fd)
        else:
            self.region = ShmRegion.attach(shm_name, nbytes)

    def clear(self, blocks: list[int]) -> None:
        HostContent.clear(self.region.array, self.layout, blocks)

    def verify(self, blocks: list[int], seed: int, tokens: int) -> VerifyResult:
        return HostContent.verify(self.region.array, self.layout, blocks, seed, tokens)

    def close(self) -> None:
        self.region.close()


class _DeviceDst:
    """The target's pool in its own device memory: cleared and verified by the target,
    on the device, over its control socket."""

    def __init__(self, control: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(control)
        self.file = self.sock.makefile("rwb")

    def _ask(self, **ask: Any) -> dict[str, Any]:
        self.file.write((json.dumps(ask) + "\n").encode())
        self.file.flush()
        line = self.file.readline()
        if not line:
            raise RuntimeError("the raw NIXL target closed its control socket")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def clear(self, blocks: list[int]) -> None:
        answer = self._ask(op="clear", blocks=blocks)
        if not answer["ok"]:
            raise RuntimeError(f"the raw NIXL target could not zero its blocks: {answer['error']}")

    def verify(self, blocks: list[int], seed: int, tokens: int) -> VerifyResult:
        answer = self._ask(op="verify", blocks=blocks, seed=seed, tokens=tokens)
        return VerifyResult(answer["ok"], 0, answer["error"] or None)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class Initiator:
    def __init__(
        self,
        plan: Plan,
        target_info: dict[str, Any],
        progress_fd: int | None,
        memory: str = "host",
    ) -> None:
        self.plan = plan
        self.layout: KvLayout = plan.layout()
        self.progress_fd = progress_fd
        self.backend = _backend("initiator")
        self.local_memory: Memory = HOST
        self.remote_memory: Memory = HOST
        self.content: Any = HostContent()
        self.region: Any
        if memory == "vram":
            self.region = _device_pool(self.layout)
            self.content = _device_content()
            self.local_memory = vram(_DEVICE)
            self.remote_memory = vram(int(target_info["device"]))
        else:
            self.region = _host_region(
                f"kvxferd-bench-raw-initiator-{os.getpid()}", self.layout.pool_bytes
            )
            if isinstance(self.region, ShmRegion):
                self.region.unlink()
        self.reg = self.backend.register(
            self.region.address, self.layout.pool_bytes, self.local_memory
        )
        self.peer = self.backend.add_peer(base64.b64decode(target_info["metadata"]))
        self.backend.connect(self.peer)
        self.remote_base = int(target_info["base"])
        self.dst: _HostDst | _DeviceDst
        if memory == "vram":
            self.dst = _DeviceDst(target_info["control"])
        else:
            self.dst = _HostDst(
                self.layout,
                target_info["shm_name"],
                int(target_info["nbytes"]),
                target_info.get("fd_path", ""),
            )
        self.records: list[RawRecord] = []
        self.verified = 0
        self.timed_start_ns = 0
        self.refresh = plan.mode == SWEEP and plan.in_flight == 1

    def close(self) -> None:
        self.backend.deregister(self.reg)
        self.backend.close()
        self.dst.close()
        self.region.close()

    def _tick(self) -> None:
        if self.progress_fd is not None:
            with contextlib.suppress(BlockingIOError):
                os.write(self.progress_fd, b".")

    def _segments(self, item: Item) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        src, dst = pair_segments(
            self.layout, self.plan.src_for(item), self.layout, self.plan.dst_for(item)
        )
        src[:, 0] += self.region.address
        dst[:, 0] += self.remote_base
        return src, dst

    def _verify(self, item: Item, seed: int) -> None:
        result = self.dst.verify(self.plan.dst_for(item), seed, item.tokens)
        if not result.ok:
            raise RuntimeError(
                f"raw NIXL request {item.request_id}: verification failed: {result.first_mismatch}"
            )
        self.verified += 1

    def run(self) -> None:
        for group in self.plan.groups():
            deadline, self.timed_start_ns = self.plan.start_group(group, self.timed_start_ns)
            self._group(group, deadline)

    def _group(self, group: Group, deadline: float | None) -> None:
        n = self.plan.in_flight
        queues = [group.slot_items(s, n) for s in range(n)]
        last: dict[int, Item] = {}
        slot_seed = {s: group.slot_seed(s) for s in range(n)}
        if not self.refresh:
            for s in range(n):
                probe = group.slot_item(s)
                self.content.fill(
                    self.region.array, self.layout, self.plan.src_for(probe), slot_seed[s]
                )
                self.dst.clear(self.plan.dst_for(probe))
            self.content.synchronize()  # device pools: the sources are there before a post
        active: dict[int, tuple[Item, XferHandle, int, RawRecord]] = {}

        def launch(slot: int) -> None:
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                item = next(queues[slot], None)
                if item is None:
                    return
                if self.refresh:
                    seed = request_seed(item.request_id)
                    self.content.fill(self.region.array, self.layout, self.plan.src_for(item), seed)
                    self.dst.clear(self.plan.dst_for(item))
                    self.content.synchronize()
                local, remote = self._segments(item)
                rec = RawRecord(item.request_id, slot, item.tokens, item.timed)
                rec.t_start_ns = time.monotonic_ns()
                handle, status = self.backend.post_write(
                    local,
                    remote,
                    self.peer,
                    local_memory=self.local_memory,
                    remote_memory=self.remote_memory,
                )
                if status is XferStatus.IN_PROGRESS:
                    active[slot] = (item, handle, rec.t_start_ns, rec)
                    return
                rec.t_done_ns = time.monotonic_ns()
                complete(item, handle, status, rec)

        def complete(item: Item, handle: XferHandle, status: XferStatus, rec: RawRecord) -> None:
            self.backend.release(handle)
            if status is not XferStatus.DONE:
                raise RuntimeError(f"raw NIXL request {item.request_id}: NIXL reported ERR")
            rec.nbytes, rec.descriptors = handle.nbytes, handle.descriptors
            self.records.append(rec)
            last[item.slot] = item
            if self.refresh:
                self._verify(item, request_seed(item.request_id))
            self._tick()

        for s in range(n):
            launch(s)
        poll = self.backend.poll
        while active:
            for slot in list(active):
                item, handle, _, rec = active[slot]
                status = poll(handle)
                if status is XferStatus.IN_PROGRESS:
                    continue
                rec.t_done_ns = time.monotonic_ns()
                del active[slot]
                complete(item, handle, status, rec)
                launch(slot)
        if not self.refresh:
            for s, item in last.items():
                self._verify(item, slot_seed[s])


def initiator(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    info = json.loads(Path(args.target_info).read_text())
    if args.progress_fd is not None:
        os.set_blocking(args.progress_fd, False)
    report: dict[str, Any] = {"error": ""}
    init: Initiator | None = None
    try:
        init = Initiator(plan, info, args.progress_fd, args.memory)
        init.run()
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
    finally:
        if init is not None:
            report["records"] = [asdict(r) for r in init.records]
            if isinstance(init.region, (ShmRegion, MemfdRegion)):
                report["pages"] = init.region.pages.to_status()
                report["target_pages"] = info.get("pages")
            report["verified"] = init.verified
            report["timed_start_ns"] = init.timed_start_ns
            with contextlib.suppress(Exception):
                init.close()
    json.dump(report, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvxferd.bench.raw")
    sub = p.add_subparsers(dest="role", required=True)
    t = sub.add_parser("target")
    t.add_argument("--plan", required=True)
    t.add_argument("--info-out", required=True)
    add_memory_args(t)
    t.set_defaults(fn=target)
    i = sub.add_parser("initiator")
    i.add_argument("--plan", required=True)
    i.add_argument("--target-info", required=True)
    i.add_argument("--progress-fd", type=int, default=None)
    add_memory_args(i)
    i.set_defaults(fn=initiator)
    args = p.parse_args(argv)
    keep_freed_heap()  # the daemons' allocator, so that only the path is compared
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
