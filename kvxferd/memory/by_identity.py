"""A cache of a pure function's answers keyed by the identity of its arguments.

The write plan and the head checks ask the same few questions about the same few pool
pairs for every request: (our layout, our rank, the receiver's layout, its rank). They were
`functools.lru_cache`d, whose key hashes each argument, and a frozen dataclass hashes in
Python: four Python calls a lookup, ~10 of the ~180 a one-block request costs the context
daemon (docs/benchmarks.md, issue 16). These objects live as long as the pools and peer
announcements they come from, so their identities are the key: a lookup hashes integers.

An argument equal to a cached one but not the same object misses and is answered afresh:
correct, only slower. The cache keeps its arguments alive, so an id in it is never reused
by another object; full, it starts over (a daemon sees a handful of pairs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

P = ParamSpec("P")
R = TypeVar("R")

MAX_ENTRIES = 256


class _ByIdentity:
    def __init__(self, fn: Callable[..., Any], max_entries: int) -> None:
        self._fn = fn
        self._max = max_entries
        self._answers: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", "by_identity")

    def __call__(self, *args: Any) -> Any:
        key = tuple(map(id, args))
        found = self._answers.get(key)
        if found is not None:
            return found[1]
        answer = self._fn(*args)
        if len(self._answers) >= self._max:
            self._answers.clear()
        self._answers[key] = (args, answer)  # the arguments kept: their ids stay theirs
        return answer

    def cache_clear(self) -> None:
        self._answers.clear()

    def __len__(self) -> int:
        return len(self._answers)


def by_identity(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` (called with positional arguments only, its answer depending on their values
    alone), its answers kept by the identity of its arguments."""
    return cast("Callable[P, R]", _ByIdentity(fn, MAX_ENTRIES))
