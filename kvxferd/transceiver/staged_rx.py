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

from kvxferd.backends.twosided import TwoSidedTransport, round_tag
from kvxferd.errors import KvxferdError, PeerLostError, TransferError, TransferTimeoutError
from kvxferd.memory.layout import LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Result, RoundAck
from kvxferd.transceiver.bounce import BounceBuffers, Reservation
from kvxferd.transceiver.direct_rx import scatter_round
from kvxferd.transceiver.legs import RxLeg, leg_block_bytes, rx_leg_heads
from kvxferd.transceiver.sessions import RxSession, Terminal
from kvxferd.transceiver.staged import refuse_device_staging
from kvxferd.transceiver.staging import NO_ROOM, blocks_per_round, reserve_all, reserve_by
from kvxferd.transceiver.state import Reason, Status


class StagedReceive:
    """RecvMover of the staged runtime (transceiver_runtime CPP)."""

    # Peers write only into the staging reservations; our own scatter fills the blocks.
    exposes_blocks = False

    def __init__(self, bounce: BounceBuffers) -> None:
        self.bounce = bounce
        # The two-sided transport once started (UCX, MPI); None: one-sided writes.
        self.transport: TwoSidedTransport | None = None
        self._drops: set[asyncio.Task[None]] = set()

    def attach(self, transport: TwoSidedTransport) -> None:
        refuse_device_staging(transport, self.bounce)
        self.transport = transport

    def reservations_exposed(self) -> bool:
        # Two-sided: bytes land only where our own posted receive puts them, and that
        # receive has completed or expired (nothing lands after) before a session ends.
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
        k = blocks_per_round(region.nbytes, len(s.blocks), sizes)
        if self.reservations_exposed():
            # A peer that stalls mid-request leaves its reservation quarantined until it is
            # fenced (kvxferd.transceiver.holds): one request never takes more than half the
            # region, so one stalled peer cannot stop every other peer's transfers.
            half = blocks_per_round(region.nbytes // 2, len(s.blocks), sizes)
            if half > 0:
                k = min(k, half)
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
        got = await reserve_by(lambda: reserve_all(region, wanted), deadline)
        if got is None:
            s.request_end(Terminal.timed_out(Reason.RECEIVER_TIMEOUT, NO_ROOM))
            return
        self.bounce.reservations_made += len(got)
        for leg, res, nbytes in zip(s.legs, got, wanted, strict=True):
            leg.res = res
            leg.offer = Reservation(res.offset, nbytes)

    async def take_round(self, s: RxSession, leg: RxLeg, first: int, end: int, nbytes: int) -> None:
        if self.transport is not None and not await self._receive(s, leg, first, end, nbytes):
            return
        await scatter_round(self.bounce, s, leg, first, end, nbytes)

    async def _receive(self, s: RxSession, leg: RxLeg, first: int, end: int, nbytes: int) -> bool:
        """Receive an announced two-sided round into the leg's reservation; False when the
        request ended (saying why)."""
        assert self.transport is not None and leg.conn is not None
        if leg.res is None or not 0 < nbytes <= leg.res.nbytes:
            s.request_end(
                Terminal.peer(
                    Status.FAILED,
                    Reason.TRANSFER_ERROR,
                    f"round of blocks [{first}, {end}) announced {nbytes} bytes, "
                    f"{leg.res.nbytes if leg.res else 0} reserved",
                )
            )
            return False
        out = self.bounce.recv.view(leg.res, nbytes).data
        # Bounded by what is left of the receive's own deadline: the outcome is due then.
        # The transport bounds only the wait for the round to start arriving; one that
        # stalls mid-message (its sender stopped) it gives a grace past that before it
        # lets go of our buffer. The receive does not wait for that grace: it ends at
        # its deadline and leaves the reservation to the transport until it lets go.
        left = s.deadline - time.monotonic()
        bound = None if left == math.inf else max(0.0, left)
        recv = asyncio.ensure_future(
            self.transport.recv(leg.conn.key, round_tag(s.rx_token, first), out, bound)
        )
        try:
            await asyncio.wait({recv}, timeout=bound)
        finally:
            if not recv.done():  # past the deadline mid-message, or the task cancelled
                self._leave_to_transport(recv, leg)
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
        except TransferTimeoutError as exc:
            s.request_end(Terminal.timed_out(Reason.RECEIVER_TIMEOUT, str(exc)))
            return False
        except PeerLostError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_LOST, str(exc)))
            return False
        except TransferError as exc:
            s.request_end(Terminal.local(Status.FAILED, Reason.TRANSFER_ERROR, str(exc)))
            return False
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

    def _leave_to_transport(self, recv: asyncio.Future[int], leg: RxLeg) -> None:
        """A round's receive still in progress when the receive ends: its staging
        reservation is released only once the transport returns (it may still be writing
        there), not with the session."""
        res, leg.res = leg.res, None
        region = self.bounce.recv
        assert res is not None

        def done(fut: asyncio.Future[int]) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved: the receive already ended, the error is moot
            region.release(res)

        recv.add_done_callback(done)

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
        for leg, first, _end, nbytes, _last in s.rounds:
            if leg.conn is not None:
                self._drop_round(leg.conn.key, round_tag(s.rx_token, first), nbytes)
        s.rounds.clear()

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
