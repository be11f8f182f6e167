"""Whose fault a failed write is (transceiver/writes.py, _ended_by): a local transport error
whose peer's connection closes within a short grace is the peer going away. A process
killed mid-write closes its sockets as it exits, not all at once: Mooncake saw its data
connection fail while the peer still accepted connections and reported a refused write, a
local transfer_error (1 CI run in 4, the generation daemon killed mid-transfer). The race
cannot be produced at will with the real parts, so the connection here is a stand-in."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvxferd.errors import PeerLostError, TransferError
from kvxferd.transceiver import writes


@dataclass
class _Peer:
    name: str = "ctx"


@dataclass
class Conn:
    peer: _Peer = field(default_factory=_Peer)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    close_reason: str = "connection closed by peer"


def _ended(exc: TransferError, close_after_s: float | None) -> Any:
    async def scenario() -> Any:
        conn = Conn()
        if close_after_s is not None:
            asyncio.get_running_loop().call_later(close_after_s, conn.closed.set)
        return await writes._ended_by(exc, conn)  # type: ignore[arg-type]

    return asyncio.run(scenario())


def test_a_local_error_as_the_peer_goes_away_is_the_peers() -> None:
    term = _ended(TransferError("MOONCAKE write failed, though its engine accepts"), 0.05)
    assert (term.status, term.reason, term.fault) == ("failed", "peer_lost", "peer")
    assert "connection closed by peer" in term.message and "MOONCAKE" in term.message


def test_a_local_error_with_the_peer_still_there_stays_local() -> None:
    term = _ended(TransferError("the local registration is gone"), None)
    assert (term.status, term.reason, term.fault) == ("failed", "transfer_error", "local")


def test_a_lost_peer_is_the_peers_at_once() -> None:
    term = _ended(PeerLostError("gone"), None)
    assert (term.reason, term.fault) == ("peer_lost", "peer")
