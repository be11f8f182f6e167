"""AsyncClient.forget and release of auto-released requests, on the client alone: which
outcomes it drops without asking the daemon, and when it leaves the call to the daemon
(whose answers the daemon tests check: tests/daemon/test_auto_release.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvxferd.client import AsyncClient, CallError, DaemonGoneError
from kvxferd.transceiver.state import Outcome


def outcome(rid: str, side: str, peer: str = "", auto: bool = True) -> Outcome:
    return Outcome(rid, side, "done", "ok", "", "", 1, 0.1, peer=peer, auto_released=auto)


def client_with(*outcomes: Outcome) -> AsyncClient:
    """A client that never connected (any call to the daemon raises DaemonGoneError),
    holding `outcomes` as if they had arrived."""
    client = AsyncClient(None, None)  # type: ignore[arg-type]
    for o in outcomes:
        client._on_outcome(o)
    return client


def test_an_auto_released_outcome_is_dropped_without_a_call() -> None:
    client = client_with(outcome("r", "send"), outcome("q", "recv", peer="ctx0"))
    asyncio.run(client.release("r"))  # no daemon behind it: a call would raise
    assert client.poll("r") is None
    assert client.forget("q", peer="ctx0") and client.poll("q") is None
    assert not client.forget("q"), "nothing left"


def test_receives_from_several_peers_need_a_peer() -> None:
    client = client_with(outcome("r", "recv", peer="a"), outcome("r", "recv", peer="b"))
    assert not client.forget("r"), "ambiguous: the daemon must answer"
    assert client.forget("r", peer="b")
    assert client.poll("r", peer="a") is not None and client.poll("r", peer="b") is None
    assert client.forget("r")  # only one left now


@pytest.mark.parametrize(
    "kept",
    [
        [outcome("r", "send", auto=False)],  # not auto-released (or an older daemon)
        [],  # no outcome yet: release must ask (the daemon says still_active)
        [outcome("r", "recv", peer="a"), outcome("r", "send", auto=False)],  # a mix
    ],
    ids=["not-auto", "no-outcome", "mixed"],
)
def test_anything_else_is_the_daemons_to_answer(kept: list[Outcome]) -> None:
    client = client_with(*kept)
    assert not client.forget("r")
    with pytest.raises(DaemonGoneError):
        asyncio.run(client.release("r"))
    assert [client.poll("r", side=o.side, peer=o.peer or None) for o in kept] == kept


def test_an_auto_released_id_stays_taken_until_released() -> None:
    """The daemon forgets an auto-released request with its outcome, so the client keeps
    its id taken: a second request under it is refused here, without a call, until the
    engine released the first."""
    client = client_with()
    client._book.auto_ids.add(("r", "send", ""))  # as send(..., auto_release=True) leaves it
    client._book.auto_ids.add(("q", "recv", "ctx0"))

    async def calls() -> None:
        with pytest.raises(CallError) as dup:
            await client.send("r", "pool0", [1], 16)
        assert dup.value.code == "duplicate_request" and "'r'" in dup.value.message
        with pytest.raises(CallError) as dup:
            await client.recv("q", "pool0", [1], "ctx0", 16, auto_release=True)
        assert dup.value.code == "duplicate_request" and "'ctx0'" in dup.value.message
        # Another context peer's receive of that id, or a later chunk, is not refused here
        # (no daemon behind this client: the call itself then fails).
        with pytest.raises(DaemonGoneError):
            await client.recv("q", "pool0", [1], "ctx1", 16, auto_release=True)
        assert ("q", "recv", "ctx1") not in client._book.auto_ids, "a failed call gives it back"
        # A block id that is no integer fails before the call: nothing taken either.
        with pytest.raises(ValueError):
            await client.recv("s", "pool0", ["x"], "ctx0", 16, auto_release=True)  # type: ignore[list-item]
        with pytest.raises(ValueError):
            await client.send("t", "pool0", ["x"], 16, auto_release=True)  # type: ignore[list-item]
        assert not {("s", "recv", "ctx0"), ("t", "send", "")} & client._book.auto_ids
        with pytest.raises(DaemonGoneError):
            await client.send("r", "pool0", [1, 2], 32, token_start=16)
        # Its outcome arrives, the engine releases it: the id is free.
        client._on_outcome(outcome("r", "send"))
        await client.release("r")
        assert ("r", "send", "") not in client._book.auto_ids
        with pytest.raises(DaemonGoneError):
            await client.send("r", "pool0", [1], 16)

    asyncio.run(calls())


def test_a_daemon_that_never_answers_the_hello_is_named(tmp_path: Path) -> None:
    """A daemon stopped (SIGSTOP) still has its socket accept connections: connect then
    fails with DaemonGoneError saying so, not a bare TimeoutError."""
    path = str(tmp_path / "silent.sock")

    async def scenario() -> None:
        server = await asyncio.start_unix_server(lambda r, w: None, path)
        async with server:
            with pytest.raises(DaemonGoneError, match=r"did not answer the hello within 0\.2 s"):
                await AsyncClient.connect(path, timeout_s=0.2)

    asyncio.run(scenario())
