"""Handing a pool's memfd to the daemon: SCM_RIGHTS on a second engine API connection.

asyncio streams read with recv(), which drops ancillary data (the kernel closes any fd sent
that way), so the API server reads the *first frame* of every connection itself, with
recvmsg on the raw socket, before it wraps the rest in streams. A first frame that is a
PoolHandoff must carry exactly one fd in the same sendmsg; the daemon checks the seals
(kvxferd.memory.memfd.check_memfd), keeps the fd under a random one-time token, answers the
token, and closes that connection. The engine's main connection then names the token in
RegisterPool.handoff. A token is bound to the peer credentials (SO_PEERCRED pid, uid) of the
connection that handed the fd over and expires after HANDOFF_TTL_S; an expired token's fd is
closed. Every fd received on an error path is closed before the error is answered.

A GPU pool shared as a CUDA VMM allocation travels the same way, its PoolHandoff of kind
"cuda_vmm": such an fd has no seals to check (the driver, not a memfd, owns the memory),
and its token is remembered with its kind, so that it can only register a device pool
(and a memfd's token only a host pool).

Engine side: hand_off_fd (blocking; kvxferd.client runs it in a worker thread).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from dataclasses import dataclass, field
from typing import Final

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.messages import DAEMON_CODEC, ENGINE_CODEC, PoolHandoff, Reply
from kvxferd.errors import ProtocolError
from kvxferd.service.logs import shown

log = logging.getLogger("kvxferd.api")

#: A first frame (hello or handoff) is tiny; a larger length prefix is garbage.
FIRST_FRAME_MAX_BYTES: Final = 64 << 10
#: Every new connection must send its first frame within this, or it is closed.
FIRST_FRAME_TIMEOUT_S: Final = 5.0
#: Room for this many fds in one recvmsg. More than one is refused; the kernel discards (closes)
#: any that do not fit and flags MSG_CTRUNC, so a flood of fds cannot pile up here.
MAX_FDS_RECEIVED: Final = 4
#: An unused token (and its fd) is dropped after this.
HANDOFF_TTL_S: Final = 30.0
#: At most this many fds held for tokens not yet used, daemon-wide.
MAX_PENDING_HANDOFFS: Final = 64

#: What a PoolHandoff's fd may be, and what each kind is called in messages.
HANDOFF_KINDS: Final = {"memfd": "a sealed memfd", "cuda_vmm": "a CUDA VMM fd"}

_HEADER: Final = struct.Struct(">I")
_CRED: Final = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"pid {self.pid} (uid {self.uid})"


def peer_cred(sock: socket.socket) -> PeerCred | None:
    """The connecting process's credentials, as the kernel recorded them at connect()."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    except OSError:
        return None
    pid, uid, gid = _CRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


@dataclass
class FirstFrame:
    body: bytes
    fds: list[int] = field(default_factory=list)  # received with it; the caller owns them
    fds_truncated: bool = False  # more fds were sent than fit (the kernel closed the rest)


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


