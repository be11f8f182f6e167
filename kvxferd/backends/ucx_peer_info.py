"""ucxx's endpoint handshake, without its use-after-free on a timeout.

Every ucxx endpoint starts with `exchange_peer_info`: each side stream-sends 16 bytes
(a tag and its checksum) and stream-receives the other's into a 16-byte bytearray,
each step under `asyncio.wait_for(..., connect_timeout)`. In ucxx 0.52, when a step
times out the function raises and the bytearray is freed, but the stream receive stays
posted in UCX: when the peer's 16 bytes come later, UCX writes them into freed memory,
and the process's allocator crashes a little later (a segfault in pymalloc, measured
here: a context daemon connecting to a generation daemon that was SIGSTOPped mid-
rendezvous died within milliseconds of the peer resuming, every time). The same holds
on the listener's side, for a connecting peer that stalls, or sends its 16 bytes late
on purpose.

`install` puts `exchange_peer_info` below in place of ucxx's, in the two ucxx modules
that call it. It speaks the same 16 bytes; the one difference is that a step that gives
up keeps its request and both buffers referenced until UCX completes the request (it
does when the endpoint closes, which ucxx does on the error), so nothing it writes
lands in memory given back.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import struct
from typing import Any

log = logging.getLogger("kvxferd.backends.ucx")

_FMT = "QQ"  # the peer's message tag, and its checksum (ucxx's hash64bits of it)

# Requests a step gave up on, and the buffers they may still use, until they complete.
_stranded: list[tuple[Any, tuple[object, ...]]] = []


def stranded() -> int:
    """Handshake requests given up on whose buffers are still kept (for tests)."""
    _prune()
    return len(_stranded)


def _prune() -> None:
    _stranded[:] = [(req, keep) for req, keep in _stranded if not req.completed]


async def exchange_peer_info(
    endpoint: Any, msg_tag: int, listener: bool, connect_timeout: float = 5.0
) -> dict[str, int]:
    """ucxx's exchange_peer_info (same arguments, same bytes, same result and errors)."""
    Array = importlib.import_module("ucxx._lib.arr").Array
    hash64bits = importlib.import_module("ucxx._lib_async.utils").hash64bits

    _prune()
    mine = struct.pack(_FMT, msg_tag, hash64bits(msg_tag))
    theirs = bytearray(len(mine))
    mine_arr, theirs_arr = Array(mine), Array(theirs)
    keep = (mine, theirs, mine_arr, theirs_arr)

    def send() -> Any:
        return endpoint.stream_send(mine_arr)

    def recv() -> Any:
        return endpoint.stream_recv(theirs_arr)

    # The listener sends first; ucxx forces an await between the two stream calls.
    for post in (send, recv) if listener else (recv, send):
        req = post()
        try:
            await asyncio.wait_for(req.wait(), timeout=connect_timeout)
        except BaseException:
            if not req.completed:
                _stranded.append((req, keep))
            raise
    tag, checksum = struct.unpack(_FMT, theirs)
    if hash64bits(tag) != checksum:
        raise RuntimeError(f"Checksum invalid! {hex(hash64bits(tag))} != {hex(checksum)}")
    return {"msg_tag": tag, "checksum": checksum}


def install() -> None:
    """Use exchange_peer_info above in ucxx's client and listener paths (idempotent)."""
    # importlib keeps the untyped package out of mypy's sight.
    for name in ("ucxx._lib_async.application_context", "ucxx._lib_async.listener"):
        module: Any = importlib.import_module(name)
        current = getattr(module, "exchange_peer_info", None)
        if current is None:
            log.warning(
                "UCX: ucxx.%s has no exchange_peer_info to replace; a peer that stalls "
                "mid-handshake may corrupt this process's memory",
                module.__name__,
            )
            continue
        module.exchange_peer_info = exchange_peer_info
