"""What an engine client knows of its requests: the outcomes and releases the daemon
pushed, the receives whose blocks are still held, the ids auto-released requests keep
taken, and who waits for which event.

Request ids are unique per context instance only, so every event is kept by request id
and then by the receive's context peer (Outcome.peer; "" for sends and for a daemon too
old to name it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeVar

from kvxferd.api.messages import ReleasedMsg
from kvxferd.client.errors import CallError
from kvxferd.transceiver.state import Outcome

E = TypeVar("E")
K = TypeVar("K")
# One wait for an event of a request: the peer it waits for (None: any) and its future.
_Waiter = tuple["str | None", "asyncio.Future[E]"]
# A request's id as an auto-released request holds it: (request id, side, peer).
IdKey = tuple[str, str, str]


@dataclass(frozen=True)
class Released:
    """Blocks an outcome reported held are back: no write into them can land any more.
    `how`: the fence (abort_ack: the writer confirmed; peer_exited: its process is gone;
    peer_restarted: it came back as a new incarnation; peer_quiescent: it refused our
    stale incarnation and said that nothing of ours is in flight; operator: an operator
    said its process is gone for good, `kvxferd fence`)."""

    request_id: str
    side: str
    how: str
    held_ms: float
    peer: str = ""  # the receive's context peer, as its Outcome.peer


class RequestBook:
    """The client's record of its requests' events; see the module docstring. Used on
    the client's loop only."""

    def __init__(self) -> None:
        # By (request id, side), then by peer.
        self.outcomes: dict[tuple[str, str], dict[str, Outcome]] = {}
        self._waiters: dict[str, list[_Waiter[Outcome]]] = {}
        # Requests whose held blocks came back (ReleasedMsg): by request id, then by peer.
        self._released: dict[str, dict[str, Released]] = {}
        # Receives reported blocks_held, not released yet: by request id, their peers.
        self._held: dict[str, set[str]] = {}
        self._release_waiters: dict[str, list[_Waiter[Released]]] = {}
        # Requests made with auto_release and not released here yet: the daemon frees
        # their ids with the outcome, so the client keeps them taken until the engine
        # releases them (refusing a second request under one, as the daemon does for a
        # request that is not auto-released).
        self.auto_ids: set[IdKey] = set()

    # ------------------------------------------------------ what the daemon pushes

    def on_outcome(self, outcome: Outcome) -> None:
        rid, peer = outcome.request_id, outcome.peer
        # A new outcome is a new request under this id: an earlier release is not its.
        # Either side may hold blocks: a receive that a write may still reach, a send
        # whose drained write still reads them.
        _discard(self._released, rid, peer)
        if outcome.blocks_held:
            self._held.setdefault(rid, set()).add(peer)
        self.outcomes.setdefault((rid, outcome.side), {})[peer] = outcome
        _wake(self._waiters, rid, peer, outcome)

    def on_released(self, msg: ReleasedMsg) -> None:
        released = Released(msg.request_id, msg.side, msg.how, msg.held_ms, msg.peer)
        held = self._held.get(msg.request_id)
        if held is not None:
            held.discard(msg.peer)
            if not held:
                del self._held[msg.request_id]
        self._released.setdefault(msg.request_id, {})[msg.peer] = released
        _wake(self._release_waiters, msg.request_id, msg.peer, released)

    def fail_waiters(self, err: BaseException) -> None:
        """The connection ended: every wait ends with `err`."""
        waiting: list[asyncio.Future[Any]] = [w for ws in self._waiters.values() for _, w in ws]
        waiting += [w for ws in self._release_waiters.values() for _, w in ws]
        for waiter in waiting:
            if not waiter.done():
                waiter.set_exception(err)
        self._waiters.clear()
        self._release_waiters.clear()

    # ------------------------------------------------------ what the engine asks

    def take_id(self, key: IdKey, auto_release: bool, what: str) -> None:
        """Refuse a request under an id an auto-released request still holds here; take
        it for this one if it is auto-released."""
        if key in self.auto_ids:
            raise CallError(
                "duplicate_request",
                f"{what} was made with auto_release and is not released yet; release "
                "it (after its outcome) before reusing the id",
            )
        if auto_release:
            self.auto_ids.add(key)

    def new_receive(self, request_id: str, peer: str) -> None:
        """A release of an earlier request of this id (from this peer) is not the new one's."""
        _discard(self._released, request_id, peer)

    def released_by_daemon(self, request_id: str, peer: str | None) -> None:
        """The daemon accepted a release: forget what is kept of the request."""
        if peer is None:
            for side in ("send", "recv"):
                self.outcomes.pop((request_id, side), None)
            self.auto_ids -= {k for k in self.auto_ids if k[0] == request_id}
        elif not _discard(self.outcomes, (request_id, "recv"), peer):
            self.outcomes.pop((request_id, "send"), None)
            self.auto_ids.discard((request_id, "send", ""))
        else:
            self.auto_ids.discard((request_id, "recv", peer))

    def forget(self, request_id: str, peer: str | None = None) -> bool:
        """AsyncClient.forget: drop an auto-released request's outcome; True if it did."""
        keys: list[tuple[str, str]] = []
        recv = self.outcomes.get((request_id, "recv"))
        if recv:
            if peer is None and len(recv) == 1:
                keys.append(("recv", next(iter(recv))))
            elif peer is not None and (peer in recv or "" in recv):
                keys.append(("recv", peer if peer in recv else ""))
        if (peer is None or not keys) and "" in self.outcomes.get((request_id, "send"), {}):
            keys.append(("send", ""))
        kept = [self.outcomes[(request_id, side)][p] for side, p in keys]
        if not kept or not all(outcome.auto_released for outcome in kept):
            return False
        for side, p in keys:
            _discard(self.outcomes, (request_id, side), p)
            self.auto_ids.discard((request_id, side, p))
        return True

    def poll(self, request_id: str, side: str | None, peer: str | None) -> Outcome | None:
        for s in (side,) if side else ("recv", "send"):
            outcome = _pick(self.outcomes.get((request_id, s)), request_id, peer)
            if outcome is not None:
                return outcome
        return None

    def released(self, request_id: str, peer: str | None) -> Released | None:
        return _pick(self._released.get(request_id), request_id, peer)

    def check_held(self, request_id: str, peer: str | None) -> None:
        """CallError `not_held` for a request with no outcome that reported held blocks."""
        known = self._held.get(request_id, set()) | set(self._released.get(request_id, {}))
        if not known or (peer is not None and peer not in known and "" not in known):
            raise CallError(
                "not_held",
                f"request {request_id!r}{f' from {peer!r}' if peer is not None else ''} "
                "has no held blocks (no outcome with blocks_held)",
            )

    async def wait_outcome(
        self, request_id: str, peer: str | None, timeout_s: float | None
    ) -> Outcome:
        """Wait for the daemon to push the outcome (check poll first)."""
        return await _wait(self._waiters, request_id, peer, timeout_s)

    def outcome_future(self, request_id: str, timeout_s: float | None) -> asyncio.Future[Outcome]:
        """The future of `request_id`'s next outcome (from any peer), for a request started
        without a coroutine waiting on it (AsyncClient.start_send / start_recv). After
        `timeout_s` it fails with TimeoutError and leaves nothing here; so does a refusal
        (drop_waiter). Cancelled by the engine, it stays until the request's outcome."""
        loop = asyncio.get_running_loop()
        waiter: _Waiter[Outcome] = (None, loop.create_future())
        self._waiters.setdefault(request_id, []).append(waiter)
        if timeout_s is not None:
            timer = loop.call_later(timeout_s, self._expire, request_id, waiter[1])
            waiter[1].add_done_callback(lambda _: timer.cancel())
        return waiter[1]

    def _expire(self, request_id: str, fut: asyncio.Future[Outcome]) -> None:
        _time_out(fut)
        self.drop_waiter(request_id, fut)

    def drop_waiter(self, request_id: str, fut: asyncio.Future[Outcome]) -> None:
        """Forget the wait of `fut` (an outcome_future that will not get its outcome)."""
        pending = self._waiters.get(request_id)
        if pending is None:
            return
        pending[:] = [w for w in pending if w[1] is not fut]
        if not pending:
            del self._waiters[request_id]

    async def wait_released(
        self, request_id: str, peer: str | None, timeout_s: float | None
    ) -> Released:
        """Wait for the daemon to push the release (check released first)."""
        return await _wait(self._release_waiters, request_id, peer, timeout_s)


