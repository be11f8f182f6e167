"""Which receive each lent block belongs to, so that a block takes one receive at a time.

Two receives into one block would let one request's writer overwrite what the other
verifies, and a block held after a failure (its writer not yet fenced) may still be
written. A careless engine reusing either is refused, naming the request that has it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvxferd.errors import RequestError
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.sessions import RxKey


class BlockLoans:
    def __init__(self) -> None:
        # Keyed by the pool object's id: a held pool of a gone engine is set aside under
        # another pool id, and stays the same object.
        # Each block's receive by its identity (context peer, request id): one request id
        # may be taken by receives from several context instances.
        self._by_pool: dict[int, dict[int, RxKey]] = {}

    def lend(
        self, pool: LocalPool, blocks: list[int], owner: RxKey, held: Callable[[RxKey], bool]
    ) -> None:
        """Put `blocks` on loan to the receive `owner`, or refuse (`held`: whether the
        receive that has a block is held, for the message)."""
        loaned = self._by_pool.setdefault(id(pool), {})
        clash = sorted({b for b in blocks if b in loaned})
        if clash:
            has = loaned[clash[0]]
            raise RequestError(
                "blocks_on_loan",
                f"pool {pool.pool_id!r}: {len(clash)} block(s) ({clash[:8]}"
                f"{', ...' if len(clash) > 8 else ''}) are still on loan to request "
                f"{has[1]!r} from {has[0]!r} "
                f"({'held until its writer is fenced' if held(has) else 'in flight'})",
            )
        for b in blocks:
            loaned[b] = owner

    def give_back(self, pool: LocalPool | None, blocks: list[int], owner: RxKey) -> None:
        if pool is None:
            return
        loaned = self._by_pool.get(id(pool), {})
        for b in blocks:
            if loaned.get(b) == owner:
                del loaned[b]
        if not loaned:
            self._by_pool.pop(id(pool), None)
