"""The two kinds of bare link (kvxferd.bench.bare.Link), over the daemon's own adapters.

* OneSidedLink: a `Backend` (NIXL, Mooncake): the receiver registers its buffer and
  publishes its agent metadata; the sender registers its own, adds the receiver as a peer
  and writes each round as ONE contiguous segment (post_write), polled to DONE on the
  daemons' schedule (0.1 ms doubling to 2 ms).
* TwoSidedLink: a `TwoSidedTransport` (UCX, MPI): the receiver listens, the sender
  connects; each round is ONE tagged message, `send` from the sender's buffer and `recv`
  into the receiver's, on this process's event loop (uvloop), as in the daemons.

Nothing here imports a transport library: the factory a bare_X module passes in does.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxferd.backends.base import Backend, XferStatus
from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.bench.bare import BareError
from kvxferd.transceiver.bounce import BounceRegion

#: The daemons give a peer's connect this long (transceiver/staged_round.py).
_CONNECT_TIMEOUT_S = 30.0
#: One-sided completion is polled after 0.1 ms, then twice as late each time up to 2 ms,
#: as the daemons' writes are (kvxferd.transceiver.writes).
_POLL_FIRST_S = 0.0001
_POLL_MAX_S = 0.002
#: Per round's receive: a generous bound; the sender's own control wait fails the run first.
_RECV_TIMEOUT_S = 300.0


class OneSidedLink:
    one_sided = True

    def __init__(self, make: Callable[[str], Backend]) -> None:
        self._make = make
        self._backend: Backend | None = None
        self._reg: object | None = None
        self._peer = ""
        self._local = 0
        self._remote = 0

    def _open(self, role: str, region: BounceRegion) -> Backend:
        backend = self._make(f"bench-bare-{role}-{os.getpid()}")
        self._backend = backend
        self._reg = backend.register(region.address, region.nbytes)
        self._local = region.address
        return backend

    async def listen(self, region: BounceRegion) -> dict[str, Any]:
        backend = self._open("receiver", region)
        return {"metadata": base64.b64encode(backend.metadata()).decode(), "base": region.address}

    def accept(self, hello: dict[str, Any]) -> None:
        return None

    async def settle(self, timeout_s: float) -> None:
        return None

    async def attach(self, region: BounceRegion, info: dict[str, Any]) -> dict[str, Any]:
        backend = self._open("sender", region)
        self._peer = backend.add_peer(base64.b64decode(info["metadata"]))
        backend.connect(self._peer)
        self._remote = int(info["base"])
        return {}

    async def receive(self, tag: int, out: memoryview) -> None:
        return None  # the sender writes into our registered buffer

    async def send(self, tag: int, nbytes: int) -> None:
        backend = self._backend
        assert backend is not None
        local = np.array([[self._local, nbytes]], dtype=np.int64)
        remote = np.array([[self._remote, nbytes]], dtype=np.int64)
        handle, status = backend.post_write(local, remote, self._peer)
        poll = backend.poll
        pause = _POLL_FIRST_S
        while status is XferStatus.IN_PROGRESS:
            # Polled as the daemons poll (transceiver/writes.py): a busy poll here would
            # take a core from the transport's own threads (Mooncake's TCP workers, NIXL's
            # progress thread) on a small host. A blocking sleep: this loop has nothing else
            # to do, and uvloop's timers are too coarse for 0.1 ms.
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
            status = poll(handle)
        backend.release(handle)
        if status is not XferStatus.DONE:
            raise BareError(f"the write of round {tag} ended {status.name}")

    async def close(self) -> None:
        if self._backend is not None:
            if self._reg is not None:
                self._backend.deregister(self._reg)
            self._backend.close()
            self._backend = None


class TwoSidedLink:
    one_sided = False

    def __init__(self, make: Callable[[str, str], TwoSidedTransport]) -> None:
        self._make = make
        self._transport: TwoSidedTransport | None = None
        self._peer_key = ""
        self._region: BounceRegion | None = None

    @property
    def peer_key(self) -> str:
        """The other side's transport key (after accept or attach)."""
        return self._peer_key

    def _open(self, role: str) -> TwoSidedTransport:
        # A key as the daemons make theirs (name/incarnation), unique per process.
        self._transport = self._make(f"bench-bare-{role}", f"{os.getpid()}-{secrets.token_hex(4)}")
        return self._transport

    async def listen(self, region: BounceRegion) -> dict[str, Any]:
        transport = self._open("receiver")
        address = await transport.start("127.0.0.1")
        return {"key": _key(transport), "address": address}

    def accept(self, hello: dict[str, Any]) -> None:
        self._peer_key = str(hello["key"])

    async def settle(self, timeout_s: float) -> None:
        """The sender connected before saying hello; our side of that connection (the
        listener's endpoint or link) may register a moment later."""
        assert self._transport is not None
        peers: Callable[[], list[str]] | None = getattr(self._transport, "peers", None)
        if peers is None:
            return
        deadline = time.monotonic() + timeout_s
        while self._peer_key not in peers():
            if time.monotonic() > deadline:
                raise BareError(f"the sender {self._peer_key} never appeared as a peer")
            await asyncio.sleep(0.005)

    async def attach(self, region: BounceRegion, info: dict[str, Any]) -> dict[str, Any]:
        transport = self._open("sender")
        self._region = region
        self._peer_key = str(info["key"])
        await transport.connect(self._peer_key, str(info["address"]), _CONNECT_TIMEOUT_S)
        return {"key": _key(transport)}

    async def receive(self, tag: int, out: memoryview) -> None:
        assert self._transport is not None
        got = await self._transport.recv(self._peer_key, tag, out, _RECV_TIMEOUT_S)
        if got != out.nbytes:
            raise BareError(f"round {tag}: received {got} bytes, {out.nbytes} sent")

    async def send(self, tag: int, nbytes: int) -> None:
        assert self._transport is not None and self._region is not None
        await self._transport.send(self._peer_key, tag, self._region.array[:nbytes].data)

    async def close(self) -> None:
        if self._transport is not None:
            await self._transport.close()
            self._transport = None


def _key(transport: TwoSidedTransport) -> str:
    key: str = getattr(transport, "key")  # noqa: B009 - both transports have one (TaggedTransport)
    return key
