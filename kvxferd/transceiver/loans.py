"""Which receive each lent block belongs to, so that a block takes one receive at a time.

Two receives into one block would let one request's writer overwrite what the other
verifies, and a block held after a failure (its writer not yet fenced) may still be
written. A careless engine reusing either is refused, naming the request that has it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvxferd.errors import RequestError
from kvxferd.service.pools import LocalPool


class BlockLoans:
    def __init__(self) -> None:
        # Keyed by the pool object's id: a held pool of a gone engine is set aside under
        # another pool id, and stays the same object.
        self._by_pool: dict[int, dict[int, str]] = {}

    def lend(
        self, pool: LocalPool, blocks: list[int], request_id: str, held: Callable[[str], bool]
    ) -> None:
        """Put `blocks` on loan to `request_id`, or refuse (`held`: whether the request
        that has a block is held, for the message)."""
        loaned = self._by_pool.setdefault(id(pool), {})
        clash = sorted({b for b in blocks if b in loaned})
        if clash:
            owner = loaned[clash[0]]
            raise RequestError(
                "blocks_on_loan",
                f"pool {pool.pool_id!r}: {len(clash)} block(s) ({clash[:8]}"
                f"{', ...' if len(clash) > 8 else ''}) are still on loan to request "
                f"{owner!r} ({'held until its writer is fenced' if held(owner) else 'in flight'})",
            )
        for b in blocks:
            loaned[b] = request_id

    def give_back(self, pool: LocalPool | None, blocks: list[int], request_id: str) -> None:
        if pool is None:
            return
        loaned = self._by_pool.get(id(pool), {})
        for b in blocks:
            if loaned.get(b) == request_id:
                del loaned[b]
        if not loaned:
            self._by_pool.pop(id(pool), None)
