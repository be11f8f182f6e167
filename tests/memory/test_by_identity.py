"""kvxferd.memory.by_identity: answers kept per argument identity, never a wrong one."""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.memory import by_identity as module
from kvxferd.memory.by_identity import by_identity


@dataclass(frozen=True)
class Box:
    value: int


def test_the_same_arguments_are_answered_once_and_equal_others_afresh() -> None:
    asked: list[tuple[int, int]] = []

    @by_identity
    def add(a: Box, b: Box) -> int:
        asked.append((a.value, b.value))
        return a.value + b.value

    one, two = Box(1), Box(2)
    assert [add(one, two) for _ in range(3)] == [3, 3, 3]
    assert asked == [(1, 2)]
    assert add(Box(1), Box(2)) == 3  # equal, other objects: asked again, same answer
    assert add(two, one) == 3  # the order of the arguments is part of the key
    assert len(asked) == 3


def test_a_full_cache_starts_over_and_keeps_its_arguments_alive() -> None:
    @by_identity
    def value(a: Box) -> int:
        return a.value

    for i in range(module.MAX_ENTRIES + 5):
        # Each Box lives only as long as the cache keeps it: a freed one's id could be
        # taken by the next, which must not find the answer of the one before.
        assert value(Box(i)) == i
    assert 0 < len(value) <= module.MAX_ENTRIES  # type: ignore[arg-type]
    value.cache_clear()  # type: ignore[attr-defined]
    assert len(value) == 0  # type: ignore[arg-type]
