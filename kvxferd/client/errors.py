"""What the engine client raises."""

from __future__ import annotations

from kvxferd.errors import KvxferdError


class CallError(KvxferdError):
    """The daemon refused a call; `code` says why (see kvxferd.api.messages.ApiError)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class DaemonGoneError(KvxferdError):
    """The connection to the daemon closed."""
