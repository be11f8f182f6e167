"""The registration value: encoded by us, decoded strictly from whatever is in etcd."""

from __future__ import annotations

import json

import pytest

from kvxferd.discovery.base import DiscoveryState
from kvxferd.discovery.etcd_client import KeyValue
from kvxferd.discovery.members import Members
from kvxferd.discovery.record import BadRegistration, Registration, decode, encode, key_of

PREFIX = "/kvxferd/c/daemons/"
GOOD = Registration(
    name="ctx-0",
    role="context",
    address="10.0.0.2:47400",
    tp_rank=1,
    tp_size=2,
    incarnation="6b0f-1a2b",
    version="0.1.0",
)


def test_round_trip_and_unknown_fields_ignored() -> None:
    assert key_of("c", "ctx-0") == PREFIX + "ctx-0"
    assert decode(PREFIX + "ctx-0", encode(GOOD), PREFIX) == GOOD
    newer = {**json.loads(encode(GOOD)), "zone": "eu-1"}
    assert decode(PREFIX + "ctx-0", json.dumps(newer).encode(), PREFIX) == GOOD


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"tp_rank": "1"}, "not a registration"),
        ({"role": "router"}, "role"),
        ({"address": "nowhere"}, "not HOST:PORT"),
        ({"address": "10.0.0.2:0"}, "port 0"),
        ({"tp_rank": 2}, "not a rank"),
        ({"name": "other"}, "under the key"),
        ({"incarnation": "a b"}, "incarnation"),
    ],
)
def test_bad_values_are_refused_with_why(change: dict[str, object], why: str) -> None:
    value = json.dumps({**json.loads(encode(GOOD)), **change}).encode()
    with pytest.raises(BadRegistration, match=why):
        decode(PREFIX + "ctx-0", value, PREFIX)


def test_not_json_too_large_and_bad_key() -> None:
    for key, value in [
        (PREFIX + "ctx-0", b"\xff\xfe"),
        (PREFIX + "ctx-0", b"[1, 2]"),
        (PREFIX + "ctx-0", b" " * 5000),
        (PREFIX + "a/b", encode(GOOD)),
    ]:
        with pytest.raises(BadRegistration):
            decode(key, value, PREFIX)


def test_members_keep_good_entries_and_say_who_left() -> None:
    state = DiscoveryState("etcd")
    members = Members(PREFIX, state)
    members.replace([KeyValue(PREFIX + "ctx-0", encode(GOOD), 1, 2, 2)])
    assert members.resolve("ctx-0", "c").address == "10.0.0.2:47400"
    # A bad value over a good one: the old entry is not trusted either.
    members.put(KeyValue(PREFIX + "ctx-0", b"junk", 1, 2, 3))
    found = members.resolve("ctx-0", "c")
    assert found.address is None and "left discovery" in found.why
    assert state.errors == {"malformed": 1} and state.members == 0
    assert "no daemon of this name" in members.resolve("gen-9", "c").why
    members.replace([KeyValue(PREFIX + "ctx-0", encode(GOOD), 1, 2, 4)])
    members.delete(PREFIX + "ctx-0")
    assert "incarnation 6b0f-1a2b" in members.resolve("ctx-0", "c").why
