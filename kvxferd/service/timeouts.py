"""The transceiver's timers, from the configuration: one conversion, used at start-up and
by a reload (so the two cannot disagree)."""

from __future__ import annotations

import math

from kvxferd.config import KvxferdConfig, ResolvedSettings
from kvxferd.transceiver.timeouts import ReceiverTimeouts, SenderTimeouts


def timeouts_of(
    cfg: KvxferdConfig, settings: ResolvedSettings
) -> tuple[SenderTimeouts, ReceiverTimeouts]:
    d = cfg.daemon
    # null (staged runtime only, the seed: "None remains available to other runtimes"):
    # no sender deadline and no receive timeout.
    timeout_ms = settings.kv_transfer_timeout_ms
    timeout_s = None if timeout_ms is None else timeout_ms / 1e3
    slice_ms = settings.kv_transfer_sender_future_timeout_ms
    sender = SenderTimeouts(
        timeout_s=timeout_s,
        # null: no slicing, one wait up to the deadline (docs/configuration.md).
        slice_s=slice_ms / 1e3 if slice_ms is not None else math.inf,
    )
    receiver = ReceiverTimeouts(
        timeout_s=timeout_s,
        answer_s=d.heartbeat_timeout_ms / 1e3,
        # The outcome of a failed receive is due at its deadline plus at most one heartbeat
        # interval; a peer that has not confirmed by then leaves a hold.
        ack_grace_s=d.heartbeat_interval_ms / 1e3,
        redial_s=d.heartbeat_interval_ms / 1e3,
        redial_max_s=d.heartbeat_timeout_ms / 1e3,
    )
    return sender, receiver
