"""What must hold right before the context side posts a write (or sends a staged round).

A post can run long after it was decided: the data-plane thread was busy, or the whole
daemon was stopped (SIGSTOP) while the request ended on the other side. Bytes posted then
can land in memory the receiver has already given up on, so every post is checked again
at the last moment, on the thread that posts it; the checks only read state.
"""

from __future__ import annotations

import time

from kvxferd.errors import KvxferdError
from kvxferd.peers.channel import PeerConnection
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.state import Reason, Status


class PostRefused(KvxferdError):
    """A write was not posted: its request ended or can no longer be served."""

    def __init__(self, terminal: Terminal) -> None:
        super().__init__(terminal.message)
        self.terminal = terminal


def post_refusal(s: TxSession, conn: PeerConnection) -> Terminal | None:
    """Why a write (or a two-sided round) for `s` to `conn` must not be posted now: the
    request ended (deadline, cancel, abort), or its connection is gone or silent past the
    heartbeat timeout (the receiver has given up on it; bytes sent now could land in
    memory it has handed back). None: post."""
    if s.terminal is not None:
        return s.terminal
    if s.deadline is not None and time.monotonic() >= s.deadline:
        return Terminal.timed_out(
            Reason.SENDER_DEADLINE,
            "kv_transfer_timeout_ms elapsed before the write was posted; not posted",
        )
    if conn.closed.is_set():
        return Terminal.peer(
            Status.FAILED, Reason.PEER_LOST, f"peer lost before the write: {conn.close_reason}"
        )
    leg = s.leg_of(conn)
    request = leg.request if leg is not None else s.request
    if (
        request is not None
        and request.expires_unix_ms
        and time.time() * 1e3 >= request.expires_unix_ms + conn.clock_offset_ms
    ):
        return Terminal.peer(
            Status.TIMED_OUT,
            Reason.PEER_TIMED_OUT,
            "the receiver's kv_transfer_timeout_ms had passed before the write was posted; "
            "not posted",
        )
    if conn.stale:
        return Terminal.peer(
            Status.FAILED,
            Reason.PEER_LOST,
            "no heartbeat answer from the receiver within heartbeat_timeout_ms; not posted",
        )
    return None
