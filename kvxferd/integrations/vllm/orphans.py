"""Whether a daemon that lives on let go of an engine connection that ended.

A transfer whose connection ended while its blocks might still be written or read is an
orphan (transfers.py). Besides the daemon's exit, what frees it is the daemon's word, on a
new connection to the same process, that it let go of the old one (ConnectionState
"gone": the old connection's requests ended and its pools are deregistered). The question
is started, never waited for: a stopped daemon must not stop vLLM's loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

from kvxferd.client import Client, DaemonGoneError
from kvxferd.peers.process import ProcessInfo

log = logging.getLogger("kvxferd.vllm")

# How often a daemon that lives on is asked whether it let go of an ended connection.
ASK_EVERY_S = 0.1

_Key = tuple[ProcessInfo, int]


class LetGo:
    """The answers so far, by (daemon process, connection number): the connections let go
    of, those that cannot be asked about (a daemon too old to know the call), and the
    question in flight (with the client it went on) and when each was last asked."""

    def __init__(self) -> None:
        self._let_go_of: set[_Key] = set()
        self._cannot_ask: set[_Key] = set()
        self._asking: dict[_Key, tuple[Client, concurrent.futures.Future[str]]] = {}
        self._asked_at: dict[_Key, float] = {}

    def of(self, process: ProcessInfo, number: int, client: Client | None) -> bool:
        """Whether daemon `process` let go of its connection `number`, asked on `client`
        (the current connection, if any): False until an answer says so. Raises the
        current connection's end (DaemonGoneError, OSError) when the question met it."""
        key = (process, number)
        if not number or key in self._cannot_ask:
            return False
        if key in self._let_go_of:
            return True
        if client is None or client.gone or client.daemon_process != process:
            return False
        asking = self._asking.get(key)
        if asking is None or asking[0] is not client:  # none, or asked on a lost connection
            now = time.monotonic()
            if now - self._asked_at.get(key, 0.0) >= ASK_EVERY_S:
                self._asked_at[key] = now
                self._asking[key] = (client, client.start_connection_state(number))
            return False
        answer = asking[1]
        if not answer.done():
            return False
        del self._asking[key]
        exc = answer.exception()
        if isinstance(exc, (DaemonGoneError, OSError)):
            raise exc  # the connection's end: the caller fails every entry
        if exc is not None:
            log.warning(
                "the kvxferd daemon cannot say whether it let go of connection %d (%s): its "
                "transfers fail once its process exits",
                number,
                exc,
            )
            self._cannot_ask.add(key)
            return False
        if answer.result() != "gone":
            return False
        log.warning("the kvxferd daemon let go of connection %d: its transfers fail now", number)
        self._let_go_of.add(key)
        self._asked_at.pop(key, None)
        return True
