"""Prometheus metrics of one daemon (served on /metrics).

Every metric lives in the daemon's own CollectorRegistry (never the global one:
tests and benchmarks run several daemons' code in one process), is prefixed
`kvxferd_`, and carries low-cardinality labels only: side (send, recv), status,
reason, phase, peer (a daemon name). Request ids go to the logs, never into a
label. The daemon's identity (name, role, backend, runtime, fingerprint) is in
the single `kvxferd_daemon_info` series, to join on.

Counters and histograms are fed at a few points every request passes:

* each terminal outcome, as it is handed to the engine (requests, bytes,
  end-to-end time, timeouts by phase);
* the context side's write, once the backend reports it done (wire time,
  descriptors per transfer);
* the admission window, when a receive is admitted (admission wait);
* the context side, when it refuses a receiver's RequestData (by reason);
* the peer manager (handshakes, their failures, connections refused before a handshake,
  peers lost to missed heartbeats).

Gauges (requests in flight, blocked by admission, engine and peer connections,
loop lag...) are read from the daemon's state at scrape time.
"""

from __future__ import annotations

import asyncio
import ssl
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Info,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from kvxferd import __version__
from kvxferd.errors import (
    HandshakeError,
    IncompatiblePeerError,
    MalformedMessageError,
    ProtocolError,
    TlsError,
)
from kvxferd.peers.framing import FrameTooLargeError
from kvxferd.service.loop_histogram import LoopCounter, LoopHistogram
from kvxferd.service.metrics_live import LiveCollector
from kvxferd.transceiver.state import Outcome, Reason, Status

if TYPE_CHECKING:
    from kvxferd.service.view import DaemonView

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

SIDES = ("send", "recv")
TIMEOUT_PHASES: dict[str, str] = {
    Reason.SENDER_DEADLINE: "sender_deadline",
    Reason.RECEIVER_TIMEOUT: "receiver_timeout",
}

# From a small inline write on loopback (~100 µs) to the seed's 60 s default timeout.
_TIME_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)

# Without this every counter would also export a `_created` gauge family.
disable_created_metrics()  # type: ignore[no-untyped-call]


