"""Which receivers a send serves: the receivers' RequestData matched to the sessions of the
send coordinator (transceiver/sender.py), and the refusals of those it does not take.

A RequestData becomes a *leg* of its session (kvxferd.transceiver.legs decides which
RequestData are legs and how many the request needs), waits as a *contender*, or is
refused with an Abort that says why; every refusal is counted (`refused`) and logged
within limits.

Whose request it is: a send may name the generation daemon it serves (`peer`, the name
that daemon announced in the handshake). A RequestData from any other daemon is then
refused (`not_your_request`) and the request waits on for the named one. RequestData
usually arrive before the send, when nobody can tell yet whose request it is: the first
is taken as today, and those of other daemons wait as *contenders* instead of being
refused as duplicates, so that a receive posted first by someone else cannot shut out
the real one. The send then keeps the named daemon's and turns the others away; a send
naming nobody keeps the first and refuses the rest as duplicates, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Abort, RequestData
from kvxferd.service.logs import LogLimiter, shown
from kvxferd.transceiver.legs import TxLeg, abort_legs, drop_strangers, refusal
from kvxferd.transceiver.plan import validate_block_ids
from kvxferd.transceiver.sessions import Terminal, TxSession, full
from kvxferd.transceiver.state import Reason, SessionState, Status
from kvxferd.transceiver.tx_peer_share import PeerShare

log = logging.getLogger("kvxferd.sender")


@dataclass(eq=False)
class Matching:
    """The receivers of the coordinator's sessions (`sessions`, shared with it).

    `accepting`: whether the coordinator takes new requests (not while draining);
    `refused`: told the reason of each RequestData refused without being served;
    `max_requests`: most sessions kept (daemon.max_requests, read at each request).
    """

    sessions: dict[str, TxSession]
    accepting: Callable[[], bool]
    refused: Callable[[str], None]
    log_limiter: LogLimiter
    max_requests: Callable[[], int]

    def __post_init__(self) -> None:
        self.shares = PeerShare(self.sessions)  # each peer's share of max_requests

    async def on_request_data(self, conn: PeerConnection, msg: RequestData) -> None:
        dst_layout = conn.layouts.get(msg.pool_id)
        if isinstance(dst_layout, KvLayout):
            # Checked once, first: ids outside the receiver's own pool would reach the
            # write plan as addresses outside it (and a refused one leaves no session).
            try:
                validate_block_ids(dst_layout, msg.blocks)
            except LayoutError as exc:
                message = f"the receive's blocks: {exc}"
                await self.refuse(conn, msg, Reason.BLOCK_MISMATCH, message)
                return
        s = self.sessions.get(msg.request_id)
        if s is None:
            if not self.accepting():
                await self.refuse(conn, msg, Reason.SHUTDOWN, "context daemon is shutting down")
                return
            if full(self.sessions, limit := self.max_requests()):
                message = (
                    f"the context daemon keeps {len(self.sessions)} sends already "
                    f"(daemon.max_requests {limit})"
                )
                await self.refuse(conn, msg, Reason.OVERLOADED, message)
                return
            if not self.shares.room(peer := conn.peer.name, limit):
                message = (
                    f"the context daemon keeps {self.shares.kept_by(peer)} requests of "
                    f"{peer} its engine has not sent, its share (half of "
                    f"daemon.max_requests {limit})"
                )
                await self.refuse(conn, msg, Reason.OVERLOADED, message)
                return
            # Generation-first: remember the request until the engine sends.
            s = TxSession(request_id=msg.request_id, engine=None)
            self.sessions[msg.request_id] = s
            self.shares.note(peer, s)
        elif s.serve_peer and conn.peer.name != s.serve_peer:
            # The send names another daemon: whatever the request's state, not this one's.
            await self.refuse(conn, msg, *self._not_yours(s, TxLeg(conn, msg)))
            return
        elif s.finished and s.terminal is not None:
            await self.refuse(conn, msg, *self._ended(s, conn))
            return
        elif s.leg_of(conn, msg.rx_token) is not None:
            await self._asked_twice(s, conn, msg)
            return
        elif (contender := s.contender_of(conn, msg.rx_token)) is not None:
            # It was never taken: refusing it ends only that receive.
            s.contenders.remove(contender)
            message = f"{conn.peer.name} sent the RequestData of one receive twice"
            await self.refuse(conn, msg, Reason.DUPLICATE_REQUEST, message)
            return
        leg = TxLeg(conn, msg)
        # A further RequestData is another generation rank of a head-split only before
        # anything was written.
        still_open = s.terminal is None and not (s.writing or s.written or s.nbytes)
        refused = refusal(s.pool, s.legs, leg, still_open)
        if refused is not None:
            if (
                s.engine is None
                and refused[0] == Reason.DUPLICATE_REQUEST
                and all(each.conn.peer.name != conn.peer.name for each in s.legs + s.contenders)
            ):
                # Before the send nobody can tell whose request this is: the send may name
                # this daemon, so it waits (one per daemon) instead of being refused.
                s.contenders.append(leg)
                return
            await self.refuse(conn, msg, *refused)
            return
        self._take(s, leg)

    def match(self, conn: PeerConnection, request_id: str, rx_token: int) -> TxSession | None:
        """The session whose receiver (`conn`, `rx_token`) was taken for `request_id`."""
        s = self.sessions.get(request_id)
        if s is None or s.request is None:
            return None
        return s if s.leg_of(conn, rx_token) is not None else None

    def _take(self, s: TxSession, leg: TxLeg) -> None:
        """`leg` is a receiver of the request from now on."""
        if s.request is None:
            s.request = leg.request
            s.conn = leg.conn
            s.advance(SessionState.READY if s.engine is None else SessionState.WAITING_FOR_PEER)
        s.legs.append(leg)
        s.wake.set()

    def choose_receivers(self, s: TxSession) -> None:
        """At the first send: of the receivers that asked so far (the legs taken, then the
        contenders, in arrival order), keep those the send allows (the named daemon's, or
        the first one's when it names none) and turn the others away (told by the task)."""
        if not s.contenders and all(
            not s.serve_peer or leg.conn.peer.name == s.serve_peer for leg in s.legs
        ):
            return  # the usual case: nothing to choose
        waiting = s.legs + s.contenders
        s.legs, s.contenders = [], []
        s.request = s.conn = None
        for leg in waiting:
            if s.serve_peer and leg.conn.peer.name != s.serve_peer:
                s.turned_away.append((leg, *self._not_yours(s, leg)))
                continue
            refused = refusal(s.pool, s.legs, leg, True)
            if refused is not None:
                s.turned_away.append((leg, *refused))
                continue
            self._take(s, leg)

    def _not_yours(self, s: TxSession, leg: TxLeg) -> tuple[str, str]:
        """Why a RequestData from a daemon the send does not name is refused (logged)."""
        self.log_limiter.log(
            log,
            logging.WARNING,
            (Reason.NOT_YOUR_REQUEST, leg.conn.peer.name),
            "request %s: refused the RequestData of peer %s: the send names %s (%s)",
            shown(s.request_id),
            shown(leg.conn.peer.name),
            shown(s.serve_peer),
            Reason.NOT_YOUR_REQUEST,
        )
        return (
            Reason.NOT_YOUR_REQUEST,
            f"request {s.request_id!r} is not yours: the context engine sends it to another "
            "generation daemon",
        )

    def _ended(self, s: TxSession, conn: PeerConnection) -> tuple[str, str]:
        """Why a RequestData (from `conn`) for a request that already has an outcome is
        refused."""
        assert s.terminal is not None
        served = [leg.conn.peer.name for leg in s.legs if leg.served]
        if s.terminal.status == Status.DONE and served:
            self.log_limiter.log(
                log,
                logging.WARNING,
                (Reason.ALREADY_SERVED, conn.peer.name),
                "request %s: refused the RequestData of peer %s: already served to %s (%s)",
                shown(s.request_id),
                shown(conn.peer.name),
                ", ".join(map(shown, served)),
                Reason.ALREADY_SERVED,
            )
            whom = ", ".join(served)
            return (
                Reason.ALREADY_SERVED,
                f"request {s.request_id!r} was already served to "
                + (whom if conn.peer.name in served else f"another peer ({whom})")
                + "; the context engine's send named "
                + (repr(s.serve_peer) if s.serve_peer else "no peer, so the first to ask got it"),
            )
        # The engine's send already ended (e.g. its deadline passed before the receiver
        # asked): say why, so the generation side can tell the operator.
        return (
            s.terminal.reason,
            f"the context side already ended this request: {s.terminal.message}",
        )

    async def refuse(
        self, conn: PeerConnection, msg: RequestData, reason: str, message: str
    ) -> None:
        """Answer a RequestData that is not taken: this request ends for that receive."""
        self.refused(reason)
        await conn.send(
            Abort(request_id=msg.request_id, rx_token=msg.rx_token, reason=reason, message=message)
        )

    async def tell_turned_away(self, s: TxSession) -> None:
        while s.turned_away:
            leg, reason, message = s.turned_away.pop(0)
            leg.told = True
            await self.refuse(leg.conn, leg.request, reason, message)

    async def refuse_strangers(self, s: TxSession) -> None:
        """Refuse the receivers that asked before our pool was known and hold none of our
        heads: counted as legs they would fail the request for the ranks that do."""
        if s.pool is None or s.writing or s.written or s.terminal is not None:
            return
        strangers = drop_strangers(s.pool, s.legs)
        if strangers:
            # `request` and `conn` are those of the first remaining leg (none: wait for one).
            s.request = s.legs[0].request if s.legs else None
            s.conn = s.legs[0].conn if s.legs else None
        for leg, why in strangers:
            await abort_legs(s.request_id, [leg], None, Reason.BLOCK_MISMATCH, why)

    async def _asked_twice(self, s: TxSession, conn: PeerConnection, msg: RequestData) -> None:
        """One receive (same connection, same token) sent its RequestData again. Refusing it
        tells that receive its request ended, so it ends here too: told (Abort) only once
        no write into its blocks can land."""
        message = f"{conn.peer.name} sent the RequestData of one receive twice"
        self.log_limiter.log(
            log,
            logging.WARNING,
            (Reason.DUPLICATE_REQUEST, conn.peer.name),
            "request %s: %s",
            shown(s.request_id),
            message,
        )
        if s.engine is None:
            # Nothing was written: tell every receiver now.
            await self.lose_receivers(s, None, Reason.DUPLICATE_REQUEST, message)
        else:
            s.request_end(Terminal.peer(Status.FAILED, Reason.DUPLICATE_REQUEST, message))

    async def lose_receivers(
        self, s: TxSession, leg: TxLeg | None, reason: str, message: str
    ) -> None:
        """A request the engine has not sent loses its receivers, because `leg` ended, left
        or asked twice: the others (every one, for None) are told why (Abort)."""
        await abort_legs(s.request_id, self._without_legs(s), leg, reason, message)

    def _without_legs(self, s: TxSession) -> list[TxLeg]:
        """A request the engine has not sent loses its receivers (one of them ended, left
        or asked twice; the caller tells the others): forgotten, unless receives of other
        daemons wait as contenders: then the first of them becomes its receiver. Returns
        the receivers it had."""
        legs, waiting = s.legs, s.contenders
        s.legs, s.contenders = [], []
        s.request = s.conn = None
        if not waiting:
            del self.sessions[s.request_id]
        for leg in waiting:
            if refusal(s.pool, s.legs, leg, True) is None:
                self._take(s, leg)
            else:
                s.contenders.append(leg)
        return legs

    def drop_contender(self, conn: PeerConnection, request_id: str, rx_token: int) -> bool:
        """Forget a contender's receive (it ended on its side); True if it was one."""
        s = self.sessions.get(request_id)
        leg = s.contender_of(conn, rx_token) if s is not None else None
        if s is None or leg is None:
            return False
        s.contenders.remove(leg)
        return True
