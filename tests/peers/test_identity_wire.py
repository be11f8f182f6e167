"""Request identity (issue 18) grew the engine API within its version: `peer` on Cancel,
Release and Query (engine -> daemon), on Outcome and ReleasedMsg (daemon -> engine), each
last and defaulted. The "old" structs are the messages as they were before, with the same
tags; each direction goes through the codec the receiving side decodes with."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    ApiError,
    Cancel,
    Query,
    Release,
    ReleasedMsg,
)
from kvxferd.transceiver.state import Outcome


class _Old(msgspec.Struct, tag_field="type"):
    pass


class OldCancel(_Old, tag="cancel"):
    call_id: int
    request_id: str


class OldRelease(_Old, tag="release"):
    call_id: int
    request_id: str


class OldQuery(_Old, tag="query"):
    call_id: int
    request_id: str


class OldOutcome(_Old, tag="outcome", frozen=True):
    request_id: str
    side: str
    status: str
    reason: str
    fault: str
    message: str
    nbytes: int
    elapsed_ms: float
    blocks_held: bool = False


class OldReleased(_Old, tag="released"):
    request_id: str
    side: str
    how: str
    held_ms: float


def _body(frame: bytes) -> bytes:
    return frame[4:]  # the codec's 4-byte length prefix


def _keys(data: bytes) -> list[str]:
    return list(msgspec.msgpack.decode(data))


@pytest.mark.parametrize(
    ("old", "new"), [(OldCancel, Cancel), (OldRelease, Release), (OldQuery, Query)]
)
def test_engine_calls_with_and_without_a_peer(old: type, new: type) -> None:
    # An old engine's call: the id alone (the daemon takes it while unambiguous).
    decoded = ENGINE_CODEC.decode(msgspec.msgpack.encode(old(4, "r1")))
    assert isinstance(decoded, new)
    assert (decoded.call_id, decoded.request_id, decoded.peer) == (4, "r1", "")
    # A new engine's call read by an old daemon: the peer is skipped, the rest is whole.
    body = _body(ENGINE_CODEC.encode(new(4, "r1", peer="ctx-b")))
    read = msgspec.msgpack.decode(body, type=old)
    assert (read.call_id, read.request_id) == (4, "r1")
    assert _keys(body)[:3] == ["type", "call_id", "request_id"] and _keys(body)[-1] == "peer"


def test_outcomes_and_released_events_carry_the_peer_last() -> None:
    """New fields come after the old ones (peer, then auto_released), and an old client
    reads a new outcome while a new one reads an old daemon's."""
    new = Outcome(
        "r1", "recv", "done", "ok", "local", "", 4096, 1.5, peer="10.0.0.2:7000", auto_released=True
    )
    body = _body(DAEMON_CODEC.encode(new))
    old = msgspec.msgpack.decode(body, type=OldOutcome)
    assert (old.request_id, old.status, old.nbytes, old.blocks_held) == ("r1", "done", 4096, False)
    old_keys = _keys(msgspec.msgpack.encode(old))
    assert _keys(body) == [*old_keys, "peer", "auto_released"]
    again = DAEMON_CODEC.decode(msgspec.msgpack.encode(old))  # an old daemon's outcome
    assert isinstance(again, Outcome) and again.peer == "" and not again.auto_released

    released = ReleasedMsg("r1", "recv", "abort_ack", 12.0, peer="ctx-b")
    read = msgspec.msgpack.decode(_body(DAEMON_CODEC.encode(released)), type=OldReleased)
    assert (read.request_id, read.how) == ("r1", "abort_ack")
    back = DAEMON_CODEC.decode(msgspec.msgpack.encode(OldReleased("r1", "recv", "abort_ack", 1)))
    assert isinstance(back, ReleasedMsg) and back.peer == ""


def test_the_ambiguity_code_travels_as_its_string() -> None:
    assert msgspec.msgpack.encode(ApiError.AMBIGUOUS_REQUEST) == msgspec.msgpack.encode(
        "ambiguous_request"
    )
