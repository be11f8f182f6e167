"""Per-request state on each side (TxSession on the sender, RxSession on the receiver), and
what both coordinators do to their sessions alike: settle, conclude, release, an engine
leaving, the drain at shutdown."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sized
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvxferd.backends.base import XferHandle
from kvxferd.errors import RequestError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import RequestData
from kvxferd.service.logs import TEXT_LIMIT, shown
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.legs import RxLeg, TxLeg
from kvxferd.transceiver.state import Fault, Outcome, Reason, SessionState, Status
from kvxferd.transceiver.tx_drains import Drain
from kvxferd.transceiver.wake import Wake


class EngineLink(Protocol):
    """Where a session's single outcome goes (the engine connection)."""

    name: str

    def deliver(self, outcome: Outcome) -> None: ...

    def released(
        self, request_id: str, side: str, how: str, held_ms: float, peer: str = ""
    ) -> None:
        """Blocks reported held (Outcome.blocks_held) are back: no write can land there.
        `peer`: the receive's context peer (Outcome.peer)."""
        ...


# A receive's identity on the generation side: (context peer as the engine named it,
# request id). Request ids are unique per context instance only (transceiver/rx_table.py).
RxKey = tuple[str, str]


@dataclass(frozen=True)
class Terminal:
    status: str
    reason: str
    fault: str
    message: str

    @staticmethod
    def local(status: str, reason: str, message: str) -> Terminal:
        return Terminal(status, reason, Fault.LOCAL, message)

    @staticmethod
    def timed_out(reason: str, message: str) -> Terminal:
        """A deadline of ours passed (the sender's or the receive's): our side's end."""
        return Terminal(Status.TIMED_OUT, reason, Fault.LOCAL, message)

    @staticmethod
    def peer(status: str, reason: str, message: str) -> Terminal:
        # The message usually quotes the peer's own (an Abort's, a Result's): bounded and
        # escaped before it reaches a log line or the engine's outcome.
        return Terminal(status, reason, Fault.PEER, shown(message, TEXT_LIMIT, quote=False))


