"""The reference engines' block allocator waiting for blocks, and the announcements the
generation engine makes to the context engine (kvxferd.sim.workload, kvxferd.sim.announce)."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvxferd.sim.announce import ENDED, POSTED, Announcements, Announcer
from kvxferd.sim.workload import BlockAllocator


def test_take_when_free_waits_for_blocks_in_arrival_order() -> None:
    async def scenario() -> None:
        alloc = BlockAllocator(8)
        held = alloc.take(7)  # one free
        big = asyncio.ensure_future(alloc.take_when_free(4))
        small = asyncio.ensure_future(alloc.take_when_free(1))
        await asyncio.sleep(0)
        # The small one fits but must not pass the big one that came first.
        assert not big.done() and not small.done()
        alloc.give(held[:3])  # four free: the big one is served, the small one waits on
        assert len(await big) == 4
        await asyncio.sleep(0)
        assert not small.done()
        alloc.give(held[3:4])
        assert len(await small) == 1
        with pytest.raises(RuntimeError, match="pool too small"):
            await alloc.take_when_free(9)

    asyncio.run(scenario())


def test_a_cancelled_wait_takes_nothing_and_lets_the_next_through() -> None:
    async def scenario() -> None:
        alloc = BlockAllocator(4)
        held = alloc.take(4)
        first = asyncio.ensure_future(alloc.take_when_free(3))
        second = asyncio.ensure_future(alloc.take_when_free(1))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        alloc.give(held[:1])
        assert len(await second) == 1  # not held back behind the cancelled head
        assert alloc.free == 0
        alloc.give(held[1:])
        assert alloc.free == 3, "nothing was lost to the cancelled wait"

    asyncio.run(scenario())


def test_announcements_over_a_pipe() -> None:
    async def scenario() -> None:
        read_fd, write_fd = os.pipe()
        heard = Announcements()
        listening = asyncio.create_task(heard.listen(read_fd))
        say = Announcer(write_fd)
        say(POSTED, "a")
        say(ENDED, "b")  # ended before it was ever posted
        say(POSTED, "c")
        say(ENDED, "c")  # posted, then over
        assert await asyncio.wait_for(heard.wait_posted("a"), 10) is True
        assert await asyncio.wait_for(heard.wait_posted("b"), 10) is False
        await asyncio.wait_for(heard.ended("c").wait(), 10)
        assert not heard.ended("a").is_set()
        heard.forget("a")
        say.close()  # the generation engine is gone: the listener ends
        await asyncio.wait_for(listening, 10)

    asyncio.run(scenario())
