"""The intruder: a peer connection that passed a real handshake, driven by the fuzzers
(issue 14)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from kvxferd.hostport import split_hostport
from kvxferd.peers.handshake import Identity, PeerIdentity, client_handshake
from kvxferd.peers.messages import PEER_CODEC, Abort, Info, PeerMessage, Ping, Pong
from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.hostile.report import http_status
from kvxferd.sim.hostile.streams import Listened


@dataclass(frozen=True)
class Credentials:
    """What gets the fuzzer through a daemon's handshake: the cluster's shared secret and a
    real NIXL agent (its name and metadata)."""

    secret: bytes
    agent_name: str
    agent_metadata: bytes


def fake_info(daemon: DaemonProc, creds: Credentials) -> Info:
    """An Info the daemon accepts: its own compat settings and fingerprint, no pools."""
    doc = http_status(daemon)
    settings = doc["settings"]
    return Info(
        agent_name=creds.agent_name,
        agent_metadata=creds.agent_metadata,
        pools=[],
        fingerprint=doc["fingerprint"],
        compat={k: settings[k] for k in ("backend", "runtime", "pipelined_transfer")},
        transceiver={},
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        context_parallel_size=1,
    )


class Intruder(Listened[PeerMessage]):
    """An authenticated peer connection we drive: it answers the daemon's Pings (so the
    heartbeat does not end it) and keeps every Pong and the time of the close."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pongs: set[int] = set()
        self.aborts: dict[str, str] = {}  # request id -> reason of the Abort we were sent
        self.received = 0
        super().__init__(reader, writer, PEER_CODEC)

    def on_message(self, msg: PeerMessage) -> None:
        self.received += 1
        if isinstance(msg, Ping):
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                self.writer.write(PEER_CODEC.encode(Pong(seq=msg.seq)))
        elif isinstance(msg, Pong):
            self.pongs.add(msg.seq)
        elif isinstance(msg, Abort):
            self.aborts[msg.request_id] = msg.reason

    def write(self, data: bytes) -> bool:
        if self.eof.is_set():
            return False
        try:
            self.writer.write(data)
        except (ConnectionError, OSError, RuntimeError):
            return False
        return True

    async def pong(self, seq: int, timeout_s: float) -> str:
        """'pong' once the daemon answered Ping(seq), 'closed', or 'hung' at the deadline."""
        if not self.write(PEER_CODEC.encode(Ping(seq=seq))):
            return "closed"
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()
        if not await self.until(lambda: seq in self.pongs, timeout_s):
            return "hung"
        return "pong" if seq in self.pongs else "closed"

    async def closed_within(self, timeout_s: float) -> bool:
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()
        try:
            await asyncio.wait_for(self.eof.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


async def handshake(
    daemon: DaemonProc,
    me: Identity,
    info: Info,
    timeout_s: float,
) -> Intruder:
    host, port = split_hostport(daemon.peer_address)
    reader, writer = await asyncio.open_connection(host, int(port))

    async def make_info() -> Info:
        return info

    def accept(_peer: PeerIdentity, _info: Info) -> None:
        return None

    try:
        await asyncio.wait_for(
            client_handshake(reader, writer, me, make_info, accept, daemon.peer_address),
            timeout_s,
        )
    except BaseException:
        writer.close()
        raise
    return Intruder(reader, writer)
