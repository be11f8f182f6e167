"""Context side of the PYTHON runtime: match the engine's send with the peer's
RequestData, WRITE the blocks with one descriptor per contiguous run, poll the
write in bounded slices, then report.

Timeouts (the seed): one absolute deadline of kv_transfer_timeout_ms from the
first send of a request (pipelined: from its last chunk), never reset; the
timeout is read once, at the first send, so a reload changes only requests
accepted after it. The write is waited in slices of
kv_transfer_sender_future_timeout_ms, and between slices cancellation, peer
health and the deadline are checked. A write that completes after the deadline
is reported as timed out, never as success. A session's source blocks are
handed back only after the backend confirmed that the write cannot move bytes.

Head-split (the generation instance has more tensor-parallel ranks than the
context instance): every generation rank whose heads overlap ours sends its own
RequestData for the request; each is a *leg* of the session (kvxferd.transceiver.legs
decides which RequestData are legs and how many the request needs). The write starts
once every expected leg is known, each leg gets only the heads it holds, and the
engine hears `done` only when every leg was served. Any leg failing fails the
request, and the other receivers are told (Abort).

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

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvxferd.errors import (
    RequestError,
)
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import (
    Abort,
    AbortAck,
    CancelAnswer,
    CancelRequest,
    RequestData,
)
from kvxferd.service.logs import TEXT_LIMIT, LogLimiter, shown
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.bounce import BounceBuffers
from kvxferd.transceiver.dataplane import DataPlane
from kvxferd.transceiver.direct import DirectMover
from kvxferd.transceiver.legs import (
    TxLeg,
    abort_legs,
    drop_strangers,
    expected_legs,
    refusal,
)
from kvxferd.transceiver.plan import validate_block_ids
from kvxferd.transceiver.sessions import (
    EngineLink,
    Terminal,
    TxSession,
    conclude,
    release_finished,
    settle,
)
from kvxferd.transceiver.state import Reason, SessionState, Status
from kvxferd.transceiver.writes import Writes

if TYPE_CHECKING:
    from kvxferd.transceiver.movers import Match, MoverFactory, SendMover

log = logging.getLogger("kvxferd.sender")


def _direct_mover(
    writes: Writes, bounce: BounceBuffers | None, pipelined: bool, match: Match
) -> SendMover:
    return DirectMover(writes, bounce, pipelined)


def _deadline(now: float, timeout_s: float | None) -> float | None:
    return None if timeout_s is None else now + timeout_s


@dataclass
class SenderTimeouts:
    # None: kv_transfer_timeout_ms is null (staged runtime only): no deadline.
    timeout_s: float | None
    slice_s: float


class Sender:
    def __init__(
        self,
        timeouts: SenderTimeouts,
        dataplane: DataPlane,
        pipelined: bool = False,
        bounce: BounceBuffers | None = None,
        mover: MoverFactory | None = None,
    ) -> None:
        """`mover`: how the bytes of each due slice cross (transceiver/movers.py); the
        direct one (PYTHON runtime) by default."""
        self.timeouts = timeouts
        self._dp = dataplane
        self.pipelined = pipelined
        self.bounce = bounce
        self.sessions: dict[str, TxSession] = {}
        self.accepting = True
        # Every write of this side: post, wait in slices, release until quiescent.
        self.writes = Writes(dataplane, lambda: self.timeouts.slice_s)
        make = mover or _direct_mover
        self.mover: SendMover = make(self.writes, bounce, pipelined, self._match)
        # Pipelined: the timeout read at a request's first chunk, until its last chunk
        # starts the deadline with it.
        self._timeout_at_accept: weakref.WeakKeyDictionary[TxSession, float | None] = (
            weakref.WeakKeyDictionary()
        )
        # Told the reason of each RequestData refused without being served.
        self.on_refused: Callable[[str], None] | None = None
        # A peer can send refused RequestData in a loop: a few lines per peer and
        # reason, then a count (the refusals metric counts every one).
        self.log_limiter = LogLimiter(interval_s=10.0, burst=5)

    # ------------------------------------------------------------ engine calls

    def send(
        self,
        engine: EngineLink,
        request_id: str,
        pool: LocalPool,
        blocks: list[int],
        token_start: int,
        token_end: int,
        last: bool,
        beam_width: int = 1,
        peer: str = "",
    ) -> None:
        """Accept one send call (a chunk; `last` marks the final one) or raise RequestError.
        `peer`: the generation daemon (by name) the request is for; "" for anyone. The
        first chunk's counts; a later chunk may repeat it or leave it empty."""
        tpb = pool.layout.tokens_per_block
        if self.pipelined and beam_width != 1:
            raise RequestError(
                "bad_request",
                f"request {request_id!r}: pipelined transfer needs beam width 1, got {beam_width}",
            )
        if not 0 <= token_start < token_end:
            raise RequestError(
                "bad_request", f"token range [{token_start}, {token_end}) is empty or negative"
            )
        needed = math.ceil(token_end / tpb)
        if len(blocks) != needed:
            raise RequestError(
                "bad_request",
                f"tokens [0, {token_end}) need {needed} blocks of {tpb} tokens, got {len(blocks)}",
            )
        try:
            validate_block_ids(pool.layout, blocks)
        except LayoutError as exc:
            raise RequestError("bad_request", f"pool {pool.pool_id!r}: {exc}") from exc
        s = self._session_for_send(engine, request_id, token_start)
        if s.task is not None and peer and peer != s.serve_peer:
            self._reject_chunk(
                s,
                f"a later chunk names peer {peer!r}, the first one "
                f"{repr(s.serve_peer) if s.serve_peer else 'none'}",
            )
        if s.blocks and blocks[: len(s.blocks)] != s.blocks:
            # Earlier chunks' blocks may already be written: they cannot move.
            self._reject_chunk(
                s, "a later chunk changed the blocks of earlier chunks; it must extend them"
            )
        s.pool = pool
        s.blocks = list(blocks)
        s.token_end = token_end
        s.last_seen = last
        pool.users.add(f"tx:{s.request_id}")
        now = time.monotonic()
        if s.task is None:
            s.serve_peer = peer
            self._choose_receivers(s)
            # The timeout is read once, at the first send: a reload applies to requests
            # accepted after it (docs/operations.md).
            timeout_s = self.timeouts.timeout_s
            if not self.pipelined:
                s.deadline = _deadline(now, timeout_s)  # from the first send, never reset
            else:
                self._timeout_at_accept[s] = timeout_s
            s.task = asyncio.create_task(self._run(s), name=f"tx-{s.request_id}")
        if self.pipelined and last:
            # Pipelined: from the last chunk (the seed's rule), with the first chunk's timeout.
            s.deadline = _deadline(now, self._timeout_at_accept.pop(s, self.timeouts.timeout_s))
        s.wake.set()

    def _reject_chunk(self, s: TxSession, why: str) -> None:
        """A chunk that breaks the request's order ends the request (and only it)."""
        message = f"request {s.request_id!r} rejected: {why}"
        if s.task is not None and s.terminal is None:
            s.request_end(Terminal.local(Status.FAILED, Reason.BAD_CHUNK, message))
        raise RequestError("bad_request", message)

    def _session_for_send(self, engine: EngineLink, request_id: str, token_start: int) -> TxSession:
        s = self.sessions.get(request_id)
        if s is not None and s.engine is not None:
            # A send starting again at token 0 is a second request under the same id:
            # refuse the call and leave the first alone.
            if s.engine is not engine or s.finished or token_start == 0:
                raise RequestError(
                    "duplicate_request",
                    f"request {request_id!r} is already active or finished on this daemon; "
                    "release it before reusing the id",
                )
            if s.last_seen:
                self._reject_chunk(s, "a chunk arrived after the one marked last")
            if token_start != s.token_end:
                self._reject_chunk(
                    s,
                    f"chunk starts at token {token_start} but the previous one ended at "
                    f"{s.token_end} (chunks must be in order and must not overlap)",
                )
            return s
        if token_start != 0:
            raise RequestError(
                "bad_request", f"the first chunk of {request_id!r} must start at token 0"
            )
        if s is None:
            if not self.accepting:
                raise RequestError("draining", "the daemon is draining; no new requests")
            s = TxSession(request_id=request_id, engine=engine)
            self.sessions[request_id] = s
        else:
            s.engine = engine  # the receiver's request arrived first
        return s

    async def cancel(self, request_id: str) -> str:
        s = self.sessions.get(request_id)
        if s is None or s.engine is None:
            raise RequestError("unknown_request", f"no send for request {request_id!r}")
        if s.finished:
            return "finished"
        if s.writing:
            return "busy"
        s.request_end(Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the engine"))
        if s.task is not None:
            await asyncio.shield(s.task)
        return "cancelled"

    def release(self, request_id: str) -> None:
        release_finished(self.sessions, request_id, "send")

    # ----------------------------------------------------------- peer messages

    async def on_request_data(self, conn: PeerConnection, msg: RequestData) -> None:
        dst_layout = conn.layouts.get(msg.pool_id)
        if isinstance(dst_layout, KvLayout):
            # Checked once, first: ids outside the receiver's own pool would reach the
            # write plan as addresses outside it (and a refused one leaves no session).
            try:
                validate_block_ids(dst_layout, msg.blocks)
            except LayoutError as exc:
                message = f"the receive's blocks: {exc}"
                await self._refuse(conn, msg, Reason.BLOCK_MISMATCH, message)
                return
        s = self.sessions.get(msg.request_id)
        if s is None:
            if not self.accepting:
                await self._refuse(conn, msg, Reason.SHUTDOWN, "context daemon is shutting down")
                return
            # Generation-first: remember the request until the engine sends.
            s = TxSession(request_id=msg.request_id, engine=None)
            self.sessions[msg.request_id] = s
        elif s.serve_peer and conn.peer.name != s.serve_peer:
            # The send names another daemon: whatever the request's state, not this one's.
            await self._refuse(conn, msg, *self._not_yours(s, TxLeg(conn, msg)))
            return
        elif s.finished and s.terminal is not None:
            await self._refuse(conn, msg, *self._ended(s, conn))
            return
        elif s.leg_of(conn, msg.rx_token) is not None:
            await self._asked_twice(s, conn, msg)
            return
        elif (contender := s.contender_of(conn, msg.rx_token)) is not None:
            # It was never taken: refusing it ends only that receive.
            s.contenders.remove(contender)
            message = f"{conn.peer.name} sent the RequestData of one receive twice"
            await self._refuse(conn, msg, Reason.DUPLICATE_REQUEST, message)
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
            await self._refuse(conn, msg, *refused)
            return
        self._take(s, leg)

    def _take(self, s: TxSession, leg: TxLeg) -> None:
        """`leg` is a receiver of the request from now on."""
        if s.request is None:
            s.request = leg.request
            s.conn = leg.conn
            s.advance(SessionState.READY if s.engine is None else SessionState.WAITING_FOR_PEER)
        s.legs.append(leg)
        s.wake.set()

    def _choose_receivers(self, s: TxSession) -> None:
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

    async def _refuse(
        self, conn: PeerConnection, msg: RequestData, reason: str, message: str
    ) -> None:
        """Answer a RequestData that is not taken: this request ends for that receive."""
        if self.on_refused is not None:
            self.on_refused(reason)
        await conn.send(
            Abort(request_id=msg.request_id, rx_token=msg.rx_token, reason=reason, message=message)
        )

    async def _tell_turned_away(self, s: TxSession) -> None:
        while s.turned_away:
            leg, reason, message = s.turned_away.pop(0)
            leg.told = True
            await self._refuse(leg.conn, leg.request, reason, message)

    async def _refuse_strangers(self, s: TxSession) -> None:
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
            legs = self._without_legs(s)  # nothing was written: tell every receiver now
            await abort_legs(s.request_id, legs, None, Reason.DUPLICATE_REQUEST, message)
        else:
            s.request_end(Terminal.peer(Status.FAILED, Reason.DUPLICATE_REQUEST, message))

    async def on_abort(self, conn: PeerConnection, msg: Abort) -> None:
        if self._drop_contender(conn, msg.request_id, msg.rx_token):
            # A receive that was never taken: nothing was written for it.
            await conn.send(AbortAck(request_id=msg.request_id, rx_token=msg.rx_token))
            return
        s = self._match(conn, msg.request_id, msg.rx_token)
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
                legs = self._without_legs(s)
                await abort_legs(
                    s.request_id,
                    legs,
                    leg,
                    Reason.PEER_FAILED,
                    f"another generation rank ended it: {msg.reason}",
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
        # Acknowledge in every case: an unknown token has nothing in flight.
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
        return all(s.xfer is None for s in mine)

    async def on_cancel_request(self, conn: PeerConnection, msg: CancelRequest) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        cancelled = True
        if s is None:
            self._drop_contender(conn, msg.request_id, msg.rx_token)
        else:
            leg = s.leg_of(conn, msg.rx_token)
            if s.writing:
                cancelled = False
            elif s.engine is None:
                legs = self._without_legs(s)
                await abort_legs(
                    s.request_id,
                    legs,
                    leg,
                    Reason.PEER_CANCELLED,
                    "cancelled by another generation rank",
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
                legs = self._without_legs(s)
                await abort_legs(
                    s.request_id,
                    legs,
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

    def _drop_contender(self, conn: PeerConnection, request_id: str, rx_token: int) -> bool:
        """Forget a contender's receive (it ended on its side); True if it was one."""
        s = self.sessions.get(request_id)
        leg = s.contender_of(conn, rx_token) if s is not None else None
        if s is None or leg is None:
            return False
        s.contenders.remove(leg)
        return True

    def _match(self, conn: PeerConnection, request_id: str, rx_token: int) -> TxSession | None:
        s = self.sessions.get(request_id)
        if s is None or s.request is None:
            return None
        return s if s.leg_of(conn, rx_token) is not None else None

    # -------------------------------------------------------------- lifecycle

    async def abort_engine(self, engine: EngineLink, reason: str, message: str) -> None:
        """Fail every session of a (disconnected) engine and wait until quiescent."""
        mine = [s for s in self.sessions.values() if s.engine is engine]
        for s in mine:
            s.request_end(Terminal.local(Status.FAILED, reason, message))
        await settle(mine)
        for s in mine:
            self.sessions.pop(s.request_id, None)

    async def drain(self, deadline: float) -> None:
        self.accepting = False
        active = [s.task for s in self.sessions.values() if s.task is not None and not s.finished]
        if active:
            await asyncio.wait(active, timeout=max(0.0, deadline - time.monotonic()))
        for s in list(self.sessions.values()):
            if s.engine is None and s.conn is not None and s.request is not None:
                # Requested by a receiver, never sent by our engine: tell the receiver why.
                del self.sessions[s.request_id]
                await abort_legs(
                    s.request_id,
                    s.legs + s.contenders,
                    None,
                    Reason.SHUTDOWN,
                    "context daemon shut down before its engine sent the KV",
                )
                continue
            if not s.finished:
                s.request_end(
                    Terminal.local(Status.FAILED, Reason.SHUTDOWN, "daemon shut down before done")
                )
        await settle(list(self.sessions.values()))

    def active_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.engine is not None and not s.finished)

    # --------------------------------------------------------------- the work

    async def _run(self, s: TxSession) -> None:
        try:
            while s.terminal is None:
                await self._tell_turned_away(s)
                await self._refuse_strangers(s)
                work = self._next_slice(s)
                if work is None:
                    await self._wait_for_work(s)
                    continue
                await self.mover.write_slice(s, *work)
                if work[2] and s.terminal is None:
                    s.request_end(Terminal.local(Status.DONE, Reason.OK, ""))
                    s.peer_told = True
        except Exception as exc:  # a bug must fail the request, not the daemon
            log.exception("request %s: unexpected error", shown(s.request_id))
            s.request_end(Terminal.local(Status.FAILED, "internal", f"internal error: {exc}"))
        finally:
            await self._finish(s)

    def _next_slice(self, s: TxSession) -> tuple[int, int, bool] | None:
        """(first block, end block, last) of the next write, or None if nothing is due.

        Without pipelining the whole request is one slice, due at the last chunk.
        With it, every chunk's complete blocks are due as soon as the receiver's
        request is known; the last slice also carries the partial tail block.
        """
        if s.request is None or s.pool is None:
            return None
        if len(s.legs) < expected_legs(s.pool, s.legs):
            return None  # head-split: another generation rank has yet to ask
        total = len(s.blocks)
        if not self.pipelined:
            return (0, total, True) if s.last_seen else None
        complete = total if s.last_seen else s.token_end // s.pool.layout.tokens_per_block
        if complete > s.written or s.last_seen:
            return (s.written, complete, s.last_seen)
        return None

    async def _wait_for_work(self, s: TxSession) -> None:
        remaining = None if s.deadline is None else s.deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            expected = expected_legs(s.pool, s.legs)
            if s.request is None:
                waiting_for = "the receiver's request"
            elif len(s.legs) < expected:
                waiting_for = (
                    f"the requests of every generation rank holding our heads "
                    f"({len(s.legs)} of {expected} arrived)"
                )
            else:
                waiting_for = "the last chunk"
            s.request_end(
                Terminal.local(
                    Status.TIMED_OUT,
                    Reason.SENDER_DEADLINE,
                    f"kv_transfer_timeout_ms elapsed waiting for {waiting_for}",
                )
            )
            return
        s.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(s.wake.wait(), remaining)

    async def _finish(self, s: TxSession) -> None:
        term = s.terminal
        assert term is not None
        await self._tell_turned_away(s)
        # The peers are always told; the write is already quiescent here.
        if term.status != Status.DONE and s.request and s.conn and not s.peer_told:
            if s.legs:
                await abort_legs(s.request_id, s.legs, None, term.reason, term.message)
            else:
                await s.conn.send(
                    Abort(
                        request_id=s.request_id,
                        rx_token=s.request.rx_token,
                        reason=term.reason,
                        message=term.message,
                    )
                )
        conclude(s, "send", s.pool, log)
