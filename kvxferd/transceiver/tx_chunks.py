"""The engine's send calls of one request (its chunks, with pipelining): what each call
must be on its own, and after the ones before it.

A call that is wrong on its own, or that would start a second request under an active
id, is refused and leaves any request alone. A later chunk that breaks the request's
order (after the last one, not where the previous one ended, another peer, moved
blocks) ends the request too: earlier chunks may already be written.
"""

from __future__ import annotations

import math
from typing import NoReturn

from kvxferd.errors import RequestError
from kvxferd.memory.layout import LayoutError
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.plan import validate_block_ids
from kvxferd.transceiver.sessions import EngineLink, Terminal, TxSession, check_room
from kvxferd.transceiver.state import Reason, Status


def check_send(
    request_id: str,
    pool: LocalPool,
    blocks: list[int],
    token_start: int,
    token_end: int,
    beam_width: int,
    pipelined: bool,
) -> None:
    """Raise RequestError unless the call is one the coordinator can take at all."""
    tpb = pool.layout.tokens_per_block
    if pipelined and beam_width != 1:
        raise RequestError(
            "bad_request",
            f"request {request_id!r}: pipelined transfer needs beam width 1, got {beam_width}",
        )
    if not 0 <= token_start < token_end:
        raise RequestError(
            "bad_request", f"token range [{token_start}, {token_end}) is empty or negative"
        )
    needed = math.ceil(token_end / tpb)
    if len(blocks) != needed:
        raise RequestError(
            "bad_request",
            f"tokens [0, {token_end}) need {needed} blocks of {tpb} tokens, got {len(blocks)}",
        )
    try:
        validate_block_ids(pool.layout, blocks)
    except LayoutError as exc:
        raise RequestError("bad_request", f"pool {pool.pool_id!r}: {exc}") from exc


def session_for_send(
    sessions: dict[str, TxSession],
    accepting: bool,
    engine: EngineLink,
    request_id: str,
    token_start: int,
    blocks: list[int],
    peer: str,
    max_requests: int = 0,
    pool: LocalPool | None = None,
) -> TxSession:
    """The session this chunk continues, or the one it starts (made here, or waiting since
    a receiver asked first); RequestError when the chunk cannot be taken. `max_requests`:
    daemon.max_requests (0: no limit), which a new session must not exceed. `pool`: the
    chunk's, which must be the first chunk's."""
    s = _session_of_chunk(sessions, accepting, engine, request_id, token_start, max_requests)
    if s.pool is not None and pool is not None and pool is not s.pool:
        # The first pool keeps this request as a user until it ends: a later chunk in
        # another pool would be read from memory the request does not hold.
        _reject_chunk(
            s, f"a later chunk names pool {pool.pool_id!r}, the first one {s.pool.pool_id!r}"
        )
    if s.task is not None and peer and peer != s.serve_peer:
        _reject_chunk(
            s,
            f"a later chunk names peer {peer!r}, the first one "
            f"{repr(s.serve_peer) if s.serve_peer else 'none'}",
        )
    if s.blocks and blocks[: len(s.blocks)] != s.blocks:
        # Earlier chunks' blocks may already be written: they cannot move.
        _reject_chunk(s, "a later chunk changed the blocks of earlier chunks; it must extend them")
    return s


def _reject_chunk(s: TxSession, why: str) -> NoReturn:
    """A chunk that breaks the request's order ends the request (and only it)."""
    message = f"request {s.request_id!r} rejected: {why}"
    if s.task is not None and s.terminal is None:
        s.request_end(Terminal.local(Status.FAILED, Reason.BAD_CHUNK, message))
    raise RequestError("bad_request", message)


def _session_of_chunk(
    sessions: dict[str, TxSession],
    accepting: bool,
    engine: EngineLink,
    request_id: str,
    token_start: int,
    max_requests: int,
) -> TxSession:
    s = sessions.get(request_id)
    if s is not None and s.engine is not None:
        # A send starting again at token 0 is a second request under the same id:
        # refuse the call and leave the first alone.
        if s.engine is not engine or s.finished or token_start == 0:
            held = s.finished and s.held
            raise RequestError(
                "duplicate_request",
                f"request {request_id!r} is already active or finished on this daemon; "
                + (
                    "its write is still drained (blocks_held): the id is free again at "
                    "its `released` event"
                    if held
                    else "release it before reusing the id"
                ),
            )
        if s.last_seen:
            _reject_chunk(s, "a chunk arrived after the one marked last")
        if token_start != s.token_end:
            _reject_chunk(
                s,
                f"chunk starts at token {token_start} but the previous one ended at "
                f"{s.token_end} (chunks must be in order and must not overlap)",
            )
        return s
    if token_start != 0:
        # Also a later chunk of a request that ended and was released (or auto-released
        # with its outcome): its session is gone, so this would start a new one.
        raise RequestError(
            "bad_request",
            f"no send of {request_id!r} is active (ended and released, or never begun), "
            "and the first chunk of a request must start at token 0",
        )
    if s is None:
        if not accepting:
            raise RequestError("draining", "the daemon is draining; no new requests")
        check_room(sessions, max_requests, "sends")
        s = TxSession(request_id=request_id, engine=engine)
        sessions[request_id] = s
    else:
        s.engine = engine  # the receiver's request arrived first
    return s
