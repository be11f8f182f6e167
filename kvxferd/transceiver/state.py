"""Session states, outcomes and reason codes shared by both sides."""

from __future__ import annotations

from enum import Enum, IntEnum

import msgspec


class SessionState(IntEnum):
    """The monotonic ladder of DESIGN.md. FAILED is sticky; DONE is terminal."""

    FAILED = 0
    WAITING_FOR_PEER = 1
    READY = 2
    TRANSFERRING = 3
    DONE = 4


class Code(str, Enum):
    """A wire code: an enum whose members are their strings (they compare, hash, format,
    encode and label metrics as the plain string, so messages and dashboards see "done",
    never "Status.DONE")."""

    def __str__(self) -> str:
        return str(self.value)


class Status(Code):
    """Terminal outcomes reported to the engine."""

    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class Reason(Code):
    """Reason codes carried in outcomes, Abort messages and metric labels."""

    OK = "ok"
    SENDER_DEADLINE = "sender_deadline"
    RECEIVER_TIMEOUT = "receiver_timeout"
    CANCELLED = "cancelled"
    PEER_CANCELLED = "peer_cancelled"
    PEER_LOST = "peer_lost"
    PEER_UNREACHABLE = "peer_unreachable"
    PEER_REFUSED = "peer_refused"
    PEER_TIMED_OUT = "peer_timed_out"
    PEER_FAILED = "peer_failed"
    TRANSFER_ERROR = "transfer_error"
    BLOCK_MISMATCH = "block_mismatch"
    BAD_CHUNK = "bad_chunk"
    UNKNOWN_POOL = "unknown_pool"
    DUPLICATE_REQUEST = "duplicate_request"
    # A RequestData refused because the send names another generation daemon (Send.peer).
    NOT_YOUR_REQUEST = "not_your_request"
    # A RequestData for a request whose KV already went to another receive.
    ALREADY_SERVED = "already_served"
    ENGINE_DISCONNECTED = "engine_disconnected"
    # A RequestData sent to a daemon that does not send (a generation daemon).
    WRONG_ROLE = "wrong_role"
    SHUTDOWN = "shutdown"
    # A RequestData refused because the context daemon keeps daemon.max_requests sends.
    OVERLOADED = "overloaded"


class Fault(Code):
    """Whose fault a failure was: this daemon's side, or the peer's."""

    LOCAL = "local"
    PEER = "peer"


class Outcome(msgspec.Struct, tag_field="type", tag="outcome", frozen=True):
    """What an engine is told, exactly once, about one of its requests: the same type in
    the daemon, on the engine socket (a message of the daemon API) and in the client."""

    request_id: str
    side: str  # "send" or "recv"
    status: str
    reason: str
    fault: str
    message: str
    nbytes: int
    elapsed_ms: float
    # A failure whose blocks the daemon still holds: a write into them may still land. The
    # engine must not reuse them before the `released` event for this request.
    blocks_held: bool = False
    # A receive's context peer, as the engine named it in the recv (the first of a
    # head-merge's peers): request ids are unique per context instance only, so two
    # receives of one id are told apart by it. "" on sends, and from older daemons.
    peer: str = ""
    # The request asked for auto_release: the daemon forgot it as it sent this (with
    # blocks_held, once they are back), and a release of it needs no call.
    auto_released: bool = False
