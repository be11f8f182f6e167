"""The generation side's receives by (context peer, request id) (transceiver/rx_table.py):
lookups for engine calls with and without a peer, clashes, and matching peer messages
by connection and token. The connections are stand-ins with a daemon name: the table
only compares them by identity and reads the name their handshake proved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

from kvxferd.errors import RequestError
from kvxferd.peers.channel import PeerConnection
from kvxferd.transceiver.legs import RxLeg
from kvxferd.transceiver.rx_table import RxTable
from kvxferd.transceiver.sessions import RxSession


@dataclass
class _Peer:
    name: str


@dataclass(eq=False)
class _Conn:
    peer: _Peer


def conn(name: str) -> PeerConnection:
    return cast(PeerConnection, _Conn(_Peer(name)))


def receive(rid: str, *peers: str, token: int = 1, conns: Any = ()) -> RxSession:
    legs = [RxLeg(p) for p in peers]
    for leg, c in zip(legs, conns, strict=False):
        leg.conn = c
    return RxSession(request_id=rid, engine=None, rx_token=token, legs=legs)


def test_two_context_instances_share_an_id_and_calls_tell_them_apart() -> None:
    table = RxTable()
    ca, cb = conn("ctx-a"), conn("ctx-b")
    a = receive("r1", "ctx-a", token=7, conns=[ca])
    b = receive("r1", "10.0.0.2:7000", token=9, conns=[cb])
    table.add(a)
    table.add(b)
    assert set(table) == {("ctx-a", "r1"), ("10.0.0.2:7000", "r1")}
    assert table.of_id("r1") == [a, b] and table.of_id("r2") == []
    with pytest.raises(RequestError) as err:
        table.find("r1")
    assert err.value.code == "ambiguous_request"
    assert "'ctx-a'" in str(err.value) and "'10.0.0.2:7000'" in str(err.value)
    assert table.find("r1", "ctx-a") is a
    assert table.find("r1", "10.0.0.2:7000") is b
    assert table.find("r1", "ctx-b") is b  # the daemon's proved name finds it too
    assert table.find("r1", "ctx-c") is None
    del table[a.key]
    assert table.find("r1") is b and table.of_id("r1") == [b]
    del table[b.key]
    assert table.find("r1") is None and len(table) == 0


def test_a_receive_naming_a_peer_another_receive_of_the_id_names_clashes() -> None:
    table = RxTable()
    merge = receive("r1", "ctx-a0", "ctx-a1")
    table.add(merge)
    assert table.clash("r1", ["ctx-a1"]) is merge
    assert table.clash("r1", ["ctx-b0", "ctx-b1"]) is None
    assert table.clash("r2", ["ctx-a0"]) is None


def test_the_same_daemon_named_two_ways_is_found_once_connected() -> None:
    table = RxTable()
    c = conn("ctx-a")
    first = receive("r1", "ctx-a", conns=[c])
    second = receive("r1", "127.0.0.1:7000", token=2)
    table.add(first)
    table.add(second)
    assert table.same_daemon(second) is None  # not connected yet: nobody knows
    second.legs[0].conn = c
    assert table.same_daemon(second) == (first, "ctx-a")
    other = receive("r1", "ctx-b", token=3, conns=[conn("ctx-b")])
    table.add(other)
    assert table.same_daemon(other) is None


def test_peer_messages_reach_only_a_receive_they_are_a_leg_of() -> None:
    """A context daemon that knows (or guesses) another instance's token of the same id
    still reaches nothing of it: the connection must be one of that receive's legs."""
    table = RxTable()
    ca, cb, evil = conn("ctx-a"), conn("ctx-b"), conn("evil")
    a = receive("r1", "ctx-a", token=7, conns=[ca])
    b = receive("r1", "ctx-b", token=9, conns=[cb])
    table.add(a)
    table.add(b)
    assert table.match(ca, "r1", 7) is a and table.match(cb, "r1", 9) is b
    assert table.match(cb, "r1", 7) is None  # b's daemon with a's token
    assert table.match(evil, "r1", 7) is None and table.match(evil, "r1", 9) is None
    assert table.match(ca, "r1", 9) is None and table.match(ca, "r2", 7) is None
    assert table.token_taken("r1", 9) and not table.token_taken("r1", 8)


def test_a_receive_is_stored_only_under_its_own_key() -> None:
    table = RxTable()
    with pytest.raises(ValueError):
        table[("ctx-b", "r1")] = receive("r1", "ctx-a")
