"""Mutual TLS for the peer control channel.

With `daemon.tls_cert_file`, `tls_key_file` and `tls_ca_file` set, every peer connection,
accepted or dialed, is TLS 1.3 with a certificate on both ends that the configured CA
signed. Identity is the daemon's name, not an address (peers are usually dialed by IP):
a peer's certificate must name the daemon name it gives in the handshake, as a DNS
subjectAltName or, lacking any, as its commonName. A certificate for `gen-0` therefore
cannot be used to act as `ctx-0`.

The TLS handshake runs after the pre-authentication caps admit a connection and within
`handshake_timeout_ms`, so a stranger cannot make the daemon do TLS work beyond those caps.
The contexts are built again on each SIGHUP (certificate rotation: same paths, new
contents); connections made from then on use the new ones, established ones keep theirs.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxferd.errors import ConfigError, IncompatiblePeerError, TlsError
from kvxferd.peers.framing import PREAUTH_MAX_FRAME_BYTES
from kvxferd.peers.messages import PEER_CODEC, Refused, StartTls

# The daemon section's keys, in the order their problems are reported.
FIELDS = ("tls_cert_file", "tls_key_file", "tls_ca_file")


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    ca_file: str


class PeerTls:
    """The server and client contexts made from one reading of the three files."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        contents = [_read(key, path) for key, path in zip(FIELDS, _paths(files), strict=True)]
        # What was loaded, to tell a reload whether anything changed.
        self.fingerprint = hashlib.sha256(b"\0".join(contents)).hexdigest()[:16]
        self.server = self._context(ssl.Purpose.CLIENT_AUTH)
        self.client = self._context(ssl.Purpose.SERVER_AUTH)
        self.own_names, self.not_after = _own_certificate(files.cert_file)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        f = self.files
        server = purpose is ssl.Purpose.CLIENT_AUTH
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        # Peers are dialed by address and identified by daemon name: the name is checked
        # against the handshake's (peer_names), not against the address dialed.
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED  # both ends: mutual
        try:
            ctx.load_cert_chain(f.cert_file, f.key_file)
        except ssl.SSLError as exc:
            raise _problem(
                "tls_key_file",
                f"{f.key_file!r} does not load with the certificate {f.cert_file!r} "
                f"(not a PEM key, encrypted, or not the certificate's key): {exc.reason or exc}",
            ) from None
        except OSError as exc:
            raise _problem("tls_cert_file", f"cannot load {f.cert_file!r}: {exc}") from None
        try:
            ctx.load_verify_locations(cafile=f.ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise _problem(
                "tls_ca_file", f"{f.ca_file!r} holds no usable CA certificate: {exc}"
            ) from None
        return ctx


def _paths(files: TlsFiles) -> tuple[str, str, str]:
    return files.cert_file, files.key_file, files.ca_file


def _problem(key: str, text: str) -> ConfigError:
    problem = f"daemon.{key}: {text}"
    return ConfigError(problem, problems=[problem])


def _read(key: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise _problem(key, f"cannot read {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise _problem(key, f"{path!r} is not PEM (no -----BEGIN line)")
    return data


def _own_certificate(path: str) -> tuple[frozenset[str], str]:
    """The names and expiry of our own certificate (for status and a start-up check)."""
    try:
        decoded: dict[str, Any] = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]
    except (ssl.SSLError, OSError, AttributeError):
        return frozenset(), ""
    return names_in(decoded), str(decoded.get("notAfter", ""))


def names_in(cert: dict[str, Any]) -> frozenset[str]:
    """The daemon names a certificate (as `getpeercert()` returns it) vouches for: its DNS
    subjectAltNames, or its commonName when it has none (RFC 6125's order)."""
    dns = {value for kind, value in cert.get("subjectAltName", ()) if kind == "DNS"}
    if dns:
        return frozenset(dns)
    common = {value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"}
    return frozenset(common)


def peer_names(transport_info: object) -> frozenset[str] | None:
    """The names in the peer's verified certificate on a TLS connection (`peercert` extra
    info), or None when the connection is not TLS."""
    if not isinstance(transport_info, dict):
        return None
    return names_in(transport_info)


def load(daemon_section: Any) -> PeerTls | None:
    """The peer TLS of a daemon section (None: not configured), with its certificate
    checked to name the daemon; ConfigError naming the setting otherwise."""
    files = files_of(daemon_section)
    if files is None:
        return None
    if sys.version_info < (3, 11):
        # Upgrading an accepted connection in place (after the pre-authentication caps
        # admitted it) needs asyncio's StreamWriter.start_tls, new in 3.11.
        raise _problem("tls_cert_file", "mutual TLS needs Python 3.11 or later")
    loaded = PeerTls(files)
    name = daemon_section.name
    if loaded.own_names and name not in loaded.own_names:
        raise _problem(
            "tls_cert_file",
            f"{files.cert_file!r} names {', '.join(sorted(loaded.own_names))}, not this "
            f"daemon ({name}): every peer would refuse it; issue it with DNS "
            f"subjectAltName {name} (docs/operations.md, 'Mutual TLS')",
        )
    return loaded


def files_of(daemon_section: Any) -> TlsFiles | None:
    """The TLS files of a daemon section, or None when TLS is not configured."""
    cert = getattr(daemon_section, "tls_cert_file", None)
    if cert is None:
        return None
    return TlsFiles(cert, daemon_section.tls_key_file, daemon_section.tls_ca_file)


async def accept(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: TlsPeer
) -> frozenset[str]:
    """The accepting side's upgrade: StartTls in clear, then TLS as the server. Returns the
    names the client's verified certificate vouches for."""
    try:
        writer.write(PEER_CODEC.encode(StartTls()))
    except RuntimeError as exc:  # uvloop: the socket is already gone
        raise ConnectionResetError(f"connection lost before TLS: {exc}") from exc
    # No await between here and the upgrade pausing the reads: nothing the client sends
    # from now on can land in the clear-text buffer. What is there already came before
    # StartTls, which a dialer that follows the protocol never sends.
    _nothing_buffered(reader, peer.label, "before StartTls")
    return await _upgrade(writer, peer)


async def dial(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: TlsPeer
) -> frozenset[str]:
    """The dialing side's upgrade: wait for StartTls, then TLS as the client."""
    msg = await PEER_CODEC.read(reader, PREAUTH_MAX_FRAME_BYTES)
    if msg is None:
        raise TlsError(f"{peer.label} closed the connection before StartTls")
    if isinstance(msg, Refused):
        raise IncompatiblePeerError(f"refused by {peer.label}: {msg.reason}: {msg.message}")
    if not isinstance(msg, StartTls):
        raise TlsError(
            f"{peer.label} sent {type(msg).__name__} where a daemon with mutual TLS sends "
            "StartTls: it does not have daemon.tls_* set"
        )
    _nothing_buffered(reader, peer.label, "after StartTls")
    return await _upgrade(writer, peer)


@dataclass(frozen=True)
class TlsPeer:
    context: ssl.SSLContext
    label: str  # who, for messages


def _nothing_buffered(reader: asyncio.StreamReader, label: str, when: str) -> None:
    # StreamReader keeps what it read ahead in `_buffer` (no public accessor); bytes there
    # were sent in clear and must never be read as if they came through TLS.
    if len(getattr(reader, "_buffer", b"")):
        raise TlsError(
            f"{label} sent data in clear {when}: refusing to start TLS (a daemon without "
            "daemon.tls_* set, or someone injecting frames)"
        )


async def _upgrade(writer: asyncio.StreamWriter, peer: TlsPeer) -> frozenset[str]:
    try:
        # StreamWriter.start_tls is Python 3.11's; load() refuses TLS on older ones.
        await writer.start_tls(peer.context)  # type: ignore[attr-defined,unused-ignore]
    except (ssl.SSLError, ConnectionError) as exc:
        # A plain daemon reads our ClientHello as a frame and drops us: a reset, no alert.
        reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
        raise TlsError(
            f"TLS with {peer.label} failed: {reason} (both daemons need daemon.tls_* "
            "files, and certificates signed by each other's tls_ca_file)"
        ) from exc
    names = peer_names(writer.get_extra_info("peercert"))
    if names is None:  # not reachable with CERT_REQUIRED; never go on unverified
        raise TlsError(f"{peer.label} presented no certificate")
    return names
