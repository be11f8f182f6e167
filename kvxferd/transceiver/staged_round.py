"""How one round of the staged runtime crosses to its receiver (RoundCrossing).

One-sided (NIXL, Mooncake): one write into the round's slot of the receiver's reservation,
out of the send region it was gathered into or straight out of the pool
(transceiver/round_source.py), then its Result says the bytes are in place. Two-sided
(UCX, MPI): the Result goes first and announces the round (the receiver then posts its
receive by tag), then the round is sent. Either way a round goes into a slot only once the
receiver scattered what the slot held before (RoundAck up to the blocks that preceded it
in the ring).

transceiver/staged.py decides which rounds a request moves and overlaps their gathers and
moves; this module is only the crossing, and the two-sided transport's endpoints it opens.
"""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np

from kvxferd.backends.base import XferStatus
from kvxferd.backends.twosided import TwoSidedTransport, round_tag
from kvxferd.errors import PeerLostError, TransferError
from kvxferd.peers.messages import Result
from kvxferd.transceiver.bounce import BounceBuffers, Reservation
from kvxferd.transceiver.leg_targets import peer_memory, unknown_memory
from kvxferd.transceiver.legs import TxLeg
from kvxferd.transceiver.postguard import post_refusal
from kvxferd.transceiver.round_source import RoundSource, packed_targets
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.staging import refuse_device_staging
from kvxferd.transceiver.state import Reason, Status
from kvxferd.transceiver.writes import Writes

# Opening the transport's endpoint to a peer the handshake already vouched for.
_CONNECT_TIMEOUT_S = 10.0


