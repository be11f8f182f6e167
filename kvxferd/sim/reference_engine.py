"""The reference engine's workload driver (ReferenceEngine): a stand-in for an inference
server's scheduler, used by `python -m kvxferd.sim.engine` (kvxferd/sim/engine.py, its
command line; the module doc there says what it does and how it runs), by the demo and by
tests that drive an engine in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvxferd.client import AsyncClient, CallError
from kvxferd.memory.heads import TpRank, overlapping_ranks
from kvxferd.memory.hugepages import HugePagesMode
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.memfd import HostRegion, MemfdRegion
from kvxferd.memory.shm import ShmRegion
from kvxferd.sim.announce import ENDED, POSTED, Announcements
from kvxferd.sim.content import request_seed
from kvxferd.sim.engine_pools import (
    MEMORY,
    VRAM_SHARE,
    HostContent,
    register_device_pool,
)
from kvxferd.sim.workload import BlockAllocator, Item
from kvxferd.transceiver.state import Outcome, Status

if TYPE_CHECKING:
    from kvxferd.memory.device import DevicePool

T = TypeVar("T")


log = logging.getLogger("kvxferd.sim")

#: How long close() waits for held blocks to be released before deregistering.
RELEASE_WAIT_S = 60.0


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
    blocks_held: bool = False  # the outcome said a write may still land in its blocks


@dataclass
class EngineReport:
    role: str
    records: list[Record] = field(default_factory=list)
    pool_bytes: int = 0
    # CPU seconds (every thread) the engine spent in its workload, for the demo's and
    # benchmarks' account of where a host's cores went.
    cpu_s: float = 0.0


@dataclass
class Rank:
    """One tensor-parallel rank of the engine: its daemon link and its pool."""

    client: AsyncClient
    tp: TpRank
    # A sealed memfd, (shm_names=True) a POSIX shm object, or (vram) a device pool.
    region: HostRegion | DevicePool | None = None
    peers: str | list[str] = ""  # generation: the context daemon(s) holding its heads


def context_peers_for(
    gen_tp: TpRank, heads_per_gen_rank: int, context_peers: Sequence[str]
) -> str | list[str]:
    """The context daemons (given in context rank order) that hold a generation rank's heads:
    one name when one rank does (equal sizes, head-split), a list for a head-merge."""
    ctx_size = len(context_peers)
    total = heads_per_gen_rank * gen_tp.size
    if total % ctx_size:
        raise ValueError(f"{total} KV heads cannot be split over {ctx_size} context ranks")
    heads = (gen_tp.rank * heads_per_gen_rank, (gen_tp.rank + 1) * heads_per_gen_rank)
    names = [context_peers[r] for r in overlapping_ranks(heads, total // ctx_size, ctx_size)]
    return names[0] if len(names) == 1 else names


class ReferenceEngine:
    """`client`: one daemon link, or one per tensor-parallel rank (rank order); `layout` is
    each rank's pool (num_kv_heads: the heads one rank holds). `memory` "vram": every rank's
    pool is on CUDA device `cuda_device`, shared by `vram_share` (see the module doc of
    kvxferd/sim/engine.py)."""

    def __init__(
        self,
        client: AsyncClient | Sequence[AsyncClient],
        layout: KvLayout,
        pool_id: str,
        *,
        memory: str = "host",
        vram_share: str = "ipc",
        cuda_device: int = 0,
        huge_pages: HugePagesMode = "off",
    ) -> None:
        if memory not in MEMORY or vram_share not in VRAM_SHARE:
            raise ValueError(f"memory {memory!r} / vram_share {vram_share!r}: unknown")
        clients = [client] if isinstance(client, AsyncClient) else list(client)
        self.ranks = [Rank(c, TpRank(i, len(clients))) for i, c in enumerate(clients)]
        self.client = clients[0]
        self.layout = layout
        self.pool_id = pool_id
        self.memory = memory
        self.vram_share = vram_share
        self.cuda_device = cuda_device
        # Host pools' pages (kvxferd.memory.hugepages): "auto" takes huge pages where the
        # host allows, "required" fails open() where it does not.
        self.huge_pages = huge_pages
        self.content: Any = HostContent()
        if memory == "vram":
            from kvxferd.sim.device_content import DeviceContent

            self.content = DeviceContent(cuda_device)
        self.alloc = BlockAllocator(layout.num_blocks)
        self._returning: set[asyncio.Task[None]] = set()  # held blocks waiting for release
        # Blocks never handed out again: their request failed with another rank's request
        # still live (_abandon).
        self.abandoned_blocks = 0
        # Generation-first coordination between the two engines of a run
        # (kvxferd.sim.announce): the generation engine announces each posted receive
        # and each that ended without its KV; the context engine sends a request only
        # once it was posted, and not (or no longer) once it ended.
        self.notify: Callable[[str, str], None] | None = None
        self.announced: Announcements | None = None
        # Generation: a receive the daemon refuses (CallError) is recorded as a failed
        # request with the refusal's code as its reason, instead of ending the run.
        self.refusals_are_outcomes = False

    @property
    def region(self) -> HostRegion | DevicePool | None:
        """Rank 0's pool (the only one without tensor parallelism)."""
        return self.ranks[0].region

    def set_context_peers(self, context_peers: Sequence[str]) -> None:
        """Generation: the context daemons in context rank order; each rank reads from the
        ones holding its heads."""
        for rank in self.ranks:
            rank.peers = context_peers_for(rank.tp, self.layout.num_kv_heads, context_peers)

    async def open(self, shm_names: bool = False) -> None:
        """Create and register each rank's pool: a sealed memfd handed to the daemon (so
        nothing here can shrink it under the daemon), or with `shm_names` the legacy POSIX
        shm object shared by name (kept for the compatibility tests). With vram, a device
        pool per rank instead."""
        if self.memory == "vram":
            await self._open_device()
            return
        for rank in self.ranks:
            name = f"kvxferd-sim-{self.pool_id}-{os.getpid()}-{rank.tp.rank}"
            if not shm_names:
                memfd = MemfdRegion.create(self.layout.pool_bytes, name, huge_pages=self.huge_pages)
                try:
                    await rank.client.register_pool(
                        self.pool_id, memfd, self.layout, rank.tp.rank, rank.tp.size
                    )
                except BaseException:
                    memfd.close()  # not registered: nothing to deregister, no fd left open
                    raise
                rank.region = memfd
                continue
            shm = ShmRegion.create(name, self.layout.pool_bytes)
            rank.region = shm
            try:
                await rank.client.register_pool(
                    self.pool_id, name, self.layout, rank.tp.rank, rank.tp.size
                )
            finally:
                # Both mappings stay valid; the name is not needed any more and
                # unlinking now means a crash leaves nothing behind in /dev/shm.
                shm.unlink()

    async def _open_device(self) -> None:
        from kvxferd.memory.device import DevicePool

        for rank in self.ranks:
            pool = DevicePool.create(
                self.layout.pool_bytes, self.cuda_device, vmm=self.vram_share == "vmm"
            )
            try:
                await register_device_pool(rank.client, self.pool_id, pool, self.layout, rank.tp)
            except BaseException:
                pool.close()  # not registered: nothing for the daemon to let go of
                raise
            rank.region = pool

    async def close(self) -> None:
        # Blocks of receives that ended while a write could still land stay the daemon's
        # until it releases them (fencing), and it refuses to deregister a pool they are
        # in: wait for those releases first (bounded: a hold that never ends fails the
        # deregistration below, with the daemon's reason).
        if self._returning:
            await asyncio.wait(set(self._returning), timeout=RELEASE_WAIT_S)
        for rank in self.ranks:
            try:
                if rank.region is not None:
                    await rank.client.deregister_pool(self.pool_id)
            finally:
                if rank.region is not None:
                    rank.region.close()

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.layout.tokens_per_block)

    async def _each(self, call: Callable[[Rank], Awaitable[T]]) -> list[T]:
        return list(await asyncio.gather(*(call(rank) for rank in self.ranks)))

    @staticmethod
    def _record(rec: Record, outcomes: list[Outcome]) -> None:
        """One record for all ranks: done only if every rank is; else the first failure
        (naming its rank when there are several)."""
        # A rank we cancelled because another failed says "cancelled": report the cause.
        failed = [o for o in outcomes if o.status != Status.DONE]
        bad = next((o for o in failed if o.status != Status.CANCELLED), None) or next(
            iter(failed), None
        )
        first = bad or outcomes[0]
        rec.status, rec.reason, rec.message = first.status, first.reason, first.message
        if bad is not None and len(outcomes) > 1:
            rec.message = f"rank {outcomes.index(bad)}: {bad.message}"
        rec.nbytes = sum(o.nbytes for o in outcomes)

    async def _begin(self, item: Item) -> tuple[Record, list[int], int]:
        """A request's record, its blocks (taken from the allocator, waiting for them while
        the pool is full: the caller gives them back) and the seed of its content."""
        rec = Record(item.request_id, item.num_tokens)
        blocks = await self.alloc.take_when_free(self.blocks_for(item.num_tokens))
        return rec, blocks, request_seed(item.request_id)

    async def send_one(self, item: Item) -> Record:
        rec, blocks, seed = await self._begin(item)
        try:
            for rank in self.ranks:
                assert rank.region is not None
                self.content.fill(rank.region.array, self.layout, blocks, seed, tp=rank.tp)
            # Device pools: the KV must be on the device before the daemon reads it.
            self.content.synchronize()
            rec.t_start_ns = time.monotonic_ns()

            async def send(rank: Rank) -> Outcome:
                await rank.client.send(
                    item.request_id, self.pool_id, blocks, item.num_tokens, auto_release=True
                )
                outcome = await self._outcome_or_cancel(rank, item.request_id)
                await rank.client.release(item.request_id)
                return outcome

            try:
                outcomes = await self._each(send)
            except BaseException:
                blocks = self._abandon(item.request_id, blocks)
                raise
            if self.announced is not None:
                self.announced.forget(item.request_id)
            rec.t_end_ns = time.monotonic_ns()
            self._record(rec, outcomes)
            rec.blocks_held = any(o.blocks_held for o in outcomes)
            # A write drained rather than cancelled still reads these blocks.
            blocks = self._give_later(item.request_id, blocks, outcomes)
        finally:
            self.alloc.give(blocks)
        return rec

    async def _outcome_or_cancel(self, rank: Rank, request_id: str) -> Outcome:
        """The send's outcome. Should the generation engine say its receive ended first,
        the send is cancelled (its outcome then comes at once) rather than left to wait
        for a receiver that will not come: a send still writing ends on its own."""
        waiting = asyncio.ensure_future(rank.client.wait(request_id))
        if self.announced is None:
            return await waiting
        ended = asyncio.ensure_future(self.announced.ended(request_id).wait())
        try:
            await asyncio.wait({waiting, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                # CallError: finished, its outcome on its way; "busy": a write in flight.
                with contextlib.suppress(CallError):
                    await rank.client.cancel(request_id)
            return await waiting
        finally:
            ended.cancel()

    async def recv_one(self, item: Item, peer: str | None = None) -> Record:
        rec, blocks, seed = await self._begin(item)
        try:
            for rank in self.ranks:
                assert rank.region is not None
                self.content.clear(rank.region.array, self.layout, blocks)
            # Device pools: the zeros must land before the daemon's writes, not after them.
            self.content.synchronize()
            rec.t_start_ns = time.monotonic_ns()
            accepted: list[Rank] = []  # ranks whose receive is live on their daemon
            try:
                refused = await self._post_receives(item, blocks, peer, accepted)
                if refused is not None:
                    rec.status, rec.reason = Status.FAILED, refused.code
                    rec.message = refused.message
                    rec.t_end_ns = time.monotonic_ns()
                    if self.notify is not None:
                        self.notify(ENDED, item.request_id)  # the context side drops it
                    return rec
                if self.notify is not None:
                    self.notify(POSTED, item.request_id)  # the context may send now
                outcomes = await self._rank_outcomes(item.request_id)
            except BaseException:
                if accepted:
                    blocks = self._abandon(item.request_id, blocks)
                raise
            rec.t_end_ns = time.monotonic_ns()
            self._record(rec, outcomes)
            rec.blocks_held = any(o.blocks_held for o in outcomes)
            if rec.status == Status.DONE:
                rec.verified = True
                for rank in self.ranks:
                    assert rank.region is not None
                    result = self.content.verify(
                        rank.region.array, self.layout, blocks, seed, item.num_tokens, tp=rank.tp
                    )
                    if not result.ok:
                        rec.verified = False
                        rec.verify_error = f"rank {rank.tp.rank}: {result.first_mismatch}"
                        break
            if rec.status != Status.DONE and self.notify is not None:
                self.notify(ENDED, item.request_id)  # the context side drops or cancels it
            for rank in self.ranks:
                await rank.client.release(item.request_id)
            blocks = self._give_later(item.request_id, blocks, outcomes)
        finally:
            self.alloc.give(blocks)
        return rec

    async def _post_receives(
        self, item: Item, blocks: list[int], peer: str | None, accepted: list[Rank]
    ) -> CallError | None:
        """Post the receive on every rank, adding each that accepts to `accepted`. A refusal
        before any rank accepted (the peer named is unknown to discovery, say) is returned
        when refusals are outcomes; any other failure is raised, also once a rank accepted
        (its receive is in flight then)."""
        for rank in self.ranks:
            peers = peer if peer and len(self.ranks) == 1 else rank.peers
            try:
                await rank.client.recv(
                    item.request_id, self.pool_id, blocks, peers, item.num_tokens, auto_release=True
                )
            except CallError as exc:
                if not self.refusals_are_outcomes or accepted:
                    raise
                return exc
            accepted.append(rank)
        return None

    async def _rank_outcomes(self, request_id: str) -> list[Outcome]:
        """Every rank's outcome of a receive, in rank order. One rank's failure dooms the
        request (each rank holds only its heads): the other ranks' receives are cancelled
        then, as a real engine aborts the request, instead of each waiting out its deadline
        for a context side that serves a request only once every rank asked for it."""
        waits: dict[asyncio.Future[Outcome], Rank] = {
            asyncio.ensure_future(rank.client.wait(request_id)): rank for rank in self.ranks
        }
        pending: set[asyncio.Future[Outcome]] = set(waits)
        doomed = False
        try:
            while pending:
                ended, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if not doomed and any(t.result().status != Status.DONE for t in ended):
                    doomed = True
                    for t in pending:
                        # CallError: it just ended too; "busy": a write in flight ends by itself.
                        with contextlib.suppress(CallError):
                            await waits[t].client.cancel(request_id)
            return [t.result() for t in waits]
        finally:
            # Leaving early (a rank's daemon went away): the first failure is what goes on.
            # The other waits are cancelled or their failures read here: left alone, each
            # printed "Task exception was never retrieved" with a traceback.
            for t in waits:
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()

    def _abandon(self, request_id: str, blocks: list[int]) -> list[int]:
        """A request of several ranks failed without every rank's outcome (a rank's daemon
        went away, or refused after another rank accepted): the other ranks' daemons may
        still write into these blocks (a receive) or read them (a send). Their requests are
        cancelled, and the blocks are never reused: nothing proves those daemons done with
        them. The blocks to give back now: none."""
        if not blocks:
            return blocks
        # Once at warning level: a daemon going away fails every request in flight at once.
        level = logging.DEBUG if self.abandoned_blocks else logging.WARNING
        self.abandoned_blocks += len(blocks)
        log.log(
            level,
            "request %s: a rank's daemon failed it mid-way; its %d blocks are not reused "
            "(%d in all)",
            request_id,
            len(blocks),
            self.abandoned_blocks,
        )
        task = asyncio.create_task(self._cancel_everywhere(request_id))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)
        return []

    async def _cancel_everywhere(self, request_id: str) -> None:
        """Best effort: a rank whose daemon is gone, or whose request already ended,
        refuses; a write in flight answers busy and ends on its own."""
        for rank in self.ranks:
            with contextlib.suppress(Exception):
                await rank.client.cancel(request_id)

    def _give_later(self, request_id: str, blocks: list[int], outcomes: list[Outcome]) -> list[int]:
        """The blocks to give back now: none when a rank's outcome held them (a write may
        still land there, or a drained write still read them); those go back to the free
        list only when every such rank's daemon says so, never on a timer."""
        held = [r for r, o in zip(self.ranks, outcomes, strict=True) if o.blocks_held]
        if not held:
            return blocks
        task = asyncio.create_task(self._give_when_released(request_id, blocks, held))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)
        return []

    async def _give_when_released(
        self, request_id: str, blocks: list[int], held: list[Rank]
    ) -> None:
        try:
            await asyncio.gather(*(rank.client.wait_released(request_id) for rank in held))
        except Exception as exc:  # the daemon went away: those blocks are never reused
            log.warning(
                "request %s: %d held blocks never released: %s", request_id, len(blocks), exc
            )
            return
        self.alloc.give(blocks)

    async def run(
        self,
        items: list[Item],
        in_flight: int,
        peer: str | None,
        progress: bool = False,
    ) -> list[Record]:
        """Run the workload: as the generation engine when `peer` is given (a context
        daemon, or "" when set_context_peers() named them per rank), else as the context
        engine."""
        sem = asyncio.Semaphore(in_flight)
        done = 0

        async def one(item: Item) -> Record:
            nonlocal done
            announced = self.announced if peer is None else None
            if announced is not None and not await announced.wait_posted(item.request_id):
                announced.forget(item.request_id)
                done += 1
                return _not_sent(item)
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


def _not_sent(item: Item) -> Record:
    """A context engine's record of a request whose receive ended before it was sent."""
    return Record(
        item.request_id,
        item.num_tokens,
        status=Status.FAILED,
        reason="receive_ended",
        message="the generation engine's receive ended before the context engine sent it",
    )