def handshake_failure_reason(exc: BaseException) -> str:
    """A small, fixed set of reasons for a failed handshake (a metric label)."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, (TlsError, ssl.SSLError)):
        return "tls"
    text = str(exc)
    if isinstance(exc, IncompatiblePeerError) and ": certificate:" in text:
        return "tls"  # the other side refused our certificate's names
    # The refusing side's reason code travels as "refused by PEER: CODE: message".
    if isinstance(exc, HandshakeError) and ("shared secret" in text or ": auth:" in text):
        return "auth"
    if isinstance(exc, IncompatiblePeerError):
        return "version" if "protocol version" in text else "incompatible"
    if isinstance(exc, HandshakeError):
        return "handshake"
    if isinstance(exc, FrameTooLargeError):
        return "oversize_frame"  # a length prefix over the pre-authentication limit
    if isinstance(exc, ProtocolError):
        return "protocol"
    if isinstance(exc, OSError):
        return "connect"
    return "other"


def malformed_reason(exc: ProtocolError) -> str:
    """A small, fixed set of reasons for a message that did not decode (a metric label)."""
    if isinstance(exc, FrameTooLargeError):
        return "oversize_frame"
    if isinstance(exc, MalformedMessageError):
        return "too_deep" if "nested too deeply" in str(exc) else "malformed"
    return "truncated"  # the other ProtocolErrors of a frame reader: a frame cut short


class DaemonMetrics:
    def __init__(self, name: str, role: str, backend: str, runtime: str, fingerprint: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_* (CPU, memory, open fds, start time)
        self.info = Info(
            "kvxferd_daemon", "Identity of this daemon (value is always 1).", registry=r
        )
        self.set_info(name, role, backend, runtime, fingerprint)
        # Every series of this daemon's registry.
        counter = partial(Counter, registry=r)
        # Fed per request on the event loop and scraped there: no locks (loop_histogram).
        histogram = partial(LoopHistogram, registry=r)
        # The two counters every request feeds, kept like the histograms (loop_histogram).
        self.requests = LoopCounter(
            "kvxferd_requests",
            "Requests that reached a terminal state, by side, status and reason.",
            ["side", "status", "reason"],
            registry=r,
        )
        self.bytes = LoopCounter(
            "kvxferd_transferred_bytes",
            "KV bytes of requests that completed (done), by side.",
            ["side"],
            registry=r,
        )
        self.request_seconds = histogram(
            "kvxferd_request_duration_seconds",
            "End-to-end time of a request on this daemon, from acceptance to its outcome.",
            ["side"],
            buckets=_TIME_BUCKETS,
        )
        self.wire_seconds = histogram(
            "kvxferd_wire_duration_seconds",
            "Context side: time from posting a write to the backend reporting it done.",
            buckets=_TIME_BUCKETS,
        )
        self.admission_seconds = histogram(
            "kvxferd_admission_wait_seconds",
            "Generation side: time a receive waited for room in the admission window.",
            buckets=(0.0, *_TIME_BUCKETS),
        )
        self.descriptors = histogram(
            "kvxferd_transfer_descriptors",
            "Descriptors (contiguous runs of bytes) per posted write.",
            buckets=_DESCRIPTOR_BUCKETS,
        )
        self.timeouts = counter(
            "kvxferd_timeouts",
            "Requests ended by a timeout, by phase (sender_deadline: the context side's "
            "absolute deadline; receiver_timeout: the generation side's per-task timeout).",
            ["phase"],
        )
        self.handshakes = counter(
            "kvxferd_handshakes", "Completed peer handshakes, by peer daemon name.", ["peer"]
        )
        self.handshake_failures = counter(
            "kvxferd_handshake_failures",
            "Failed peer handshakes (either direction), by reason.",
            ["reason"],
        )
        self.connections_refused = counter(
            "kvxferd_peer_connections_refused",
            "Peer connections closed before their handshake began, by reason "
            "(preauth_limit: too many unauthenticated connections in all; "
            "preauth_per_source_limit: too many from that source address).",
            ["reason"],
        )
        self.heartbeats_missed = counter(
            "kvxferd_heartbeats_missed",
            "Peer connections closed because the peer was silent past heartbeat_timeout_ms.",
            ["peer"],
        )
        self.peers_lost = counter(
            "kvxferd_peer_disconnects",
            "Established peer connections that closed, by peer daemon name.",
            ["peer"],
        )
        self.refused_requests = counter(
            "kvxferd_refused_request_data",
            "Context side: receivers' RequestData refused without being served, by reason "
            "(not_your_request: the send names another generation daemon; already_served: "
            "another receive got the KV; duplicate_request, block_mismatch, shutdown, ...).",
            ["reason"],
        )
        self.malformed = counter(
            "kvxferd_malformed_messages",
            "Messages that did not decode, by source (peer: an established peer connection, "
            "which is then closed; engine: an engine API call, answered with an error) and "
            "reason (malformed, too_deep, oversize_frame, truncated). Before a peer is "
            "authenticated they count as handshake failures instead.",
            ["source", "reason"],
        )
        self.reloads = counter(
            "kvxferd_config_reloads",
            "SIGHUP reloads, by result (applied, unchanged, rejected).",
            ["result"],
        )
        # Series that exist from the start, so that rate() and alerts see a zero.
        for phase in TIMEOUT_PHASES.values():
            self.timeouts.labels(phase=phase)
        for side in SIDES:
            self.bytes.labels(side=side)
        # Reasons are the daemon's own codes (a bounded set), so this stays small.
        self._outcome_series: dict[tuple[str, str, str], Any] = {}
        self._side_series = {
            side: (self.request_seconds.labels(side=side), self.bytes.labels(side=side))
            for side in SIDES
        }
        for result in ("applied", "unchanged", "rejected"):
            self.reloads.labels(result=result)
        for refused in (Reason.NOT_YOUR_REQUEST, Reason.ALREADY_SERVED):
            self.refused_requests.labels(reason=refused)
        for reason in ("preauth_limit", "preauth_per_source_limit"):
            self.connections_refused.labels(reason=reason)

    def set_info(self, name: str, role: str, backend: str, runtime: str, fingerprint: str) -> None:
        self.info.info(
            {
                "name": name,
                "version": __version__,
                "role": role,
                "backend": backend,
                "runtime": runtime,
                "fingerprint": fingerprint,
            }
        )

    def bind(self, daemon: DaemonView) -> None:
        """Export the daemon's live gauges (read at each scrape)."""
        self.registry.register(LiveCollector(daemon))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------- observers

    def observe_outcome(self, outcome: Outcome) -> None:
        """Every terminal outcome passes here exactly once (as it goes to the engine)."""
        side = outcome.side
        key = (side, outcome.status, outcome.reason)
        # The labelled children, looked up once per label set: `labels()` costs a few
        # microseconds a call, paid by every request (three series per outcome).
        count = self._outcome_series.get(key)
        if count is None:
            count = self._outcome_series[key] = self.requests.labels(
                side=side, status=outcome.status, reason=outcome.reason
            )
        count.inc()
        seconds, nbytes = self._side_series[side]
        seconds.observe(outcome.elapsed_ms / 1e3)
        if outcome.status == Status.DONE:
            nbytes.inc(outcome.nbytes)
        phase = TIMEOUT_PHASES.get(outcome.reason)
        if phase is not None:
            self.timeouts.labels(phase=phase).inc()

    def observe_write(self, wire_s: float, descriptors: int) -> None:
        self.wire_seconds.observe(wire_s)
        self.descriptors.observe(descriptors)

    def request_refused(self, reason: str) -> None:
        self.refused_requests.labels(reason=reason).inc()

    def observe_admission_wait(self, wait_s: float) -> None:
        self.admission_seconds.observe(wait_s)

    def handshake_ok(self, peer: str) -> None:
        self.handshakes.labels(peer=peer).inc()

    def handshake_failed(self, exc: BaseException) -> None:
        self.handshake_failures.labels(reason=handshake_failure_reason(exc)).inc()

    def malformed_message(self, source: str, exc: ProtocolError) -> None:
        self.malformed.labels(source=source, reason=malformed_reason(exc)).inc()

    def connection_refused(self, reason: str) -> None:
        self.connections_refused.labels(reason=reason).inc()

    def peer_closed(self, peer: str, heartbeat_lost: bool) -> None:
        self.peers_lost.labels(peer=peer).inc()
        if heartbeat_lost:
            self.heartbeats_missed.labels(peer=peer).inc()
