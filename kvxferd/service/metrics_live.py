"""The daemon's gauges computed from its state at each scrape (engines, peers, sessions,
admission, bounce and staging buffers, holds), beside the counters of metrics.py."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvxferd.discovery import DiscoveryState
    from kvxferd.peers.backoff import DialBackoff
    from kvxferd.service.view import DaemonView
    from kvxferd.transceiver.holds import HoldKeeper
    from kvxferd.transceiver.tx_drains import Drains


class LiveCollector:
    """Gauges computed from the daemon's state when scraped."""

    def __init__(self, daemon: DaemonView) -> None:
        self._d = daemon

    def collect(self) -> Iterable[Metric]:
        d = self._d
        yield _gauge("kvxferd_ready", "1 when the daemon serves (see /readyz).", float(d.ready))
        yield _gauge("kvxferd_draining", "1 while the daemon drains for shutdown.", d.draining)
        yield _gauge(
            "kvxferd_transport_stalled_peers",
            "Peers alive whose transport messages stopped arriving (MPI: the receive queue "
            "held up by a process stopped or killed mid-send); not ready while above 0.",
            len(d.stalled_peers()),
        )
        refused = CounterMetricFamily(
            "kvxferd_transport_connections_refused",
            "Connections to the staged transport's own listener (UCX, MPI) closed before "
            "their hellos, by reason (preauth_limit, preauth_per_source_limit; MPI: "
            "accept_queue_limit, too many waiting for its one accept at a time).",
            labels=["reason"],
        )
        # The two every listener has, at 0 until one happens; and whatever else the
        # transport counts (the MPI listener's accept_queue_limit was counted and never
        # shown).
        counts = {"preauth_limit": 0, "preauth_per_source_limit": 0, **d.listener_refused()}
        for reason, count in counts.items():
            refused.add_metric([reason], count)
        yield refused
        in_flight = GaugeMetricFamily(
            "kvxferd_requests_in_flight",
            "Accepted requests without an outcome yet, by side.",
            labels=["side"],
        )
        in_flight.add_metric(["send"], d.sender.active_count())
        in_flight.add_metric(["recv"], d.receiver.active_count())
        yield in_flight
        yield _gauge(
            "kvxferd_admission_blocked_requests",
            "Receives waiting for room in the admission window.",
            d.admission.waiting,
        )
        yield _gauge(
            "kvxferd_admission_in_flight_blocks",
            "Destination blocks currently admitted.",
            d.admission.in_flight_blocks,
        )
        if d.admission.capacity is not None:
            yield _gauge(
                "kvxferd_admission_window_blocks",
                "Size of the admission window (ceil(max_tokens_in_buffer / tokens_per_block)).",
                d.admission.capacity,
            )
        yield _gauge(
            "kvxferd_engine_connections", "Engines attached to the API socket.", len(d.api.engines)
        )
        yield _gauge(
            "kvxferd_peer_connections",
            "Established, authenticated peer connections.",
            len(d.peers.connections),
        )
        yield _gauge(
            "kvxferd_peer_unauthenticated_connections",
            "Accepted peer connections whose peer has not proved the shared secret yet.",
            d.peers.preauth.connections,
        )
        yield _gauge(
            "kvxferd_open_transfer_handles",
            "Posted writes not yet confirmed quiescent.",
            d.sender.writes.open_handles,
        )
        yield from _drain_families(d.sender.writes.drains)
        yield from _dial_backoff_families(d.peers.dial_backoff)
        yield from _discovery_families(d.discovery.state)
        yield from _bounce_families(getattr(d, "bounce", None))
        yield from _hold_families(d.receiver.holds)
        yield _gauge(
            "kvxferd_event_loop_lag_seconds",
            "How late the event loop woke a 100 ms sleep, last measurement.",
            d.loop_monitor.lag_s,
        )
        yield CounterMetricFamily(
            "kvxferd_event_loop_stalls",
            "Times the event loop woke 2 s or more late (logged, with where its thread was).",
            value=d.loop_monitor.stalls,
        )


def _discovery_families(state: DiscoveryState) -> Iterable[Metric]:
    """Discovery (static: always up; etcd: registered and watching)."""
    yield _gauge(
        "kvxferd_discovery_up",
        "1 while discovery works (etcd: registered, lease kept, prefix watched); "
        "0 while etcd is unreachable. Transfers go on either way.",
        state.up,
    )
    yield _gauge(
        "kvxferd_discovery_registered", "1 while this daemon's key is in etcd.", state.registered
    )
    yield _gauge(
        "kvxferd_discovery_members",
        "Daemons discovery knows (etcd: registered in the cluster, this one included).",
        state.members,
    )
    errors = CounterMetricFamily(
        "kvxferd_discovery_errors",
        "Discovery failures by kind: registration, keepalive, watch, conflict (name held by "
        "another live daemon), malformed (a value in etcd that does not decode), internal.",
        labels=["kind"],
    )
    for kind in ("registration", "keepalive", "watch", "conflict", "malformed", "internal"):
        errors.add_metric([kind], state.errors.get(kind, 0))
    yield errors


