"""The bench engine: one side of a daemon-path measurement, as its own process.

Run as `python -m kvxferd.bench.engine --role context|generation --socket SOCK --plan FILE
--notify-fd FD ...` (the bench driver starts two of them, one per daemon). It allocates its KV
pool in shared memory, registers it with its daemon through kvxferd.client, runs the plan's
requests and prints one JSON object (its records) on stdout.

Coordination is generation-first, over a pipe the driver creates between the two engines:
the generation engine zeroes request i's destination blocks and posts `recv` for it (started,
not awaited: AsyncClient.start_recv), then writes "slot request_id" to the pipe without
waiting for its daemon's reply; the context engine then fills request i's source
blocks (not timed), records t_send just before `send`, and the generation engine
records t_done when the outcome arrives. Latency = t_done - t_send (time.monotonic_ns is one
clock for every process of the machine). Every byte is verified after t_done, not timed.

With `--memory vram` the pool is a DevicePool on the GPU, registered with
register_device_pool; it is filled, zeroed and verified on the device
(kvxferd.sim.device_content), and the device is synchronised before each send and recv
(untimed), as device pools require of an engine.

"When the outcome arrives" is the moment the client's reader decodes the outcome message,
not when the waiting coroutine next runs: with many requests in flight the engine may be busy
verifying earlier ones, and that queueing is the bench engine's, not the daemon's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvxferd.bench import cpu
from kvxferd.bench.plan import VERIFY_SLOT, Group, Item, Plan, pool_huge_pages
from kvxferd.client import AsyncClient
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.memfd import MemfdRegion
from kvxferd.peers.framing import CorkedWriter
from kvxferd.service.heap_tuning import keep_freed_heap
from kvxferd.service.runner import run_event_loop
from kvxferd.sim.content import request_seed
from kvxferd.sim.engine_pools import HostContent, add_memory_args, register_device_pool
from kvxferd.transceiver.state import Outcome, Status

if TYPE_CHECKING:
    from kvxferd.memory.device import DevicePool

_END = "end"
# Test hook: when set to "1" in the context engine's environment, the first timed request is
# filled with another request's content, so the generation engine must report a mismatch.
CORRUPT_ENV = "KVXFERD_BENCH_TEST_CORRUPT"
# Progress bytes go to the driver at most this often (a write per request costs a syscall).
_PROGRESS_EVERY_S = 0.05


class StampingClient(AsyncClient):
    """AsyncClient that notes when each outcome message arrived (monotonic ns)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.arrived_ns: dict[str, int] = {}

    def _on_outcome(self, msg: Outcome) -> None:
        self.arrived_ns[msg.request_id] = time.monotonic_ns()
        super()._on_outcome(msg)

    def arrival(self, request_id: str) -> int:
        """When the outcome of `request_id` arrived (now, if it was not seen), and forget it."""
        return self.arrived_ns.pop(request_id, 0) or time.monotonic_ns()


@dataclass
class GenRecord:
    request_id: str
    slot: int
    tokens: int
    timed: bool
    t_post_ns: int = 0
    t_done_ns: int = 0
    status: str = ""
    reason: str = ""
    message: str = ""
    nbytes: int = 0
    verified: bool = False
    verify_error: str = ""


@dataclass
class CtxRecord:
    request_id: str
    t_send_ns: int = 0
    t_last_send_ns: int = 0  # --chunk-tokens: just before the send of the last chunk
    t_done_ns: int = 0
    status: str = ""
    reason: str = ""
    message: str = ""


