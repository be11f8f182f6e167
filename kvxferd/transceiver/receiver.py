"""Generation side of the PYTHON runtime: admit a posted receive, ask the context
daemon for the KV (RequestData), and complete when the last slice is reported.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvxferd.errors import HandshakeError, IncompatiblePeerError, KvxferdError, RequestError
from kvxferd.memory.layout import LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import (
    Abort,
    AbortAck,
    CancelAnswer,
    CancelRequest,
    RequestData,
    Result,
)
from kvxferd.peers.process import exited
from kvxferd.service.logs import shown
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.admission import AdmissionWindow
from kvxferd.transceiver.bounce import BounceBuffers, Reservation, worth_bouncing
from kvxferd.transceiver.holds import HeldLeg, Hold, HoldKeeper
from kvxferd.transceiver.legs import (
    RxLeg,
    leg_block_bytes,
    leg_heads,
    peer_tp,
    source_problem,
    whole_blocks_from,
)
from kvxferd.transceiver.loans import BlockLoans
from kvxferd.transceiver.plan import validate_block_ids
from kvxferd.transceiver.sessions import (
    EngineLink,
    RxSession,
    Terminal,
    conclude,
    release_finished,
    settle,
)
from kvxferd.transceiver.state import Reason, SessionState, Status

log = logging.getLogger("kvxferd.receiver")

Connect = Callable[[str], Awaitable[PeerConnection]]

# Phases in which the task holds no promise towards the peer and may simply be cancelled.
_CANCELLABLE = ("admission", "connecting")


@dataclass
class ReceiverTimeouts:
    # None: kv_transfer_timeout_ms is null (staged runtime only): no receive deadline.
    timeout_s: float | None
    # Bound on waiting for the context side's answer to a cancel.
    answer_s: float
    # How long an ended receive waits for its AbortAcks before its outcome goes out (a
    # peer that has not answered by then leaves a hold: heartbeat_interval_ms).
    ack_grace_s: float = 1.0
    # Dialing a context daemon again while a hold waits for it: first pause, longest pause.
    redial_s: float = 1.0
    redial_max_s: float = 10.0


class Receiver:
    # The PYTHON runtime's context daemon writes straight into the engine's blocks.
    exposes_blocks = True

    def __init__(
        self,
        timeouts: ReceiverTimeouts,
        admission: AdmissionWindow,
        connect: Connect,
        pipelined: bool = False,
        bounce: BounceBuffers | None = None,
    ) -> None:
        self.timeouts = timeouts
        self.pipelined = pipelined
        self.bounce = bounce
        self.admission = admission
        self._connect = connect
        self.sessions: dict[str, RxSession] = {}
        self.accepting = True
        self._phase: dict[str, str] = {}
        # By (request id, rx_token, peer connection): the legs of a merge share the token.
        self._cancel_answers: dict[tuple[str, int, str], asyncio.Future[bool]] = {}
        self.holds = HoldKeeper(
            connect, self._release_reservation, timeouts.redial_s, timeouts.redial_max_s
        )
        self.holds.on_released = self._hold_released
        self._sending: set[asyncio.Task[bool]] = set()  # Aborts still draining
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
    ) -> None:
        """Accept a receive from one context daemon, or from several (head-merge), of the
        request's logical blocks [block_start, block_start + len(blocks)) into `blocks`."""
        peers = [peers] if isinstance(peers, str) else list(peers)
        if not peers:
            raise RequestError("bad_request", "a receive needs at least one context peer")
        if len(set(peers)) != len(peers):
            raise RequestError("bad_request", f"the peers {peers} name a context daemon twice")
        if self.pipelined and beam_width != 1:
            raise RequestError(
                "bad_request",
                f"request {request_id!r}: pipelined transfer needs beam width 1, got {beam_width}",
            )
        if not self.accepting:
            raise RequestError("draining", "the daemon is draining; no new requests")
        old = self.sessions.get(request_id)
        if old is not None:
            raise RequestError(
                "duplicate_request",
                f"request {request_id!r} ended, but its blocks are still held (a write into "
                "them may still land); wait for its released event before reusing the id"
                if old.held
                else f"request {request_id!r} is already active or finished on this daemon; "
                "release it before reusing the id",
            )
        if not blocks:
            raise RequestError("bad_request", "a receive needs at least one block")
        try:
            validate_block_ids(pool.layout, blocks)
        except LayoutError as exc:
            raise RequestError("bad_request", f"pool {pool.pool_id!r}: {exc}") from exc
        if block_start < 0:
            raise RequestError(
                "bad_request", f"block_start must be 0 or more (a block index), got {block_start}"
            )
        if num_tokens is not None:
            tpb = pool.layout.tokens_per_block
            if block_start * tpb >= num_tokens:
                raise RequestError(
                    "bad_request",
                    f"block_start {block_start} starts at token {block_start * tpb}, at or "
                    f"past the end of the request's {num_tokens} tokens: nothing to receive",
                )
            # num_tokens counts from token 0, the blocks from block_start.
            end = block_start + len(blocks)
            if not (end - 1) * tpb < num_tokens <= end * tpb:
                raise RequestError(
                    "bad_request",
                    f"{num_tokens} tokens do not fill {len(blocks)} blocks of {tpb} tokens"
                    + (f" from block {block_start} on" if block_start else ""),
                )
        self.loans.lend(pool, blocks, request_id, self._is_held)
        s = RxSession(
            request_id=request_id,
            engine=engine,
            pool=pool,
            blocks=list(blocks),
            block_start=block_start,
            num_tokens=num_tokens,
            rx_token=secrets.randbits(63),
            legs=[RxLeg(peer) for peer in peers],
        )
        self.sessions[request_id] = s
        pool.users.add(f"rx:{request_id}")
        self._phase[request_id] = "admission"
        # The timeout is read once, here: a reload applies to receives accepted after it,
        # not to one still waiting for admission (docs/operations.md).
        s.task = asyncio.create_task(self._run(s, self.timeouts.timeout_s), name=f"rx-{request_id}")

    async def cancel(self, request_id: str) -> str:
        s = self.sessions.get(request_id)
        if s is None:
            raise RequestError("unknown_request", f"no receive for request {request_id!r}")
        if s.finished or s.terminal is not None:
            return "finished" if s.finished else "busy"
        phase = self._phase.get(request_id, "")
        if phase in _CANCELLABLE and s.task is not None:
            s.request_end(
                Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the engine")
            )
            s.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(s.task)
            return "cancelled"
        asked = [leg for leg in s.legs if leg.conn is not None and leg.request_sent]
        if not asked:
            return "busy"
        answers = await asyncio.gather(*(self._ask_cancel(s, leg) for leg in asked))
        stopped = [leg for leg, cancelled in zip(asked, answers, strict=True) if cancelled]
        if not stopped:
            return "busy"
        # A context daemon that agreed has ended its side and will write nothing more; the
        # request cannot complete now, so it ends and the other legs are aborted (their
        # in-flight writes quiesce first).
        for leg in stopped:
            leg.fenced = True  # it agreed: nothing was or will be written
            s.mark_told(leg)
        s.request_end(Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the engine"))
        if s.task is not None:
            await asyncio.shield(s.task)
        return "cancelled" if s.terminal and s.terminal.status == Status.CANCELLED else "finished"

    async def _ask_cancel(self, s: RxSession, leg: RxLeg) -> bool:
        """Ask one context daemon to cancel; True when nothing was or will be written."""
        conn = leg.conn
        assert conn is not None
        key = (s.request_id, s.rx_token, conn.key)
        answer = asyncio.get_running_loop().create_future()
        self._cancel_answers[key] = answer
        try:
            if not await conn.send(CancelRequest(request_id=s.request_id, rx_token=s.rx_token)):
                return False
            try:
                return await asyncio.wait_for(answer, self.timeouts.answer_s)
            except asyncio.TimeoutError:
                return False
        finally:
            self._cancel_answers.pop(key, None)

    def release(self, request_id: str) -> None:
        s = self.sessions.get(request_id)
        if s is not None and s.finished and s.held:
            s.forget = True  # the id stays taken until the blocks are back
            return
        release_finished(self.sessions, request_id, "receive")

    # ----------------------------------------------------------- peer messages

    def owns(self, conn: PeerConnection, request_id: str, rx_token: int) -> bool:
        """Ours: an active or finished receive, or the hold of an ended one."""
        return (
            self._match(conn, request_id, rx_token) is not None
            or (request_id, rx_token) in self.holds.holds
        )

    def _match(self, conn: PeerConnection, request_id: str, rx_token: int) -> RxSession | None:
        s = self.sessions.get(request_id)
        if s is None or s.rx_token != rx_token or s.leg_of(conn) is None:
            return None  # late or foreign: never revives a finished request
        return s

    async def on_result(self, conn: PeerConnection, msg: Result) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        if msg.last and msg.status == Reason.OK:
            # A late last Result of an ended receive: that write completed, nothing follows.
            self.holds.on_fence_message(conn, msg.request_id, msg.rx_token)
        if s is None or s.terminal is not None:
            return
        leg = s.leg_of(conn)
        assert leg is not None
        if msg.status == Reason.OK:
            if leg.source is None:
                # Messages arrive in order: the pool it wrote from is announced by now.
                peer = peer_tp(conn)
                leg.source = peer if isinstance(peer, tuple) else None
            s.nbytes += msg.nbytes
            if msg.bounced:
                # Scattered by the session's task, in order, before any ack. Logical block
                # indices of the request, as the context side counts them.
                first, end = msg.first_block, msg.end_block
                if not end:  # the whole request: our blocks
                    first, end = s.block_start, s.block_start + len(s.blocks)
                s.rounds.append((leg, first, end, msg.nbytes, msg.last))
                s.wake.set()
            elif msg.last:
                leg.done = leg.fenced = True  # written in full: nothing more comes from it
                if len(s.legs) > 1:
                    leg.told = True  # that context daemon is done with the request
                if all(each.done for each in s.legs):
                    s.result = (msg.status, s.nbytes, msg.message)
                    s.wake.set()
                else:
                    s.advance(SessionState.TRANSFERRING)  # some heads are in place
            else:
                s.advance(SessionState.TRANSFERRING)
        else:
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_FAILED, msg.message))
            s.mark_told(leg)

    async def on_abort(self, conn: PeerConnection, msg: Abort) -> None:
        # Sent only once its write is quiescent: a fence for a hold too (a late Abort).
        self.holds.on_fence_message(conn, msg.request_id, msg.rx_token)
        s = self._match(conn, msg.request_id, msg.rx_token)
        if s is None:
            return
        if msg.reason == Reason.SENDER_DEADLINE:
            term = Terminal.peer(Status.FAILED, Reason.PEER_TIMED_OUT, msg.message)
        elif msg.reason in (Reason.CANCELLED, Reason.PEER_CANCELLED):
            term = Terminal.peer(Status.CANCELLED, Reason.PEER_CANCELLED, msg.message)
        elif msg.reason in (Reason.NOT_YOUR_REQUEST, Reason.ALREADY_SERVED):
            # Not a failure of the context side: this request's KV is someone else's.
            term = Terminal.peer(Status.FAILED, msg.reason, f"context side: {msg.message}")
        else:
            term = Terminal.peer(
                Status.FAILED, Reason.PEER_FAILED, f"context side: {msg.reason}: {msg.message}"
            )
        # The context side sends Abort only once its write is quiescent.
        s.request_end(term)
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
        answer = self._cancel_answers.get((msg.request_id, msg.rx_token, conn.key))
        if answer is not None and not answer.done():
            answer.set_result(msg.cancelled)

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
        for key, answer in self._cancel_answers.items():
            if key[2] == conn.key and not answer.done():
                answer.set_result(False)
        await settle(lost)

    # -------------------------------------------------------------- lifecycle

    async def abort_engine(self, engine: EngineLink, reason: str, message: str) -> None:
        mine = [s for s in self.sessions.values() if s.engine is engine]
        for s in mine:
            self._end_now(s, Terminal.local(Status.FAILED, reason, message))
        await settle(mine)
        for s in mine:
            self.sessions.pop(s.request_id, None)

    async def drain(self, deadline: float) -> None:
        self.accepting = False
        active = [s.task for s in self.sessions.values() if s.task is not None and not s.finished]
        if active:
            await asyncio.wait(active, timeout=max(0.0, deadline - time.monotonic()))
        for s in list(self.sessions.values()):
            if not s.finished:
                self._end_now(
                    s,
                    Terminal.local(Status.FAILED, Reason.SHUTDOWN, "daemon shut down before done"),
                )
        await settle(list(self.sessions.values()))

    def active_count(self) -> int:
        return sum(1 for s in self.sessions.values() if not s.finished)

    def _end_now(self, s: RxSession, term: Terminal) -> None:
        s.request_end(term)
        if self._phase.get(s.request_id) in _CANCELLABLE and s.task is not None:
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
            self._phase[s.request_id] = "connecting"
            if not await self._connect_legs(s):
                return
            conn = s.conn
            assert conn is not None
            # A cancel either sees "connecting" (the task is cancelled before any
            # request goes out) or "sent" (it asks the legs already asked).
            if s.terminal is not None:
                return
            problem = self._source_problem(s, final=False)
            if problem is not None:
                s.request_end(Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, problem))
                return
            await self._make_offer(s, conn, deadline)
            if s.terminal is not None:
                return
            self._phase[s.request_id] = "sent"
            s.advance(SessionState.READY)
            await self._ask_legs(s)
            await self._await_result(s, deadline)
        except asyncio.CancelledError:
            if s.terminal is None:
                raise
        except Exception as exc:  # a bug must fail the request, not the daemon
            log.exception("request %s: unexpected error", shown(s.request_id))
            s.request_end(Terminal.local(Status.FAILED, "internal", f"internal error: {exc}"))
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await self._quiesce(s)
            hold = self._hold_for(s)
            for leg in s.legs:
                if leg.res is not None and (hold is None or leg.res not in hold.reservations):
                    self._release_reservation(leg.res)  # nothing can land there now
                leg.res = leg.offer = None
            if admitted:
                # The window bounds transfers in flight; a hold waits for a fence, not for
                # bandwidth, and must not stall other peers' requests.
                self.admission.release(len(s.blocks))
            self._finish(s, hold)

    async def _ask_legs(self, s: RxSession) -> None:
        """Send the RequestData to each context daemon of the receive, in order, each with
        the reservation offered to it (if any)."""
        assert s.pool is not None
        remaining = s.deadline - time.monotonic()
        expires_ms = 0 if remaining == math.inf else int((time.time() + remaining) * 1e3)
        for leg in s.legs:
            assert leg.conn is not None
            if s.terminal is not None:
                # Ended while an earlier leg's send waited (a cancel one leg agreed to, a
                # lost leg): ask no one else, or that daemon would keep a request for
                # blocks handed back.
                return
            # Marked as it is queued: a cancel or abort to this leg goes out after it.
            leg.request_sent = True
            offer = leg.offer
            sent = await leg.conn.send(
                RequestData(
                    request_id=s.request_id,
                    rx_token=s.rx_token,
                    pool_id=s.pool.pool_id,
                    blocks=s.blocks,
                    block_start=s.block_start,
                    num_tokens=s.num_tokens,
                    bounce_offset=offer.offset if offer else 0,
                    bounce_nbytes=offer.nbytes if offer else 0,
                    expires_unix_ms=expires_ms,
                )
            )
            if not sent:
                # Closed since we connected (its close handling may have run before this
                # leg knew the connection): a gone connection writes nothing.
                s.request_end(
                    Terminal.peer(
                        Status.FAILED,
                        Reason.PEER_LOST,
                        f"peer lost: {leg.conn.peer.name}: {leg.conn.close_reason}",
                    )
                )
                s.mark_told(leg)

    async def _make_offer(self, s: RxSession, conn: PeerConnection, deadline: float) -> None:
        """Set the reservation offered to each leg with the request (none: the per-block
        path)."""
        self._offer_bounce(s, conn)

    def _offer_bounce(self, s: RxSession, conn: PeerConnection) -> None:
        """Reserve room in the receive region when bouncing this request pays off."""
        if self.bounce is None or self.pipelined or s.pool is None or conn.info.bounce_nbytes == 0:
            return
        if len(s.legs) > 1 or not whole_blocks_from(s.pool, conn) or not s.pool.layout.named:
            return  # head slices move per token: the per-block path
        layout = s.pool.layout
        nbytes = len(s.blocks) * layout.block_bytes
        if not worth_bouncing(len(layout.block_segments(s.blocks)), nbytes):
            return
        res = self.bounce.recv.reserve(nbytes)
        if res is None:
            self.bounce.fallbacks += 1  # never wait for room: the per-block path it is
            return
        self.bounce.reservations_made += 1
        s.legs[0].res = res
        s.legs[0].offer = Reservation(res.offset, nbytes)

    async def _connect_legs(self, s: RxSession) -> bool:
        """Connect to every context daemon of the receive (concurrently); False when one
        cannot be reached or two of them turn out to be the same daemon."""
        conns = await asyncio.gather(*(self._connect_peer(s, leg) for leg in s.legs))
        for leg, conn in zip(s.legs, conns, strict=True):
            leg.conn = conn
        if s.terminal is not None or any(conn is None for conn in conns):
            return False
        names = [conn.peer.name for conn in conns if conn is not None]
        if len(set(names)) != len(names):
            s.request_end(
                Terminal.local(
                    Status.FAILED,
                    "bad_request",
                    f"the peers {s.peer_address} include the same context daemon twice "
                    f"({', '.join(names)})",
                )
            )
            return False
        return True

    def _source_problem(self, s: RxSession, final: bool) -> str | None:
        """Why this receive's context daemons do not hold our heads exactly once."""
        assert s.pool is not None
        return source_problem(s.pool, s.legs, final, self.pipelined)

    async def _connect_peer(self, s: RxSession, leg: RxLeg) -> PeerConnection | None:
        try:
            return await self._connect(leg.peer_address)
        except IncompatiblePeerError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_REFUSED, str(exc)))
        except HandshakeError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_UNREACHABLE, str(exc)))
        except (OSError, asyncio.TimeoutError, KvxferdError) as exc:
            s.request_end(
                Terminal.peer(
                    Status.FAILED,
                    Reason.PEER_UNREACHABLE,
                    f"cannot reach context peer {leg.peer_address!r}: {exc or type(exc).__name__}",
                )
            )
        return None

    async def _await_result(self, s: RxSession, deadline: float) -> None:
        while s.terminal is None:
            while s.rounds and s.terminal is None:
                leg, first, end, nbytes, last = s.rounds.pop(0)
                await self._scatter(s, leg, first, end, nbytes)
                if s.terminal is not None:
                    return
                if last:
                    leg.done = leg.fenced = True  # its last round is scattered
                    if len(s.legs) > 1:
                        leg.told = True  # that context daemon is done with the request
                    if all(each.done for each in s.legs):
                        s.result = (Reason.OK, s.nbytes, "")
                    else:
                        s.advance(SessionState.TRANSFERRING)  # some heads are in place
                else:
                    await self._round_done(s, leg, end)
            if s.terminal is not None:
                return
            if s.result is not None:
                # Every leg delivered: only heads exactly covered count as done.
                problem = self._source_problem(s, final=True)
                if problem is not None:
                    s.request_end(Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, problem))
                else:
                    s.request_end(Terminal.local(Status.DONE, Reason.OK, ""))
                s.mark_told(None)
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                s.request_end(
                    Terminal.local(
                        Status.TIMED_OUT,
                        Reason.RECEIVER_TIMEOUT,
                        "kv_transfer_timeout_ms elapsed before the context side reported the KV",
                    )
                )
                return
            s.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(s.wake.wait(), None if remaining == math.inf else remaining)

    def _leg_heads(self, s: RxSession, leg: RxLeg) -> tuple[int, int] | None:
        """The heads of our pool a leg moves (None: whole blocks). A context daemon that
        announced no pool yet is taken to hold our heads (a receive without tensor
        parallelism); LayoutError when it holds none of them."""
        assert s.pool is not None and leg.conn is not None
        peer = leg.source if leg.source is not None else peer_tp(leg.conn)
        if peer is None:
            return None
        if isinstance(peer, str):
            raise LayoutError(peer)
        tp, layout = peer
        return leg_heads(s.pool.layout, s.pool.tp, layout, tp)

    async def _scatter(self, s: RxSession, leg: RxLeg, first: int, end: int, nbytes: int) -> None:
        """Move one round of a leg's bytes from its reservation into the request's logical
        blocks [first, end) (only into the heads that leg holds)."""
        res = leg.res
        if self.bounce is None or res is None or s.pool is None:
            raise RuntimeError("the peer bounced a request that has no reservation here")
        try:
            heads = self._leg_heads(s, leg)
        except LayoutError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc)))
            return
        expected = (end - first) * leg_block_bytes(s.pool.layout, heads)
        ours = (s.block_start, s.block_start + len(s.blocks))  # the logical blocks we hold
        if not ours[0] <= first < end <= ours[1] or nbytes != expected or nbytes > res.nbytes:
            held = f"(we hold [{ours[0]}, {ours[1]}))" if s.block_start else f"of {len(s.blocks)}"
            s.request_end(
                Terminal.peer(
                    Status.FAILED,
                    Reason.TRANSFER_ERROR,
                    f"the peer reported blocks [{first}, {end}) {held} with "
                    f"{nbytes} bytes; {expected} expected, at most {res.nbytes} reserved",
                )
            )
            return
        dst = s.blocks[first - s.block_start : end - s.block_start]
        await self.bounce.scatter(res, nbytes, s.pool.region.array, s.pool.layout, dst, heads)

    async def _round_done(self, s: RxSession, leg: RxLeg, end: int) -> None:
        """Bounce never has more than one round; the staged runtime acks each."""
        raise RuntimeError("the peer sent a partial round to a receiver without rounds")

    async def _quiesce(self, s: RxSession) -> None:
        """Tell every context daemon that may still write (Abort) and give them a short
        grace to confirm (AbortAck). Whoever has not confirmed by then leaves a hold: the
        outcome must not wait for a peer that is stopped or unreachable."""
        term = s.terminal
        assert term is not None
        give_up = time.monotonic() + self.timeouts.ack_grace_s
        waiting: list[tuple[RxLeg, PeerConnection]] = []
        for leg in s.legs:
            conn = leg.conn
            if not leg.request_sent or leg.fenced or conn is None or conn.closed.is_set():
                continue
            # Also to a leg that knows the outcome: only an AbortAck proves it stopped.
            leg.told = True
            abort = Abort(
                request_id=s.request_id,
                rx_token=s.rx_token,
                reason=term.reason,
                message=term.message,
            )
            # Waiting for room in the socket (a stopped peer reads nothing) is bounded by
            # the grace, so the outcome stays on time; the send itself is never cancelled
            # (it goes out when the socket drains) and is kept until it ends.
            sending = asyncio.create_task(conn.send(abort))
            self._sending.add(sending)
            sending.add_done_callback(self._sending.discard)
            await asyncio.wait({sending}, timeout=max(0.0, give_up - time.monotonic()))
            waiting.append((leg, conn))
        while True:
            pending = [leg for leg, conn in waiting if not leg.fenced and not conn.closed.is_set()]
            remaining = give_up - time.monotonic()
            if not pending or remaining <= 0:
                break
            s.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(s.wake.wait(), remaining)
        s.mark_told(None)

    # ----------------------------------------------------------------- holds

    def _reservations_exposed(self) -> bool:
        """Whether a peer writes into our reservations itself (one-sided backends)."""
        return True

    def _hold_for(self, s: RxSession) -> Hold | None:
        """What this ended receive must keep until fenced (None: nothing can land)."""
        if s.terminal is None or s.terminal.status == Status.DONE:
            return None
        unfenced = [leg for leg in s.legs if leg.request_sent and not leg.fenced]
        if not unfenced:
            return None
        reservations = (
            [leg.res for leg in s.legs if leg.res is not None]
            if self._reservations_exposed()
            else []
        )
        if not self.exposes_blocks and not reservations:
            return None  # only our own transport lands bytes, and it has stopped
        pending = []
        for leg in unfenced:
            conn = leg.conn
            if conn is None:
                continue  # never connected, so never asked
            if exited(conn.info.process):
                continue  # its process is gone already (killed): nothing to hold for
            address = conn.label if conn.dialed else leg.peer_address
            pending.append(
                HeldLeg(conn.peer.name, conn.peer.incarnation, address, conn.info.process)
            )
        if not pending:
            return None
        return Hold(
            request_id=s.request_id,
            rx_token=s.rx_token,
            reason=s.terminal.reason,
            message=s.terminal.message,
            pool=s.pool,
            block_ids=list(s.blocks) if self.exposes_blocks else [],
            reservations=reservations,
            pending=pending,
        )

    def _is_held(self, request_id: str) -> bool:
        s = self.sessions.get(request_id)
        return s is not None and s.held

    def _release_reservation(self, res: Reservation) -> None:
        if self.bounce is not None:
            self.bounce.recv.release(res)

    def _hold_released(self, hold: Hold, how: str) -> None:
        s = self.sessions.get(hold.request_id)
        if hold.block_ids:
            self.loans.give_back(hold.pool, hold.block_ids, hold.request_id)
        if s is not None and s.rx_token == hold.rx_token and s.held:
            s.held = False
            if s.forget:
                del self.sessions[hold.request_id]
            if hold.blocks and s.engine is not None:
                s.engine.released(
                    hold.request_id, "recv", how, (time.monotonic() - hold.since) * 1e3
                )
        if self.on_hold_released is not None:
            self.on_hold_released(hold, how)

    def _finish(self, s: RxSession, hold: Hold | None = None) -> None:
        if s.terminal is None:
            s.terminal = Terminal.local(Status.FAILED, "internal", "ended without a terminal state")
        self._phase.pop(s.request_id, None)
        s.held = hold is not None and hold.blocks > 0
        if not s.held:
            self.loans.give_back(s.pool, s.blocks, s.request_id)
        conclude(s, "recv", s.pool, log, blocks_held=s.held)
        if hold is not None:
            # In the same step as conclude (no await between): the pool never looks unused.
            # After it: a hold fenced at once still reports `released` after the outcome.
            self.holds.add(hold)