class RoundCrossing:
    """The context side's crossing of rounds out of the send staging region (or, one-sided,
    the pool): one-sided writes through `writes`, or, once a two-sided transport is
    attached, sends."""

    def __init__(self, writes: Writes, staging: BounceBuffers) -> None:
        self.writes = writes
        self.staging = staging
        # The two-sided transport once started (UCX, MPI); None: one-sided writes.
        self.transport: TwoSidedTransport | None = None
        # Peers whose transport endpoint is open.
        self._connected: set[str] = set()

    def attach(self, transport: TwoSidedTransport) -> None:
        refuse_device_staging(transport, self.staging)
        self.transport = transport

    def forget_peer(self, peer_key: str) -> None:
        self._connected.discard(peer_key)

    async def cross(
        self,
        s: TxSession,
        leg: TxLeg,
        src: RoundSource,
        rnd: tuple[int, int, int],
        ring: tuple[int, int, int],
        last: bool,
        deadline: float,
        announced: asyncio.Event,
        prior: asyncio.Future[bool] | None = None,
    ) -> bool:
        """Move one round (`rnd`: first, stop, slot; read from `src`) into its slot of the
        receiver's reservation (`ring`: the slice's first block, the reservation's blocks,
        bytes per block) once the receiver scattered what that slot held before; False when the
        request ended. `announced` is set once the next round may start: two-sided once its
        Result is out, one-sided once its write is posted. `prior`: the leg's round before
        it, still moving; a one-sided round reports its Result only after that one's, so
        the receiver learns of rounds in order."""
        assert s.pool is not None
        staging = self.staging
        first, stop, slot = rnd
        base, ring_blocks, leg_bytes = ring
        nbytes = (stop - first) * leg_bytes
        why = "kv_transfer_timeout_ms elapsed waiting for the receiver to take a round"
        need = stop - ring_blocks  # the blocks before it held this round's slots
        while need > base and leg.acked_block < need and s.terminal is None:
            if not await s.wait_wake(deadline, Reason.SENDER_DEADLINE, why):
                return False
        if s.terminal is not None:
            return False
        offset = slot * leg_bytes
        result = leg.written(s.request_id, nbytes, last, True, (first, stop), offset)
        if self.transport is not None:
            assert src.res is not None  # a send takes one buffer: two-sided rounds are gathered
            if not await self._send_two_sided(s, leg, src.res, result, deadline, announced):
                return False
        else:
            info = leg.conn.info
            remote_memory = peer_memory(info.bounce_memory, info.bounce_device)
            if remote_memory is None:
                s.request_end(unknown_memory("staging", info.bounce_memory))
                return False
            if src.res is not None:
                local = np.array([[staging.send.address + src.res.offset, nbytes]], np.int64)
                local_memory = staging.send.memory
            else:
                assert src.runs is not None
                local, local_memory = src.runs, s.pool.memory
                staging.pool_rounds += 1  # here, not when planned: one planned ahead may never go
            remote = packed_targets(
                local[:, 1], info.bounce_base + leg.request.bounce_offset + offset
            )
            status = await self.writes.post_and_wait(
                s,
                local,
                remote,
                leg.conn,
                local_memory=local_memory,
                remote_memory=remote_memory,
                on_posted=announced.set,
            )
            if prior is not None:
                # Not cancelled with us: its own move task quiesces and reports it.
                await asyncio.wait({prior})
            if status is not XferStatus.DONE or s.terminal is not None:
                return False
        if time.monotonic() > deadline:
            late = "a round completed after kv_transfer_timeout_ms; not reported as success"
            s.request_end(Terminal.timed_out(Reason.SENDER_DEADLINE, late))
            return False
        s.nbytes += nbytes
        # One-sided: the bytes are in place, say so. Two-sided: said before sending.
        sent = self.transport is not None or await leg.conn.send(result)
        if not sent:
            s.request_end(
                Terminal.peer(Status.FAILED, Reason.PEER_LOST, "could not report the round")
            )
            s.mark_told(leg)
            return False
        return s.terminal is None

    async def _send_two_sided(
        self,
        s: TxSession,
        leg: TxLeg,
        res: Reservation,
        result: Result,
        deadline: float,
        announced: asyncio.Event,
    ) -> bool:
        """Announce the round (the receiver then receives it by tag; `announced` is set),
        then send it."""
        assert self.transport is not None
        conn = leg.conn
        # From here a cancel answers "busy", until no round of the request is sending.
        s.posting += 1
        try:
            try:
                if conn.key not in self._connected:
                    await self.transport.connect(
                        conn.key, conn.info.transport_address, _CONNECT_TIMEOUT_S
                    )
                    self._connected.add(conn.key)
                await conn.fresh()
                refused = post_refusal(s, conn)
                if refused is not None:
                    s.request_end(refused)  # an ended request announces no further round
                    return False
                if not await conn.send(result):
                    s.request_end(
                        Terminal.peer(Status.FAILED, Reason.PEER_LOST, "could not announce a round")
                    )
                    s.mark_told(leg)
                    return False
                announced.set()
                # Announced: the round goes out even if the request ends now. The receiver
                # waits for it by tag, and two-sided bytes land only in its own posted
                # receive, so sending cannot touch memory it handed back.
                data = self.staging.send.view(res, result.nbytes).data
                tag = round_tag(leg.request.rx_token, result.first_block)
                remaining = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
                # On timeout the send is cancelled, which returns only once the transport no
                # longer reads the staging bytes (or the endpoint was closed).
                await asyncio.wait_for(self.transport.send(conn.key, tag, data), remaining)
            except asyncio.TimeoutError:
                s.request_end(
                    Terminal.timed_out(
                        Reason.SENDER_DEADLINE,
                        "kv_transfer_timeout_ms elapsed while a round was being sent",
                    )
                )
                return False
            except PeerLostError as exc:
                self._connected.discard(conn.key)
                s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_LOST, str(exc)))
                return False
            except TransferError as exc:
                s.request_end(Terminal.local(Status.FAILED, Reason.TRANSFER_ERROR, str(exc)))
                return False
        finally:
            s.posting -= 1
        return s.terminal is None