@dataclass(eq=False, repr=False)
class _Side:
    """What both engines hold; each side's constructor takes these four first."""

    client: StampingClient
    plan: Plan
    region: MemfdRegion | DevicePool
    pool_id: str
    layout: KvLayout = field(init=False)
    error: str = field(default="", init=False)
    # The reference content of the pool's memory: host, or made and checked on the device.
    content: Any = field(init=False)
    _releases: set[asyncio.Future[None]] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.layout = self.plan.layout()
        if isinstance(self.region, MemfdRegion):
            self.content = HostContent()
        else:
            from kvxferd.sim.device_content import DeviceContent

            self.content = DeviceContent(self.region.device)

    @property
    def per_slot(self) -> bool:
        """--verify slot: content filled and checked once per slot and group, not per request."""
        return self.plan.verify == VERIFY_SLOT

    def fail(self, message: str) -> None:
        if not self.error:
            self.error = message

    def release(self, request_id: str) -> None:
        """Release a finished request without waiting for the daemon's answer, so that the
        slot's next call goes out right behind it: one round trip less in every slot's
        cycle (at 32 in flight the daemons answer in batches, and each wait for an answer
        was ~1/4 of a one-block request's cycle). A refused release fails the run. The
        bench's requests are auto-released (their daemon forgot them with the outcome): no
        call at all then."""
        if self.client.forget(request_id):
            return  # auto-released by the daemon with its outcome: nothing to ask
        task = asyncio.ensure_future(self.client.release(request_id))
        self._releases.add(task)
        task.add_done_callback(self._release_done)

    def _release_done(self, task: asyncio.Future[None]) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fail(f"release refused: {task.exception()}")

    async def settle(self) -> None:
        """Until every release sent has its answer."""
        await asyncio.gather(*self._releases, return_exceptions=True)


