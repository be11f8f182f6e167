"""Deterministic workloads shared by the two reference engines of a run.

Both engines derive the same list of (request id, prompt length) from a seed,
so they agree on every request without talking to each other.
"""

from __future__ import annotations

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
        self._free: deque[int] = deque(range(num_blocks))

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

    def give(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
