"""Deterministic workloads shared by the two reference engines of a run.

Both engines derive the same list of (request id, prompt length) from a seed,
so they agree on every request without talking to each other.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    request_id: str
    num_tokens: int


def make_workload(
    seed: int, count: int, min_tokens: int, max_tokens: int, prefix: str = "req"
) -> list[Item]:
    rng = random.Random(seed)
    return [Item(f"{prefix}-{seed}-{i}", rng.randint(min_tokens, max_tokens)) for i in range(count)]


def fixed_workload(seed: int, count: int, tokens: int, prefix: str = "req") -> list[Item]:
    return [Item(f"{prefix}-{seed}-{i}", tokens) for i in range(count)]


class BlockAllocator:
    """A free list of block ids. Blocks come back in completion order, so
    concurrent requests end up with scattered, non-contiguous blocks as in a
    real engine's cache."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Requests waiting for blocks (take_when_free), served in arrival order.
        self._waiting: deque[tuple[int, asyncio.Future[list[int]]]] = deque()

    @property
    def free(self) -> int:
        return len(self._free)

    def shuffle(self, seed: int) -> None:
        """Scatter future allocations over the pool, as in a long-running engine."""
        free = list(self._free)
        random.Random(seed).shuffle(free)
        self._free = deque(free)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"pool exhausted: need {count} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    async def take_when_free(self, count: int) -> list[int]:
        """`count` blocks, waiting until that many are free, as a real engine's scheduler
        holds a request back while its cache is full (blocks a daemon holds after a failed
        receive come back only once it says they are released: that can be long while a
        writer is stopped). First come, first served: a large request is not starved by
        smaller ones. Raises at once for more blocks than the pool has."""
        if count > self.num_blocks:
            raise RuntimeError(f"pool too small: need {count} blocks, it has {self.num_blocks}")
        if not self._waiting and count <= len(self._free):
            return self.take(count)
        got: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((count, got))
        try:
            return await got
        except asyncio.CancelledError:
            if got.done() and not got.cancelled():
                self.give(got.result())  # served as it was cancelled: hand them on
            else:
                self._waiting = deque(w for w in self._waiting if w[1] is not got)
                self._serve()  # it may have been the head that kept others waiting
            raise

    def give(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
        self._serve()

    def _serve(self) -> None:
        while self._waiting and self._waiting[0][0] <= len(self._free):
            count, got = self._waiting.popleft()
            if not got.done():
                got.set_result(self.take(count))
