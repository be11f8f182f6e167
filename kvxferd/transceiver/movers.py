"""How a request's bytes cross, chosen by the runtime: the movers of both sides.

A send coordinator (transceiver/sender.py: engine sends, receivers' RequestData, aborts,
cancels, peers lost, drain, outcomes) hands each due slice of a request to its
SendMover. A receive coordinator (transceiver/receiver.py: receives, admission, legs,
results, quiescence, holds, outcomes) asks its RecvMover what to offer a context daemon
and how a reported round reaches the blocks. Adding a mover is a module with its class
and a line in SEND_MOVERS or RECV_MOVERS (docs/internals.md, "Adding a mover").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Result
from kvxferd.transceiver.bounce import BounceBuffers, Reservation
from kvxferd.transceiver.direct import DirectMover
from kvxferd.transceiver.direct_rx import DirectReceive
from kvxferd.transceiver.legs import RxLeg
from kvxferd.transceiver.sessions import RxSession, TxSession
from kvxferd.transceiver.staged import StagedMover
from kvxferd.transceiver.staged_rx import StagedReceive
from kvxferd.transceiver.writes import Writes

# The coordinator's lookup of a request by the receiver that asked for it (connection,
# request id, receive token): how a mover matches peer messages of its own to sessions.
Match = Callable[[PeerConnection, str, int], "TxSession | None"]
Route = Callable[[PeerConnection, Any], Awaitable[None]]


class SendMover(Protocol):
    async def write_slice(self, s: TxSession, start: int, end: int, last: bool) -> None:
        """Write blocks [start, end) of `s` to every receiver and send each its Result
        (`last`: the request's final slice); or end the request (s.request_end) saying why.
        Returns with every write it made quiescent."""

    def routes(self) -> dict[type, Route]:
        """Peer messages this mover takes itself (by type), besides the coordinator's."""

    def attach(self, transport: TwoSidedTransport) -> None:
        """The two-sided transport, once started (UCX, MPI); never called for the others."""

    def peer_gone(self, peer_key: str) -> None:
        """A peer's connection closed and its sessions are quiescent: forget its state."""


MoverFactory = Callable[[Writes, "BounceBuffers | None", bool, Match], SendMover]


def _direct(
    writes: Writes, bounce: BounceBuffers | None, pipelined: bool, match: Match
) -> SendMover:
    return DirectMover(writes, bounce, pipelined)


def _staged(
    writes: Writes, bounce: BounceBuffers | None, pipelined: bool, match: Match
) -> SendMover:
    if bounce is None:
        raise ValueError("the staged mover needs the staging buffers")
    return StagedMover(writes, bounce, pipelined, match)


# By transceiver runtime (cache_transceiver_config.transceiver_runtime, resolved).
SEND_MOVERS: dict[str, MoverFactory] = {"PYTHON": _direct, "CPP": _staged}


class RecvMover(Protocol):
    # Whether a context daemon writes into the engine's blocks itself: then an ended
    # receive's blocks stay on loan until that writer is fenced.
    exposes_blocks: bool

    def reservations_exposed(self) -> bool:
        """Whether a peer writes into our reservations itself (one-sided backends): then
        an ended receive's reservations wait for the fence too."""

    async def make_offer(self, s: RxSession, conn: PeerConnection, deadline: float) -> None:
        """Set each leg's reservation (leg.res) and the part offered with the RequestData
        (leg.offer), or none; or end the request saying why (waits up to `deadline`)."""

    async def take_round(
        self, s: RxSession, leg: RxLeg, first: int, end: int, nbytes: int, offset: int = 0
    ) -> None:
        """Bring a reported round (the request's logical blocks [first, end), at `offset`
        in the leg's reservation) into the blocks, or end the request saying why."""

    async def round_done(self, s: RxSession, leg: RxLeg, end: int) -> None:
        """A round that was not the leg's last is in the blocks: let its sender go on."""

    def late_round(self, conn: PeerConnection, s: RxSession, msg: Result) -> bool:
        """A Result for a receive that has ended: True when the mover took it (nothing
        else is to be done with it)."""

    def drop_unscattered(self, s: RxSession) -> None:
        """The receive ended with rounds reported and not taken: deal with their bytes."""

    def release(self, res: Reservation) -> None:
        """Hand a reservation back: nothing can land in it any more."""

    def attach(self, transport: TwoSidedTransport) -> None:
        """The two-sided transport, once started (UCX, MPI); never called for the others."""


RecvMoverFactory = Callable[["BounceBuffers | None", bool], RecvMover]


def _direct_rx(bounce: BounceBuffers | None, pipelined: bool) -> RecvMover:
    return DirectReceive(bounce, pipelined)


def _staged_rx(bounce: BounceBuffers | None, pipelined: bool) -> RecvMover:
    if bounce is None:
        raise ValueError("the staged mover needs the staging buffers")
    return StagedReceive(bounce)


RECV_MOVERS: dict[str, RecvMoverFactory] = {"PYTHON": _direct_rx, "CPP": _staged_rx}
