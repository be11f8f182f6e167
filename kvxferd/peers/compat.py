"""Whether a peer's handshake Info can work with ours; the refusal names the mismatch."""

from __future__ import annotations

from kvxferd.config import ResolvedSettings
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.handshake import PeerIdentity
from kvxferd.peers.messages import Info

SENDING_ROLES = ("context", "both")
RECEIVING_ROLES = ("generation", "both")


def check_peer(
    role: str,
    settings: ResolvedSettings,
    our_layouts: list[KvLayout],
    peer: PeerIdentity,
    info: Info,
) -> tuple[str, str] | None:
    """None when compatible, else (reason code, message) for the Refused frame."""
    sends = role in SENDING_ROLES and peer.role in RECEIVING_ROLES
    receives = role in RECEIVING_ROLES and peer.role in SENDING_ROLES
    if not (sends or receives):
        return ("role", f"a {role} daemon cannot pair with a {peer.role} daemon")
    if info.fingerprint != settings.fingerprint():
        mine = settings.peer_compat_fields()
        diffs = [
            f"{key}: ours {mine[key]}, peer {info.compat.get(key)}"
            for key in mine
            if info.compat.get(key) != mine[key]
        ]
        return (
            "settings",
            "effective transceiver settings differ ("
            + ("; ".join(diffs) or "fingerprints differ")
            + "); keep context and generation configurations consistent",
        )
    if settings.pipelined_transfer and (
        info.pipeline_parallel_size != 1 or info.context_parallel_size != 1
    ):
        return (
            "pipelining",
            "enable_pipelined_transfer needs pipeline_parallel_size=1 and "
            "context_parallel_size=1 on both peers; the peer has "
            f"pipeline_parallel_size={info.pipeline_parallel_size}, "
            f"context_parallel_size={info.context_parallel_size}",
        )
    for theirs in info.pools:
        try:
            their_layout = KvLayout.from_wire(theirs.layout)
        except LayoutError as exc:
            return ("layout", f"peer pool {theirs.pool_id!r} has a bad layout: {exc}")
        for ours in our_layouts:
            diffs = ours.same_geometry(their_layout)
            if diffs:
                return (
                    "layout",
                    f"KV geometry of peer pool {theirs.pool_id!r} and ours differ: "
                    + "; ".join(diffs),
                )
    return None
