"""The MPI listener's accept turn (kvxferd/backends/mpi/accept_turns.py), without MPI: who
gets it next, what a cancelled waiter does to it, and what holds a source back. The
listener itself, with real MPI and strangers, is in test_mpi.py."""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.backends.mpi import accept_turns, accepts
from kvxferd.backends.mpi.accept_turns import AcceptTurns


async def _granted_in_order(turns: AcceptTurns, sources: list[str]) -> list[str]:
    """Each of `sources` (labels "src:n") queues in this order behind a holder; each
    hands the turn on as soon as it gets it. The labels in the order they got it."""
    order: list[str] = []
    holder = await turns.take("holder")

    async def one(label: str) -> None:
        hand_on = await turns.take(label.split(":")[0])
        order.append(label)
        hand_on()
        hand_on()  # a second call does nothing

    tasks = [asyncio.ensure_future(one(label)) for label in sources]
    await asyncio.sleep(0)  # all queued
    assert turns.waiting == len(sources)
    holder()
    await asyncio.gather(*tasks)
    assert not turns.held and turns.waiting == 0
    return order


def test_the_turn_goes_round_the_sources() -> None:
    """First come, first served put a peer behind every hello of a stranger that queued
    first; now each source waiting gets one turn in its round."""
    order = asyncio.run(
        _granted_in_order(AcceptTurns(), ["a:1", "a:2", "a:3", "b:1", "c:1", "b:2"])
    )
    assert order == ["a:1", "b:1", "c:1", "a:2", "b:2", "a:3"]


def test_a_cancelled_waiter_leaves_its_place_and_a_granted_one_passes_the_turn_on() -> None:
    async def scenario() -> None:
        turns = AcceptTurns()
        holder = await turns.take("x")
        first = asyncio.ensure_future(turns.take("a"))
        second = asyncio.ensure_future(turns.take("b"))
        third = asyncio.ensure_future(turns.take("c"))
        await asyncio.sleep(0)
        first.cancel()  # still waiting: it leaves the queue
        await asyncio.sleep(0)
        assert turns.waiting == 2
        holder()  # granted to `second` ...
        second.cancel()  # ... which is cancelled before it runs: `third` gets it
        hand_on = await asyncio.wait_for(third, 5)
        assert second.cancelled() and turns.held and turns.waiting == 0
        hand_on()
        assert not turns.held

    asyncio.run(scenario())


def test_a_full_queue_is_said_so_overall_and_per_source() -> None:
    """One address queued 256 hellos in 1.1 s and every other peer was refused: a source
    may have MAX_WAITING_PER_SOURCE waiting, and all of them MAX_WAITING."""

    async def scenario() -> None:
        turns = AcceptTurns(max_waiting=3, max_per_source=2)
        holder = await turns.take("x")
        waiters = [asyncio.ensure_future(turns.take("a")) for _ in range(2)]
        await asyncio.sleep(0)
        assert "from a" in (turns.full("a") or "")
        assert turns.full("b") is None
        waiters.append(asyncio.ensure_future(turns.take("b")))
        await asyncio.sleep(0)
        assert "3 rendezvous already wait" in (turns.full("c") or "")
        holder()
        for w in asyncio.as_completed(waiters, timeout=5):  # each passes the turn on
            (await w)()
        assert turns.full("a") is None and not turns.held and turns._waiting_from == {}

    asyncio.run(scenario())


def test_a_source_that_abandoned_a_rendezvous_waits_and_a_link_clears_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After an abandoned rendezvous its source's next one waits (doubling each time),
    while another source's goes first; a link made from it clears the wait."""
    monkeypatch.setattr(accept_turns, "_PENALTY_FIRST_S", 0.2)

    async def scenario() -> None:
        turns = AcceptTurns()
        turns.penalize("s")
        assert turns._penalties["s"][0] == 1
        turns.penalize("s")
        assert turns._penalties["s"][0] == 2  # waits 0.4 s now
        order: list[str] = []

        async def one(source: str) -> None:
            hand_on = await turns.take(source)
            order.append(source)
            hand_on()

        held_back = asyncio.ensure_future(one("s"))
        await asyncio.sleep(0)
        assert turns.waiting == 1 and not turns.held  # waits although the turn is free
        await one("t")
        await held_back
        assert order == ["t", "s"]
        turns.forgive("s")
        assert "s" not in turns._penalties

    asyncio.run(scenario())