async def _wait(
    waiters: dict[str, list[_Waiter[E]]],
    request_id: str,
    peer: str | None,
    timeout_s: float | None,
) -> E:
    loop = asyncio.get_running_loop()
    waiter: _Waiter[E] = (peer, loop.create_future())
    waiters.setdefault(request_id, []).append(waiter)
    # A timer on the waiter itself rather than asyncio.wait_for, which adds a second future,
    # a done callback and their removal to every wait: an engine waits once per request.
    timer = None if timeout_s is None else loop.call_later(timeout_s, _time_out, waiter[1])
    try:
        return await waiter[1]
    finally:
        if timer is not None:
            timer.cancel()
        # A wait that timed out leaves no future behind (an engine polling with short
        # timeouts would otherwise pile them up until the event came).
        pending = waiters.get(request_id)
        if pending is not None and waiter in pending:
            pending.remove(waiter)
            if not pending:
                del waiters[request_id]


def _time_out(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


def _pick(by_peer: dict[str, E] | None, request_id: str, peer: str | None) -> E | None:
    """The event of `peer` among a request's (by Outcome.peer). An older daemon names no
    peer (""): that one is anyone's. None: the only one, or `ambiguous_request`."""
    if not by_peer:
        return None
    if peer is not None:
        return by_peer.get(peer, by_peer.get(""))
    if len(by_peer) == 1:
        return next(iter(by_peer.values()))
    raise CallError(
        "ambiguous_request",
        f"request {request_id!r} has events from the context peers "
        f"{', '.join(repr(p) for p in by_peer)}; say which (peer=...)",
    )


def _discard(table: dict[K, dict[str, Any]], key: K, peer: str) -> bool:
    """Forget the event of `peer` under `key`; True when there was one."""
    by_peer = table.get(key)
    if by_peer is None or by_peer.pop(peer, None) is None:
        return False
    if not by_peer:
        del table[key]
    return True


def _wake(waiters: dict[str, list[_Waiter[E]]], request_id: str, peer: str, event: E) -> None:
    """Hand `event` (of `peer`) to those waiting for it or for any peer of the request."""
    pending = waiters.get(request_id)
    if not pending:
        return
    keep: list[_Waiter[E]] = []
    for wanted, fut in pending:
        if wanted is None or wanted == peer or not peer:
            if not fut.done():
                fut.set_result(event)
        else:
            keep.append((wanted, fut))
    if keep:
        waiters[request_id] = keep
    else:
        del waiters[request_id]
