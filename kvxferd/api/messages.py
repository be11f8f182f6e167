"""Engine <-> daemon messages on the local Unix socket. Typed, versioned, by field name.

Every engine call carries a `call_id` answered by exactly one Reply; outcomes
arrive unsolicited as Outcome messages, one per request.
"""

from __future__ import annotations

from typing import Union

import msgspec

from kvxferd.peers.framing import FrameCodec
from kvxferd.peers.process import ProcessInfo
from kvxferd.transceiver.state import Code, Outcome


class _Msg(msgspec.Struct, tag_field="type"):
    pass


class EngineCall(_Msg):
    """An engine call: its `call_id` comes back in exactly one Reply. A base's fields
    encode first, so `call_id` stays the first field of every call, as it always was."""

    call_id: int


class _RequestCall(EngineCall):
    """A call about one request: `request_id` follows `call_id` in each of them."""

    request_id: str


class EngineHello(_Msg, tag="hello"):
    version: int
    engine: str


class DaemonHello(_Msg, tag="hello_ok"):
    version: int
    daemon: str
    role: str
    tokens_per_block: int
    # The daemon's process (empty from a daemon that predates it): an engine whose
    # connection ended can tell a daemon that exited, which writes nothing more into its
    # pool, from one that lives on (see the vLLM connector's `Transfers`).
    process: ProcessInfo = msgspec.field(default_factory=ProcessInfo)
    # This connection's number in the daemon's process (0 from a daemon that predates it):
    # after the connection ends, ConnectionState on a new one says when the daemon let go
    # of everything the old one started.
    connection: int = 0


class RegisterPool(EngineCall, tag="register_pool"):
    """`layout.num_kv_heads` counts the heads this rank holds: with tensor parallelism, rank
    `tp_rank` of `tp_size` holds the global heads [tp_rank * h, (tp_rank + 1) * h).

    The pool is either a sealed memfd handed over first (`handoff`: the token a PoolHandoff
    got) or, the legacy way, a POSIX shm object named `shm_name`; exactly one of the two.

    A pool in GPU memory (`memory` "vram") lives on the GPU `device_uuid` names (a UUID, not
    an ordinal: engine and daemon may see different CUDA_VISIBLE_DEVICES) and is shared
    either by a CUDA IPC handle (`ipc_handle`, the 64-byte cudaIpcMemHandle_t of the
    allocation the pool sits in, the pool starting `ipc_offset` bytes into it: allocators
    hand out sub-allocations) or by a CUDA VMM allocation's fd handed over first
    (`handoff`, a PoolHandoff of kind "cuda_vmm"). The new fields come last, with defaults
    that describe a host pool, so an older engine's message still means what it meant.
    """

    pool_id: str
    shm_name: str
    nbytes: int
    layout: dict[str, object]
    tp_rank: int = 0
    tp_size: int = 1
    handoff: str = ""
    memory: str = "host"  # "host" | "vram"
    device_uuid: str = ""
    ipc_handle: bytes = b""
    ipc_offset: int = 0


class PoolHandoff(EngineCall, tag="pool_handoff"):
    """The first and only frame of a short-lived second connection to the engine API: it
    carries the pool's memfd as SCM_RIGHTS ancillary data, in the same sendmsg. The daemon
    checks the seals and answers a Reply whose `result` is a one-time token for
    RegisterPool.handoff (usable by the same process only, for a short while).

    `kind` says what the fd is: "memfd" (a host pool, seals checked) or "cuda_vmm" (a CUDA
    VMM allocation exported as a POSIX fd, which has no seals). An older engine sends no
    kind and means a memfd."""

    version: int
    pool_id: str
    nbytes: int
    kind: str = "memfd"


class DeregisterPool(EngineCall, tag="deregister_pool"):
    pool_id: str


class Recv(_RequestCall, tag="recv"):
    """From `peer` (one context daemon), or from every daemon of `peers` (head-merge: the
    context instance has more tensor-parallel ranks than we do); exactly one of the two.

    `blocks` hold the request's logical blocks [block_start, block_start + len(blocks)):
    the ones before are already here (a prefix cache) and are not written. `num_tokens`
    counts the whole request's tokens, from token 0. `auto_release`: as Send's."""

    pool_id: str
    blocks: list[int]
    peer: str = ""
    num_tokens: int | None = None
    beam_width: int = 1
    peers: list[str] = []
    block_start: int = 0
    auto_release: bool = False


class Send(_RequestCall, tag="send"):
    """`peer`: the generation daemon (its announced name) whose receive this request
    serves; "" serves whoever asks first.

    `auto_release`: the daemon forgets the request as it delivers its outcome, as a
    Release right after it would (the outcome says `auto_released`), so that the engine
    need not make that call. The first chunk's value counts. An older daemon ignores the
    field: its outcomes do not say `auto_released`, and the engine releases as before."""

    pool_id: str
    blocks: list[int]
    token_start: int
    token_end: int
    last: bool = True
    beam_width: int = 1
    peer: str = ""
    auto_release: bool = False


