"""The reference engine: a stand-in for an inference server, for demo, tests and bench.

It allocates a KV pool in POSIX shared memory, shares it with its daemon through
kvxferd.client, and runs a workload. As the context engine it fills every
source block with content derived from (request, block, layer, kv, token) and
sends it; as the generation engine it zeroes the destination blocks, posts the
receive and verifies every byte that arrives.

Run as `python -m kvxferd.sim.engine --role context|generation ...`; it prints
one JSON object with per-request records on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvxferd.client import AsyncClient
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.shm import ShmRegion
from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed, verify_blocks
from kvxferd.sim.workload import BlockAllocator, Item, fixed_workload, make_workload
from kvxferd.transceiver.state import Status


@dataclass
class Record:
    request_id: str
    num_tokens: int
    status: str = ""
    reason: str = ""
    message: str = ""
    verified: bool = False
    nbytes: int = 0
    t_start_ns: int = 0  # context: just before send; generation: just before recv
    t_end_ns: int = 0  # when the outcome arrived (and, generation side, was verified)
    verify_error: str = ""


@dataclass
class EngineReport:
    role: str
    records: list[Record] = field(default_factory=list)
    pool_bytes: int = 0


class ReferenceEngine:
    def __init__(self, client: AsyncClient, layout: KvLayout, pool_id: str) -> None:
        self.client = client
        self.layout = layout
        self.pool_id = pool_id
        self.region: ShmRegion | None = None
        self.alloc = BlockAllocator(layout.num_blocks)
        # Generation-first coordination between the two engines of a run: the
        # generation engine announces each posted receive; the context engine
        # sends a request only once it was announced (as a real scheduler would).
        self.notify: Callable[[str], None] | None = None
        self.posted: dict[str, asyncio.Event] | None = None

    async def open(self) -> None:
        name = f"kvxferd-sim-{self.pool_id}-{os.getpid()}"
        self.region = ShmRegion.create(name, self.layout.pool_bytes)
        try:
            await self.client.register_pool(self.pool_id, name, self.layout)
        finally:
            # Both mappings stay valid; the name is not needed any more and
            # unlinking now means a crash leaves nothing behind in /dev/shm.
            self.region.unlink()

    async def close(self) -> None:
        try:
            await self.client.deregister_pool(self.pool_id)
        finally:
            if self.region is not None:
                self.region.close()

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.layout.tokens_per_block)

    async def send_one(self, item: Item) -> Record:
        assert self.region is not None
        rec = Record(item.request_id, item.num_tokens)
        blocks = self.alloc.take(self.blocks_for(item.num_tokens))
        try:
            fill_blocks(self.region.array, self.layout, blocks, request_seed(item.request_id))
            rec.t_start_ns = time.monotonic_ns()
            await self.client.send(item.request_id, self.pool_id, blocks, item.num_tokens)
            outcome = await self.client.wait(item.request_id)
            rec.t_end_ns = time.monotonic_ns()
            rec.status, rec.reason, rec.message = outcome.status, outcome.reason, outcome.message
            rec.nbytes = outcome.nbytes
            await self.client.release(item.request_id)
        finally:
            self.alloc.give(blocks)
        return rec

    async def recv_one(self, item: Item, peer: str) -> Record:
        assert self.region is not None
        rec = Record(item.request_id, item.num_tokens)
        blocks = self.alloc.take(self.blocks_for(item.num_tokens))
        try:
            clear_blocks(self.region.array, self.layout, blocks)
            rec.t_start_ns = time.monotonic_ns()
            await self.client.recv(item.request_id, self.pool_id, blocks, peer, item.num_tokens)
            if self.notify is not None:
                self.notify(item.request_id)  # generation-first: the context may send now
            outcome = await self.client.wait(item.request_id)
            rec.status, rec.reason, rec.message = outcome.status, outcome.reason, outcome.message
            rec.nbytes = outcome.nbytes
            rec.t_end_ns = time.monotonic_ns()
            if outcome.status == Status.DONE:
                result = verify_blocks(
                    self.region.array,
                    self.layout,
                    blocks,
                    request_seed(item.request_id),
                    item.num_tokens,
                )
                rec.verified = result.ok
                rec.verify_error = result.first_mismatch or ""
            await self.client.release(item.request_id)
        finally:
            self.alloc.give(blocks)
        return rec

    async def run(
        self, items: list[Item], in_flight: int, peer: str | None, progress: bool = False
    ) -> list[Record]:
        sem = asyncio.Semaphore(in_flight)
        done = 0

        async def one(item: Item) -> Record:
            nonlocal done
            if peer is None and self.posted is not None:
                await self.posted.setdefault(item.request_id, asyncio.Event()).wait()
            async with sem:
                if peer is None:
                    rec = await self.send_one(item)
                else:
                    rec = await self.recv_one(item, peer)
            done += 1
            if progress:
                print(f"\r{done}/{len(items)}", end="", file=sys.stderr, flush=True)
            return rec

        records = await asyncio.gather(*(one(i) for i in items))
        if progress:
            print(file=sys.stderr)
        return list(records)


def layout_from_args(args: argparse.Namespace) -> KvLayout:
    return KvLayout(
        num_layers=args.layers,
        kv_factor=2,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        tokens_per_block=args.tokens_per_block,
        dtype=args.dtype,
        major=args.layout,
        num_blocks=args.pool_blocks,
    )


def add_geometry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--layout", choices=["block-major", "layer-major"], default="block-major")


async def _main(args: argparse.Namespace) -> EngineReport:
    layout = layout_from_args(args)
    client = await AsyncClient.connect(args.socket, engine=f"sim-{args.role}")
    engine = ReferenceEngine(client, layout, args.pool_id)
    if args.tokens is not None:
        items = fixed_workload(args.seed, args.requests, args.tokens, args.prefix)
    else:
        items = make_workload(
            args.seed, args.requests, args.min_tokens, args.max_tokens, args.prefix
        )
    await engine.open()
    reader_task = None
    if args.notify_fd is not None:
        notify_file = os.fdopen(args.notify_fd, "w", buffering=1)

        def announce(request_id: str) -> None:
            notify_file.write(request_id + "\n")

        engine.notify = announce
    if args.wait_fd is not None:
        engine.posted = {}
        reader_task = asyncio.create_task(_read_posted(args.wait_fd, engine.posted))
    try:
        peer = args.peer if args.role == "generation" else None
        records = await engine.run(items, args.in_flight, peer, args.progress)
    finally:
        if reader_task is not None:
            reader_task.cancel()
        await engine.close()
        await client.close()
    return EngineReport(role=args.role, records=records, pool_bytes=layout.pool_bytes)


async def _read_posted(fd: int, posted: dict[str, asyncio.Event]) -> None:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb"))
    while line := await reader.readline():
        posted.setdefault(line.decode().strip(), asyncio.Event()).set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvxferd.sim.engine")
    p.add_argument("--role", choices=["context", "generation"], required=True)
    p.add_argument("--socket", required=True, help="the daemon's engine API socket")
    p.add_argument("--peer", default="", help="generation: the context daemon (name or HOST:PORT)")
    p.add_argument("--pool-id", default="pool0")
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefix", default="req")
    p.add_argument("--min-tokens", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=None, help="fixed prompt length")
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--notify-fd", type=int, help="generation: announce posted receives here")
    p.add_argument("--wait-fd", type=int, help="context: send only announced requests")
    add_geometry_args(p)
    args = p.parse_args(argv)
    report = asyncio.run(_main(args))
    json.dump(asdict(report), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
