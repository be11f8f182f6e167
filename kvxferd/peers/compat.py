"""Whether a peer's handshake Info can work with ours; the refusal names the mismatch."""

from __future__ import annotations

from kvxferd.config import ResolvedSettings
from kvxferd.memory.heads import TpRank, mapping_problems
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.handshake import PeerIdentity
from kvxferd.peers.messages import Info
from kvxferd.service.logs import shown

# How many compatibility settings of the peer's own a refusal names beyond ours.
_EXTRA_KEYS = 4

SENDING_ROLES = ("context", "both")
RECEIVING_ROLES = ("generation", "both")


def tp_support_problem(role: str, ours: TpRank, theirs: TpRank, pipelined: bool) -> str | None:
    """Why pools of these tensor-parallel sizes cannot exchange KV with these settings.

    Head-split and head-merge move each (context rank, generation rank) pair's shared heads
    as a leg: the PYTHON runtime's per-block path writes them straight between the pools
    (one descriptor per token's slice), its bounce buffer gathers each leg into one write
    and scatters it on the other side, and the staged runtime moves each leg's rounds
    through its staging buffers. Pipelined transfer moves one leg per request and is
    refused here (and again per request, for pools registered after the handshake).
    """
    if ours.size == theirs.size or not pipelined:
        return None
    if role in SENDING_ROLES and role not in RECEIVING_ROLES:
        sizes = f"ctx {ours.size}, gen {theirs.size}"
    elif role in RECEIVING_ROLES and role not in SENDING_ROLES:
        sizes = f"ctx {theirs.size}, gen {ours.size}"
    else:
        sizes = f"ours {ours.size}, peer {theirs.size}"
    return (
        f"tensor-parallel sizes differ ({sizes}): head-split and head-merge do not work "
        "with enable_pipelined_transfer"
    )


def check_peer(
    role: str,
    settings: ResolvedSettings,
    our_pools: list[tuple[KvLayout, TpRank]],
    peer: PeerIdentity,
    info: Info,
    pipeline_parallel_size: int = 1,
) -> tuple[str, str] | None:
    """None when compatible, else (reason code, message) for the Refused frame."""
    sends = role in SENDING_ROLES and peer.role in RECEIVING_ROLES
    receives = role in RECEIVING_ROLES and peer.role in SENDING_ROLES
    if not (sends or receives):
        return ("role", f"a {role} daemon cannot pair with a {peer.role} daemon")
    if info.fingerprint != settings.fingerprint():
        mine = settings.peer_compat_fields()
        # Ours first, then the peer's that we lack (a setting only some daemons announce,
        # such as kv_memory: vram); a few at most, since the peer wrote them.
        extra = [key for key in info.compat if key not in mine][:_EXTRA_KEYS]
        diffs = [
            f"{shown(key, 40, quote=False)}: ours {mine.get(key)}, "
            f"peer {shown(info.compat.get(key), 80, quote=False)}"
            for key in [*mine, *extra]
            if info.compat.get(key) != mine.get(key)
        ]
        return (
            "settings",
            "effective transceiver settings differ ("
            + ("; ".join(diffs) or "fingerprints differ")
            + "); keep context and generation configurations consistent",
        )
    if info.pipeline_parallel_size != pipeline_parallel_size:
        return (
            "parallelism",
            f"pipeline parallel sizes differ: ours {pipeline_parallel_size}, peer "
            f"{info.pipeline_parallel_size}; not supported yet",
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
            their_tp = TpRank(theirs.tp_rank, theirs.tp_size)
        except LayoutError as exc:
            return ("layout", f"peer pool {theirs.pool_id!r} has a bad layout: {exc}")
        for ours, our_tp in our_pools:
            diffs = mapping_problems(ours, our_tp, their_layout, their_tp)
            if diffs:
                return (
                    "layout",
                    f"KV geometry of peer pool {theirs.pool_id!r} and ours differ: "
                    + "; ".join(diffs),
                )
            problem = tp_support_problem(role, our_tp, their_tp, settings.pipelined_transfer)
            if problem is not None:
                return ("parallelism", f"peer pool {theirs.pool_id!r}: {problem}")
    return None
