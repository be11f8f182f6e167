"""The checks of an engine's receive call, before anything is taken: each names what is
wrong (RequestError, the reason the engine is told)."""

from __future__ import annotations

from kvxferd.errors import RequestError
from kvxferd.memory.layout import LayoutError
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.plan import validate_block_ids
from kvxferd.transceiver.sessions import RxSession


def check_peers(request_id: str, peers: list[str], beam_width: int, pipelined: bool) -> None:
    """The context daemons a receive names, and its beam width."""
    if not peers:
        raise RequestError("bad_request", "a receive needs at least one context peer")
    if len(set(peers)) != len(peers):
        raise RequestError("bad_request", f"the peers {peers} name a context daemon twice")
    if pipelined and beam_width != 1:
        raise RequestError(
            "bad_request",
            f"request {request_id!r}: pipelined transfer needs beam width 1, got {beam_width}",
        )


def check_blocks(
    pool: LocalPool, blocks: list[int], num_tokens: int | None, block_start: int
) -> None:
    """The blocks exist in the pool, and `num_tokens` (counted from token 0) ends in the
    last of them."""
    if not blocks:
        raise RequestError("bad_request", "a receive needs at least one block")
    try:
        validate_block_ids(pool.layout, blocks)
    except LayoutError as exc:
        raise RequestError("bad_request", f"pool {pool.pool_id!r}: {exc}") from exc
    if block_start < 0:
        raise RequestError(
            "bad_request", f"block_start must be 0 or more (a block index), got {block_start}"
        )
    if num_tokens is None:
        return
    tpb = pool.layout.tokens_per_block
    if block_start * tpb >= num_tokens:
        raise RequestError(
            "bad_request",
            f"block_start {block_start} starts at token {block_start * tpb}, at or "
            f"past the end of the request's {num_tokens} tokens: nothing to receive",
        )
    end = block_start + len(blocks)
    if not (end - 1) * tpb < num_tokens <= end * tpb:
        raise RequestError(
            "bad_request",
            f"{num_tokens} tokens do not fill {len(blocks)} blocks of {tpb} tokens"
            + (f" from block {block_start} on" if block_start else ""),
        )


def check_id_free(request_id: str, old: RxSession | None) -> None:
    """The id is not taken by a receive still known here from one of the same context
    peers (`old`: such a receive, if any). Receives of one id from different context
    instances are distinct (transceiver/rx_table.py)."""
    if old is None:
        return
    raise RequestError(
        "duplicate_request",
        f"request {request_id!r} from {old.peer!r} ended, but its blocks are still held (a "
        "write into them may still land); wait for its released event before reusing the id"
        if old.held
        else f"request {request_id!r} from {old.peer!r} is already active or finished on this "
        "daemon; release it before reusing the id",
    )


def same_daemon_problem(s: RxSession, clash: tuple[RxSession, str] | None) -> str | None:
    """Why a connected receive cannot go on: another receive of its id reached the same
    context daemon (`clash`: that receive and the daemon's name), which the engine named
    another way (by name once, by HOST:PORT once). That daemon keys its sends by request id
    alone and could not tell the two apart; the later one fails, the earlier is unharmed."""
    if clash is None:
        return None
    other, daemon = clash
    return (
        f"request {s.request_id!r} from {s.peer!r} reaches context daemon {daemon!r}, which "
        f"the receive of the same id from {other.peer!r} already asks; name a context "
        "daemon one way (its name or its HOST:PORT) for every request"
    )
