"""Requests an engine started without a coroutine waiting for the daemon's reply
(AsyncClient.start_send / start_recv). Their reply matters only when it is a refusal: it
then fails the future of the request's outcome, with the CallError that send or recv
would have raised, and gives back the id the request took."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvxferd.api.messages import Reply
from kvxferd.client.book import IdKey, RequestBook
from kvxferd.client.errors import CallError
from kvxferd.transceiver.state import Outcome


@dataclass(frozen=True, slots=True)
class _Started:
    request_id: str
    outcome: asyncio.Future[Outcome]
    took: IdKey | None  # the auto-released id the request took (RequestBook.take_id)


class StartedCalls:
    """The started calls whose reply has not come yet, by call id. Used on the client's
    loop only."""

    def __init__(self, book: RequestBook) -> None:
        self._book = book
        self._calls: dict[int, _Started] = {}

    def add(
        self, call_id: int, request_id: str, outcome: asyncio.Future[Outcome], took: IdKey | None
    ) -> None:
        self._calls[call_id] = _Started(request_id, outcome, took)

    def forget(self, call_id: int) -> None:
        """The call never left (its write failed): the caller undoes the rest."""
        self._calls.pop(call_id, None)

    def on_reply(self, reply: Reply) -> bool:
        """Take the reply to a started call; False when it is not one."""
        started = self._calls.pop(reply.call_id, None)
        if started is None:
            return False
        if not reply.ok:
            if started.took is not None:
                self._book.auto_ids.discard(started.took)
            self._book.drop_waiter(started.request_id, started.outcome)
            if not started.outcome.done():
                started.outcome.set_exception(CallError(reply.error, reply.message))
        return True

    def clear(self) -> None:
        """The connection ended: the book fails the outcomes' futures (fail_waiters)."""
        self._calls.clear()
