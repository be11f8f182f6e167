"""The daemon's JSON status (/v1/status and `kvxferd status`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvxferd import PROTOCOL_VERSION, __version__
from kvxferd.backends import registry
from kvxferd.backends.cma import cma_writes_here
from kvxferd.memory.heads import head_range, total_heads
from kvxferd.memory.hugepages import Pages
from kvxferd.service.cpu_policy import current_policy
from kvxferd.service.logs import shown
from kvxferd.transceiver.sessions import RxSession, TxSession

if TYPE_CHECKING:
    from kvxferd.discovery import DiscoveryState
    from kvxferd.service.view import DaemonView

# Names listed in the status (the count is always exact).
_MEMBERS_LISTED = 256


def daemon_status(daemon: DaemonView) -> dict[str, object]:
    return {
        "name": daemon.daemon_name,
        "version": __version__,
        "protocol_version": PROTOCOL_VERSION,
        "role": daemon.role,
        "incarnation": daemon.incarnation,
        "pid": os.getpid(),
        "ready": daemon.ready,
        "draining": daemon.draining,
        # Peers alive whose transport messages stopped arriving: seconds since the last.
        "stalled_peers": {k: round(v, 1) for k, v in daemon.stalled_peers().items()},
        # Why /healthz answers 503 (a supervisor should restart the daemon), or None.
        "health_problem": daemon.health_problem(),
        "uptime_s": round(time.monotonic() - daemon.started_at, 3),
        "settings": daemon.settings.to_json_dict(),
        "fingerprint": daemon.settings.fingerprint(),
        "peer_listen": daemon.peers.listen_address,
        "peer_security": _peer_security(daemon),
        "api_socket": daemon.api.path,
        "peers": [
            {
                "name": c.peer.name,
                "incarnation": c.peer.incarnation,
                "role": c.peer.role,
                "address": c.label,
                "tls": c.tls,
                "pools": sorted(c.pools),
                "tensor_parallel": {
                    p.pool_id: {"rank": p.tp_rank, "size": p.tp_size} for p in c.pools.values()
                },
                # Where each peer pool lives ("host" or "vram"), as its daemon announced.
                "memory": {p.pool_id: p.memory for p in c.pools.values()},
            }
            for c in daemon.peers.connections.values()
        ],
        "pools": sorted(daemon.pools.pools),
        # Which KV heads each pool holds (tensor parallelism; rank 0 of 1 without it).
        "tensor_parallel": {
            p.pool_id: {
                "rank": p.tp.rank,
                "size": p.tp.size,
                "heads": list(head_range(p.layout, p.tp)),
                "total_heads": total_heads(p.layout, p.tp),
            }
            for p in daemon.pools.pools.values()
        },
        # Where each pool lives and how the daemon reaches it (device pools: copy-only
        # unless the backend registered them, zero_copy).
        "pool_memory": {
            p.pool_id: {
                "memory": "vram" if p.memory.on_device else "host",
                "device": p.memory.device if p.memory.on_device else None,
                "device_uuid": p.device_uuid or None,
                "sharing": p.sharing,
                "zero_copy": p.zero_copy,
                # Host pools: the kind of page the daemon's mapping of it is on (hugepages.py).
                "pages": _pages(p.region),
            }
            for p in daemon.pools.pools.values()
        },
        # The GPU of a daemon with engine.kv_memory vram; null for host pools.
        "device": daemon.device,
        "sessions": {
            "send": _count_states(daemon.sender.sessions.values()),
            "recv": _count_states(daemon.receiver.sessions.values()),
        },
        "admission": {
            "window_blocks": daemon.admission.capacity,
            "in_flight_blocks": daemon.admission.in_flight_blocks,
            "waiting": daemon.admission.waiting,
            "use": (
                round(daemon.admission.in_flight_blocks / daemon.admission.capacity, 4)
                if daemon.admission.capacity
                else None
            ),
        },
        # The event loop thread's CPU scheduling policy as it is now (service/cpu_policy.py),
        # and what the configuration asked for.
        "cpu_policy": {"policy": current_policy(), "configured": daemon.cfg.daemon.cpu_policy},
        "event_loop": {
            "lag_ms": round(daemon.loop_monitor.lag_s * 1e3, 3),
            "max_lag_ms": round(daemon.loop_monitor.max_lag_s * 1e3, 3),
            "stalls": daemon.loop_monitor.stalls,
        },
        "config": {
            "source": daemon.cfg.source,
            "last_reload": daemon.last_reload.to_json_dict() if daemon.last_reload else None,
        },
        "systemd": {
            "notify": daemon.notifier.enabled,
            "watchdog_s": daemon.notifier.watchdog_s,
        },
        "bounce": _buffers(daemon) if not daemon.staged else None,
        "staging": _buffers(daemon) if daemon.staged else None,
        "holds": _holds(daemon),
        "engines": len(daemon.api.engines),
        "open_transfer_handles": daemon.sender.writes.open_handles,
        # The small-request fast paths: backend calls made on the event loop's thread, and
        # writes posted from NIXL descriptor lists prepared once per region.
        "data_plane": daemon.dataplane.counters(),
        # Writes ended in flight that could still land, waited out rather than cancelled.
        "drains": {
            **daemon.sender.writes.drains.status(),
            # Whether a write to a peer on this host that supports it too is cancelled at
            # once (UCX's CMA) or drained like one to another host (kvxferd/backends/cma.py).
            # (None: a two-sided backend, which never posts a write to cancel or drain.)
            "ucx_cma": None
            if registry.is_two_sided(daemon.settings.backend)
            else cma_writes_here(daemon.settings.backend),
        },
        # Context side: receives of other daemons waiting for the send to say whose request
        # it is (Send.peer); the first receive of each request is in `sessions`.
        "contending_receives": sum(len(s.contenders) for s in daemon.sender.sessions.values()),
        # Context side: the receivers its requests in flight serve (more than one a request
        # for a head-split: one per generation rank whose RequestData came).
        "receivers": sum(len(s.legs) for s in daemon.sender.sessions.values() if not s.finished),
        "handshake_failures": dict(daemon.peers.handshake_failures),
        # Peer addresses whose last dial failed: not dialed again until their backoff ends.
        "dial_backoff": daemon.peers.dial_backoff.status(),
        # How peer names resolve (static or etcd): up or down since when, members, errors.
        "discovery": {
            **daemon.discovery.state.to_json_dict(),
            "member_names": sorted(daemon.discovery.members())[:_MEMBERS_LISTED],
        },
    }


def readiness_detail(daemon: DaemonView) -> str:
    """The lines /readyz adds after ready / not ready: the peers whose transfers stopped
    arriving (which make it unready), and discovery's state. An etcd outage does not make
    the daemon unready (docs/operations.md, "Discovery with etcd")."""
    stalled = "".join(
        _stall_line(key, seconds) + "\n" for key, seconds in sorted(daemon.stalled_peers().items())
    )
    return stalled + _discovery_line(daemon.discovery.state)


def stall_health_problem(stalled: dict[str, float], limit_s: float) -> str | None:
    """/healthz's lines for the peers stalled for `limit_s` or more (0: none ever), or None."""
    if limit_s <= 0:
        return None
    lines = [
        f"{_stall_line(key, seconds)} (daemon.stall_unhealthy_s {limit_s:g}); a restart clears it"
        for key, seconds in sorted(stalled.items())
        if seconds >= limit_s
    ]
    return "\n".join(lines) if lines else None


