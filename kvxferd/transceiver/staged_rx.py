"""The staged runtime's receive mover: one staging reservation per leg (one, or one per
context rank of a head-merge), each sized for that leg's heads; every round is taken
into its leg's reservation (written there by the peer on one-sided backends, received
by tag on two-sided ones), scattered into the heads its leg holds, then acknowledged to
that leg (RoundAck) so the same reservation takes the next round.

The receive's deadline bounds every wait here: room in the staging region, and each
round's arrival. Reservations are freed only when no write into them can still land.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from kvxferd.backends.twosided import TwoSidedTransport, lent_until, round_tag
from kvxferd.errors import KvxferdError, PeerLostError, TransferError, TransferTimeoutError
from kvxferd.memory.layout import LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Result, RoundAck
from kvxferd.transceiver.bounce import BounceBuffers, Reservation
from kvxferd.transceiver.direct_rx import scatter_round
from kvxferd.transceiver.legs import RxLeg, leg_block_bytes, rx_leg_heads
from kvxferd.transceiver.sessions import RxSession, Terminal
from kvxferd.transceiver.staging import (
    NO_ROOM,
    TWO_SIDED_ROUNDS_AHEAD,
    RoomLine,
    blocks_per_round,
    offer_legs,
    refuse_device_staging,
    reserve_all,
)
from kvxferd.transceiver.state import Reason, Status


def _key(s: RxSession, leg: RxLeg, first: int) -> tuple[int, int, int]:
    return (s.rx_token, id(leg), first)


class StagedReceive:
    """RecvMover of the staged runtime (transceiver_runtime CPP)."""

    # Peers write only into the staging reservations; our own scatter fills the blocks.
    exposes_blocks = False

    def __init__(self, bounce: BounceBuffers) -> None:
        self.bounce = bounce
        # Receives waiting for room, served in the order they began to wait.
        self.room = RoomLine()
        # The two-sided transport once started (UCX, MPI); None: one-sided writes.
        self.transport: TwoSidedTransport | None = None
        self._drops: set[asyncio.Task[None]] = set()
        # Receives of announced rounds posted ahead of their turn, by _key; and the keys of
        # those handed to the transport with their reservation when a receive ended.
        self._early: dict[tuple[int, int, int], asyncio.Future[int]] = {}
        self._gone: set[tuple[int, int, int]] = set()

    def attach(self, transport: TwoSidedTransport) -> None:
        refuse_device_staging(transport, self.bounce)
        self.transport = transport

    def reservations_exposed(self) -> bool:
        # Two-sided: bytes land only where our own posted receive puts them; one the
        # transport still holds when the session ends keeps its bytes (_leave_to_transport)
        # rather than quarantining them under a hold.
        return self.transport is None

    def release(self, res: Reservation) -> None:
        self.bounce.recv.release(res)

    async def make_offer(self, s: RxSession, conn: PeerConnection, deadline: float) -> None:
        """Every staged request needs a staging reservation per leg, together up to the whole
        region, each a whole number of that leg's blocks. Waits for room (bounded by the
        receive deadline)."""
        assert s.pool is not None
        layout = s.pool.layout
        region = self.bounce.recv
        try:
            # A leg whose context daemon announced no pool yet: sized for whole blocks (no
            # leg moves more); the sender fits its rounds into what it is offered.
            sizes = [leg_block_bytes(layout, rx_leg_heads(s.pool, leg)) for leg in s.legs]
        except LayoutError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc)))
            return
        # A peer that stalls mid-request keeps its reservation from us: quarantined until
        # it is fenced (one-sided, kvxferd.transceiver.holds), or lent to an MPI receive
        # its stopped sender had begun (two-sided, twosided.lent_until). One request never
        # takes more than half the region (unless not one block fits in half), so one
        # stalled peer cannot stop every other peer's transfers.
        k = blocks_per_round(region.nbytes // 2, len(s.blocks), sizes) or blocks_per_round(
            region.nbytes, len(s.blocks), sizes
        )
        if k == 0:
            s.request_end(
                Terminal.local(
                    Status.FAILED,
                    Reason.BLOCK_MISMATCH,
                    f"the staging buffer ({region.nbytes} bytes) cannot hold one block of "
                    f"each of the {len(sizes)} leg(s) ({', '.join(map(str, sizes))} bytes); "
                    "raise max_tokens_in_buffer",
                )
            )
            return
        wanted = [k * size for size in sizes]
        got = await self.room.reserve_by(lambda: reserve_all(region, wanted), deadline)
        if got is None:
            s.request_end(Terminal.timed_out(Reason.RECEIVER_TIMEOUT, NO_ROOM))
            return
        offer_legs(self.bounce, s.legs, got, wanted)

    async def take_round(
        self, s: RxSession, leg: RxLeg, first: int, end: int, nbytes: int, offset: int = 0
    ) -> None:
        if self.transport is not None:
            recv = self._early.pop(_key(s, leg, first), None)
            if recv is None:
                recv = self._post(s, leg, first, end, nbytes, offset, True)
            if recv is None:
                return
            # The rounds announced after this one start landing while it is scattered.
            self._receive_ahead(s)
            if not await self._received(s, leg, recv, first, end, nbytes):
                return
        await scatter_round(self.bounce, s, leg, first, end, nbytes, offset)

    def _receive_ahead(self, s: RxSession) -> None:
        """Post the receives of the next announced rounds (their slots of the reservation
        are free: the sender sends into a slot only once we acknowledged what it held)."""
        for leg, first, end, nbytes, _last, offset in s.rounds[:TWO_SIDED_ROUNDS_AHEAD]:
            key = _key(s, leg, first)
            if key not in self._early:
                recv = self._post(s, leg, first, end, nbytes, offset, False)
                if recv is not None:
                    self._early[key] = recv

    def _post(
        self,
        s: RxSession,
        leg: RxLeg,
        first: int,
        end: int,
        nbytes: int,
        offset: int,
        now: bool,
    ) -> asyncio.Future[int] | None:
        """Start receiving an announced two-sided round into its slot of the leg's
        reservation. A round that does not fit there: None, and when it is to be taken
        `now` the request ends saying why (else it is left for its turn)."""
        assert self.transport is not None
        res = leg.res
        if (
            leg.conn is None
            or res is None
            or not (nbytes > 0 and 0 <= offset <= res.nbytes - nbytes)
        ):
            if now:
                s.request_end(
                    Terminal.peer(
                        Status.FAILED,
                        Reason.TRANSFER_ERROR,
                        f"round of blocks [{first}, {end}) announced {nbytes} bytes at offset "
                        f"{offset}, {res.nbytes if res else 0} reserved",
                    )
                )
            return None
        out = self.bounce.recv.view(Reservation(res.offset + offset, nbytes), nbytes).data
        # Bounded by what is left of the receive's own deadline: the outcome is due then.
        # The transport bounds only the wait for the round to start arriving; one that
        # stalls mid-message (its sender stopped) it gives a grace past that before it
        # lets go of our buffer.
        left = s.deadline - time.monotonic()
        bound = None if left == math.inf else max(0.0, left)
        return asyncio.ensure_future(
            self.transport.recv(leg.conn.key, round_tag(s.rx_token, first), out, bound)
        )

    async def _received(
        self, s: RxSession, leg: RxLeg, recv: asyncio.Future[int], first: int, end: int, nbytes: int
    ) -> bool:
        """Wait for a round's receive; False when the request ended (saying why). The
        receive does not wait past its deadline for the transport's grace: it ends then and
        leaves the reservation to the transport until it lets go."""
        left = s.deadline - time.monotonic()
        bound = None if left == math.inf else max(0.0, left)
        try:
            await asyncio.wait({recv}, timeout=bound)
        finally:
            if not recv.done():  # past the deadline mid-message, or the task cancelled
                self._leave_to_transport([recv, *self._pop_early(s, leg)], leg)
        if not recv.done():
            s.request_end(
                Terminal.timed_out(
                    Reason.RECEIVER_TIMEOUT,
                    f"kv_transfer_timeout_ms elapsed while the round of blocks [{first}, "
                    f"{end}) was arriving",
                )
            )
            return False
        try:
            got = recv.result()
        except TransferError as exc:
            lent = lent_until(exc)
            if lent is not None:  # its payload may still land in the reservation (MPI)
                self._leave_to_transport([lent, *self._pop_early(s, leg)], leg)
            return self._failed(s, exc)
        if got != nbytes:
            s.request_end(
                Terminal.peer(
                    Status.FAILED,
                    Reason.TRANSFER_ERROR,
                    f"round of blocks [{first}, {end}) carried {got} bytes, {nbytes} announced",
                )
            )
            return False
        return True

    @staticmethod
    def _failed(s: RxSession, exc: TransferError) -> bool:
        if isinstance(exc, TransferTimeoutError):
            s.request_end(Terminal.timed_out(Reason.RECEIVER_TIMEOUT, str(exc)))
        elif isinstance(exc, PeerLostError):
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_LOST, str(exc)))
        else:
            s.request_end(Terminal.local(Status.FAILED, Reason.TRANSFER_ERROR, str(exc)))
        return False

    def _leave_to_transport(self, receives: list[asyncio.Future[Any]], leg: RxLeg) -> None:
        """Receives of a leg's rounds still in progress (or still lent their bytes) when
        the receive ends: its staging reservation is released only once the transport let
        go of every one (it may still be writing there), not with the session."""
        res, leg.res = leg.res, None
        bounce = self.bounce
        assert res is not None
        left = len(receives)
        bounce.recv_lent_bytes += res.nbytes

        def done(fut: asyncio.Future[Any]) -> None:
            nonlocal left
            # Retrieved: the receive already ended, the error is moot, unless it says the
            # transport may still write the reservation.
            exc = None if fut.cancelled() else fut.exception()
            lent = None if exc is None else lent_until(exc)
            if lent is not None:
                lent.add_done_callback(done)
                return
            left -= 1
            if left == 0:
                bounce.recv_lent_bytes -= res.nbytes
                bounce.recv.release(res)

        for recv in receives:
            recv.add_done_callback(done)

    def _pop_early(self, s: RxSession, leg: RxLeg) -> list[asyncio.Future[int]]:
        """The receives posted ahead for that leg, handed over (their rounds are not
        dropped: they are being received)."""
        keys = [k for k in self._early if k[0] == s.rx_token and k[1] == id(leg)]
        self._gone.update(keys)
        return [self._early.pop(k) for k in keys]

    async def round_done(self, s: RxSession, leg: RxLeg, end: int) -> None:
        assert leg.conn is not None
        await leg.conn.send(RoundAck(request_id=s.request_id, rx_token=s.rx_token, end_block=end))

    def late_round(self, conn: PeerConnection, s: RxSession, msg: Result) -> bool:
        """A two-sided round announced after this receive ended (e.g. another leg of a merge
        failed): the sender is sending it and cannot quiesce, nor answer our Abort, until
        it is taken; so it is taken and dropped."""
        if self.transport is None or not msg.bounced or msg.status != Reason.OK:
            return False
        self._drop_round(conn.key, round_tag(s.rx_token, msg.first_block), msg.nbytes)
        return True

    def drop_unscattered(self, s: RxSession) -> None:
        """Rounds announced but not received: their senders wait for them to be taken."""
        if self.transport is None:
            return
        for leg, first, _end, nbytes, _last, _offset in s.rounds:
            key = _key(s, leg, first)
            if key in self._early or key in self._gone:
                continue  # posted ahead: being received into the reservation
            if leg.conn is not None:
                self._drop_round(leg.conn.key, round_tag(s.rx_token, first), nbytes)
        s.rounds.clear()
        for leg in s.legs:
            early = self._pop_early(s, leg)
            if early and leg.res is not None:
                self._leave_to_transport(early, leg)
        self._gone = {k for k in self._gone if k[0] != s.rx_token}

    def _drop_round(self, peer_key: str, tag: int, nbytes: int) -> None:
        """Take a two-sided round nobody will scatter: received into scratch memory if it is
        there, else abandoned to the transport, which drops it when it arrives."""
        transport = self.transport
        assert transport is not None

        async def drop() -> None:
            scratch = memoryview(bytearray(max(0, nbytes)))
            with contextlib.suppress(KvxferdError):  # a timeout abandons the tag: dropped
                await transport.recv(peer_key, tag, scratch, 0.0)

        task = asyncio.create_task(drop(), name=f"drop-round-{tag}")
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)
