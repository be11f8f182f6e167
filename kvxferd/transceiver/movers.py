"""How a request's bytes cross, chosen by the runtime: the send side's movers.

A send coordinator (transceiver/sender.py: engine sends, receivers' RequestData, aborts,
cancels, peers lost, drain, outcomes) hands each due slice of a request to its mover.
A mover implements SendMover; adding one is a module with its class and a line in
SEND_MOVERS (docs/internals.md, "Adding a mover").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.peers.channel import PeerConnection
from kvxferd.transceiver.bounce import BounceBuffers
from kvxferd.transceiver.direct import DirectMover
from kvxferd.transceiver.sessions import TxSession
from kvxferd.transceiver.staged import StagedMover
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
