"""The authenticated peer handshake.

    client (generation side)            server (context side)
    Hello(version, id, nonce_c)   -->
                                  <--   Challenge(version, id, nonce_s, proof_s)
    [client verifies proof_s]
    Auth(proof_c)                 -->
                                        [server verifies proof_c]
                                  <--   Info(server agent metadata, pools, settings)
    [client checks compatibility]
    Info(client ...)              -->
                                        [server checks compatibility]
                                  <--   Ready

Both proofs are HMAC-SHA256 over both nonces and both identities, keyed by the
shared secret, so each side proves knowledge of the secret before the other
reveals any agent metadata or memory layout. Any refusal is sent as Refused
(reason code + message naming the mismatch) and raised on both sides.

Until the other side has proved the secret (the server: Hello and Auth; the client:
Challenge) a frame may be at most PREAUTH_MAX_FRAME_BYTES: a stranger's length prefix
cannot make us buffer megabytes. Info and later frames take MAX_FRAME_BYTES.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from kvxferd import PROTOCOL_VERSION
from kvxferd.errors import HandshakeError, IncompatiblePeerError, ProtocolError, TlsError
from kvxferd.peers.framing import MAX_FRAME_BYTES, PREAUTH_MAX_FRAME_BYTES
from kvxferd.peers.messages import (
    PEER_CODEC,
    Auth,
    Challenge,
    Hello,
    Info,
    PeerMessage,
    Ready,
    Refused,
    StartTls,
)
from kvxferd.service.logs import TEXT_LIMIT, shown

NONCE_BYTES = 32

# What a peer may call itself: as a daemon.name in the configuration, bounded. Checked as
# soon as it arrives, before the name reaches a log line or a message: a newline in it
# would forge log lines, megabytes of it would flood the log.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_INCARNATION = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ROLES = ("context", "generation", "both")


def _check_identity(msg: Hello | Challenge, peer: str) -> None:
    problems = []
    if not _NAME.fullmatch(msg.name):
        problems.append(f"name {msg.name[:40]!r}{'...' if len(msg.name) > 40 else ''}")
    if not _INCARNATION.fullmatch(msg.incarnation):
        problems.append(f"incarnation {msg.incarnation[:40]!r}")
    if msg.role not in _ROLES:
        problems.append(f"role {msg.role[:40]!r}")
    if problems:
        raise ProtocolError(
            f"{peer} sent a bad identity ({', '.join(problems)}): names are 1-128 letters, "
            f"digits, '_', '.', '-'; incarnations 1-64 of them; roles {', '.join(_ROLES)}"
        )


@dataclass(frozen=True)
class Identity:
    name: str
    incarnation: str
    role: str
    secret: bytes


@dataclass(frozen=True)
class PeerIdentity:
    name: str
    incarnation: str
    role: str

    @property
    def key(self) -> str:
        """name/incarnation: one process of the peer (the transports' peer key)."""
        return f"{self.name}/{self.incarnation}"


# Returns None when the peer's Info is acceptable, else (reason code, message).
# Whether a peer's Info is acceptable: None, or (reason, message) for the Refused. It may be
# a coroutine (the daemon loads the peer's agent metadata there, before Ready).
InfoCheck = Callable[
    [PeerIdentity, Info], "tuple[str, str] | Awaitable[tuple[str, str] | None] | None"
]


async def _check_info(
    writer: asyncio.StreamWriter, check: InfoCheck, peer: PeerIdentity, info: Info, label: str
) -> None:
    """Either side, on the other's Info: refuse it (and raise) when `check` says so."""
    refusal = check(peer, info)
    if inspect.isawaitable(refusal):
        refusal = await refusal
    if refusal is not None:
        await _refuse(writer, *refusal)
        raise IncompatiblePeerError(f"refused {peer.name} at {label}: {refusal[1]}")


# Asked once the peer proved the secret, before any metadata is sent: None to go on,
# else the Refused to send (e.g. its name belongs to a live, connected peer).
Admit = Callable[[PeerIdentity], Awaitable["Refused | None"]]


async def _admit(
    admit: Admit | None, writer: asyncio.StreamWriter, peer: PeerIdentity, label: str
) -> None:
    if admit is None:
        return
    refusal = await admit(peer)
    if refusal is not None:
        with contextlib.suppress(ConnectionError, OSError):
            await _send(writer, refusal)
        raise IncompatiblePeerError(
            f"refused {peer.name} at {label}: {refusal.message}", refusal.reason
        )


async def _check_certificate(
    writer: asyncio.StreamWriter, tls_names: frozenset[str] | None, name: str, peer: str
) -> None:
    """On mutual TLS, the peer's certificate must name the daemon it says it is: another
    daemon's certificate, though signed by the same CA, does not make it that daemon."""
    if tls_names is None or name in tls_names:
        return
    shown = ", ".join(sorted(tls_names)[:4]) or "no DNS name or commonName"
    await _refuse(writer, "certificate", f"your certificate names {shown}, not {name}")
    raise TlsError(
        f"{peer} says it is {name} but its TLS certificate names {shown}: "
        "a daemon's certificate must name its daemon.name (DNS subjectAltName)"
    )


def _proof(secret: bytes, label: bytes, first: bytes, second: bytes, names: str) -> bytes:
    msg = b"kvxferd-handshake|" + label + b"|" + first + b"|" + second + b"|" + names.encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()


async def _send(writer: asyncio.StreamWriter, msg: object) -> None:
    try:
        writer.write(PEER_CODEC.encode(msg))
        await writer.drain()
    except RuntimeError as exc:
        # uvloop's "the handler is closed": the peer's socket went away (its daemon was
        # killed) between our last read and this write. A lost connection, like a reset.
        raise ConnectionResetError(f"connection lost during the handshake: {exc}") from exc


async def _recv(
    reader: asyncio.StreamReader, peer: str, max_bytes: int = MAX_FRAME_BYTES
) -> PeerMessage:
    msg = await PEER_CODEC.read(reader, max_bytes)
    if msg is None:
        raise HandshakeError(f"{peer} closed the connection during the handshake")
    if isinstance(msg, Refused):
        raise IncompatiblePeerError(
            f"refused by {peer}: {shown(msg.reason, quote=False)}: "
            f"{shown(msg.message, TEXT_LIMIT, quote=False)}",
            msg.reason[:64],
            msg.quiescent,
        )
    return msg


async def _refuse(writer: asyncio.StreamWriter, reason: str, message: str) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        await _send(writer, Refused(reason=reason, message=message))


M = TypeVar("M")


def _expect(msg: PeerMessage, kind: type[M], peer: str) -> M:
    if isinstance(msg, StartTls):
        raise TlsError(
            f"{peer} requires mutual TLS on the peer channel (it sent StartTls): set "
            "daemon.tls_cert_file, tls_key_file and tls_ca_file here too"
        )
    if not isinstance(msg, kind):
        raise ProtocolError(
            f"{peer} sent {type(msg).__name__} during the handshake, expected {kind.__name__}"
        )
    return msg


Opening = TypeVar("Opening", Hello, Challenge)


async def _opening(
    msg: PeerMessage,
    kind: type[Opening],
    writer: asyncio.StreamWriter,
    tls_names: frozenset[str] | None,
    peer: str,
) -> Opening:
    """Either side, on the other's first message (Hello, Challenge): a well-formed identity,
    one its certificate names (mutual TLS), of our protocol version."""
    opening = _expect(msg, kind, peer)
    _check_identity(opening, peer)
    await _check_certificate(writer, tls_names, opening.name, peer)
    if opening.version != PROTOCOL_VERSION:
        text = f"protocol version {opening.version} at {peer}, ours is {PROTOCOL_VERSION}"
        await _refuse(writer, "version", text)
        raise IncompatiblePeerError(text)
    return opening


# Our Info as `peer` alone may read it: the parts drawn for that peer (a link secret).
ForPeer = Callable[[PeerIdentity, Info], Info]


def _personal(info: Info, peer: PeerIdentity, for_peer: ForPeer | None) -> Info:
    return info if for_peer is None else for_peer(peer, info)


async def client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    me: Identity,
    make_info: Callable[[], Awaitable[Info]],
    check: InfoCheck,
    peer_label: str,
    admit: Admit | None = None,
    tls_names: frozenset[str] | None = None,
    for_peer: ForPeer | None = None,
) -> tuple[PeerIdentity, Info]:
    """The dialing side. `tls_names`: on a mutual-TLS connection, the names the server's
    verified certificate vouches for; the daemon name it gives must be one of them.
    `for_peer`: what of our Info is for this peer alone (its link secret)."""
    nonce_c = os.urandom(NONCE_BYTES)
    await _send(
        writer,
        Hello(
            version=PROTOCOL_VERSION,
            name=me.name,
            incarnation=me.incarnation,
            role=me.role,
            nonce=nonce_c,
        ),
    )
    msg = await _recv(reader, peer_label, PREAUTH_MAX_FRAME_BYTES)  # not authenticated yet
    msg = await _opening(msg, Challenge, writer, tls_names, peer_label)
    names = f"{me.name}>{msg.name}"
    expected = _proof(me.secret, b"server", nonce_c, msg.nonce, names)
    if not hmac.compare_digest(expected, msg.proof):
        text = f"{peer_label} ({msg.name}) could not prove the shared secret"
        await _refuse(writer, "auth", "the server's proof of the shared secret is wrong")
        raise HandshakeError(text)
    peer = PeerIdentity(name=msg.name, incarnation=msg.incarnation, role=msg.role)
    await _send(writer, Auth(proof=_proof(me.secret, b"client", msg.nonce, nonce_c, names)))
    await _admit(admit, writer, peer, peer_label)
    try:
        info = await _recv(reader, peer_label)
    except IncompatiblePeerError as exc:
        exc.peer_name, exc.peer_incarnation = peer.name, peer.incarnation  # who refused
        raise
    info = _expect(info, Info, peer_label)
    await _check_info(writer, check, peer, info, peer_label)
    await _send(writer, _personal(await make_info(), peer, for_peer))
    ready = await _recv(reader, peer_label)
    _expect(ready, Ready, peer_label)
    return peer, info


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    me: Identity,
    make_info: Callable[[], Awaitable[Info]],
    check: InfoCheck,
    peer_label: str,
    admit: Admit | None = None,
    authenticated: Callable[[], None] | None = None,
    tls_names: frozenset[str] | None = None,
    for_peer: ForPeer | None = None,
) -> tuple[PeerIdentity, Info]:
    """The accepting side. `authenticated` is called once the client proved the secret
    (the manager stops counting the connection as unauthenticated then); `tls_names` as
    in client_handshake, for the client's certificate."""
    hello = await _recv(reader, peer_label, PREAUTH_MAX_FRAME_BYTES)
    hello = await _opening(hello, Hello, writer, tls_names, peer_label)
    if len(hello.nonce) != NONCE_BYTES:
        raise ProtocolError(f"{peer_label} sent a {len(hello.nonce)}-byte nonce")
    nonce_s = os.urandom(NONCE_BYTES)
    names = f"{hello.name}>{me.name}"
    await _send(
        writer,
        Challenge(
            version=PROTOCOL_VERSION,
            name=me.name,
            incarnation=me.incarnation,
            role=me.role,
            nonce=nonce_s,
            proof=_proof(me.secret, b"server", hello.nonce, nonce_s, names),
        ),
    )
    auth = await _recv(reader, peer_label, PREAUTH_MAX_FRAME_BYTES)
    auth = _expect(auth, Auth, peer_label)
    expected = _proof(me.secret, b"client", nonce_s, hello.nonce, names)
    if not hmac.compare_digest(expected, auth.proof):
        await _refuse(writer, "auth", "wrong shared secret")
        raise HandshakeError(f"{hello.name} at {peer_label} could not prove the shared secret")
    if authenticated is not None:
        authenticated()
    peer = PeerIdentity(name=hello.name, incarnation=hello.incarnation, role=hello.role)
    await _admit(admit, writer, peer, peer_label)
    await _send(writer, _personal(await make_info(), peer, for_peer))
    info = await _recv(reader, peer_label)
    info = _expect(info, Info, peer_label)
    await _check_info(writer, check, peer, info, peer_label)
    await _send(writer, Ready())
    return peer, info