def _bounce_families(bounce: object | None) -> Iterable[Metric]:
    """The bounce buffer's own counters (all zero while bounce is off)."""
    yield CounterMetricFamily(
        "kvxferd_bounce_reservations",
        "Reservations made in the bounce regions.",
        value=getattr(bounce, "reservations_made", 0),
    )
    yield CounterMetricFamily(
        "kvxferd_bounce_fallbacks",
        "Requests that took the per-block path although bounce is on.",
        value=getattr(bounce, "fallbacks", 0),
    )
    yield CounterMetricFamily(
        "kvxferd_bounce_room_waits",
        "Reservations that found no room at once and waited for it (tensor-parallel legs, "
        "copy-only requests).",
        value=getattr(bounce, "room_waits", 0),
    )
    in_use = GaugeMetricFamily(
        "kvxferd_bounce_in_use_bytes", "Bytes reserved in each bounce region.", labels=["region"]
    )
    for region in ("send", "recv"):
        in_use.add_metric([region], getattr(getattr(bounce, region, None), "in_use_bytes", 0))
    yield in_use
    yield _gauge(
        "kvxferd_bounce_region_bytes",
        "Size of each bounce region (0: bounce is off).",
        getattr(getattr(bounce, "send", None), "nbytes", 0),
    )


def _dial_backoff_families(backoff: DialBackoff) -> Iterable[Metric]:
    """Peers not dialed again yet after failed dials (kvxferd.peers.backoff)."""
    yield _gauge(
        "kvxferd_peers_in_dial_backoff",
        "Peer addresses whose last dial failed and that are not dialed again yet.",
        len(backoff.waiting()),
    )
    dials = CounterMetricFamily(
        "kvxferd_peer_dials",
        "Peer dials, by result (ok; failed; refused_in_backoff: failed at once, not dialed).",
        labels=["result"],
    )
    dials.add_metric(["ok"], backoff.dials_ok_total)
    dials.add_metric(["failed"], backoff.dials_failed_total)
    dials.add_metric(["refused_in_backoff"], backoff.refused_total)
    yield dials


def _drain_families(drains: Drains) -> Iterable[Metric]:
    """Writes that ended in flight and could still land, waited out (transceiver/tx_drains.py)."""
    yield _gauge(
        "kvxferd_drained_writes",
        "Writes that ended in flight to another host (or to one on this host without UCX's "
        "CMA), not released until the transport "
        "reports them done or failed (their send's blocks stay lent).",
        len(drains.active),
    )
    yield _gauge(
        "kvxferd_drained_writes_oldest_seconds",
        "Age of the oldest drained write (0: none).",
        max((d.held_ms / 1e3 for d in drains.active), default=0.0),
    )
    yield _counts_by_how(
        "kvxferd_drained_writes_ended",
        "Drained writes ended, by what the backend reported (DONE, ERROR, poll_failed, shutdown).",
        drains.ended_total,
    )


def _hold_families(holds: HoldKeeper) -> Iterable[Metric]:
    """Memory kept from reuse until a writer is fenced (kvxferd.transceiver.holds)."""
    yield _gauge(
        "kvxferd_held_requests", "Ended receives whose memory waits for a fence.", len(holds.holds)
    )
    yield _gauge(
        "kvxferd_held_blocks",
        "Engine blocks held because a write into them may still land.",
        holds.held_blocks(),
    )
    yield _gauge(
        "kvxferd_held_reservation_bytes",
        "Bounce/staging bytes quarantined because a peer may still write there.",
        holds.held_reservation_bytes(),
    )
    yield _gauge(
        "kvxferd_held_oldest_seconds", "Age of the oldest hold (0: none).", holds.oldest_age_s()
    )
    by_peer = GaugeMetricFamily(
        "kvxferd_held_blocks_by_peer",
        "Engine blocks held, by the context daemon that may still write them.",
        labels=["peer"],
    )
    oldest = GaugeMetricFamily(
        "kvxferd_held_oldest_seconds_by_peer",
        "Age of the oldest hold waiting for that context daemon.",
        labels=["peer"],
    )
    for peer, row in sorted(holds.by_peer().items()):
        by_peer.add_metric([peer], row["blocks"])
        oldest.add_metric([peer], row["oldest_s"])
    yield by_peer
    yield oldest
    yield _counts_by_how(
        "kvxferd_holds_released",
        "Holds released, by the fence that ended them (abort_ack, peer_exited, peer_restarted, "
        "peer_quiescent, operator).",
        holds.released_total,
    )


def _counts_by_how(name: str, doc: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["how"])
    for how, count in sorted(counts.items()):
        family.add_metric([how], count)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))
