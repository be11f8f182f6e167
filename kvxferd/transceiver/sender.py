"""The send coordinator: match the engine's send with the receivers' RequestData
(transceiver/tx_matching.py), hand each due slice of the request to the mover
(transceiver/movers.py), then report. How the generation side ends a request (Abort,
CancelRequest, its connection closing) is transceiver/tx_peer_ends.py.

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
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable

from kvxferd.errors import RequestError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Abort, CancelRequest, RequestData
from kvxferd.service.logs import LogLimiter, shown
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.bounce import BounceBuffers
from kvxferd.transceiver.dataplane import DataPlane
from kvxferd.transceiver.legs import abort_legs, expected_legs
from kvxferd.transceiver.movers import SEND_MOVERS, MoverFactory, SendMover
from kvxferd.transceiver.sessions import (
    EngineLink,
    Terminal,
    TxSession,
    abort_engine_sessions,
    conclude,
    drain_sessions,
    forget_auto_released,
    release_finished,
)
from kvxferd.transceiver.state import Reason, Status
from kvxferd.transceiver.timeouts import SenderTimeouts
from kvxferd.transceiver.tx_chunks import check_send, session_for_send
from kvxferd.transceiver.tx_drains import Drain, Drains
from kvxferd.transceiver.tx_matching import Matching
from kvxferd.transceiver.tx_peer_ends import PeerEnds
from kvxferd.transceiver.writes import Writes

log = logging.getLogger("kvxferd.sender")


def _deadline(now: float, timeout_s: float | None) -> float | None:
    return None if timeout_s is None else now + timeout_s


class Sender:
    def __init__(
        self,
        timeouts: SenderTimeouts,
        dataplane: DataPlane,
        pipelined: bool = False,
        bounce: BounceBuffers | None = None,
        mover: MoverFactory | None = None,
        max_requests: Callable[[], int] = lambda: 0,
    ) -> None:
        """`mover`: how the bytes of each due slice cross (transceiver/movers.py); the
        direct one (PYTHON runtime) by default. `max_requests`: most sessions kept
        (daemon.max_requests, read at each new one; 0: no limit)."""
        self.timeouts = timeouts
        self._dp = dataplane
        self.pipelined = pipelined
        self.bounce = bounce
        self.sessions: dict[str, TxSession] = {}
        self.accepting = True
        # Every write of this side: post, wait in slices, release until quiescent.
        self.writes = Writes(dataplane, lambda: self.timeouts.slice_s)
        # A peer can send refused RequestData in a loop: a few lines per peer and
        # reason, then a count (the refusals metric counts every one).
        self.log_limiter = LogLimiter(interval_s=10.0, burst=5)
        self.max_requests = max_requests
        # Which receivers each request serves, and the generation side ending requests.
        self._matching = Matching(
            self.sessions,
            lambda: self.accepting,
            self._count_refusal,
            self.log_limiter,
            max_requests,
        )
        self._ends = PeerEnds(self.sessions, self._matching, self.log_limiter, self.writes.drains)
        # Writes drained rather than cancelled (tx_drains.py): the engine hears `released`
        # when each ends, and the Aborts owed to its receivers go out then.
        self.writes.drains.on_end = self._drained
        self._owed_aborts: set[asyncio.Task[None]] = set()
        # Told of a pool one of whose users left (a drain ended): a gone engine's pool set
        # aside meanwhile may go now.
        self.on_pool_user_left: Callable[[LocalPool], None] | None = None
        make = mover or SEND_MOVERS["PYTHON"]
        self.mover: SendMover = make(self.writes, bounce, pipelined, self._matching.match)
        # Pipelined: the timeout read at a request's first chunk, until its last chunk
        # starts the deadline with it.
        self._timeout_at_accept: weakref.WeakKeyDictionary[TxSession, float | None] = (
            weakref.WeakKeyDictionary()
        )
        # Told the reason of each RequestData refused without being served.
        self.on_refused: Callable[[str], None] | None = None

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
        auto_release: bool = False,
    ) -> None:
        """Accept one send call (a chunk; `last` marks the final one) or raise RequestError.
        `peer`: the generation daemon (by name) the request is for; "" for anyone. The
        first chunk's counts; a later chunk may repeat it or leave it empty. So does
        `auto_release`'s (forget the request with its outcome: Send.auto_release)."""
        check_send(request_id, pool, blocks, token_start, token_end, beam_width, self.pipelined)
        s = session_for_send(
            self.sessions, self.accepting, engine, request_id, token_start, blocks, peer,
            self.max_requests(), pool,
        )  # fmt: skip
        s.pool = pool
        s.blocks = list(blocks)
        s.token_end = token_end
        s.last_seen = last
        pool.users.add(f"tx:{s.request_id}")
        now = time.monotonic()
        if s.task is None:
            s.serve_peer = peer
            s.auto_release = auto_release
            self._matching.choose_receivers(s)
            self._matching.shares.sent(s)
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
        # Held (a drained write still reads the blocks): forgotten once they are back.
        release_finished(self.sessions, request_id, "send")

    # ----------------------------------------------------------- peer messages
    # RequestData: tx_matching.py; the generation side ending a request: tx_peer_ends.py.

    async def on_request_data(self, conn: PeerConnection, msg: RequestData) -> None:
        await self._matching.on_request_data(conn, msg)

    async def on_abort(self, conn: PeerConnection, msg: Abort) -> None:
        await self._ends.on_abort(conn, msg)

    async def on_cancel_request(self, conn: PeerConnection, msg: CancelRequest) -> None:
        await self._ends.on_cancel_request(conn, msg)

    async def on_peer_closed(self, conn: PeerConnection) -> None:
        await self._ends.on_peer_closed(conn)

    async def settle_incarnation(self, name: str, incarnation: str) -> bool:
        """Wait until no transfer for daemon `name`/`incarnation` can still move bytes; True
        once none is left (tx_peer_ends.py)."""
        return await self._ends.settle_incarnation(name, incarnation)

    def _count_refusal(self, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)

    # -------------------------------------------------------------- lifecycle

    async def abort_engine(self, engine: EngineLink, reason: str, message: str) -> None:
        """Fail every session of a (disconnected) engine and wait until quiescent."""
        await abort_engine_sessions(self.sessions, engine, reason, message)

    async def drain(self, deadline: float) -> None:
        self.accepting = False
        await drain_sessions(self.sessions, deadline, self._end_at_shutdown)

    async def _end_at_shutdown(self, s: TxSession, shutdown: Terminal) -> None:
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
        else:
            s.request_end(shutdown)

    async def drained_into(self, conn: PeerConnection) -> None:
        """Until no write into `conn`'s daemon incarnation is drained any more."""
        await Drains.wait(self.writes.drains.of(conn.peer.name, conn.peer.incarnation))

    async def close_drains(self) -> list[Drain]:
        """Shutdown: stop draining (the drains left are returned) and the Aborts owed."""
        left = await self.writes.drains.close()
        for task in list(self._owed_aborts):
            task.cancel()
        await asyncio.gather(*self._owed_aborts, return_exceptions=True)
        return left

    def active_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.engine is not None and not s.finished)

    # --------------------------------------------------------------- the work

    async def _run(self, s: TxSession) -> None:
        try:
            while s.terminal is None:
                if s.turned_away:  # checked here: a coroutine call a request costs ~1 us
                    await self._matching.tell_turned_away(s)
                await self._matching.refuse_strangers(s)
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
                Terminal.timed_out(
                    Reason.SENDER_DEADLINE,
                    f"kv_transfer_timeout_ms elapsed waiting for {waiting_for}",
                )
            )
            return
        s.wake.clear()
        await s.wake.wait(remaining)

    async def _finish(self, s: TxSession) -> None:
        term = s.terminal
        assert term is not None
        if s.turned_away:
            await self._matching.tell_turned_away(s)
        # The peers are always told, once the write is quiescent: now, or for a drained
        # write when its drain ends (an Abort says nothing more of it can land).
        if term.status != Status.DONE and s.request and s.conn and not s.peer_told:
            if s.held:
                task = asyncio.create_task(self._abort_when_drained(s, term), name="owed-abort")
                self._owed_aborts.add(task)
                task.add_done_callback(self._owed_aborts.discard)
            else:
                await self._abort_receivers(s, term)
        # A drained write still reads the blocks: the engine hears `released` for them.
        conclude(s, "send", s.pool, log, blocks_held=s.held)
        forget_auto_released(self.sessions, s)

    async def _abort_receivers(self, s: TxSession, term: Terminal) -> None:
        assert s.request is not None and s.conn is not None
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

    async def _abort_when_drained(self, s: TxSession, term: Terminal) -> None:
        await Drains.wait(s.draining)
        await self._abort_receivers(s, term)

    def _drained(self, drain: Drain) -> None:
        """A drained write ended: its session's blocks are back once its last drain is."""
        s = self.sessions.get(drain.request_id)
        if s is not None and drain in s.draining and not s.held:
            told_held = s.outcome is not None and s.outcome.blocks_held
            if told_held and s.engine is not None and drain.how != "shutdown":
                s.engine.released(s.request_id, "send", "drained", drain.held_ms)
            if s.forget:
                del self.sessions[s.request_id]
        if drain.pool is not None and self.on_pool_user_left is not None:
            self.on_pool_user_left(drain.pool)
