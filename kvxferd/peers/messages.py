"""Peer-to-peer control messages (TCP). Typed, versioned, decoded by field name.

Every message that can fail a request carries the request id, the receiver's
session token (`rx_token`, so a late message for an earlier request with the
same id is recognised and dropped) and a reason code.
"""

from __future__ import annotations

from typing import Union

import msgspec

from kvxferd.peers.framing import FrameCodec
from kvxferd.peers.process import ProcessInfo


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


# --- handshake -------------------------------------------------------------


class StartTls(_Msg, tag="start_tls"):
    """A daemon configured for mutual TLS sends this, in clear, as the first frame of each
    connection it accepts; the dialer starts TLS only once it has read it. The server thus
    upgrades a connection on which it has received nothing (bytes already read in clear
    would otherwise be taken as the first frames inside TLS), and a dialer without TLS
    reads a message that says why it is not served."""


class Hello(_Msg, tag="hello"):
    """Client opens: who it is and a fresh nonce the server must prove a MAC over."""

    version: int
    name: str
    incarnation: str
    role: str
    nonce: bytes


class Challenge(_Msg, tag="challenge"):
    """Server answers with its identity, its own nonce and its proof of the secret."""

    version: int
    name: str
    incarnation: str
    role: str
    nonce: bytes
    proof: bytes


class Auth(_Msg, tag="auth"):
    """Client's proof of the secret over the server's nonce."""

    proof: bytes


class PoolInfo(msgspec.Struct):
    pool_id: str
    layout: dict[str, object]
    base: int
    nbytes: int
    # The pool's tensor-parallel rank (its layout's num_kv_heads are the heads it holds);
    # defaults keep an older peer's message decodable.
    tp_rank: int = 0
    tp_size: int = 1
    # Where the pool lives: "host" or "vram" on the registering daemon's CUDA ordinal
    # `device` (NIXL's descriptor device column, meaningful in that daemon only).
    # `writable` False: the pool is not registered with the backend (a device pool the
    # daemon only copies to and from), so a peer must write through the bounce/staging
    # reservations, never into its blocks. Defaults: an older peer's pools are host memory,
    # registered, as they always were.
    memory: str = "host"
    device: int = 0
    writable: bool = True


class Info(_Msg, tag="info"):
    """Sent only after both sides proved the secret: memory metadata and settings."""

    agent_name: str
    agent_metadata: bytes
    pools: list[PoolInfo]
    fingerprint: str
    compat: dict[str, object]
    transceiver: dict[str, object]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int
    # The receive bounce region (absent: no bounce buffer on that side).
    bounce_base: int = 0
    bounce_nbytes: int = 0
    # Where a two-sided transport (UCX) listens for the sender's endpoint.
    transport_address: str = ""
    # The daemon's process (boot id, pid namespace, pid, start time): a receiver on the
    # same kernel can prove that a writer is gone (kvxferd.peers.process).
    process: ProcessInfo = msgspec.field(default_factory=ProcessInfo)
    # The sender's wall clock (Unix ms) as it made this Info: the peer learns the offset
    # between the two clocks, so RequestData.expires_unix_ms survives clock skew.
    wall_ms: int = 0
    # Where the receive bounce region lives: "host", or "vram" on CUDA ordinal
    # `bounce_device` of the daemon that sent this Info; the memory kind a peer names when
    # it writes into that region.
    bounce_memory: str = "host"
    bounce_device: int = 0
    # The staged runtime's receiver places each round at Result.round_offset in its
    # reservation (absent: at its start), so senders may pipeline rounds into it.
    round_offsets: bool = False
    # UCX in this daemon may reach peers on this kernel with CMA, so a write from such a
    # peer is the writer's own copy and ends with its handle (kvxferd/backends/cma.py);
    # False (or absent: an older daemon) makes a writer here drain rather than cancel.
    ucx_cma: bool = False
    # With mutual TLS and no shared secret: this daemon's random secret, from which each
    # pair of daemons makes the key their UCX or MPI links prove
    # (kvxferd/backends/link_secrets.py). Sent only inside TLS; empty otherwise.
    link_secret: bytes = b""