class Cancel(_RequestCall, tag="cancel"):
    """Stop the request unless a write of it is in flight (Reply.result says which).

    `peer` (of Cancel, Release and Query): for a receive, its context peer as the recv
    named it (or that daemon's name), telling apart receives of one request id from
    several context instances. "" (older engines): the id alone, refused with
    `ambiguous_request` when two receives share it. Ignored for sends. Last, defaulted."""

    peer: str = ""


class Release(_RequestCall, tag="release"):
    """Forget a finished request, so that its id may be used again (`peer`: as Cancel's)."""

    peer: str = ""


class Query(_RequestCall, tag="query"):
    """The request's state name, in Reply.result (`peer`: as Cancel's)."""

    peer: str = ""


class FenceWriter(EngineCall, tag="fence_writer"):
    """An operator's word that context daemon `peer` (its `daemon.name`; one `incarnation`
    of it, or "" for every one) is gone for good: the holds waiting for it to be fenced
    end (ReleasedMsg.how "operator"). Only for a writer that cannot answer any more (its
    host died, and it will not come back where it was): a stopped process can still write.
    Refused (writer_alive) while a connection to it is up, or while its process runs on
    this host (watched: its exit fences it by itself). Reply.result: how many holds
    ended."""

    peer: str
    incarnation: str = ""


class ConnectionState(EngineCall, tag="connection_state"):
    """Where the daemon is with its engine connection number `connection` (a DaemonHello's),
    in Reply.result: "live" (open), "closing" (ended, but a request it started or a pool it
    registered is still held: a write may still land in that memory, or one be read from
    it), "gone" (nothing it started can touch its memory any more). An engine whose
    connection ended while the daemon lives on asks on a new connection, and reports the
    old connection's transfers failed once it is "gone". bad_request for a number this
    daemon process never gave out."""

    connection: int


class Reply(_Msg, tag="reply"):
    """`ok` False carries an error code and a message naming what was wrong.

    `result` is call-specific: for cancel "cancelled", "busy" or "finished";
    for query the request's state name.
    """

    call_id: int
    ok: bool
    error: str = ""
    message: str = ""
    result: str = ""


class ReleasedMsg(_Msg, tag="released"):
    """Blocks of a request reported with `blocks_held` are back: no write can land there.
    `how`: the fence (abort_ack, peer_exited, peer_restarted, peer_quiescent, operator; for a send,
    drained: its write that ended in flight reached done or error). `peer`: the
    receive's context peer (as its Outcome.peer); "" from older daemons."""

    request_id: str
    side: str
    how: str
    held_ms: float
    peer: str = ""


EngineMessage = Union[  # noqa: UP007 - msgspec needs a runtime Union object
    EngineHello,
    RegisterPool,
    PoolHandoff,
    DeregisterPool,
    Recv,
    Send,
    Cancel,
    Release,
    Query,
    FenceWriter,
    ConnectionState,
]
DaemonMessage = Union[DaemonHello, Reply, Outcome, ReleasedMsg]  # noqa: UP007

ENGINE_CODEC: FrameCodec[EngineMessage] = FrameCodec(EngineMessage, "engine API")  # type: ignore[arg-type]
DAEMON_CODEC: FrameCodec[DaemonMessage] = FrameCodec(DaemonMessage, "daemon API")  # type: ignore[arg-type]


class ApiError(Code):
    """Error codes in Reply.error."""

    BAD_REQUEST = "bad_request"
    DUPLICATE_REQUEST = "duplicate_request"
    # A cancel, release or query without a peer for a request id that several receives
    # (from different context instances) share; the message names their peers.
    AMBIGUOUS_REQUEST = "ambiguous_request"
    UNKNOWN_REQUEST = "unknown_request"
    # A receive naming a peer that discovery does not know (never registered, or left).
    PEER_UNKNOWN = "peer_unknown"
    UNKNOWN_POOL = "unknown_pool"
    POOL_EXISTS = "pool_exists"
    POOL_BUSY = "pool_busy"
    REGISTRATION_FAILED = "registration_failed"
    UNSEALED_POOL = "unsealed_pool"  # a handed-over fd that is not a memfd sealed against shrinking
    POOL_SHRUNK = "pool_shrunk"  # a shm-name pool its engine truncated: no new work on it
    WRONG_ROLE = "wrong_role"
    STILL_ACTIVE = "still_active"
    DRAINING = "draining"
    VERSION = "version"
    BLOCKS_ON_LOAN = "blocks_on_loan"
    # A recv or send while the daemon keeps daemon.max_requests of that side already.
    TOO_MANY_REQUESTS = "too_many_requests"
    # A GPU pool where this host or daemon has no usable CUDA device (or no cupy).
    DEVICE_UNAVAILABLE = "device_unavailable"
    # A pool whose memory kind (host or vram) is not the one this daemon is configured for.
    MEMORY_MISMATCH = "memory_mismatch"
    # FenceWriter for a context daemon that is alive: connected, or its process (on this
    # host) has not exited.
    WRITER_ALIVE = "writer_alive"
    # FenceWriter for a daemon no hold waits for.
    NOTHING_HELD = "nothing_held"
