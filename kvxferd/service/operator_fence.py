"""The operator's fence (engine API FenceWriter, `kvxferd fence`): the holds waiting for a
context daemon that is gone for good end on an operator's word, unless the daemon can
see that it is not gone (docs/operations.md, "A context daemon on another host that died
and will not come back")."""

from __future__ import annotations

from kvxferd.api.messages import ApiError, FenceWriter
from kvxferd.errors import RequestError
from kvxferd.peers.manager import PeerManager
from kvxferd.transceiver.holds import HoldKeeper


def fence_writer(msg: FenceWriter, peers: PeerManager, holds: HoldKeeper) -> str:
    """End the holds waiting for `msg.peer` (one incarnation, or all); Reply.result: how
    many holds ended. RequestError writer_alive or nothing_held, saying why, otherwise."""
    held = {leg.key: leg for h in holds.holds.values() for leg in h.pending}
    live = sorted(
        conn.key
        for conn in peers.connections.values()
        if conn.peer.name == msg.peer
        and not conn.closed.is_set()
        and (not msg.incarnation or conn.peer.incarnation == msg.incarnation)
    )
    if live:
        mine = sorted(key for key, leg in held.items() if leg.name == msg.peer and key not in live)
        hint = (
            f"; holds wait for {', '.join(mine)}: name its incarnation to fence only that"
            if mine
            else ""
        )
        raise RequestError(
            ApiError.WRITER_ALIVE,
            f"{', '.join(live)} is connected: it is alive, and its holds end when it answers "
            f"their Aborts. Fence only a daemon whose process is gone for good{hint}",
        )
    before = len(holds.holds)
    fenced, alive = holds.fence_by_operator(msg.peer, msg.incarnation)
    if alive and not fenced:
        raise RequestError(
            ApiError.WRITER_ALIVE,
            f"the process of {', '.join(alive)} runs on this host and has not exited (a "
            "stopped process still writes once resumed); its holds end by themselves when "
            "it exits",
        )
    if not fenced:
        who = f"{msg.peer}/{msg.incarnation}" if msg.incarnation else msg.peer
        raise RequestError(
            ApiError.NOTHING_HELD,
            f"no hold waits for {who}; holds wait for: {', '.join(sorted(held)) or 'nobody'}",
        )
    return str(before - len(holds.holds))
