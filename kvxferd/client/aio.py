"""AsyncClient: the engine client for engines running an asyncio loop (the package
docstring says what the calls promise)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    Cancel,
    ConnectionState,
    DaemonHello,
    EngineCall,
    EngineHello,
    FenceWriter,
    Query,
    Recv,
    Release,
    ReleasedMsg,
    Reply,
    Send,
)
from kvxferd.client.book import IdKey, Released, RequestBook
from kvxferd.client.errors import CallError, DaemonGoneError
from kvxferd.client.pool_calls import PoolCalls, host_pool
from kvxferd.client.started import StartedCalls
from kvxferd.errors import ProtocolError
from kvxferd.peers.framing import CorkedWriter
from kvxferd.peers.process import ProcessInfo
from kvxferd.transceiver.state import Outcome

# host_pool: still importable from here, where it lived before pool_calls.py.
__all__ = ["AsyncClient", "host_pool"]

P = ParamSpec("P")


class AsyncClient(PoolCalls):
    """An engine's connection to its daemon, on the engine's asyncio loop: the calls (those
    that share pools: PoolCalls), and the outcomes and releases the daemon pushes (kept in
    a RequestBook)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._out = CorkedWriter(writer)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[str]] = {}
        self._book = RequestBook()
        self._started = StartedCalls(self._book)
        self._reader_task: asyncio.Task[None] | None = None
        self._closed_reason = ""
        # Where a pool handoff's second connection goes (set by connect; else the peer name).
        self.socket_path = ""
        self.daemon = ""
        self.role = ""
        self.tokens_per_block = 0
        self.daemon_process = ProcessInfo()  # the daemon's, from its hello
        # This connection's number in the daemon's process (0: a daemon too old to say).
        self.connection_id = 0
        self.errors: list[str] = []  # errors the daemon sent without a call (call_id -1)

    @classmethod
    async def connect(
        cls, socket_path: str, engine: str = "engine", timeout_s: float = 10.0
    ) -> AsyncClient:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(socket_path), timeout_s
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise DaemonGoneError(
                f"cannot reach the kvxferd daemon at {socket_path}: {exc or 'timed out'}"
            ) from exc
        client = cls(reader, writer)
        client.socket_path = socket_path
        writer.write(ENGINE_CODEC.encode(EngineHello(version=PROTOCOL_VERSION, engine=engine)))
        await writer.drain()
        try:
            hello = await asyncio.wait_for(DAEMON_CODEC.read(reader), timeout_s)
        except asyncio.TimeoutError:
            writer.close()
            # Its socket accepted us (the kernel does that for a stopped process too).
            raise DaemonGoneError(
                f"the kvxferd daemon at {socket_path} accepted the connection but did not "
                f"answer the hello within {timeout_s:g} s (stopped, hung or overloaded?)"
            ) from None
        except (ConnectionError, OSError) as exc:
            writer.close()
            raise DaemonGoneError(f"the kvxferd daemon at {socket_path} failed: {exc}") from exc
        if isinstance(hello, Reply) and not hello.ok:
            writer.close()
            raise CallError(hello.error, hello.message)
        if not isinstance(hello, DaemonHello):
            writer.close()
            raise ProtocolError(f"daemon at {socket_path} did not answer the hello")
        client.daemon, client.role = hello.daemon, hello.role
        client.tokens_per_block = hello.tokens_per_block
        client.daemon_process = hello.process
        client.connection_id = hello.connection
        client._reader_task = asyncio.create_task(client._read_loop())
        return client

    async def _read_loop(self) -> None:
        frames = DAEMON_CODEC.frames(self._reader)
        try:
            while (bodies := await frames.read()) is not None:
                for body in bodies:
                    msg = DAEMON_CODEC.decode(body)
                    if isinstance(msg, Reply):
                        fut = self._pending.pop(msg.call_id, None)
                        if fut is None:
                            if not self._started.on_reply(msg):
                                self.errors.append(f"{msg.error}: {msg.message}")
                        elif not fut.done():
                            if msg.ok:
                                fut.set_result(msg.result)
                            else:
                                fut.set_exception(CallError(msg.error, msg.message))
                    elif isinstance(msg, Outcome):
                        self._on_outcome(msg)
                    elif isinstance(msg, ReleasedMsg):
                        self._book.on_released(msg)
            self._closed_reason = "the daemon closed the connection"
        except (ProtocolError, ConnectionError, OSError) as exc:
            self._closed_reason = f"connection to the daemon failed: {exc}"
        finally:
            if not self._closed_reason:
                self._closed_reason = "client closed"
            self._fail_all()

    def _on_outcome(self, outcome: Outcome) -> None:
        self._book.on_outcome(outcome)

    def _fail_all(self) -> None:
        err = DaemonGoneError(self._closed_reason)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._started.clear()
        self._book.fail_waiters(err)

    async def _ask(
        self, call: Callable[Concatenate[int, P], EngineCall], *args: P.args, **kw: P.kwargs
    ) -> str:
        """Make the engine call `call` (its message class, given all fields but the first,
        call_id, which is this connection's next) and wait for its Reply's result."""
        return await self._call(call(next(self._ids), *args, **kw))

    async def _call(self, msg: EngineCall, took: IdKey | None = None) -> str:
        """Send `msg` and wait for its Reply's result. `took`: the id that send or recv took
        (take_id), given back if the call fails. One coroutine, not one per step: each
        layer that waits costs two Python calls a request (docs/benchmarks.md, issue 16)."""
        try:
            self._check_connected()
            fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self._pending[msg.call_id] = fut
            try:
                self._out.write(ENGINE_CODEC.encode(msg))
                await self._out.drain()
            except (ConnectionError, OSError) as exc:
                self._pending.pop(msg.call_id, None)
                raise DaemonGoneError(f"connection to the daemon failed: {exc}") from exc
            return await fut
        except BaseException:
            if took is not None:
                self._book.auto_ids.discard(took)
            raise

    # ------------------------------------------------------------- the calls

    async def recv(
        self,
        request_id: str,
        pool_id: str,
        blocks: Sequence[int],
        peer: str | Sequence[str],
        num_tokens: int | None = None,
        beam_width: int = 1,
        *,
        block_start: int = 0,
        auto_release: bool = False,
    ) -> None:
        """Generation side: post a receive of `request_id` into `blocks`, from `peer`
        (a static peer name of the daemon's config, or the context daemon's HOST:PORT).

        A list of peers receives from several context daemons at once: the context ranks
        whose KV heads this pool holds, when the context instance has more tensor-parallel
        ranks than the generation instance (each writes its heads; the request is done when
        all have).

        `block_start` k: the first k blocks of the request are already here (a prefix
        cache) and must not be written; `blocks` are ours for the request's logical blocks
        [k, k + len(blocks)), and only those move. `num_tokens` still counts the whole
        request's tokens, from token 0.

        `auto_release`: as send's.
        """
        recv, took = self._recv_call(
            request_id, pool_id, blocks, peer, num_tokens, beam_width, block_start, auto_release
        )
        await self._call(recv, took)

    def _recv_call(
        self,
        request_id: str,
        pool_id: str,
        blocks: Sequence[int],
        peer: str | Sequence[str],
        num_tokens: int | None,
        beam_width: int,
        block_start: int,
        auto_release: bool,
    ) -> tuple[Recv, IdKey | None]:
        """recv's message, its id taken (returned when auto-released, to give back if the
        call fails)."""
        single = isinstance(peer, str)
        # A release of an earlier request of this id (from this context peer) is not its.
        # (No peer at all is the daemon's to refuse, with bad_request.)
        first = peer if isinstance(peer, str) else next(iter(peer), "")
        key = (request_id, "recv", first)
        recv = Recv(  # first: a bad block id raises before the id is taken
            next(self._ids),
            request_id=request_id,
            pool_id=pool_id,
            blocks=[int(b) for b in blocks],
            peer=peer if isinstance(peer, str) else "",
            num_tokens=num_tokens,
            beam_width=beam_width,
            peers=[] if single else list(peer),
            block_start=block_start,
            auto_release=auto_release,
        )
        self._book.take_id(key, auto_release, f"request {request_id!r} from {first!r}")
        self._book.new_receive(request_id, first)
        return recv, key if auto_release else None

    async def send(
        self,
        request_id: str,
        pool_id: str,
        blocks: Sequence[int],
        token_end: int,
        token_start: int = 0,
        last: bool = True,
        beam_width: int = 1,
        peer: str | None = None,
        *,
        auto_release: bool = False,
    ) -> None:
        """Context side: the KV of tokens [token_start, token_end) is ready. `blocks`
        are all blocks of the request up to token_end; `last` marks the final chunk
        (with pipelined transfer each chunk's complete blocks move right away).

        `peer`: the generation daemon this request is for, by the name it announces
        (its `daemon.name`); the daemon then serves only that daemon's receive and
        refuses any other's (`not_your_request`). None: whoever asks first (the first
        chunk's value counts; a later chunk may repeat it or leave it out).

        `auto_release`: the daemon forgets the request as it sends its outcome (as a
        release right after it would; with `blocks_held`, once the blocks are back), and
        the outcome says `auto_released`. `release` then makes no call: it only drops the
        outcome kept here (so does `forget`). The id stays taken until then, as without
        the option: this client refuses a second request under it (`duplicate_request`).
        A daemon older than this option ignores it, and release asks it as before. The
        first chunk's value counts."""
        send, took = self._send_call(
            request_id, pool_id, blocks, token_end, token_start, last, beam_width, peer,
            auto_release,
        )  # fmt: skip
        await self._call(send, took)

    def _send_call(
        self,
        request_id: str,
        pool_id: str,
        blocks: Sequence[int],
        token_end: int,
        token_start: int,
        last: bool,
        beam_width: int,
        peer: str | None,
        auto_release: bool,
    ) -> tuple[Send, IdKey | None]:
        """send's message, its id taken by a first chunk (returned when auto-released, to
        give back if the call fails)."""
        key = (request_id, "send", "")
        send = Send(  # first: a bad block id raises before the id is taken
            next(self._ids),
            request_id=request_id,
            pool_id=pool_id,
            blocks=[int(b) for b in blocks],
            token_start=token_start,
            token_end=token_end,
            last=last,
            beam_width=beam_width,
            peer=peer or "",
            auto_release=auto_release,
        )
        if token_start == 0:  # a later chunk continues the request that took the id
            self._book.take_id(key, auto_release, f"request {request_id!r}")
        return send, key if auto_release and token_start == 0 else None

    # ------------------------------------------------- started, not waited for

    def start_recv(
        self,
        request_id: str,
        pool_id: str,
        blocks: Sequence[int],
        peer: str | Sequence[str],
        num_tokens: int | None = None,
        beam_width: int = 1,
        *,
        block_start: int = 0,
        auto_release: bool = False,
        timeout_s: float | None = None,
    ) -> asyncio.Future[Outcome]:
        """recv, and the future of the request's outcome (what `wait(request_id)` returns),
        without waiting for the daemon's reply: the call is written and the future returned
        at once. The reply only matters when it is a refusal: the future then fails with
        the CallError recv would raise (and the id is given back). The connection's end
        fails it with DaemonGoneError, and `timeout_s` (None: none) with TimeoutError. Not
        connected, or a bad argument: raises at once, as recv does.

        For engines that keep many requests going on one loop: one coroutine step a
        request instead of the call's and the wait's (kvxferd bench's engines use it;
        docs/benchmarks.md, issue 16). A context engine told of the request at once may
        send before this daemon has the receive: its daemon's send waits for the
        receiver's request, as it always does."""
        recv, took = self._recv_call(
            request_id, pool_id, blocks, peer, num_tokens, beam_width, block_start, auto_release
        )
        return self._start(recv, request_id, took, timeout_s)

    def start_send(
        self,
        request_id: str,
        pool_id: str,
        blocks: Sequence[int],
        token_end: int,
        token_start: int = 0,
        last: bool = True,
        beam_width: int = 1,
        peer: str | None = None,
        *,
        auto_release: bool = False,
        timeout_s: float | None = None,
    ) -> asyncio.Future[Outcome]:
        """send, and the future of the request's outcome, without waiting for the daemon's
        reply: as start_recv. A request has one outcome: every chunk's future (`last`
        False included) gets it, once the last chunk was sent and written."""
        send, took = self._send_call(
            request_id, pool_id, blocks, token_end, token_start, last, beam_width, peer,
            auto_release,
        )  # fmt: skip
        return self._start(send, request_id, took, timeout_s)

    def _start(
        self, msg: Recv | Send, request_id: str, took: IdKey | None, timeout_s: float | None
    ) -> asyncio.Future[Outcome]:
        """As _call, but returning the outcome's future: `took` is given back if the call
        does not go out."""
        try:
            self._check_connected()
            outcome = self._book.outcome_future(request_id, timeout_s)
            self._started.add(msg.call_id, request_id, outcome, took)
            try:
                self._out.write(ENGINE_CODEC.encode(msg))
            except (ConnectionError, OSError) as exc:
                self._started.forget(msg.call_id)
                self._book.drop_waiter(request_id, outcome)
                outcome.cancel()  # never handed out; its done callback stops its timer
                raise DaemonGoneError(f"connection to the daemon failed: {exc}") from exc
            return outcome
        except BaseException:
            if took is not None:
                self._book.auto_ids.discard(took)
            raise

    async def cancel(self, request_id: str, peer: str | None = None) -> str:
        """ "cancelled" (blocks are free), "busy" (a write is in flight: retry), or "finished".
        `peer`: a receive's context peer, as the recv named it (or that daemon's name);
        needed only when receives of this id from several context instances are known."""
        return await self._ask(Cancel, request_id=request_id, peer=peer or "")

    async def release(self, request_id: str, peer: str | None = None) -> None:
        """Forget a finished request, so that its id may be used again (a request whose
        blocks are held keeps its id until they are released). `peer`: as cancel's. A
        request the daemon auto-released (its outcome here says so) needs no call: its
        outcome is dropped here (`forget`)."""
        if self.forget(request_id, peer):
            return
        await self._ask(Release, request_id=request_id, peer=peer or "")
        self._book.released_by_daemon(request_id, peer)

    def flush(self) -> None:
        """Hand the calls written so far (start_recv / start_send) to the socket now, not at
        the loop's next turn."""
        self._out.flush()

    def forget(self, request_id: str, peer: str | None = None) -> bool:
        """Drop the outcome kept here of a request the daemon auto-released (sent or
        received with auto_release), without a call to the daemon; True if it did.
        False when no such outcome is here (not arrived yet, not auto-released, or
        receives of the id from several context peers and no `peer`): then release asks
        the daemon, which answers for it. `peer`: as release's. Not thread-safe: call it
        on the client's loop (the blocking Client's release does)."""
        return self._book.forget(request_id, peer)

    async def fence_writer(self, peer: str, incarnation: str = "") -> int:
        """An operator's word that context daemon `peer` (one `incarnation`, or every one)
        is gone for good: the holds waiting for it end, and each engine hears `released`
        (how "operator") for its blocks. Only for a writer whose host died and that will not
        come back where it was; a stopped process can still write. CallError
        `writer_alive` while the daemon is connected to it or its process (on this host)
        has not exited, `nothing_held` when no hold waits for it. Returns how many holds
        ended (`kvxferd fence` calls this)."""
        return int(await self._ask(FenceWriter, peer=peer, incarnation=incarnation))

    async def connection_state(self, connection: int) -> str:
        """Where the daemon is with its engine connection `connection` (an earlier
        connection's `connection_id`, to this same daemon process): "live", "closing" (a
        request it started or a pool it registered is still held: its memory may still be
        written or read) or "gone" (nothing it started can touch that memory any more).
        CallError bad_request for a number this daemon process never gave out."""
        return await self._ask(ConnectionState, connection=connection)

    async def query(self, request_id: str, peer: str | None = None) -> str:
        return await self._ask(Query, request_id=request_id, peer=peer or "")

    def poll(
        self, request_id: str, side: str | None = None, peer: str | None = None
    ) -> Outcome | None:
        """The outcome of `request_id` if it has arrived. `peer`: a receive's context
        peer as the recv named it; None: the only one (CallError `ambiguous_request` when
        receives of this id from several context peers have outcomes)."""
        return self._book.poll(request_id, side, peer)

    async def wait(
        self, request_id: str, timeout_s: float | None = None, peer: str | None = None
    ) -> Outcome:
        """The outcome of `request_id` (from `peer`, as poll's), waiting for it if needed;
        without a peer, the first to arrive."""
        got = self.poll(request_id, peer=peer)
        if got is not None:
            return got
        self._check_connected()
        return await self._book.wait_outcome(request_id, peer, timeout_s)

    def _check_connected(self) -> None:
        if self._reader_task is None or self._reader_task.done():
            raise DaemonGoneError(self._closed_reason or "not connected")

    def released(self, request_id: str, peer: str | None = None) -> Released | None:
        """The release of `request_id`'s held blocks (from `peer`, as poll's), if it has
        arrived."""
        return self._book.released(request_id, peer)

    @property
    def gone(self) -> str:
        """Why the connection to the daemon ended; "" while it is up."""
        if self._reader_task is None or not self._reader_task.done():
            return ""
        return self._closed_reason or "the connection to the daemon ended"

    async def wait_released(
        self, request_id: str, timeout_s: float | None = None, peer: str | None = None
    ) -> Released:
        """Wait until the blocks of a request whose outcome had `blocks_held` are back
        (its `released` event): only then may the engine reuse them. There is no timer
        behind it: it comes when the daemon proves no write can still land. Raises
        DaemonGoneError if the daemon goes away first (then never reuse those blocks), and
        CallError `not_held` at once for a request whose blocks were not reported held.
        `peer`: as poll's."""
        self._book.check_held(request_id, peer)
        got = self.released(request_id, peer)
        if got is not None:
            return got
        self._check_connected()
        return await self._book.wait_released(request_id, peer, timeout_s)

    async def close(self) -> None:
        self._out.close()
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)
