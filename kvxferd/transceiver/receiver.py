"""Generation side of the PYTHON runtime: admit a posted receive, ask the context
daemon for the KV (RequestData), and complete when the last slice is reported.

Timeouts (the seed): kv_transfer_timeout_ms applies per receive task, from
admission. When a request ends here while the context side may still be
writing (timeout, cancel, engine gone, shutdown), the peer is told (Abort) and
the blocks stay on loan until it confirms quiescence (AbortAck) or the
connection is gone; only then is the outcome reported.
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
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.admission import AdmissionWindow
from kvxferd.transceiver.bounce import BounceBuffers, Reservation, worth_bouncing
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
    # Bound on waiting for the context side's answer to a cancel or an abort;
    # past it the connection is closed, which stops the peer's writes.
    answer_s: float


class Receiver:
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
        self._cancel_answers: dict[tuple[str, int], asyncio.Future[bool]] = {}

    # ------------------------------------------------------------ engine calls

    def recv(
        self,
        engine: EngineLink,
        request_id: str,
        pool: LocalPool,
        blocks: list[int],
        peer_address: str,
        num_tokens: int | None,
        beam_width: int = 1,
    ) -> None:
        if self.pipelined and beam_width != 1:
            raise RequestError(
                "bad_request",
                f"request {request_id!r}: pipelined transfer needs beam width 1, got {beam_width}",
            )
        if not self.accepting:
            raise RequestError("draining", "the daemon is draining; no new requests")
        if request_id in self.sessions:
            raise RequestError(
                "duplicate_request",
                f"request {request_id!r} is already active or finished on this daemon; "
                "release it before reusing the id",
            )
        if not blocks:
            raise RequestError("bad_request", "a receive needs at least one block")
        try:
            validate_block_ids(pool.layout, blocks)
        except LayoutError as exc:
            raise RequestError("bad_request", f"pool {pool.pool_id!r}: {exc}") from exc
        if num_tokens is not None:
            tpb = pool.layout.tokens_per_block
            if not (len(blocks) - 1) * tpb < num_tokens <= len(blocks) * tpb:
                raise RequestError(
                    "bad_request",
                    f"{num_tokens} tokens do not fill {len(blocks)} blocks of {tpb} tokens",
                )
        s = RxSession(
            request_id=request_id,
            engine=engine,
            pool=pool,
            blocks=list(blocks),
            num_tokens=num_tokens,
            peer_address=peer_address,
            rx_token=secrets.randbits(63),
        )
        self.sessions[request_id] = s
        pool.users.add(f"rx:{request_id}")
        self._phase[request_id] = "admission"
        s.task = asyncio.create_task(self._run(s), name=f"rx-{request_id}")

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
        conn = s.conn
        if conn is None:
            return "busy"
        key = (request_id, s.rx_token)
        answer = asyncio.get_running_loop().create_future()
        self._cancel_answers[key] = answer
        try:
            if not await conn.send(CancelRequest(request_id=request_id, rx_token=s.rx_token)):
                return "busy"
            try:
                cancelled = await asyncio.wait_for(answer, self.timeouts.answer_s)
            except asyncio.TimeoutError:
                return "busy"
        finally:
            self._cancel_answers.pop(key, None)
        if not cancelled:
            return "busy"
        if s.request_end(
            Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the engine")
        ):
            s.peer_told = True
        if s.task is not None:
            await asyncio.shield(s.task)
        return "cancelled" if s.terminal and s.terminal.status == Status.CANCELLED else "finished"

    def release(self, request_id: str) -> None:
        release_finished(self.sessions, request_id, "receive")

    # ----------------------------------------------------------- peer messages

    def owns(self, conn: PeerConnection, request_id: str, rx_token: int) -> bool:
        return self._match(conn, request_id, rx_token) is not None

    def _match(self, conn: PeerConnection, request_id: str, rx_token: int) -> RxSession | None:
        s = self.sessions.get(request_id)
        if s is None or s.conn is not conn or s.rx_token != rx_token:
            return None  # late or foreign: never revives a finished request
        return s

    async def on_result(self, conn: PeerConnection, msg: Result) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        if s is None or s.terminal is not None:
            return
        if msg.status == Reason.OK:
            s.nbytes += msg.nbytes
            if msg.bounced:
                # Scattered by the session's task, in order, before any ack.
                end = msg.end_block or len(s.blocks)
                s.rounds.append((msg.first_block, end, msg.nbytes, msg.last))
                s.wake.set()
            elif msg.last:
                s.result = (msg.status, s.nbytes, msg.message)
                s.wake.set()
            else:
                s.advance(SessionState.TRANSFERRING)
        else:
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_FAILED, msg.message))
            s.peer_told = True

    async def on_abort(self, conn: PeerConnection, msg: Abort) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        if s is None:
            return
        if msg.reason == Reason.SENDER_DEADLINE:
            term = Terminal.peer(Status.FAILED, Reason.PEER_TIMED_OUT, msg.message)
        elif msg.reason in (Reason.CANCELLED, Reason.PEER_CANCELLED):
            term = Terminal.peer(Status.CANCELLED, Reason.PEER_CANCELLED, msg.message)
        else:
            term = Terminal.peer(
                Status.FAILED, Reason.PEER_FAILED, f"context side: {msg.reason}: {msg.message}"
            )
        # The context side sends Abort only once its write is quiescent.
        s.request_end(term)
        s.peer_told = True
        s.wake.set()

    async def on_abort_ack(self, conn: PeerConnection, msg: AbortAck) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        if s is not None:
            s.abort_acked = True
            s.wake.set()

    async def on_cancel_answer(self, conn: PeerConnection, msg: CancelAnswer) -> None:
        answer = self._cancel_answers.get((msg.request_id, msg.rx_token))
        if answer is not None and not answer.done():
            answer.set_result(msg.cancelled)

    async def on_peer_closed(self, conn: PeerConnection) -> None:
        lost = []
        for s in self.sessions.values():
            if s.conn is conn and not s.finished:
                s.request_end(
                    Terminal.peer(
                        Status.FAILED, Reason.PEER_LOST, f"peer lost: {conn.close_reason}"
                    )
                )
                s.peer_told = True  # nobody left to tell; a gone connection writes nothing
                s.wake.set()
                lost.append(s)
        for answer in self._cancel_answers.values():
            if not answer.done():
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

    async def _run(self, s: RxSession) -> None:
        admitted = False
        try:
            await self.admission.acquire(len(s.blocks))
            admitted = True
            timeout_s = self.timeouts.timeout_s
            deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
            self._phase[s.request_id] = "connecting"
            conn = await self._connect_peer(s)
            if conn is None:
                return
            s.conn = conn
            # No await between this check and the write below: a cancel either
            # sees "connecting" (and no request is ever sent) or "sent".
            if s.terminal is not None:
                return
            offer = await self._make_offer(s, conn, deadline)
            if s.terminal is not None:
                return
            self._phase[s.request_id] = "sent"
            s.request_sent = True
            s.advance(SessionState.READY)
            await conn.send(
                RequestData(
                    request_id=s.request_id,
                    rx_token=s.rx_token,
                    pool_id=s.pool.pool_id if s.pool else "",
                    blocks=s.blocks,
                    num_tokens=s.num_tokens,
                    bounce_offset=offer.offset if offer else 0,
                    bounce_nbytes=offer.nbytes if offer else 0,
                )
            )
            await self._await_result(s, deadline)
        except asyncio.CancelledError:
            if s.terminal is None:
                raise
        except Exception as exc:  # a bug must fail the request, not the daemon
            log.exception("request %s: unexpected error", s.request_id)
            s.request_end(Terminal.local(Status.FAILED, "internal", f"internal error: {exc}"))
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await self._quiesce(s)
            if s.bounce_res is not None and self.bounce is not None:
                self.bounce.recv.release(s.bounce_res)  # quiescent: nothing can land there now
                s.bounce_res = None
            if admitted:
                self.admission.release(len(s.blocks))
            self._finish(s)

    async def _make_offer(
        self, s: RxSession, conn: PeerConnection, deadline: float
    ) -> Reservation | None:
        """The reservation offered with the request (None: the per-block path)."""
        return self._offer_bounce(s, conn)

    def _offer_bounce(self, s: RxSession, conn: PeerConnection) -> Reservation | None:
        """Reserve room in the receive region when bouncing this request pays off."""
        if self.bounce is None or self.pipelined or s.pool is None or conn.info.bounce_nbytes == 0:
            return None
        layout = s.pool.layout
        nbytes = len(s.blocks) * layout.block_bytes
        if not worth_bouncing(len(layout.block_segments(s.blocks)), nbytes):
            return None
        res = self.bounce.recv.reserve(nbytes)
        if res is None:
            self.bounce.fallbacks += 1  # never wait for room: the per-block path it is
            return None
        self.bounce.reservations_made += 1
        s.bounce_res = res
        return Reservation(res.offset, nbytes)

    async def _connect_peer(self, s: RxSession) -> PeerConnection | None:
        try:
            return await self._connect(s.peer_address)
        except IncompatiblePeerError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_REFUSED, str(exc)))
        except HandshakeError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_UNREACHABLE, str(exc)))
        except (OSError, asyncio.TimeoutError, KvxferdError) as exc:
            s.request_end(
                Terminal.peer(
                    Status.FAILED,
                    Reason.PEER_UNREACHABLE,
                    f"cannot reach context peer {s.peer_address!r}: {exc or type(exc).__name__}",
                )
            )
        return None

    async def _await_result(self, s: RxSession, deadline: float) -> None:
        while s.terminal is None:
            while s.rounds and s.terminal is None:
                first, end, nbytes, last = s.rounds.pop(0)
                await self._scatter(s, first, end, nbytes)
                if s.terminal is not None:
                    return
                if last:
                    s.result = (Reason.OK, s.nbytes, "")
                elif s.conn is not None:
                    await self._round_done(s, end)
            if s.terminal is not None:
                return
            if s.result is not None:
                s.request_end(Terminal.local(Status.DONE, Reason.OK, ""))
                s.peer_told = True
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

    async def _scatter(self, s: RxSession, first: int, end: int, nbytes: int) -> None:
        """Move one round's bytes from the reservation into blocks [first, end)."""
        if self.bounce is None or s.bounce_res is None or s.pool is None:
            raise RuntimeError("the peer bounced a request that has no reservation here")
        expected = (end - first) * s.pool.layout.block_bytes
        if not 0 <= first < end <= len(s.blocks) or nbytes != expected:
            raise RuntimeError(
                f"the peer reported blocks [{first}, {end}) of {len(s.blocks)} "
                f"with {nbytes} bytes; {expected} expected"
            )
        await self.bounce.scatter(
            s.bounce_res, nbytes, s.pool.region.array, s.pool.layout, s.blocks[first:end]
        )

    async def _round_done(self, s: RxSession, end: int) -> None:
        """Bounce never has more than one round; the staged runtime acks each."""
        raise RuntimeError("the peer sent a partial round to a receiver without rounds")

    async def _quiesce(self, s: RxSession) -> None:
        """Tell the peer and wait until no write into our blocks can still land."""
        conn = s.conn
        if not s.request_sent or s.peer_told or conn is None:
            return
        term = s.terminal
        assert term is not None
        if await conn.send(
            Abort(
                request_id=s.request_id,
                rx_token=s.rx_token,
                reason=term.reason,
                message=term.message,
            )
        ):
            give_up = time.monotonic() + self.timeouts.answer_s
            while not s.abort_acked and not conn.closed.is_set():
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    # The peer neither answers nor dies: cut it off so its writes stop.
                    log.error(
                        "request %s: peer %s did not confirm the abort; closing the connection",
                        s.request_id,
                        conn.key,
                    )
                    conn.close("no answer to an abort")
                    break
                s.wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(s.wake.wait(), remaining)
        s.peer_told = True

    def _finish(self, s: RxSession) -> None:
        if s.terminal is None:
            s.terminal = Terminal.local(Status.FAILED, "internal", "ended without a terminal state")
        self._phase.pop(s.request_id, None)
        conclude(s, "recv", s.pool, log)
