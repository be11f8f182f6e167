"""How the generation side ends a request on the send side: its Abort, its CancelRequest,
its connection closing, and an old incarnation of it settling.

Each is answered only once no write of ours into that receiver's blocks can still land
(the session's task ends only with its work quiescent). A request the engine has not sent
yet has nothing in flight: its receivers are dropped at once (Matching.lose_receivers),
and the other generation ranks of a head-split are told. A receiver already served keeps
what it has; it going away changes nothing for the others.
"""

from __future__ import annotations

import asyncio
import logging

from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Abort, AbortAck, CancelAnswer, CancelRequest
from kvxferd.service.logs import TEXT_LIMIT, LogLimiter, shown
from kvxferd.transceiver.sessions import Terminal, TxSession, settle
from kvxferd.transceiver.state import Reason, Status
from kvxferd.transceiver.tx_drains import Drains
from kvxferd.transceiver.tx_matching import Matching

log = logging.getLogger("kvxferd.sender")


class PeerEnds:
    """The peer-ended requests of the coordinator's sessions (`sessions`, shared with it)."""

    def __init__(
        self,
        sessions: dict[str, TxSession],
        matching: Matching,
        log_limiter: LogLimiter,
        drains: Drains,
    ) -> None:
        self.sessions = sessions
        self._matching = matching
        self.log_limiter = log_limiter
        self._drains = drains

    async def on_abort(self, conn: PeerConnection, msg: Abort) -> None:
        if self._matching.drop_contender(conn, msg.request_id, msg.rx_token):
            # A receive that was never taken: nothing was written for it.
            await conn.send(AbortAck(request_id=msg.request_id, rx_token=msg.rx_token))
            return
        s = self._matching.match(conn, msg.request_id, msg.rx_token)
        if s is None:
            await self._quiesce_elsewhere(conn, msg)
        if s is not None:
            leg = s.leg_of(conn, msg.rx_token)
            if s.engine is None:
                # The engine never sent it; nothing to report to it, but say so here.
                self.log_limiter.log(
                    log,
                    logging.WARNING,
                    ("ended before the send", conn.peer.name),
                    "request %s: the generation side ended it (%s) before the engine sent: %s",
                    shown(s.request_id),
                    shown(msg.reason),
                    shown(msg.message, TEXT_LIMIT, quote=False),
                )
                await self._matching.lose_receivers(
                    s, leg, Reason.PEER_FAILED, f"another generation rank ended it: {msg.reason}"
                )
            else:
                status = Status.CANCELLED if msg.reason == Reason.CANCELLED else Status.FAILED
                theirs: dict[str, Reason] = {
                    Reason.RECEIVER_TIMEOUT: Reason.PEER_TIMED_OUT,
                    Reason.CANCELLED: Reason.PEER_CANCELLED,
                }
                reason = theirs.get(msg.reason, Reason.PEER_FAILED)
                s.request_end(
                    Terminal.peer(status, reason, f"generation side: {msg.reason}: {msg.message}")
                )
                s.mark_told(leg)
                if s.task is not None:
                    await asyncio.shield(s.task)
        # Acknowledge in every case: an unknown token has nothing in flight. A write of
        # this request into that daemon being drained (tx_drains.py) is still in flight:
        # the AbortAck waits for it, however long, since it is the receiver's fence.
        await Drains.wait(self._drains.of(conn.peer.name, conn.peer.incarnation, msg.request_id))
        await conn.send(AbortAck(request_id=msg.request_id, rx_token=msg.rx_token))

    async def _quiesce_elsewhere(self, conn: PeerConnection, msg: Abort) -> None:
        """An Abort for a receive we serve through another (older) connection of the same
        daemon: it lost that connection and asks again on a new one. Our answer must mean
        the write through the old connection is quiescent, so end and wait for it."""
        s = self.sessions.get(msg.request_id)
        if s is None:
            return
        leg = next(
            (
                each
                for each in s.legs
                if each.request.rx_token == msg.rx_token
                and each.conn is not conn
                and each.conn.peer.name == conn.peer.name
                and each.conn.peer.incarnation == conn.peer.incarnation
            ),
            None,
        )
        if leg is None:
            return
        if s.terminal is None and s.task is not None:
            s.request_end(
                Terminal.peer(
                    Status.FAILED,
                    Reason.PEER_FAILED,
                    f"generation side (asked again): {msg.reason}: {msg.message}",
                )
            )
        if s.task is not None:
            await asyncio.shield(s.task)

    async def settle_incarnation(self, name: str, incarnation: str) -> bool:
        """Wait until no transfer for daemon `name`/`incarnation` can still move bytes; True
        once none is left. Only for an incarnation whose connections are all closed (a
        stale one): its sessions ended when they closed and only need to quiesce."""
        mine = [
            s
            for s in self.sessions.values()
            if any(
                leg.conn.peer.name == name and leg.conn.peer.incarnation == incarnation
                for leg in s.legs
            )
        ]
        if any(
            not leg.conn.closed.is_set()
            for s in mine
            for leg in s.legs
            if leg.conn.peer.incarnation == incarnation
        ):
            return False
        await settle(mine)
        await Drains.wait(self._drains.of(name, incarnation))
        return all(not s.xfers for s in mine)

    async def on_cancel_request(self, conn: PeerConnection, msg: CancelRequest) -> None:
        s = self._matching.match(conn, msg.request_id, msg.rx_token)
        cancelled = True
        if s is None:
            self._matching.drop_contender(conn, msg.request_id, msg.rx_token)
        else:
            leg = s.leg_of(conn, msg.rx_token)
            if s.writing:
                cancelled = False
            elif s.engine is None:
                await self._matching.lose_receivers(
                    s, leg, Reason.PEER_CANCELLED, "cancelled by another generation rank"
                )
            elif not s.finished:
                s.request_end(
                    Terminal.peer(
                        Status.CANCELLED, Reason.PEER_CANCELLED, "cancelled by the generation side"
                    )
                )
                s.mark_told(leg)
                if s.task is not None:
                    await asyncio.shield(s.task)
            else:
                cancelled = s.terminal is not None and s.terminal.status != Status.DONE
        await conn.send(
            CancelAnswer(request_id=msg.request_id, rx_token=msg.rx_token, cancelled=cancelled)
        )

    async def on_peer_closed(self, conn: PeerConnection) -> None:
        lost = []
        for s in list(self.sessions.values()):
            s.contenders = [each for each in s.contenders if each.conn is not conn]
            leg = s.leg_of(conn)
            if leg is None or leg.served:
                # A receiver already served has what we wrote; it going away changes
                # nothing for the other ranks of a head-split.
                continue
            leg.told = True  # nobody left to tell on that connection
            if s.engine is None:
                await self._matching.lose_receivers(
                    s,
                    leg,
                    Reason.PEER_FAILED,
                    f"another generation rank was lost: {conn.close_reason}",
                )
                continue
            s.request_end(
                Terminal.peer(Status.FAILED, Reason.PEER_LOST, f"peer lost: {conn.close_reason}")
            )
            s.mark_told(leg)
            lost.append(s)
        await settle(lost)
