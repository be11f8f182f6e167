"""HoldKeeper on its own: each fence releases a hold, and nothing else does.

The writer's process is a real child process (its pidfd is the proof of death); the peer
connections are small stand-ins that record what is sent (the daemons' tests in
tests/daemon/test_fencing.py run the same fences across real daemons and signals).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvxferd.errors import HandshakeError, IncompatiblePeerError
from kvxferd.peers import process
from kvxferd.peers.messages import Abort
from kvxferd.transceiver.bounce import Reservation
from kvxferd.transceiver.holds import HeldLeg, Hold, HoldKeeper


@dataclass
class _Peer:
    name: str
    incarnation: str


@dataclass
class FakeConn:
    peer: _Peer
    sent: list[Any] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    dialed: bool = True
    label: str = "127.0.0.1:1"

    @property
    def key(self) -> str:
        return f"{self.peer.name}/{self.peer.incarnation}"

    async def send(self, msg: Any) -> bool:
        self.sent.append(msg)
        return True


def child() -> tuple[subprocess.Popen[bytes], process.ProcessInfo]:
    proc = subprocess.Popen(["sleep", "60"])
    fields = process._stat_fields(proc.pid)
    assert fields is not None
    me = process.me()
    return proc, process.ProcessInfo(me.boot_id, me.pid_ns, proc.pid, int(fields[19]))


@contextlib.contextmanager
def running_child() -> Iterator[tuple[subprocess.Popen[bytes], process.ProcessInfo]]:
    """child(), killed and reaped when the block ends."""
    proc, info = child()
    try:
        yield proc, info
    finally:
        proc.kill()
        proc.wait()


def hold(leg: HeldLeg, rid: str = "r1") -> Hold:
    return Hold(
        request_id=rid,
        rx_token=7,
        reason="receiver_timeout",
        message="",
        pool=None,
        block_ids=[1, 2, 3],
        reservations=[Reservation(0, 4096)],
        pending=[leg],
    )


class Keeper:
    """A keeper whose dials fail (or raise `refusal`), recording releases."""

    def __init__(self, refusal: Exception | None = None, live: FakeConn | None = None) -> None:
        """`live`: what a dial returns instead, as PeerManager.connect returns a connection
        that is up already (no on_established then)."""
        self.freed: list[Reservation] = []
        self.released: list[tuple[str, str]] = []
        self.dials = 0
        self.refusal = refusal

        async def connect(address: str) -> Any:
            self.dials += 1
            if live is not None:
                return live
            raise self.refusal or HandshakeError(f"cannot reach {address}")

        self.keeper = HoldKeeper(connect, self.freed.append, retry_s=0.01, retry_max_s=0.05)
        self.keeper.on_released = lambda h, how: self.released.append((h.request_id, how))
        self.event = asyncio.Event()
        inner = self.keeper.on_released

        def note(h: Hold, how: str) -> None:
            inner(h, how)
            self.event.set()

        self.keeper.on_released = note

    async def released_within(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


def test_a_stopped_writer_holds_until_it_dies() -> None:
    async def scenario() -> None:
        with running_child() as (proc, info):
            k = Keeper()
            proc.send_signal(signal.SIGSTOP)  # stopped is not gone
            k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", info)))
            assert not await k.released_within(0.3)
            assert k.dials > 1 and k.keeper.held_blocks() == 3  # it keeps asking
            proc.kill()
            assert await k.released_within(5)
            assert k.released == [("r1", "peer_exited")]
            assert k.freed == [Reservation(0, 4096)] and not k.keeper.holds

    asyncio.run(scenario())


def test_an_abort_ack_of_the_same_incarnation_releases() -> None:
    async def scenario() -> None:
        k = Keeper()
        k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", None)))
        # Another incarnation's ack, or another token's, proves nothing.
        assert not k.keeper.on_fence_message(FakeConn(_Peer("ctx", "inc2")), "r1", 7)
        assert not k.keeper.on_fence_message(FakeConn(_Peer("ctx", "inc1")), "r1", 8)
        assert k.keeper.holds
        # A new connection of the same incarnation is asked again...
        conn = FakeConn(_Peer("ctx", "inc1"))
        await k.keeper.on_established(conn)
        assert [type(m) for m in conn.sent] == [Abort] and conn.sent[0].rx_token == 7
        assert k.keeper.holds
        # ... and its answer releases.
        assert k.keeper.on_fence_message(conn, "r1", 7)
        assert k.released == [("r1", "abort_ack")] and not k.keeper.holds

    asyncio.run(scenario())


@pytest.mark.parametrize("watchable", [False, True])
def test_a_new_incarnation_releases_only_where_death_cannot_be_watched(watchable: bool) -> None:
    async def scenario() -> None:
        with running_child() as (proc, info):
            k = Keeper()
            k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", info if watchable else None)))
            # A name alone proves nothing: not a connection we dialed, or not where the
            # old one was.
            await k.keeper.on_established(FakeConn(_Peer("ctx", "inc2"), dialed=False))
            await k.keeper.on_established(FakeConn(_Peer("ctx", "inc2"), label="10.0.0.9:1"))
            assert k.keeper.holds and not k.released
            await k.keeper.on_established(FakeConn(_Peer("ctx", "inc2")))
            if watchable:
                # Same host: the old process is alive (maybe stopped); its pidfd decides.
                assert k.keeper.holds and not k.released
                proc.kill()
                assert await k.released_within(5)
                assert k.released == [("r1", "peer_exited")]
            else:
                assert k.released == [("r1", "peer_restarted")]

    asyncio.run(scenario())


def test_a_quiescent_refusal_from_the_same_incarnation_releases() -> None:
    async def scenario() -> None:
        wrong = IncompatiblePeerError("refused", "name_in_use", True, "ctx", "inc9")
        k = Keeper(refusal=wrong)
        k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", None)))
        assert not await k.released_within(0.2)  # another incarnation's word: no proof
        k.refusal = IncompatiblePeerError("refused", "name_in_use", False, "ctx", "inc1")
        assert not await k.released_within(0.2)  # not quiescent: no proof
        k.refusal = IncompatiblePeerError("refused", "name_in_use", True, "ctx", "inc1")
        assert await k.released_within(5)
        assert k.released == [("r1", "peer_quiescent")]

    asyncio.run(scenario())


def test_a_writer_already_gone_is_fenced_at_once() -> None:
    async def scenario() -> None:
        proc, info = child()
        proc.kill()
        proc.wait()
        assert process.exited(info)
        k = Keeper()
        k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", info)))
        assert k.released == [("r1", "peer_exited")] and not k.keeper.holds

    asyncio.run(scenario())


async def _sent(conn: FakeConn, count: int) -> list[Any]:
    """What `conn` was sent once it holds `count` messages (deadline-bound)."""
    for _ in range(500):
        if len(conn.sent) >= count:
            return conn.sent
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(conn.sent)} message(s) sent, expected {count}: {conn.sent}")


def test_a_hold_added_after_its_daemon_reconnected_is_asked_on_that_connection() -> None:
    """The receive failed because the old connection closed, and ended just after the
    context daemon dialed back in: on_established had asked only the holds of then. Seen
    in a 2->1 demo whose generation daemon was stopped 8 s: the hold waited until the
    context daemon exited (68 s) and the engine could not deregister its pool."""

    async def scenario() -> None:
        conn = FakeConn(_Peer("ctx", "inc1"))
        k = Keeper(live=conn)
        await k.keeper.on_established(conn)  # before any hold: nothing to ask
        k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", None), "r1"))
        sent = await _sent(conn, 1)
        assert [(type(m), m.request_id) for m in sent] == [(Abort, "r1")]
        # A second hold of the same daemon, on the same live connection, is asked too;
        # the first is not asked twice there, not even by a repeated on_established.
        k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", None), "r2"))
        sent = await _sent(conn, 2)
        await k.keeper.on_established(conn)
        assert [m.request_id for m in conn.sent] == ["r1", "r2"]
        assert k.keeper.on_fence_message(conn, "r1", 7)
        assert k.keeper.on_fence_message(conn, "r2", 7)
        assert sorted(k.released) == [("r1", "abort_ack"), ("r2", "abort_ack")]
        assert not k.keeper.holds

    asyncio.run(scenario())


def test_a_new_incarnation_already_connected_when_the_hold_is_added_releases() -> None:
    async def scenario() -> None:
        k = Keeper(live=FakeConn(_Peer("ctx", "inc2")))  # dialed, where the old one was
        k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", None)))
        assert await k.released_within(5)
        assert k.released == [("r1", "peer_restarted")]

    asyncio.run(scenario())