async def _recvmsg(sock: socket.socket, n: int, fds: list[int], state: FirstFrame) -> bytes:
    """One recvmsg on a non-blocking socket, waiting for readability on the loop. Any fds
    received go into `fds` at once, so that an error or a cancellation never leaks them."""
    loop = asyncio.get_running_loop()
    ancsize = socket.CMSG_SPACE(MAX_FDS_RECEIVED * array.array("i").itemsize)
    while True:
        try:
            data, ancdata, flags, _ = sock.recvmsg(n, ancsize, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(sock.fileno(), _wake, ready)
            try:
                await ready
            finally:
                loop.remove_reader(sock.fileno())
            continue
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            state.fds_truncated = True
        return bytes(data)


async def _read_exactly(
    sock: socket.socket, n: int, fds: list[int], state: FirstFrame
) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = await _recvmsg(sock, n - len(buf), fds, state)
        if not chunk:
            return buf or None
        buf += chunk
    return buf


async def read_first_frame(sock: socket.socket, timeout_s: float) -> FirstFrame | None:
    """The first frame of a new connection and the fds that came with it.

    Reads exactly one frame (nothing more, so the streams that take over next miss no byte).
    None: the peer closed before sending a byte (a liveness probe). Raises ProtocolError
    (after closing any fd received) on silence past `timeout_s`, a truncated frame or a
    length over FIRST_FRAME_MAX_BYTES.
    """
    state = FirstFrame(b"")
    fds = state.fds

    async def read() -> FirstFrame | None:
        header = await _read_exactly(sock, _HEADER.size, fds, state)
        if header is None:
            return None
        if len(header) < _HEADER.size:
            raise ProtocolError("truncated first frame header")
        (length,) = _HEADER.unpack(header)
        if length > FIRST_FRAME_MAX_BYTES:
            raise ProtocolError(
                f"first frame of {length} bytes exceeds the {FIRST_FRAME_MAX_BYTES}-byte "
                "limit of a hello or pool handoff (not a kvxferd engine client?)"
            )
        body = await _read_exactly(sock, length, fds, state)
        if body is None or len(body) < length:
            raise ProtocolError(f"truncated first frame: {len(body or b'')} of {length} bytes")
        state.body = body
        return state

    try:
        got = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        close_fds(fds)
        raise ProtocolError(
            f"no complete first frame (hello or pool handoff) within {timeout_s:g} s"
        ) from None
    except BaseException:
        close_fds(fds)
        raise
    if got is None:
        close_fds(fds)
    return got


@dataclass
class _Pending:
    fd: int
    cred: PeerCred | None
    pool_id: str
    nbytes: int
    timer: asyncio.TimerHandle | None = None
    kind: str = "memfd"


class HandoffError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class HandoffTable:
    """fds handed over and not yet named by a RegisterPool, by one-time token."""

    def __init__(self, ttl_s: float = HANDOFF_TTL_S, limit: int = MAX_PENDING_HANDOFFS) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def put(
        self, fd: int, cred: PeerCred | None, pool_id: str, nbytes: int, kind: str = "memfd"
    ) -> str:
        """Take ownership of `fd` (closed on expiry or close_all) and return its token."""
        if len(self._pending) >= self.limit:
            raise HandoffError(
                "bad_request",
                f"{len(self._pending)} pool handoffs are waiting for their RegisterPool already "
                f"(the limit); register them or let them expire ({self.ttl_s:g} s)",
            )
        token = secrets.token_urlsafe(18)
        entry = _Pending(fd, cred, pool_id, nbytes, kind=kind)
        entry.timer = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, token)
        self._pending[token] = entry
        return token

    def _expire(self, token: str) -> None:
        entry = self._pending.pop(token, None)
        if entry is not None:
            log.warning(
                "pool handoff for %s from %s expired unused after %g s; its fd is closed",
                shown(entry.pool_id),
                entry.cred or "an unknown process",
                self.ttl_s,
            )
            close_fds([entry.fd])

    def take(
        self, token: str, cred: PeerCred | None, pool_id: str, kind: str = "memfd"
    ) -> tuple[int, int]:
        """The fd and declared size for `token`, now the caller's to close. Refuses a token
        that is unknown, expired or used, one handed over by another process, or one of
        another kind than `kind` (a memfd for a device pool, a VMM fd for a host pool)."""
        entry = self._pending.get(token)
        if entry is None:
            raise HandoffError(
                "bad_request",
                f"pool {pool_id!r}: handoff token unknown, already used or expired (a token "
                f"is used once, within {self.ttl_s:g} s of the handoff)",
            )
        if (
            entry.cred is None
            or cred is None
            or (entry.cred.pid, entry.cred.uid)
            != (
                cred.pid,
                cred.uid,
            )
        ):
            raise HandoffError(
                "bad_request",
                f"pool {pool_id!r}: the handoff token belongs to another process (handed over "
                f"by {entry.cred or 'unknown'}, named by {cred or 'unknown'}); the process "
                "holding the engine connection must hand its pool over itself",
            )
        if entry.pool_id != pool_id:
            raise HandoffError(
                "bad_request",
                f"pool {pool_id!r}: the handoff token was issued for pool {entry.pool_id!r}",
            )
        if entry.kind != kind:
            wanted = "GPU (vram)" if kind == "cuda_vmm" else "host"
            raise HandoffError(
                "bad_request",
                f"pool {pool_id!r}: the handoff token was handed over as "
                f"{HANDOFF_KINDS.get(entry.kind, entry.kind)} (kind {entry.kind}), but a "
                f"{wanted} pool is registered with {HANDOFF_KINDS[kind]} (kind {kind}); "
                "hand the pool over with the kind its RegisterPool.memory declares",
            )
        del self._pending[token]
        if entry.timer is not None:
            entry.timer.cancel()
        return entry.fd, entry.nbytes

    def close_all(self) -> None:
        for entry in self._pending.values():
            if entry.timer is not None:
                entry.timer.cancel()
            close_fds([entry.fd])
        self._pending.clear()


# ---------------------------------------------------------------------- engine side


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError(
                f"the daemon closed the pool handoff connection ({len(buf)} of {n} bytes)"
            )
        buf += chunk
    return buf


def hand_off_fd(
    socket_path: str,
    fd: int,
    pool_id: str,
    nbytes: int,
    timeout_s: float = 10.0,
    kind: str = "memfd",
) -> Reply:
    """Blocking: send `fd` with a PoolHandoff of `kind` ("memfd" or "cuda_vmm") on a new
    connection; the daemon's Reply (ok: `result` is the token). Does not close `fd` (the
    engine keeps its own)."""
    frame = ENGINE_CODEC.encode(
        PoolHandoff(call_id=1, version=PROTOCOL_VERSION, pool_id=pool_id, nbytes=nbytes, kind=kind)
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(socket_path)
        # The fd rides on the frame's first byte; the rest of a (tiny) frame follows if the
        # kernel took only part of it.
        sent = socket.send_fds(sock, [frame], [fd])
        if sent < len(frame):
            sock.sendall(frame[sent:])
        (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
        if length > FIRST_FRAME_MAX_BYTES:
            raise ProtocolError(f"daemon answered a pool handoff with a {length}-byte frame")
        reply = DAEMON_CODEC.decode(_recv_exactly(sock, length))
    if not isinstance(reply, Reply):
        raise ProtocolError(f"daemon answered a pool handoff with {type(reply).__name__}")
    return reply
