"""The operator's fence on its own (service/operator_fence.py over a real HoldKeeper):
which legs it ends, and what its refusals say. The peer connections are the stand-ins of
test_holds.py; tests/cluster/test_operator_fence.py runs it across hosts and real
kills."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from test_holds import FakeConn, Keeper, _Peer, hold, running_child

from kvxferd.api.messages import FenceWriter
from kvxferd.errors import RequestError
from kvxferd.peers.manager import PeerManager
from kvxferd.service.operator_fence import fence_writer
from kvxferd.transceiver.holds import HeldLeg


@dataclass
class Peers:
    """What fence_writer reads of PeerManager: its connections by key."""

    connections: dict[str, Any] = field(default_factory=dict)

    def up(self, name: str, incarnation: str) -> None:
        conn = FakeConn(_Peer(name, incarnation))
        self.connections[conn.key] = conn


def _fence(msg: FenceWriter, peers: Peers, k: Keeper) -> str:
    return fence_writer(msg, cast(PeerManager, peers), k.keeper)


def _refused(msg: FenceWriter, peers: Peers, k: Keeper) -> str:
    with pytest.raises(RequestError) as info:
        _fence(msg, peers, k)
    return f"{info.value.code}: {info.value}"


def test_only_the_named_writers_legs_end_and_each_engine_hears() -> None:
    async def scenario() -> None:
        k = Keeper()
        k.keeper.add(hold(HeldLeg("ctx1", "a", "10.0.0.2:1", None), "r1"))
        k.keeper.add(hold(HeldLeg("ctx2", "b", "10.0.0.3:1", None), "r2"))
        both = hold(HeldLeg("ctx1", "a", "10.0.0.2:1", None), "r3")
        both.pending.append(HeldLeg("ctx2", "b", "10.0.0.3:1", None))  # a head-merge
        k.keeper.add(both)
        assert _fence(FenceWriter(1, "ctx1"), Peers(), k) == "1"
        assert k.released == [("r1", "operator")]
        # r3 waits on for ctx2, which nobody fenced.
        assert sorted(h.request_id for h in k.keeper.holds.values()) == ["r2", "r3"]
        assert k.keeper.released_total == {"operator": 1}

    asyncio.run(scenario())


def test_refused_while_connected_naming_the_incarnation_to_fence() -> None:
    async def scenario() -> None:
        k = Keeper()
        k.keeper.add(hold(HeldLeg("ctx1", "old", "10.0.0.2:1", None)))
        peers = Peers()
        peers.up("ctx1", "new")  # it came back elsewhere: not where the holds reached it
        text = _refused(FenceWriter(1, "ctx1"), peers, k)
        assert text.startswith("writer_alive: ctx1/new is connected"), text
        assert "holds wait for ctx1/old: name its incarnation" in text, text
        assert k.keeper.holds  # nothing changed
        assert _fence(FenceWriter(2, "ctx1", "old"), peers, k) == "1"
        assert k.released == [("r1", "operator")]

    asyncio.run(scenario())


def test_a_watched_process_is_never_fenced_by_word() -> None:
    async def scenario() -> None:
        with running_child() as (_proc, info):
            k = Keeper()
            k.keeper.add(hold(HeldLeg("ctx", "inc1", "127.0.0.1:1", info)))
            text = _refused(FenceWriter(1, "ctx"), Peers(), k)
            assert text.startswith("writer_alive: the process of ctx/inc1 runs on this host")
            assert k.keeper.holds and not k.released

    asyncio.run(scenario())


def test_nothing_held_names_who_holds_wait_for() -> None:
    async def scenario() -> None:
        k = Keeper()
        assert _refused(FenceWriter(1, "ctx1"), Peers(), k) == (
            "nothing_held: no hold waits for ctx1; holds wait for: nobody"
        )
        k.keeper.add(hold(HeldLeg("ctx2", "b", "10.0.0.3:1", None)))
        text = _refused(FenceWriter(2, "ctx2", "zzz"), Peers(), k)
        assert text == "nothing_held: no hold waits for ctx2/zzz; holds wait for: ctx2/b", text

    asyncio.run(scenario())