@dataclass(eq=False)
class _Session:
    request_id: str
    engine: EngineLink | None
    state: SessionState = SessionState.WAITING_FOR_PEER
    created: float = field(default_factory=time.monotonic)
    terminal: Terminal | None = None
    outcome: Outcome | None = None
    nbytes: int = 0
    wake: Wake = field(default_factory=Wake)
    task: asyncio.Task[None] | None = None
    peer_told: bool = False  # the peer already knows the outcome (or cannot be told)
    # The engine asked to have it forgotten with its outcome (Send/Recv.auto_release).
    auto_release: bool = False
    # Released (by the engine, or auto_release) while its blocks are held: the id stays
    # taken until they are back.
    forget: bool = False

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    @property
    def key(self) -> object:
        """Its key in its coordinator's table of sessions."""
        return self.request_id

    @property
    def peer(self) -> str:
        """The peer that tells this request apart from others of its id (Outcome.peer);
        "" where the id alone does (a send: ids are unique per context instance)."""
        return ""

    @property
    def user(self) -> str:
        """Its mark among its pool's users (the sender adds the same one)."""
        return f"tx:{self.request_id}"

    def advance(self, state: SessionState) -> None:
        # States only move forward; FAILED is sticky.
        if self.state is SessionState.FAILED or state <= self.state:
            return
        self.state = state

    def request_end(self, terminal: Terminal) -> bool:
        """Record the first terminal decision; later ones are ignored."""
        if self.terminal is not None:
            return False
        self.terminal = terminal
        self.wake.set()
        return True

    async def wait_wake(self, deadline: float, reason: str, why: str) -> bool:
        """Wait for the next wake-up, at most until `deadline` (monotonic; inf: none).
        False once the deadline has passed: the session then ended timed out (`reason`,
        `why`)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.request_end(Terminal.timed_out(reason, why))
            return False
        self.wake.clear()
        await self.wake.wait(None if remaining == math.inf else remaining)
        return True


@dataclass(eq=False)
class TxSession(_Session):
    """Context side: the engine's send(s) and the peers' RequestData meet here.

    `request` and `conn` are those of the first leg; `legs` lists every receiver.
    `serve_peer`: the generation daemon the send names ("" until then, or when it names
    none). `contenders`: RequestData from other daemons that arrived before the send,
    after the first receiver; the send decides which of them (if any) it serves.
    """

    pool: LocalPool | None = None
    blocks: list[int] = field(default_factory=list)
    token_end: int = 0
    last_seen: bool = False
    deadline: float | None = None  # absolute, from the first send, never reset
    request: RequestData | None = None
    conn: PeerConnection | None = None
    # Its writes that may still move bytes (more than one: a staged leg's rounds overlap).
    xfers: list[XferHandle] = field(default_factory=list)
    # Posts and sends under way, each from just before it is made until it is quiescent.
    posting: int = 0
    written: int = 0  # blocks already written (pipelined slices)
    legs: list[TxLeg] = field(default_factory=list)
    serve_peer: str = ""
    contenders: list[TxLeg] = field(default_factory=list)
    # Receivers the send turned away, to be told (by the session's task) before it works.
    turned_away: list[tuple[TxLeg, str, str]] = field(default_factory=list)
    # Its write that ended in flight and could still land, drained (transceiver/tx_drains.py).
    draining: list[Drain] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """Ended, but a drained write may still read its blocks."""
        return any(not d.ended.is_set() for d in self.draining)

    def when_quiescent(self, release: Callable[[], None]) -> None:
        """Hand back memory the session's writes read from (a bounce or staging
        reservation): now, or once every drained write of it ended."""
        live = [d for d in self.draining if not d.ended.is_set()]
        if not live:
            release()
            return
        left = [len(live)]

        def one_ended() -> None:
            left[0] -= 1
            if left[0] == 0:
                release()

        for drain in live:
            drain.then.append(one_ended)

    @property
    def writing(self) -> bool:
        return self.posting > 0 or bool(self.xfers)

    def contender_of(self, conn: PeerConnection, rx_token: int) -> TxLeg | None:
        for leg in self.contenders:
            if leg.conn is conn and leg.request.rx_token == rx_token:
                return leg
        return None

    def leg_of(self, conn: PeerConnection, rx_token: int | None = None) -> TxLeg | None:
        for leg in self.legs:
            if leg.conn is conn and (rx_token is None or leg.request.rx_token == rx_token):
                return leg
        return None

    def mark_told(self, leg: TxLeg | None) -> None:
        """This receiver knows (it ended the request, or its connection is gone)."""
        if leg is not None:
            leg.told = True
        if leg is None or all(other.told for other in self.legs):
            self.peer_told = True


@dataclass(eq=False)
class RxSession(_Session):
    """Generation side: one posted receive, its blocks on loan until the outcome.

    `legs` holds one entry per context daemon asked (one, or several for a head-merge);
    `conn` is the first leg's connection (the staged runtime's rounds use it).
    """

    pool: LocalPool | None = None
    blocks: list[int] = field(default_factory=list)
    # `blocks` hold the request's logical blocks [block_start, block_start + len(blocks)).
    block_start: int = 0
    num_tokens: int | None = None
    rx_token: int = 0
    admitted: bool = False
    result: tuple[str, int, str] | None = None  # (status, nbytes, message) of the last slice
    # Ended, but its blocks are still on loan until fenced (kvxferd.transceiver.holds);
    # `forget` once the engine released the id meanwhile.
    held: bool = False
    deadline: float = math.inf  # monotonic; set at admission (the per-task timeout)
    legs: list[RxLeg] = field(default_factory=list)
    # Rounds reported in a leg's reservation and not yet scattered, in arrival order:
    # (leg, first, end, nbytes, last, offset in the reservation).
    rounds: list[tuple[RxLeg, int, int, int, bool, int]] = field(default_factory=list)

    @property
    def conn(self) -> PeerConnection | None:
        return self.legs[0].conn if self.legs else None

    # `peer`, `key` and `user` are worked out once, when the receive is made: its legs are
    # given then and never change, and the table, the loans and the outcome ask for them
    # ~15 times a request. (functools.cached_property cost more than the properties it
    # would save: on Python 3.11 its first read takes a lock.)
    _peer: str = field(default="", init=False, repr=False)
    _key: RxKey = field(default=("", ""), init=False, repr=False)
    _user: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        self._peer = self.legs[0].peer_address if self.legs else ""
        self._key = (self._peer, self.request_id)
        self._user = f"rx:{self.request_id}@{self._peer}"

    @property
    def peer(self) -> str:
        """The context peer as the engine named it (the first of a head-merge's)."""
        return self._peer

    @property
    def key(self) -> RxKey:
        return self._key

    @property
    def user(self) -> str:
        return self._user

    @property
    def peer_address(self) -> str:
        return ", ".join(leg.peer_address for leg in self.legs)

    @property
    def request_sent(self) -> bool:
        return any(leg.request_sent for leg in self.legs)

    def leg_of(self, conn: PeerConnection) -> RxLeg | None:
        for leg in self.legs:
            if leg.conn is conn:
                return leg
        return None

    def mark_told(self, leg: RxLeg | None) -> None:
        """That context daemon (None: every one) knows the outcome or cannot be told."""
        for each in self.legs if leg is None else [leg]:
            each.told = True
        if all(each.told for each in self.legs):
            self.peer_told = True


async def settle(sessions: Iterable[_Session]) -> None:
    """Wait for these sessions' tasks; each ends only once its work is quiescent.

    Shielded: the caller giving up (shutdown) must not cut a quiescence short.
    """
    tasks = [s.task for s in sessions if s.task is not None]
    if tasks:
        await asyncio.gather(*(asyncio.shield(t) for t in tasks), return_exceptions=True)


S = TypeVar("S", bound="_Session")
# How a coordinator ends one session now (request_end, plus whatever its side must do
# at once, such as cancelling the task or telling peers); may be a coroutine function.
EndNow = Callable[[S, Terminal], "Awaitable[None] | None"]


async def _end(s: S, term: Terminal, end_now: EndNow[S] | None) -> None:
    if end_now is None:
        s.request_end(term)
    elif (pending := end_now(s, term)) is not None:
        await pending


async def abort_engine_sessions(
    sessions: MutableMapping[Any, S],
    engine: EngineLink,
    reason: str,
    message: str,
    end_now: EndNow[S] | None = None,
) -> None:
    """An engine left: end every session of it (FAILED, `reason`), wait until each is
    quiescent, then forget them (nobody is left to release them)."""
    mine = [s for s in sessions.values() if s.engine is engine]
    for s in mine:
        await _end(s, Terminal.local(Status.FAILED, reason, message), end_now)
    await settle(mine)
    for s in mine:
        sessions.pop(s.key, None)


async def drain_sessions(
    sessions: MutableMapping[Any, S], deadline: float, end_now: EndNow[S] | None = None
) -> None:
    """Shutdown: give the running sessions until `deadline` (monotonic) to end by
    themselves, end every one still without an outcome (FAILED, SHUTDOWN), and wait until
    all are quiescent. `end_now` (default `request_end`) may also forget a session."""
    active = [s.task for s in sessions.values() if s.task is not None and not s.finished]
    if active:
        await asyncio.wait(active, timeout=max(0.0, deadline - time.monotonic()))
    shutdown = Terminal.local(Status.FAILED, Reason.SHUTDOWN, "daemon shut down before done")
    for s in list(sessions.values()):
        if not s.finished:
            await _end(s, shutdown, end_now)
    await settle(list(sessions.values()))


def release_finished(sessions: MutableMapping[str, Any], request_id: str, what: str) -> None:
    """The engine forgets a finished request, so its id may be used again."""
    s = sessions.get(request_id)
    if s is None or s.engine is None:
        raise RequestError("unknown_request", f"no {what} for request {request_id!r}")
    if not s.finished:
        raise RequestError(
            "still_active",
            f"request {request_id!r} has no outcome yet; cancel it or wait for it first",
        )
    forget_finished(sessions, s)


def forget_finished(sessions: MutableMapping[Any, Any], s: TxSession | RxSession) -> None:
    """A finished session its engine released: forget it now, or, while its blocks are
    held, once they are back (`forget`: the id stays taken until then)."""
    if s.held:
        s.forget = True
    elif sessions.get(s.key) is s:
        del sessions[s.key]


def forget_auto_released(sessions: MutableMapping[Any, Any], s: TxSession | RxSession) -> None:
    """After conclude: a request the engine asked to auto_release is released now, as the
    engine's release right after its outcome would be. The outcome and the release happen
    in one step, so a call the engine makes after seeing the outcome finds the daemon's
    side of the id settled."""
    if s.auto_release and s.engine is not None:  # an engine that left: abort_engine_sessions
        forget_finished(sessions, s)


def conclude(
    session: _Session,
    side: str,
    pool: LocalPool | None,
    log: logging.Logger,
    blocks_held: bool = False,
) -> None:
    """The one exit of every session: final state, blocks off loan (or `blocks_held`, kept
    by a hold until fenced), one logged outcome, delivered once to the engine. Callers have
    already made the work quiescent, or handed what is not to a hold."""
    term = session.terminal
    assert term is not None
    if term.status == Status.DONE:
        session.advance(SessionState.DONE)
    else:
        session.state = SessionState.FAILED
    if pool is not None:
        pool.users.discard(session.user)
    session.outcome = make_outcome(session, side, blocks_held)
    # Successes at DEBUG: at thousands of requests a second, one line each
    # would drown the log; every failure is logged with its reason. The line is built
    # only when it is emitted: this runs once per request.
    level = logging.DEBUG if term.status == Status.DONE else logging.WARNING
    if log.isEnabledFor(level):
        _log_outcome(session, side, term, log, level, blocks_held)
    if session.engine is not None:
        session.engine.deliver(session.outcome)


_HELD_UNTIL = {
    "recv": "; blocks held until the writer is fenced",
    "send": "; blocks held until its write in flight is drained",
}


def _log_outcome(
    session: _Session,
    side: str,
    term: Terminal,
    log: logging.Logger,
    level: int,
    blocks_held: bool,
) -> None:
    log.log(
        level,
        "%s %s: %s (%s, %s fault)%s%s",
        side,
        shown(session.request_id),
        term.status,
        shown(term.reason, quote=False),
        term.fault,
        f": {shown(term.message, TEXT_LIMIT, quote=False)}" if term.message else "",
        _HELD_UNTIL[side] if blocks_held else "",
        extra={"request_id": session.request_id},
    )


def make_outcome(session: _Session, side: str, blocks_held: bool = False) -> Outcome:
    term = session.terminal or Terminal.local(Status.FAILED, "internal", "no terminal state")
    return Outcome(
        request_id=session.request_id,
        side=side,
        status=term.status,
        reason=term.reason,
        fault=term.fault,
        message=term.message,
        nbytes=session.nbytes if term.status == Status.DONE else 0,
        elapsed_ms=(time.monotonic() - session.created) * 1e3,
        blocks_held=blocks_held,
        peer=session.peer,
        auto_released=session.auto_release,
    )


def full(sessions: Sized, limit: int) -> bool:
    """`limit` (daemon.max_requests; 0: none) requests are kept already: an engine that
    never releases its finished requests, or posts sends nobody asks for, or a peer that
    asks for requests nobody sends, must not exhaust the daemon's memory."""
    return 0 < limit <= len(sessions)


def check_room(sessions: Sized, limit: int, what: str) -> None:
    """RequestError `too_many_requests` for an engine's new request when `full`."""
    if full(sessions, limit):
        raise RequestError(
            "too_many_requests",
            f"the daemon keeps {len(sessions)} {what} (daemon.max_requests {limit}): in "
            "progress, or finished and not released; release finished requests (or pass "
            "auto_release), or raise the limit",
        )
