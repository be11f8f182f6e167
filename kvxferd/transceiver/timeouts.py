"""The timers each coordinator reads, in seconds (built from the configuration by
kvxferd.service.timeouts, at start-up and on every reload; a request in flight keeps the
deadline it was given)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SenderTimeouts:
    # None: kv_transfer_timeout_ms is null (staged runtime only): no deadline.
    timeout_s: float | None
    slice_s: float


@dataclass
class ReceiverTimeouts:
    # None: kv_transfer_timeout_ms is null (staged runtime only): no receive deadline.
    timeout_s: float | None
    # Bound on waiting for the context side's answer to a cancel.
    answer_s: float
    # How long an ended receive waits for its AbortAcks before its outcome goes out (a
    # peer that has not answered by then leaves a hold: heartbeat_interval_ms).
    ack_grace_s: float = 1.0
    # Dialing a context daemon again while a hold waits for it: first pause, longest pause.
    redial_s: float = 1.0
    redial_max_s: float = 10.0