class Ready(_Msg, tag="ready"):
    pass


class Refused(_Msg, tag="refused"):
    """The handshake is refused; `reason` is a code, `message` names the mismatch.

    `quiescent` (name_in_use only): every transfer the refused daemon's incarnation asked
    for has been released here, so nothing can still be written into its memory."""

    reason: str
    message: str
    quiescent: bool = False


# --- steady state ----------------------------------------------------------


class PoolsUpdate(_Msg, tag="pools"):
    """Our pools changed. NIXL needs the registration keys of new memory before
    it can write there, so the update carries our full agent metadata again."""

    pools: list[PoolInfo]
    agent_metadata: bytes = b""


class _AboutReceive(_Msg):
    """A message about one receive (see the module docstring). A base's fields encode
    first, so these two stay the first fields of each such message, as they always were."""

    request_id: str
    rx_token: int


class RequestData(_AboutReceive, tag="request_data"):
    """Generation -> context: write this request's KV into these blocks."""

    pool_id: str
    # The receiver's blocks for the request's logical blocks [block_start, ...): the blocks
    # before block_start are in its prefix cache and get nothing. num_tokens counts from
    # token 0 all the same.
    blocks: list[int]
    num_tokens: int | None = None
    # A reservation in the receiver's bounce region offered for this request.
    bounce_offset: int = 0
    bounce_nbytes: int = 0
    # When the receiver gives up (its kv_transfer_timeout_ms), as Unix time in ms (0: no
    # deadline): the context side posts no write for it after that. Wall clock because
    # monotonic clocks of two hosts are not comparable; skew only moves the refusal.
    expires_unix_ms: int = 0
    # The default keeps an older generation daemon's message decodable (0: from the first
    # block). An older context daemon ignores the field and fails the request on the block
    # count (block_mismatch): it writes only into the blocks listed, never reports success.
    block_start: int = 0


class Result(_AboutReceive, tag="result"):
    """Context -> generation: a slice was written (status "ok") or failed (a reason code)."""

    status: str
    nbytes: int = 0
    last: bool = True
    message: str = ""
    bounced: bool = False  # the bytes are in the receiver's bounce reservation
    # Staged rounds: the blocks [first_block, end_block) of the request are in the
    # reservation (end_block 0: the whole request). Logical block indices of the request
    # (from block 0, whatever the receive's block_start), as in RoundAck.end_block.
    first_block: int = 0
    end_block: int = 0
    # Staged rounds to a receiver whose Info says `round_offsets`: where in the
    # reservation the round lies (bytes from its start); 0 otherwise.
    round_offset: int = 0


class RoundAck(_AboutReceive, tag="round_ack"):
    """Generation -> context (staged runtime): the round ending at `end_block` was
    scattered; the staging reservation may take the next one."""

    end_block: int


class Abort(_AboutReceive, tag="abort"):
    """Either side: this request failed here; stop working on it.

    From the generation side it also asks for quiescence: the context side
    answers AbortAck once no write for `rx_token` can still land.
    """

    reason: str
    message: str = ""


class AbortAck(_AboutReceive, tag="abort_ack"):
    """Context -> generation: no write for the aborted receive can still land."""


class CancelRequest(_AboutReceive, tag="cancel"):
    """Generation -> context: the engine cancels; stop unless a write is in flight."""


class CancelAnswer(_AboutReceive, tag="cancel_answer"):
    """`cancelled` True: nothing was or will be written; False: busy, retry later."""

    cancelled: bool


class Ping(_Msg, tag="ping"):
    seq: int


class Pong(_Msg, tag="pong"):
    seq: int


PeerMessage = Union[  # noqa: UP007 - msgspec needs a runtime Union object
    StartTls,
    Hello,
    Challenge,
    Auth,
    Info,
    Ready,
    Refused,
    PoolsUpdate,
    RequestData,
    Result,
    Abort,
    AbortAck,
    CancelRequest,
    CancelAnswer,
    RoundAck,
    Ping,
    Pong,
]

PEER_CODEC: FrameCodec[PeerMessage] = FrameCodec(PeerMessage, "peer")  # type: ignore[arg-type]