def _stall_line(key: str, seconds: float) -> str:
    """A stalled peer, as /readyz and /healthz name it."""
    return f"transport: nothing from peer {shown(key)} for {seconds:.0f}s although it is alive"


def _discovery_line(state: DiscoveryState) -> str:
    if state.kind == "static":
        return "discovery: static\n"
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.since))
    if state.up:
        return f"discovery: up since {since}, {state.members} member(s)\n"
    return f"discovery: down since {since}: {state.last_error or '?'}\n"


def _buffers(daemon: DaemonView) -> dict[str, object] | None:
    """The bounce or staging regions' counters, and the memory they are in (the regions'
    own word when they say it, else the daemon's kv_memory, which they are built for)."""
    if daemon.bounce is None:
        return None
    return {"memory": daemon.settings.kv_memory, **daemon.bounce.status()}


def _pages(region: object) -> dict[str, object] | None:
    pages = getattr(region, "pages", None)
    return pages.to_status() if isinstance(pages, Pages) else None


def _peer_security(daemon: DaemonView) -> dict[str, object]:
    """How peers authenticate: the shared secret, mutual TLS (with the certificate in use
    for new connections), both, or neither (loopback only)."""
    peer_tls = daemon.peers.tls
    return {
        "shared_secret": daemon.secret_configured,
        "tls": (
            {
                "names": sorted(peer_tls.own_names),
                "not_after": peer_tls.not_after,
                "fingerprint": peer_tls.fingerprint,
            }
            if peer_tls is not None
            else None
        ),
    }


def _count_states(sessions: Iterable[TxSession | RxSession]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in sessions:
        key = s.outcome.status if s.outcome else s.state.name.lower()
        counts[key] = counts.get(key, 0) + 1
    return counts


def _holds(daemon: DaemonView) -> dict[str, object]:
    """Memory an ended receive keeps until its writer is fenced (kvxferd.transceiver.holds)."""
    holds = daemon.receiver.holds
    now = time.monotonic()
    return {
        "requests": len(holds.holds),
        "blocks": holds.held_blocks(),
        "reservation_bytes": holds.held_reservation_bytes(),
        "oldest_s": round(holds.oldest_age_s(), 3),
        "by_peer": {
            peer: {
                "holds": int(row["holds"]),
                "blocks": int(row["blocks"]),
                "oldest_s": round(row["oldest_s"], 3),
            }
            for peer, row in sorted(holds.by_peer().items())
        },
        "released": dict(holds.released_total),
        # The oldest few, for an operator to find in the logs (request ids are not labels).
        "oldest": [
            {
                "request_id": h.request_id,
                "reason": h.reason,
                "blocks": h.blocks,
                "waiting_for": [leg.key for leg in h.pending],
                "age_s": round(now - h.since, 3),
            }
            for h in sorted(holds.holds.values(), key=lambda h: h.since)[:10]
        ],
    }
