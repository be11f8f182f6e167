"""kvxferd.client: what an inference engine imports to talk to its daemon.

Two forms over the same Unix-socket protocol:

* `AsyncClient` for engines running an asyncio loop (aio.py);
* `Client`, the blocking form, which runs a private loop in a background thread
  (blocking.py).

What the client keeps of its requests' events is book.py's.

Calls raise `CallError` (with the daemon's error `code`) when the daemon refuses
them; nothing a call did is then left half-done. Every accepted recv or send
produces exactly one `Outcome`, available through `wait` or `poll`. A failure
whose blocks a write may still reach says `blocks_held`; those blocks may be
reused only after `wait_released` returns (the daemon proved no write can land). A send
may say it too: its write to another host ended in flight and is drained, still reading
those blocks, until `released` (how "drained").

Request ids are unique per context instance only: a generation engine may receive the
same id from two context instances at once. Those receives are told apart by their
context peer as the recv named it (Outcome.peer): cancel, release, query, poll, wait,
released and wait_released take an optional `peer`. Left out, they mean the only
request of the id, and raise CallError `ambiguous_request` when there are several.
"""

from kvxferd.client.aio import AsyncClient
from kvxferd.client.blocking import Client
from kvxferd.client.book import Released
from kvxferd.client.errors import CallError, DaemonGoneError
from kvxferd.client.pool_calls import host_pool
from kvxferd.transceiver.state import Outcome

__all__ = [
    "AsyncClient",
    "CallError",
    "Client",
    "DaemonGoneError",
    "Outcome",
    "Released",
    "host_pool",
]
