"""The receive coordinator (generation side, every runtime): admit a posted receive, ask
the context daemon(s) for the KV (RequestData), and complete when the last slice is
reported. How the bytes arrive (written into the blocks, or rounds through a staging
reservation) is the runtime's receive mover's (transceiver/movers.py, RecvMover); talking
to the context daemons is transceiver/context_legs.py's.

Timeouts (the seed): kv_transfer_timeout_ms applies per receive task, from
admission. When a request ends here while the context side may still be
writing (timeout, cancel, peer lost, engine gone, shutdown), the peer is told
(Abort) and gets a short grace to confirm quiescence (AbortAck); the outcome is
reported then, on time. Memory a write may still reach (the engine's blocks on
the PYTHON runtime, our bounce/staging reservations on one-sided backends) is
not handed back on a timer or because a connection closed: it goes to a hold
(kvxferd.transceiver.holds) until the writer is fenced, and the engine hears a
`released` event when its blocks are back.

Head-merge (the context instance has more tensor-parallel ranks than ours): the
receive names every context daemon holding some of our heads; each is a *leg*
that gets its own RequestData and writes its heads. The request is done when
every leg delivered and the legs' ranks cover our heads exactly once (checked by
kvxferd.transceiver.legs); any leg
failing fails the request, the other legs are aborted, and the blocks are handed
back only once every leg is quiescent.

Identity: a receive is known by (context peer as the engine named it, request id), since
request ids are unique per context instance only (transceiver/rx_table.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable

from kvxferd.errors import RequestError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Abort, AbortAck, CancelAnswer, Result
from kvxferd.service.logs import shown
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.admission import AdmissionWindow
from kvxferd.transceiver.context_legs import Connect, ContextLegs, abort_terminal, hold_for
from kvxferd.transceiver.holds import Hold, HoldKeeper
from kvxferd.transceiver.legs import RxLeg, peer_tp, source_problem
from kvxferd.transceiver.loans import BlockLoans
from kvxferd.transceiver.movers import RecvMover
from kvxferd.transceiver.recv_checks import (
    check_blocks,
    check_id_free,
    check_peers,
    same_daemon_problem,
)
from kvxferd.transceiver.rx_table import RxTable
from kvxferd.transceiver.sessions import (
    EngineLink,
    RxKey,
    RxSession,
    Terminal,
    abort_engine_sessions,
    check_room,
    conclude,
    drain_sessions,
    forget_auto_released,
    forget_finished,
    settle,
)
from kvxferd.transceiver.state import Reason, SessionState, Status
from kvxferd.transceiver.timeouts import ReceiverTimeouts

log = logging.getLogger("kvxferd.receiver")

# How long a head-merge's receive waits for a context daemon to announce its pools before
# planning without them (Receiver._await_sources): long enough for an engine that is still
# registering. The wait costs nothing real: a context daemon without a pool cannot send.
SOURCES_WAIT_S = 5.0


class Receiver:
    def __init__(
        self,
        timeouts: ReceiverTimeouts,
        admission: AdmissionWindow,
        connect: Connect,
        mover: RecvMover,
        pipelined: bool = False,
        max_requests: Callable[[], int] = lambda: 0,
    ) -> None:
        """`max_requests`: most receives kept (daemon.max_requests, read at each new one;
        0: no limit)."""
        self.timeouts = timeouts
        self.pipelined = pipelined
        self.max_requests = max_requests
        self.mover = mover
        self.admission = admission
        self.legs = ContextLegs(connect)
        self.sessions = RxTable()
        self.accepting = True
        self.holds = HoldKeeper(connect, mover.release, timeouts.redial_s, timeouts.redial_max_s)
        self.holds.on_released = self._hold_released
        # Per pool, which request each block on loan belongs to (in flight or held).
        self.loans = BlockLoans()
        # Told of every hold released (the daemon: metrics, pools of engines gone).
        self.on_hold_released: Callable[[Hold, str], None] | None = None

    # ------------------------------------------------------------ engine calls

    def recv(
        self,
        engine: EngineLink,
        request_id: str,
        pool: LocalPool,
        blocks: list[int],
        peers: str | list[str],
        num_tokens: int | None,
        beam_width: int = 1,
        block_start: int = 0,
        auto_release: bool = False,
    ) -> None:
        """Accept a receive from one context daemon, or from several (head-merge), of the
        request's logical blocks [block_start, block_start + len(blocks)) into `blocks`.
        `auto_release`: forget it with its outcome (Recv.auto_release)."""
        peers = [peers] if isinstance(peers, str) else list(peers)
        check_peers(request_id, peers, beam_width, self.pipelined)
        if not self.accepting:
            raise RequestError("draining", "the daemon is draining; no new requests")
        check_id_free(request_id, self.sessions.clash(request_id, peers))
        check_room(self.sessions, self.max_requests(), "receives")
        check_blocks(pool, blocks, num_tokens, block_start)
        rx_token = secrets.randbits(63)
        while self.sessions.token_taken(request_id, rx_token):
            rx_token = secrets.randbits(63)  # (request id, token) names one receive
        self.loans.lend(pool, blocks, (peers[0], request_id), self._is_held)
        s = RxSession(
            request_id=request_id,
            engine=engine,
            pool=pool,
            blocks=list(blocks),
            block_start=block_start,
            num_tokens=num_tokens,
            rx_token=rx_token,
            legs=[RxLeg(peer) for peer in peers],
            auto_release=auto_release,
        )
        self.sessions.add(s)
        pool.users.add(s.user)
        # The timeout is read once, here: a reload applies to receives accepted after it,
        # not to one still waiting for admission (docs/operations.md).
        s.task = asyncio.create_task(self._run(s, self.timeouts.timeout_s), name=f"rx-{request_id}")

    def find(self, request_id: str, peer: str = "") -> RxSession | None:
        """The receive an engine call names (RxTable.find: `peer` may be left out while
        the id is unambiguous; RequestError `ambiguous_request` when it is not)."""
        return self.sessions.find(request_id, peer)

    def _named(self, request_id: str, peer: str) -> RxSession:
        s = self.sessions.find(request_id, peer)
        if s is None:
            raise RequestError(
                "unknown_request",
                f"no receive for request {request_id!r}" + (f" from {peer!r}" if peer else ""),
            )
        return s

    async def cancel(self, request_id: str, peer: str = "") -> str:
        s = self._named(request_id, peer)
        if s.finished or s.terminal is not None:
            return "finished" if s.finished else "busy"
        if _cancellable(s) and s.task is not None:
            s.request_end(
                Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the engine")
            )
            s.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(s.task)
            return "cancelled"
        if not await self.legs.cancel(s, self.timeouts.answer_s):
            return "busy"
        # A context daemon that agreed has ended its side and will write nothing more; the
        # request cannot complete now, so it ends and the other legs are aborted (their
        # in-flight writes quiesce first).
        s.request_end(Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the engine"))
        if s.task is not None:
            await asyncio.shield(s.task)
        return "cancelled" if s.terminal and s.terminal.status == Status.CANCELLED else "finished"

    def release(self, request_id: str, peer: str = "") -> None:
        """The engine forgets a finished receive, so that its id (from its context peer)
        may be used again."""
        s = self._named(request_id, peer)
        if not (s.finished and s.held):  # held: forgotten once the blocks are back
            if s.engine is None:
                raise RequestError("unknown_request", f"no receive for request {request_id!r}")
            if not s.finished:
                raise RequestError(
                    "still_active",
                    f"request {request_id!r} from {s.peer!r} has no outcome yet; "
                    "cancel it or wait for it first",
                )
        forget_finished(self.sessions, s)

    # ----------------------------------------------------------- peer messages

    def owns(self, conn: PeerConnection, request_id: str, rx_token: int) -> bool:
        """Ours: an active or finished receive, or the hold of an ended one."""
        return (
            self._match(conn, request_id, rx_token) is not None
            or (request_id, rx_token) in self.holds.holds
        )

    def _match(self, conn: PeerConnection, request_id: str, rx_token: int) -> RxSession | None:
        # Late or foreign (another connection, another context instance's receive of the
        # same id): None, never revives or touches a receive.
        return self.sessions.match(conn, request_id, rx_token)

    async def on_result(self, conn: PeerConnection, msg: Result) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        if s is not None and s.terminal is not None and self.mover.late_round(conn, s, msg):
            return
        if msg.last and msg.status == Reason.OK:
            # A late last Result of an ended receive: that write completed, nothing follows.
            self.holds.on_fence_message(conn, msg.request_id, msg.rx_token)
        if s is None or s.terminal is not None:
            return
        leg = s.leg_of(conn)
        assert leg is not None
        if msg.status != Reason.OK:
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_FAILED, msg.message))
            s.mark_told(leg)
            return
        if leg.source is None:
            # Messages arrive in order: the pool it wrote from is announced by now.
            peer = peer_tp(conn)
            leg.source = peer if isinstance(peer, tuple) else None
        s.nbytes += msg.nbytes
        if msg.bounced:
            # Taken by the session's task, in order, before any ack. Logical block
            # indices of the request, as the context side counts them.
            first, end = msg.first_block, msg.end_block
            if not end:  # the whole request: our blocks
                first, end = s.block_start, s.block_start + len(s.blocks)
            s.rounds.append((leg, first, end, msg.nbytes, msg.last, msg.round_offset))
            s.wake.set()
        elif msg.last:
            self._leg_delivered(s, leg, msg.status, msg.message)
        else:
            s.advance(SessionState.TRANSFERRING)

    def _leg_delivered(self, s: RxSession, leg: RxLeg, status: str, message: str) -> None:
        """A leg's last bytes are in the blocks: nothing more comes from it."""
        leg.done = leg.fenced = True
        if len(s.legs) > 1:
            leg.told = True  # that context daemon is done with the request
        if all(each.done for each in s.legs):
            s.result = (status, s.nbytes, message)
            s.wake.set()
        else:
            s.advance(SessionState.TRANSFERRING)  # some heads are in place

    async def on_abort(self, conn: PeerConnection, msg: Abort) -> None:
        # Sent only once its write is quiescent: a fence for a hold too (a late Abort).
        self.holds.on_fence_message(conn, msg.request_id, msg.rx_token)
        s = self._match(conn, msg.request_id, msg.rx_token)
        if s is None:
            return
        # The context side sends Abort only once its write is quiescent.
        s.request_end(abort_terminal(msg))
        leg = s.leg_of(conn)
        if leg is not None:
            leg.fenced = True
        s.mark_told(leg)
        s.wake.set()

    async def on_abort_ack(self, conn: PeerConnection, msg: AbortAck) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        leg = s.leg_of(conn) if s is not None else None
        if s is not None and leg is not None:
            leg.abort_acked = leg.fenced = True
            s.wake.set()
        # An ended receive's hold, maybe: the ack came after the grace, on this connection
        # or on a new one of the same incarnation.
        self.holds.on_fence_message(conn, msg.request_id, msg.rx_token)

    async def on_cancel_answer(self, conn: PeerConnection, msg: CancelAnswer) -> None:
        self.legs.on_cancel_answer(conn, msg)

    async def on_peer_closed(self, conn: PeerConnection) -> None:
        lost = []
        for s in self.sessions.values():
            leg = s.leg_of(conn)
            # A leg that delivered everything wrote its last byte: its peer going away
            # cannot touch our blocks, and what it wrote stays valid.
            if leg is not None and not leg.done and not s.finished:
                s.request_end(
                    Terminal.peer(
                        Status.FAILED,
                        Reason.PEER_LOST,
                        f"peer lost: {conn.peer.name}: {conn.close_reason}",
                    )
                )
                # Nobody left to tell; but a closed connection does not stop a write
                # already queued (shared memory, RDMA): the leg stays unfenced.
                s.mark_told(leg)
                s.wake.set()
                lost.append(s)
        self.legs.peer_closed(conn)
        await settle(lost)

    # -------------------------------------------------------------- lifecycle

    async def abort_engine(self, engine: EngineLink, reason: str, message: str) -> None:
        await abort_engine_sessions(self.sessions, engine, reason, message, self._end_now)

    async def drain(self, deadline: float) -> None:
        self.accepting = False
        await drain_sessions(self.sessions, deadline, self._end_now)

    def active_count(self) -> int:
        return sum(1 for s in self.sessions.values() if not s.finished)

    def _end_now(self, s: RxSession, term: Terminal) -> None:
        s.request_end(term)
        if _cancellable(s) and s.task is not None:
            s.task.cancel()

    # --------------------------------------------------------------- the work

    async def _run(self, s: RxSession, timeout_s: float | None) -> None:
        """The receive task. `timeout_s`: kv_transfer_timeout_ms as it was when the receive
        was accepted; the per-task deadline runs from admission, and every later wait for
        the peer (staging room, each round, the last Result) is bounded by what is left of
        it."""
        admitted = False
        try:
            await self.admission.acquire(len(s.blocks))
            admitted = True
            deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
            s.deadline = deadline
            if not await self.legs.connect(s):
                return
            clash = same_daemon_problem(s, self.sessions.same_daemon(s))
            if clash is not None:
                s.request_end(Terminal.local(Status.FAILED, Reason.DUPLICATE_REQUEST, clash))
                return
            conn = s.conn
            assert conn is not None and s.pool is not None
            if s.terminal is not None:
                return
            if len(s.legs) > 1:  # only a head-merge waits for its sources' pools
                await self._await_sources(s, deadline)
            problem = source_problem(s.pool, s.legs, False, self.pipelined)
            if problem is not None:
                s.request_end(Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, problem))
                return
            await self.mover.make_offer(s, conn, deadline)
            if s.terminal is not None:
                return
            # A cancel either sees the receive waiting (the task is cancelled before any
            # request goes out) or ready (it asks the legs already asked).
            s.advance(SessionState.READY)
            await self.legs.ask(s)
            await self._await_result(s, deadline)
        except asyncio.CancelledError:
            if s.terminal is None:
                raise
        except Exception as exc:  # a bug must fail the request, not the daemon
            log.exception("request %s: unexpected error", shown(s.request_id))
            s.request_end(Terminal.local(Status.FAILED, "internal", f"internal error: {exc}"))
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                self.mover.drop_unscattered(s)
                await self.legs.quiesce(s, self.timeouts.ack_grace_s)
            hold = hold_for(s, self.mover.exposes_blocks, self.mover.reservations_exposed())
            for leg in s.legs:
                if leg.res is not None and (hold is None or leg.res not in hold.reservations):
                    self.mover.release(leg.res)  # nothing can land there now
                leg.res = leg.offer = None
            if admitted:
                # The window bounds transfers in flight; a hold waits for a fence, not for
                # bandwidth, and must not stall other peers' requests.
                self.admission.release(len(s.blocks))
            self._finish(s, hold)

    async def _await_sources(self, s: RxSession, deadline: float) -> None:
        """A receive from several context daemons (a head-merge) plans each leg's heads, and
        the room it offers for them, from the pools they announced: one that has announced
        none yet (its engine registers its pool after we dialed it) would be taken to hold
        our heads, offered nothing, and written per block, a head slice as one descriptor
        per (block, layer, K/V, token). So wait for it a little (SOURCES_WAIT_S); then go
        on with what is known, as before. Called for a head-merge only (_run checks: one
        coroutine call less for every other receive)."""
        until = min(deadline, time.monotonic() + SOURCES_WAIT_S)
        for leg in s.legs:
            conn = leg.conn
            while conn is not None and peer_tp(conn) is None and not conn.closed.is_set():
                left = until - time.monotonic()
                if left <= 0 or s.terminal is not None:
                    return
                await conn.pools_announced(left)

    async def _await_result(self, s: RxSession, deadline: float) -> None:
        while s.terminal is None:
            while s.rounds and s.terminal is None:
                leg, first, end, nbytes, last, offset = s.rounds.pop(0)
                await self.mover.take_round(s, leg, first, end, nbytes, offset)
                if s.terminal is not None:
                    return
                if last:
                    self._leg_delivered(s, leg, Reason.OK, "")
                else:
                    await self.mover.round_done(s, leg, end)
            if s.terminal is not None:
                return
            if s.result is not None:
                # Every leg delivered: only heads exactly covered count as done.
                assert s.pool is not None
                problem = source_problem(s.pool, s.legs, True, self.pipelined)
                if problem is not None:
                    s.request_end(Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, problem))
                else:
                    s.request_end(Terminal.local(Status.DONE, Reason.OK, ""))
                s.mark_told(None)
                return
            why = "kv_transfer_timeout_ms elapsed before the context side reported the KV"
            if not await s.wait_wake(deadline, Reason.RECEIVER_TIMEOUT, why):
                return

    # ----------------------------------------------------------------- holds

    def _is_held(self, key: RxKey) -> bool:
        s = self.sessions.get(key)
        return s is not None and s.held

    def _hold_released(self, hold: Hold, how: str) -> None:
        key = (hold.peer, hold.request_id)
        s = self.sessions.get(key)
        if hold.block_ids:
            self.loans.give_back(hold.pool, hold.block_ids, key)
        if s is not None and s.rx_token == hold.rx_token and s.held:
            s.held = False
            if s.forget:
                del self.sessions[key]
            if hold.blocks and s.engine is not None:
                s.engine.released(
                    hold.request_id,
                    "recv",
                    how,
                    (time.monotonic() - hold.since) * 1e3,
                    peer=hold.peer,
                )
        if self.on_hold_released is not None:
            self.on_hold_released(hold, how)

    def _finish(self, s: RxSession, hold: Hold | None = None) -> None:
        if s.terminal is None:
            s.terminal = Terminal.local(Status.FAILED, "internal", "ended without a terminal state")
        s.held = hold is not None and hold.blocks > 0
        if not s.held:
            self.loans.give_back(s.pool, s.blocks, s.key)
        conclude(s, "recv", s.pool, log, blocks_held=s.held)
        forget_auto_released(self.sessions, s)
        if hold is not None:
            # In the same step as conclude (no await between): the pool never looks unused.
            # After it: a hold fenced at once still reports `released` after the outcome.
            self.holds.add(hold)


def _cancellable(s: RxSession) -> bool:
    """Still waiting for admission or connecting: the task holds no promise towards the
    peer (no RequestData went out) and may simply be cancelled."""
    return s.state is SessionState.WAITING_FOR_PEER and not s.finished