def test_penalties_are_bounded_in_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accept_turns, "_PENALTY_SOURCES", 8)
    turns = AcceptTurns()
    for i in range(100):
        turns.penalize(f"10.0.0.{i}")
    assert len(turns._penalties) <= 8
    assert "10.0.0.99" in turns._penalties  # the newest stays


def test_the_loop_waits_for_the_gate_to_clear_and_gives_up_at_its_deadline() -> None:
    """quiet.py: the event loop's MPI work waits while an accept waits (MPICH holds every
    other MPI call meanwhile); a receive's wait ends at its deadline, an infinite one
    (uvloop has no infinite timer) when the count is back to zero, and a cancelled
    waiter leaves no trace."""
    import math

    import uvloop

    from kvxferd.backends.mpi.quiet import Gate

    async def scenario() -> None:
        gate = Gate("test")
        gate.enter()
        loop = asyncio.get_running_loop()
        assert not await gate.quiet_by(loop.time() + 0.05)  # still under way
        assert not await gate.quiet_by(loop.time() - 1)
        cancelled = asyncio.ensure_future(gate.quiet())
        waiter = asyncio.ensure_future(gate.quiet_by(math.inf))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.sleep(0)
        assert not waiter.done() and len(gate._waiters) == 1
        gate.enter()
        gate.leave()  # one still under way
        await asyncio.sleep(0)
        assert not waiter.done()
        gate.leave()
        assert await asyncio.wait_for(waiter, 5)
        assert gate.count == 0 and gate._waiters == []
        await asyncio.wait_for(gate.quiet(), 1)  # at once when none is under way

    uvloop.run(scenario())


def test_a_waiter_gets_in_between_back_to_back_accepts() -> None:
    """Strangers from many addresses abandon rendezvous back to back: each accept is
    released and the turn goes to the next at once. Gate.quiet_by woke through
    wait_for's extra task, a pass after the next accept had started, and a receive with
    20 s left failed in 0.16 s (an outgoing connect in 0.2 s). It now wakes in the same
    pass as the gate's leave(), before the next holder runs."""
    from kvxferd.backends.mpi.quiet import Gate

    async def scenario() -> None:
        accepts, turns = Gate("accepts"), AcceptTurns()
        loop = asyncio.get_running_loop()
        started = 0

        async def stranger(source: str) -> None:
            nonlocal started
            hand_on = await turns.take(source)
            await accepts.quiet()
            accepts.enter()  # PendingAccept
            started += 1
            ended: asyncio.Future[None] = loop.create_future()

            def released() -> None:  # the accept's thread ended: PendingAccept._settle
                accepts.leave()
                ended.set_result(None)

            loop.call_later(0.05, released)
            ended.add_done_callback(lambda _: hand_on())  # link.py's except path

        strangers = [asyncio.ensure_future(stranger(f"10.0.0.{i}")) for i in range(20)]
        await asyncio.sleep(0.01)
        assert accepts.count == 1
        assert await accepts.quiet_by(loop.time() + 5)  # got in, long before the deadline
        assert started < 5, started
        await asyncio.gather(*strangers)

    asyncio.run(scenario())


def test_released_ports_are_retired_never_closed_and_a_full_list_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MPICH hands out the lowest free port name: closing the oldest retired port gave
    its name, and the late connect queued on it, to the next accept (SIGSEGV, reproduced
    with the cap at 1). Retired ports stay open; past the cap no new port is opened."""
    closed: list[str] = []

    class _MPI:
        @staticmethod
        def Close_port(port: str) -> None:
            closed.append(port)

    class _Runtime:
        MPI = _MPI

    monkeypatch.setattr(accepts, "_retired", [])
    monkeypatch.setattr(accepts, "_RETIRED_MAX", 3)
    for n in range(3):
        assert not accepts.retired_full()
        accepts._retire(f"tag#{n}")
    assert accepts.retired_full() and closed == []
