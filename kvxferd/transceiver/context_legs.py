"""The generation side's conversation with the context daemons of its receives (one per
leg): dial them, ask each for the KV (RequestData), ask them to cancel, and, once a
receive ended, tell those that may still write (Abort) and give them a short grace to
confirm (AbortAck). The receive coordinator (transceiver/receiver.py) decides when.

Also what an ended receive leaves behind: the hold (transceiver/holds.py) of the memory
that a context daemon not yet fenced may still write into.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from kvxferd.errors import HandshakeError, IncompatiblePeerError, KvxferdError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Abort, CancelAnswer, CancelRequest, RequestData
from kvxferd.peers.process import exited
from kvxferd.transceiver.bounce import Reservation
from kvxferd.transceiver.holds import HeldLeg, Hold
from kvxferd.transceiver.legs import RxLeg
from kvxferd.transceiver.sessions import RxSession, Terminal
from kvxferd.transceiver.state import Reason, Status

Connect = Callable[[str], Awaitable[PeerConnection]]


class ContextLegs:
    def __init__(self, connect: Connect) -> None:
        self._connect = connect
        # By (request id, rx_token, peer connection): the legs of a merge share the token.
        self._cancel_answers: dict[tuple[str, int, str], asyncio.Future[bool]] = {}
        self._sending: set[asyncio.Task[bool]] = set()  # Aborts still draining

    async def connect(self, s: RxSession) -> bool:
        """Connect to every context daemon of the receive (concurrently); False when one
        cannot be reached or two of them turn out to be the same daemon."""
        if len(s.legs) == 1:  # the usual receive: no task and no gather for one dial
            conns = [await self._connect_peer(s, s.legs[0])]
        else:
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

    async def ask(self, s: RxSession) -> None:
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

    async def cancel(self, s: RxSession, answer_s: float) -> bool:
        """Ask every context daemon already asked for the KV to cancel; True when one
        agreed (those that did are fenced: they wrote nothing and will write nothing)."""
        asked = [leg for leg in s.legs if leg.conn is not None and leg.request_sent]
        answers = await asyncio.gather(*(self.ask_cancel(s, leg, answer_s) for leg in asked))
        stopped = [leg for leg, cancelled in zip(asked, answers, strict=True) if cancelled]
        for leg in stopped:
            leg.fenced = True
            s.mark_told(leg)
        return bool(stopped)

    async def ask_cancel(self, s: RxSession, leg: RxLeg, answer_s: float) -> bool:
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
                return await asyncio.wait_for(answer, answer_s)
            except asyncio.TimeoutError:
                return False
        finally:
            self._cancel_answers.pop(key, None)

    def on_cancel_answer(self, conn: PeerConnection, msg: CancelAnswer) -> None:
        answer = self._cancel_answers.get((msg.request_id, msg.rx_token, conn.key))
        if answer is not None and not answer.done():
            answer.set_result(msg.cancelled)

    def peer_closed(self, conn: PeerConnection) -> None:
        """A closed connection answers no cancel: those waiting hear no."""
        for key, answer in self._cancel_answers.items():
            if key[2] == conn.key and not answer.done():
                answer.set_result(False)

    async def quiesce(self, s: RxSession, grace_s: float) -> None:
        """Tell every context daemon that may still write (Abort) and give them a short
        grace to confirm (AbortAck). Whoever has not confirmed by then leaves a hold: the
        outcome must not wait for a peer that is stopped or unreachable."""
        term = s.terminal
        assert term is not None
        give_up = time.monotonic() + grace_s
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
            await s.wake.wait(remaining)
        s.mark_told(None)


def abort_terminal(msg: Abort) -> Terminal:
    """What a context daemon's Abort means for the receive."""
    if msg.reason == Reason.SENDER_DEADLINE:
        return Terminal.peer(Status.FAILED, Reason.PEER_TIMED_OUT, msg.message)
    if msg.reason in (Reason.CANCELLED, Reason.PEER_CANCELLED):
        return Terminal.peer(Status.CANCELLED, Reason.PEER_CANCELLED, msg.message)
    if msg.reason in (Reason.NOT_YOUR_REQUEST, Reason.ALREADY_SERVED):
        # Not a failure of the context side: this request's KV is someone else's.
        return Terminal.peer(Status.FAILED, msg.reason, f"context side: {msg.message}")
    return Terminal.peer(
        Status.FAILED, Reason.PEER_FAILED, f"context side: {msg.reason}: {msg.message}"
    )


def hold_for(s: RxSession, exposes_blocks: bool, reservations_exposed: bool) -> Hold | None:
    """What this ended receive must keep until fenced (None: nothing can land).
    `exposes_blocks`: a context daemon writes into the engine's blocks itself;
    `reservations_exposed`: into our reservations."""
    if s.terminal is None or s.terminal.status == Status.DONE:
        return None
    unfenced = [leg for leg in s.legs if leg.request_sent and not leg.fenced]
    if not unfenced:
        return None
    reservations: list[Reservation] = (
        [leg.res for leg in s.legs if leg.res is not None] if reservations_exposed else []
    )
    if not exposes_blocks and not reservations:
        return None  # only our own transport lands bytes, and it has stopped
    pending = []
    for leg in unfenced:
        conn = leg.conn
        if conn is None:
            continue  # never connected, so never asked
        if exited(conn.info.process):
            continue  # its process is gone already (killed): nothing to hold for
        address = conn.label if conn.dialed else leg.peer_address
        pending.append(HeldLeg(conn.peer.name, conn.peer.incarnation, address, conn.info.process))
    if not pending:
        return None
    return Hold(
        request_id=s.request_id,
        rx_token=s.rx_token,
        reason=s.terminal.reason,
        message=s.terminal.message,
        pool=s.pool,
        block_ids=list(s.blocks) if exposes_blocks else [],
        reservations=reservations,
        pending=pending,
        peer=s.peer,
    )