@dataclass(eq=False, repr=False)
class GenerationSide(_Side):
    peer: str
    notify_fd: int
    progress_fd: int | None
    wait_s: float
    # The daemons' pids: their CPU seconds are read at each group's start and end (`cpu`),
    # and the engines' (the context engine's and this one's), with the wall time between:
    # on a host with few cores the four processes share them.
    cpu_pids: tuple[int, ...] = ()
    engine_pids: tuple[int, ...] = ()
    records: list[GenRecord] = field(default_factory=list, init=False)
    timed_start_ns: int = field(default=0, init=False)
    cpu: list[dict[str, Any]] = field(default_factory=list, init=False)
    _unreported: int = field(default=0, init=False)
    # --verify slot: the group's records of each slot, checked together at the group's end.
    _slot_records: dict[int, list[GenRecord]] = field(default_factory=dict, init=False)
    _notices: list[str] = field(default_factory=list, init=False)
    _reported_at: float = field(default=0.0, init=False)

    def _notify(self, line: str) -> None:
        # Batched as the daemons batch their frames (CorkedWriter): a write per request woke
        # the context engine once per request (a syscall and a wake-up each, on the cores
        # the daemons share), and a whole loop turn's worth at once makes the processes take
        # turns instead of overlapping; so at the end of the turn or every 8 lines.
        self._notices.append(line)
        if len(self._notices) >= CorkedWriter.FLUSH_AT_FRAMES:
            self._flush_notices()
        elif len(self._notices) == 1:
            asyncio.get_running_loop().call_soon(self._flush_at_turn_end)

    def _flush_at_turn_end(self) -> None:
        # A callback's exception would go to the loop's handler, not to the run: the
        # context engine gone mid-run must fail the run, saying so.
        try:
            self._flush_notices()
        except OSError as exc:
            self._notices.clear()
            self.fail(f"could not notify the context engine: {exc}")

    def _flush_notices(self) -> None:
        if self._notices:
            os.write(self.notify_fd, "".join(f"{line}\n" for line in self._notices).encode())
            self._notices.clear()

    def _tick(self, flush: bool = False) -> None:
        if self.progress_fd is None:
            return
        self._unreported += 1 if not flush else 0
        now = time.monotonic()
        if self._unreported and (flush or now - self._reported_at >= _PROGRESS_EVERY_S):
            with contextlib.suppress(BlockingIOError):
                os.write(self.progress_fd, b"." * self._unreported)
                self._unreported = 0
            self._reported_at = now

    async def run(self) -> None:
        try:
            for group in self.plan.groups():
                if self.error:
                    break
                deadline, self.timed_start_ns = self.plan.start_group(group, self.timed_start_ns)
                before = cpu.sample(self.cpu_pids)
                engines_before = cpu.sample(self.engine_pids)
                wall_start = time.monotonic()
                if self.per_slot:
                    self._clear_slots(group)
                await asyncio.gather(
                    *(self._slot(group.slot_items(s, self.plan.in_flight), deadline)
                      for s in range(self.plan.in_flight))
                )  # fmt: skip
                if self.per_slot:
                    self._check_slots(group)
                if self.cpu_pids:
                    self.cpu.append(
                        {"group": group.key, "tokens": group.tokens, "timed": group.timed,
                         "start": before, "end": cpu.sample(self.cpu_pids),
                         "engines_start": engines_before,
                         "engines_end": cpu.sample(self.engine_pids),
                         "wall_s": time.monotonic() - wall_start}
                    )  # fmt: skip
        finally:
            self._tick(flush=True)
            # The context engine may be gone already (its sequence ended, or it failed).
            with contextlib.suppress(BrokenPipeError):
                self._notices.append(_END)
                self._flush_notices()

    def _clear_slots(self, group: Group) -> None:
        self._slot_records = {}
        for s in range(self.plan.in_flight):
            blocks = self.plan.dst_for(group.slot_item(s))
            self.content.clear(self.region.array, self.layout, blocks)
        self.content.synchronize()  # device pools: zeros first, then the daemon's writes

    def _check_slots(self, group: Group) -> None:
        """--verify slot: every slot that moved a request holds its slot's content; its
        requests are verified together (as the raw pair's are)."""
        for s, records in sorted(self._slot_records.items()):
            done = [r for r in records if r.status == Status.DONE]
            if not done:
                continue
            result = self.content.verify(
                self.region.array,
                self.layout,
                self.plan.dst_for(group.slot_item(s)),
                group.slot_seed(s),
                group.tokens,
            )
            for rec in done:
                rec.verified = result.ok
                rec.verify_error = result.first_mismatch or ""
            if not result.ok:
                self.fail(
                    f"group {group.key} slot {s} (requests {done[0].request_id} to "
                    f"{done[-1].request_id}): verification failed: {result.first_mismatch}"
                )

    async def _slot(self, items: Any, deadline: float | None) -> None:
        for item in items:
            if self.error or (deadline is not None and time.monotonic() >= deadline):
                return
            await self._one(item)

    async def _one(self, item: Item) -> None:
        pool = self.region.array
        blocks = self.plan.dst_for(item)
        rec = GenRecord(item.request_id, item.slot, item.tokens, item.timed)
        self.records.append(rec)
        if self.per_slot:
            self._slot_records.setdefault(item.slot, []).append(rec)
        else:
            self.content.clear(pool, self.layout, blocks)
            self.content.synchronize()  # device pools: zeros first, then the daemon's writes
        rec.t_post_ns = time.monotonic_ns()
        # Started, not awaited: the context engine hears of the request right away (its
        # send waits for our daemon's request in any case), and the slot's coroutine steps
        # once a request. A refused receive fails `done`.
        done = self.client.start_recv(
            item.request_id,
            self.pool_id,
            blocks,
            self.peer,
            item.tokens,
            auto_release=True,
            timeout_s=self.wait_s,
        )
        self._notify(f"{item.slot} {item.request_id}")
        outcome = await done
        rec.t_done_ns = self.client.arrival(item.request_id)
        rec.status, rec.reason, rec.message = outcome.status, outcome.reason, outcome.message
        rec.nbytes = outcome.nbytes
        if outcome.status != Status.DONE:
            self.fail(
                f"request {item.request_id} (generation side): {outcome.status} "
                f"({outcome.reason}): {outcome.message}"
            )
        elif not self.per_slot:  # per slot: checked with its slot at the group's end
            result = self.content.verify(
                pool, self.layout, blocks, request_seed(item.request_id), item.tokens
            )
            rec.verified = result.ok
            rec.verify_error = result.first_mismatch or ""
            if not result.ok:
                self.fail(f"request {item.request_id}: verification failed: {rec.verify_error}")
        self.release(item.request_id)
        self._tick()


