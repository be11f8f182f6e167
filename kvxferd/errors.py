"""The error hierarchy. Every error kvxferd raises on purpose derives from KvxferdError.

Messages say what was wrong and how to fix it; the CLI prints them without a traceback.
"""

from __future__ import annotations


class KvxferdError(Exception):
    """Root of every error kvxferd raises deliberately."""


class ConfigError(KvxferdError):
    """A configuration file or value is invalid. `problems` holds one line per problem."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


class StartupError(KvxferdError):
    """The daemon cannot start (resolution rule broken, backend missing, port busy...)."""


class BackendUnavailableError(StartupError):
    """The transport library of a backend is not installed or does not load."""


class ProtocolError(KvxferdError):
    """A message from a peer or an engine is malformed, truncated or of the wrong version."""


class MalformedMessageError(ProtocolError):
    """One message did not decode; the stream itself is intact and can go on. `body`: the
    frame's bytes, for a reader that can still find out whom to answer (a call id)."""

    # The decoder's text can quote what was sent (a type name, a field): bounded here,
    # once, for every place that logs it or answers with it.
    MESSAGE_LIMIT = 1024

    def __init__(self, message: str, body: bytes = b"") -> None:
        if len(message) > self.MESSAGE_LIMIT:
            message = f"{message[: self.MESSAGE_LIMIT]}... ({len(message)} chars)"
        super().__init__(message)
        self.body = body


class HandshakeError(KvxferdError):
    """The peer handshake failed (authentication, timeout, connection)."""


class TlsError(HandshakeError):
    """Mutual TLS with a peer failed: no certificate, one the CA did not sign, one that
    does not name the peer's daemon, or a peer that does not speak TLS at all."""


class IncompatiblePeerError(HandshakeError):
    """The peer was refused because its settings cannot work with ours.

    When the other side refused us, `reason` is its code and `quiescent` its word that
    nothing our daemon (this incarnation) asked of it can still be written;
    `peer_incarnation` is the refusing daemon's (empty: unknown)."""

    def __init__(
        self,
        message: str,
        reason: str = "",
        quiescent: bool = False,
        peer_name: str = "",
        peer_incarnation: str = "",
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.quiescent = quiescent
        self.peer_name = peer_name
        self.peer_incarnation = peer_incarnation


class DuplicateRequestError(KvxferdError):
    """A request id is already active on this daemon."""


class TransferError(KvxferdError):
    """A data-plane operation failed."""


class TransferTimeoutError(TransferError):
    """A transfer did not finish before its deadline."""


class RemoteMemoryError(TransferError):
    """The addresses the peer gave are not memory its agent registered: the peer's fault
    (a bogus pool announcement or blocks), not ours."""


class PeerLostError(TransferError):
    """The peer daemon went away (connection closed, heartbeats missed, new incarnation)."""


class RequestError(KvxferdError):
    """An engine call was refused; `code` is the API error code sent back to the engine."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