@dataclass(eq=False, repr=False)
class ContextSide(_Side):
    notify_fd: int
    wait_s: float
    chunk_blocks: int = 0
    records: list[CtxRecord] = field(default_factory=list, init=False)
    queues: list[asyncio.Queue[str]] = field(init=False)
    sending: set[str] = field(default_factory=set, init=False)
    _cancels: list[asyncio.Task[None]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.queues = [asyncio.Queue() for _ in range(self.plan.in_flight)]

    async def _read_notifications(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        pipe = os.fdopen(self.notify_fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        try:
            while True:
                line = (await reader.readline()).decode().strip()
                if not line or line == _END:
                    break
                slot, request_id = line.split(" ", 1)
                self.queues[int(slot)].put_nowait(request_id)
        finally:
            transport.close()
            for q in self.queues:
                q.put_nowait(_END)
            # The generation engine is done. A send still waiting here can only be one whose
            # receive failed on the other side: cancel it rather than wait for its deadline.
            for request_id in list(self.sending):
                self._cancels.append(asyncio.create_task(self._cancel(request_id)))

    async def _cancel(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.client.cancel(request_id)

    async def run(self) -> None:
        reader = asyncio.create_task(self._read_notifications())
        try:
            await asyncio.gather(*(self._slot(s) for s in range(self.plan.in_flight)))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await asyncio.gather(*self._cancels, return_exceptions=True)

    async def _send(self, item: Item, blocks: list[int]) -> Outcome:
        """One send, or one per chunk of chunk_blocks blocks (a chunked prefill finishing its
        chunks back to back; only the last has last=True); the request's outcome."""
        if not self.chunk_blocks:
            # Started, not awaited (as the generation side's receive): one step a request.
            return await self.client.start_send(
                item.request_id,
                self.pool_id,
                blocks,
                item.tokens,
                auto_release=True,
                timeout_s=self.wait_s,
            )
        tpb = self.layout.tokens_per_block
        step = self.chunk_blocks * tpb
        for start in range(0, item.tokens, step):
            end = min(item.tokens, start + step)
            await self.client.send(
                item.request_id,
                self.pool_id,
                blocks[: -(-end // tpb)],
                end,
                token_start=start,
                last=end == item.tokens,
                auto_release=True,
            )
        return await self.client.wait(item.request_id, self.wait_s)

    def _fill(self, blocks: list[int], seed: int) -> None:
        """Write a request's KV before its send (a subclass may write it chunk by chunk)."""
        self.content.fill(self.region.array, self.layout, blocks, seed)

    async def _slot(self, slot: int) -> None:
        corrupt = os.environ.get(CORRUPT_ENV) == "1"
        for group in self.plan.groups():
            if self.per_slot:
                # --verify slot: the slot's content once for the whole group (the raw pair's
                # way); the first timed group's is wrong on purpose when a test asks.
                seed = group.slot_seed(slot)
                if corrupt and group.timed:
                    seed, corrupt = request_seed(group.key + "-not"), False
                self._fill(self.plan.src_for(group.slot_item(slot)), seed)
                self.content.synchronize()
            for item in group.slot_items(slot, self.plan.in_flight):
                blocks = self.plan.src_for(item)
                posted = await self.queues[slot].get()
                if posted == _END:
                    return
                if posted != item.request_id:
                    self.fail(
                        f"slot {slot}: the generation engine posted {posted}, "
                        f"expected {item.request_id}"
                    )
                    return
                # Filled just before the send, as a prefill writes its KV just before it is
                # sent: memory left untouched for a while is slow to read on some hosts
                # (this 2-core VM: ~10 ms per 4 MiB after 0.2 s), and the raw pair fills
                # right before its post too.
                if not self.per_slot:
                    seed = request_seed(item.request_id)
                    if corrupt and item.timed:
                        seed, corrupt = request_seed(item.request_id + "-not"), False
                    self._fill(blocks, seed)
                    self.content.synchronize()  # device pools: the KV is there before the send
                rec = CtxRecord(item.request_id)
                self.records.append(rec)
                self.sending.add(item.request_id)
                rec.t_send_ns = time.monotonic_ns()
                outcome = await self._send(item, blocks)
                rec.t_done_ns = self.client.arrival(item.request_id)
                self.sending.discard(item.request_id)
                rec.status, rec.reason, rec.message = (
                    outcome.status,
                    outcome.reason,
                    outcome.message,
                )
                if outcome.status != Status.DONE:
                    self.fail(
                        f"request {item.request_id} (context side): {outcome.status} "
                        f"({outcome.reason}): {outcome.message}"
                    )
                self.release(item.request_id)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan.load(args.plan)
    layout = plan.layout()
    report: dict[str, Any] = {"role": args.role, "pool_bytes": layout.pool_bytes, "error": ""}
    client = await StampingClient.connect(args.socket, engine=f"bench-{args.role}")
    assert isinstance(client, StampingClient)
    region: MemfdRegion | DevicePool
    huge_pages = pool_huge_pages()
    if args.memory == "vram":
        from kvxferd.memory.device import DevicePool

        region = DevicePool.create(
            layout.pool_bytes, args.cuda_device, vmm=args.vram_share == "vmm"
        )
    else:
        # A sealed memfd, handed over: the way docs/engine-integration.md tells engines to
        # share a pool (a pool shared by shm name costs the daemon an fstat a request, its
        # guard against a shrink). Shared memory of normal pages like the raw pair's
        # /dev/shm buffers; on huge pages with kvxferd bench --huge-pages (hugepages.py).
        region = MemfdRegion.create(
            layout.pool_bytes, f"kvxferd-bench-{args.role}", huge_pages=huge_pages
        )
        if huge_pages != "off":
            report["pages"] = region.pages.to_status()
    side: GenerationSide | ContextSide | None = None
    try:
        if isinstance(region, MemfdRegion):
            await client.register_pool(args.pool_id, region, layout)
        else:
            await register_device_pool(client, args.pool_id, region, layout, TpRank())
        if args.role == "generation":
            side = GenerationSide(
                client,
                plan,
                region,
                args.pool_id,
                args.peer,
                args.notify_fd,
                args.progress_fd,
                args.wait_timeout,
                tuple(args.cpu_pids),
                (*args.engine_pids, os.getpid()),
            )
        else:
            from kvxferd.bench.pipeline import ComputingContextSide

            side_class = ComputingContextSide if args.chunk_tokens else ContextSide
            side = side_class(
                client,
                plan,
                region,
                args.pool_id,
                args.notify_fd,
                args.wait_timeout,
                args.chunk_blocks,
            )
            if isinstance(side, ComputingContextSide):
                side.compute(args.chunk_tokens, args.compute_ms / 1e3)
        await side.run()
        await side.settle()
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
    finally:
        with contextlib.suppress(Exception):
            await client.deregister_pool(args.pool_id)
        await client.close()
        region.close()
    if side is not None:
        report["error"] = report["error"] or side.error
        report["records"] = [asdict(r) for r in side.records]
        if isinstance(side, GenerationSide):
            report["timed_start_ns"] = side.timed_start_ns
            report["cpu"] = side.cpu
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvxferd.bench.engine")
    p.add_argument("--role", choices=["context", "generation"], required=True)
    p.add_argument("--socket", required=True, help="the daemon's engine API socket")
    p.add_argument("--plan", required=True, help="the run's plan (JSON, written by the driver)")
    p.add_argument("--peer", default="", help="generation: the context daemon's HOST:PORT")
    p.add_argument("--pool-id", default="bench")
    p.add_argument("--notify-fd", type=int, required=True, help="pipe between the two engines")
    p.add_argument("--progress-fd", type=int, default=None, help="one byte per finished request")
    p.add_argument("--wait-timeout", type=float, default=300.0, help="seconds per outcome")
    p.add_argument(
        "--cpu-pids",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default=[],
        help="generation: pids whose CPU seconds are read at each group's start and end",
    )
    p.add_argument(
        "--engine-pids",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default=[],
        help="generation: the other engines' pids, read as --cpu-pids (this one's is added)",
    )
    p.add_argument(
        "--chunk-blocks", type=int, default=0, help="context: send in chunks of this many blocks"
    )
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="context: compute and send each request in prefill chunks of this many tokens",
    )
    p.add_argument("--compute-ms", type=float, default=0.0, help="context: compute per chunk")
    add_memory_args(p)
    args = p.parse_args(argv)
    if args.progress_fd is not None:
        os.set_blocking(args.progress_fd, False)
    keep_freed_heap()  # as the daemons do (service/heap_tuning.py)
    report: dict[str, Any] = {}

    async def run() -> int:
        report.update(await _main(args))
        return 0

    run_event_loop(run)
    json.dump(report, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
