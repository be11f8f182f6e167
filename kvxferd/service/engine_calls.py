"""The engine API's calls, routed by message type, and what an engine leaving does.

The API server decodes and answers; this module decides: which side (send or receive)
a call goes to, whether the engine may make it (role, draining, its own pools and
requests), and pool registration with every check a pool must pass. It reads the
daemon through DaemonView only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any

from kvxferd.api.messages import (
    ApiError,
    Cancel,
    DeregisterPool,
    EngineHello,
    EngineMessage,
    FenceWriter,
    Query,
    Recv,
    RegisterPool,
    Release,
    Send,
)
from kvxferd.api.server import EngineConnection
from kvxferd.discovery import PeerUnknownError
from kvxferd.errors import KvxferdError, RequestError
from kvxferd.memory import device
from kvxferd.memory.heads import tp_rank
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.compat import RECEIVING_ROLES, SENDING_ROLES
from kvxferd.service.logs import TEXT_LIMIT, shown
from kvxferd.service.operator_fence import fence_writer
from kvxferd.service.ops import TaskScope
from kvxferd.service.pools import LocalPool, PoolError
from kvxferd.service.view import DaemonView
from kvxferd.transceiver.holds import Hold
from kvxferd.transceiver.sender import Sender
from kvxferd.transceiver.sessions import RxSession, TxSession
from kvxferd.transceiver.state import Reason

log = logging.getLogger("kvxferd.daemon")

# A peer named by a send: a daemon name, as the handshake accepts one (1-128 characters).
_DAEMON_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
# cudaIpcMemHandle_t is 64 opaque bytes (CUDA_IPC_HANDLE_SIZE).
IPC_HANDLE_BYTES = 64
GPU_POOLS_DOC = "docs/engine-integration.md, 'GPU pools'"

Handler = Callable[[EngineConnection, Any], Awaitable[str]]


class EngineCalls:
    """The daemon's EngineHandler (kvxferd.api.server)."""

    def __init__(
        self, daemon: DaemonView, scope: TaskScope, announce: Callable[[], Awaitable[None]]
    ) -> None:
        self._d = daemon
        self._scope = scope
        self._announce = announce  # tell every peer our pools changed
        self._routes: dict[type, Handler] = {
            RegisterPool: self._register_pool,
            DeregisterPool: self._deregister_pool,
            Recv: self._recv,
            Send: self._send,
            Cancel: self._cancel,
            Release: self._release,
            Query: self._query,
            FenceWriter: self._fence_writer,
        }

    @property
    def daemon_name(self) -> str:
        return self._d.daemon_name

    @property
    def role(self) -> str:
        return self._d.role

    @property
    def tokens_per_block(self) -> int:
        return self._d.cfg.engine.kv_layout.tokens_per_block

    async def handle_call(self, engine: EngineConnection, msg: EngineMessage) -> str:
        if isinstance(msg, EngineHello):
            raise RequestError(ApiError.BAD_REQUEST, "hello was already exchanged")
        if self._d.draining and isinstance(msg, (Recv, Send, RegisterPool)):
            # A later chunk of a send this engine already started is not new work.
            tx = self._d.sender.sessions.get(msg.request_id) if isinstance(msg, Send) else None
            if tx is None or tx.engine is not engine:
                raise RequestError(ApiError.DRAINING, "the daemon is draining; no new work")
        route = self._routes.get(type(msg))
        if route is None:
            raise RequestError(ApiError.BAD_REQUEST, f"unsupported call {type(msg).__name__}")
        return await route(engine, msg)

    # ------------------------------------------------------------- requests

    async def _recv(self, engine: EngineConnection, msg: Recv) -> str:
        self._require_role(RECEIVING_ROLES, "recv")
        _check_request_id(msg.request_id)
        pool = self._usable_pool(engine, msg.pool_id)
        peers = self._recv_peers(msg)
        self._d.receiver.recv(
            engine,
            msg.request_id,
            pool,
            msg.blocks,
            peers,
            msg.num_tokens,
            msg.beam_width,
            msg.block_start,
            msg.auto_release,
        )
        return ""

    async def _send(self, engine: EngineConnection, msg: Send) -> str:
        self._require_role(SENDING_ROLES, "send")
        _check_request_id(msg.request_id)
        pool = self._usable_pool(engine, msg.pool_id)
        if msg.peer:
            _check_daemon_name(msg.peer)
        self._d.sender.send(
            engine,
            msg.request_id,
            pool,
            msg.blocks,
            msg.token_start,
            msg.token_end,
            msg.last,
            msg.beam_width,
            msg.peer,
            msg.auto_release,
        )
        return ""

    async def _cancel(self, engine: EngineConnection, msg: Cancel) -> str:
        rx = self._receive_of(engine, msg.request_id, msg.peer)
        if rx is not None:
            return await self._d.receiver.cancel(msg.request_id, rx.peer)
        return await self._send_of(engine, msg.request_id).cancel(msg.request_id)

    async def _release(self, engine: EngineConnection, msg: Release) -> str:
        rx = self._receive_of(engine, msg.request_id, msg.peer)
        if rx is not None:
            self._d.receiver.release(msg.request_id, rx.peer)
        else:
            self._send_of(engine, msg.request_id).release(msg.request_id)
        return ""

    async def _query(self, engine: EngineConnection, msg: Query) -> str:
        s: RxSession | TxSession | None = self._receive_of(engine, msg.request_id, msg.peer)
        if s is None:
            s = self._send_of(engine, msg.request_id).sessions[msg.request_id]
        return s.outcome.status if s.outcome else s.state.name.lower()

    async def _fence_writer(self, engine: EngineConnection, msg: FenceWriter) -> str:
        self._require_role(RECEIVING_ROLES, "fence_writer")
        _check_daemon_name(msg.peer)
        return fence_writer(msg, self._d.peers, self._d.receiver.holds)

    def _recv_peers(self, msg: Recv) -> list[str]:
        """The context daemons of a receive: `peer`, or the list `peers` (head-merge)."""
        if msg.peer and msg.peers:
            raise RequestError(ApiError.BAD_REQUEST, "give either peer or peers (a list), not both")
        peers = list(msg.peers) if msg.peers else [msg.peer] if msg.peer else []
        if not peers:
            raise RequestError(ApiError.BAD_REQUEST, "a receive needs a context peer")
        seen: dict[str, str] = {}
        manager = self._d.peers
        for peer in peers:
            try:
                address = manager.resolve_address(peer)
            except PeerUnknownError as exc:
                # Discovery does not know it (never registered, or its lease ended): fail
                # now, with why, rather than at a dial that cannot succeed.
                raise RequestError(ApiError.PEER_UNKNOWN, str(exc)) from exc
            except Exception as exc:
                raise RequestError(
                    ApiError.BAD_REQUEST,
                    f"peer {peer!r} is neither a static peer name "
                    f"({', '.join(manager.static_peers) or 'none configured'}) nor HOST:PORT",
                ) from exc
            if address in seen:
                raise RequestError(
                    ApiError.BAD_REQUEST,
                    f"peers {seen[address]!r} and {peer!r} name the same context daemon "
                    f"({address}); each context rank is named once",
                )
            seen[address] = peer
        return peers

    def _require_role(self, roles: tuple[str, ...], call: str) -> None:
        if self._d.role not in roles:
            raise RequestError(
                ApiError.WRONG_ROLE,
                f"{call} needs a daemon with role {' or '.join(roles)}; this one is {self._d.role}",
            )

    def _receive_of(self, engine: EngineConnection, request_id: str, peer: str) -> RxSession | None:
        """This engine's receive the call names (receives first, as always): by id and, when
        given, context peer. Without a peer, an id two receives share is refused
        (ambiguous_request, naming their peers)."""
        receiver = self._d.receiver
        mine = [s for s in receiver.sessions.of_id(request_id) if s.engine is engine]
        if not mine:
            return None
        if not peer and len(mine) == 1:
            return mine[0]
        s = receiver.find(request_id, peer)
        if s is not None and s.engine is engine:
            return s
        if peer and self._d.sender.sessions.get(request_id) is None:
            raise RequestError(
                ApiError.UNKNOWN_REQUEST,
                f"no receive of request {request_id!r} from {peer!r} of this engine (its "
                f"receives of that id are from {', '.join(repr(s.peer) for s in mine)})",
            )
        return None

    def _send_of(self, engine: EngineConnection, request_id: str) -> Sender:
        s = self._d.sender.sessions.get(request_id)
        if s is not None and s.engine is engine:
            return self._d.sender
        raise RequestError(ApiError.UNKNOWN_REQUEST, f"no request {request_id!r} of this engine")

    # ---------------------------------------------------------------- pools

    def _own_pool(self, engine: EngineConnection, pool_id: str) -> LocalPool:
        try:
            pool = self._d.pools.get(pool_id)
        except PoolError as exc:
            raise RequestError(exc.code, str(exc)) from exc
        if pool.owner is not engine:
            raise RequestError(ApiError.UNKNOWN_POOL, f"pool {pool_id!r} belongs to another engine")
        return pool

    def _usable_pool(self, engine: EngineConnection, pool_id: str) -> LocalPool:
        """_own_pool, refusing new work on a shm-name pool its engine shrank (SIGBUS ahead)."""
        pool = self._own_pool(engine, pool_id)
        try:
            pool.check_intact()
        except PoolError as exc:
            raise RequestError(exc.code, str(exc)) from exc
        return pool

    async def _deregister_pool(self, engine: EngineConnection, msg: DeregisterPool) -> str:
        pool = self._own_pool(engine, msg.pool_id)
        await _pool_call(self._d.pools.deregister(pool.pool_id))
        await self._announce()
        return ""

    async def _register_pool(self, engine: EngineConnection, msg: RegisterPool) -> str:
        _check_sharing(msg)
        if not msg.handoff:
            return await self._register_checked_pool(engine, msg, None)
        # Taken (used up) first, so that every refusal below still closes the fd.
        kind = "cuda_vmm" if msg.memory == "vram" else "memfd"
        fd = self._d.api.take_handoff(msg.handoff, engine, msg.pool_id, kind)
        try:
            return await self._register_checked_pool(engine, msg, fd)
        finally:
            os.close(fd)  # the daemon's mapping keeps the memory

    def _check_memory(self, msg: RegisterPool) -> None:
        """One memory kind per daemon (engine.kv_memory): a pool of the other kind is
        refused, and a GPU pool on a daemon without a usable device says why there is none."""
        d = self._d
        ours = d.settings.kv_memory
        if msg.memory == ours:
            return
        where = f"engine.kv_memory: {ours} in {d.cfg.source}"
        if msg.memory == "vram":
            found = device.probe()
            if not found.available:
                raise RequestError(
                    ApiError.DEVICE_UNAVAILABLE,
                    f"pool {msg.pool_id!r} is in GPU memory (vram), but this daemon has no "
                    f"usable CUDA device: {found.why}; run the daemon beside the GPU, with "
                    f"cupy installed and engine.kv_memory: vram ({GPU_POOLS_DOC})",
                )
            raise RequestError(
                ApiError.MEMORY_MISMATCH,
                f"pool {msg.pool_id!r} is in GPU memory (vram), but this daemon is "
                f"configured for host pools ({where}); set engine.kv_memory: vram and restart "
                f"it to serve GPU pools ({GPU_POOLS_DOC})",
            )
        raise RequestError(
            ApiError.MEMORY_MISMATCH,
            f"pool {msg.pool_id!r} is in host memory, but this daemon is configured for GPU "
            f"pools ({where}); a daemon serves one memory kind: register the pool in VRAM "
            f"(register_device_pool), or serve it from a daemon with engine.kv_memory: host",
        )

    async def _register_checked_pool(
        self, engine: EngineConnection, msg: RegisterPool, fd: int | None
    ) -> str:
        d = self._d
        self._check_memory(msg)
        try:
            layout = KvLayout.from_wire(msg.layout)
        except LayoutError as exc:
            raise RequestError(ApiError.BAD_REQUEST, f"pool {msg.pool_id!r}: {exc}") from exc
        if d.staged and not layout.named:
            raise RequestError(
                ApiError.BAD_REQUEST,
                f"pool {msg.pool_id!r} has the order {layout.major}: the staged (CPP) runtime "
                "packs (layer, kv) pieces, which only block-major and layer-major pools have; "
                "use the PYTHON runtime for this pool",
            )
        if layout.tokens_per_block != self.tokens_per_block:
            raise RequestError(
                ApiError.BAD_REQUEST,
                f"pool {msg.pool_id!r} has {layout.tokens_per_block} tokens per block, but "
                f"engine.kv_layout.tokens_per_block is {self.tokens_per_block} in "
                f"{d.cfg.source}",
            )
        try:
            # From tp_rank's cache: the very object a peer's equal rank is (compared by `is`).
            tp = tp_rank(msg.tp_rank, msg.tp_size)
        except LayoutError as exc:
            raise RequestError(ApiError.BAD_REQUEST, f"pool {msg.pool_id!r}: {exc}") from exc
        for other in d.pools.pools.values():
            # One daemon serves one engine rank: its peers map heads by the daemon's pools.
            if other.tp != tp:
                raise RequestError(
                    ApiError.BAD_REQUEST,
                    f"pool {msg.pool_id!r} declares {tp}, but pool {other.pool_id!r} of this "
                    f"daemon declares {other.tp}; a daemon serves one engine rank",
                )
        if tp.size != d.cfg.engine.tensor_parallel_size:
            log.warning(
                "pool %s declares %s, but engine.tensor_parallel_size is %d in %s; "
                "KV heads are mapped by the pool's declaration",
                shown(msg.pool_id, quote=False),
                tp,
                d.cfg.engine.tensor_parallel_size,
                d.cfg.source,
            )
        if msg.memory == "vram":
            await _pool_call(
                d.pools.register_device(
                    msg.pool_id,
                    msg.nbytes,
                    layout,
                    engine,
                    tp,
                    device_uuid=msg.device_uuid,
                    ipc_handle=msg.ipc_handle,
                    ipc_offset=msg.ipc_offset,
                    vmm_fd=fd,
                )
            )
        else:
            await _pool_call(
                d.pools.register(msg.pool_id, msg.shm_name, msg.nbytes, layout, engine, tp, fd)
            )
        await self._announce()
        return ""

    # ---------------------------------------------------------- engine gone

    async def engine_gone(self, engine: EngineConnection) -> None:
        d = self._d
        reason, message = Reason.ENGINE_DISCONNECTED, f"engine {engine.name!r} disconnected"
        # Set aside at once, under another id: ending the engine's requests can wait a
        # heartbeat interval for a peer's answer, and a restarted engine registers its pool
        # under the same id meanwhile. Each goes below, or once its holds are fenced.
        mine = [(p, p.pool_id) for p in d.pools.pools.values() if p.owner is engine]
        for pool, _ in mine:
            d.pools.set_aside(pool.pool_id)
        await asyncio.gather(
            d.sender.abort_engine(engine, reason, message),
            d.receiver.abort_engine(engine, reason, message),
        )
        engine.requests_ended = True
        try:
            for pool, own_id in mine:
                await self._drop_gone_engines_pool(pool, own_id, engine)
            if mine:
                await self._announce()
        finally:
            self._settle_if_let_go(engine)

    async def _drop_gone_engines_pool(
        self, pool: LocalPool, own_id: str, engine: EngineConnection
    ) -> None:
        d = self._d
        if d.pools.pools.get(pool.pool_id) is not pool:
            return  # its last user left during the aborts: dropped already
        if pool.users:
            # Held: a write may still land there. Our mapping keeps the memory valid
            # (a late write lands harmlessly).
            log.warning(
                "pool %s of the gone engine %r stays registered as %s until its %d "
                "hold(s) are fenced",
                shown(own_id, quote=False),
                engine.name,
                pool.pool_id,
                len(pool.users),
            )
            return
        try:
            await d.pools.deregister(pool.pool_id)
        except (PoolError, KvxferdError) as exc:
            log.error(
                "cannot deregister pool %s of the gone engine %r: %s",
                shown(own_id, quote=False),
                engine.name,
                shown(exc, TEXT_LIMIT, quote=False),
            )

    def _settle_if_let_go(self, engine: EngineConnection) -> None:
        """A closed engine none of whose pools is registered any more: its requests ended
        (engine_gone) and nothing can touch its memory (ConnectionState "gone")."""
        pools = self._d.pools
        if not any(p.owner is engine for p in (*pools.pools.values(), *pools.closing)):
            engine.settle()

    def hold_released(self, hold: Hold, how: str) -> None:
        """A held pool of a gone engine goes once its last hold is released."""
        if hold.pool is not None:
            self.pool_user_left(hold.pool)

    def pool_user_left(self, pool: LocalPool) -> None:
        """A pool's hold or drained write ended: a gone engine's pool goes once it has no
        user left."""
        if pool.users or self._d.draining:
            return
        owner = pool.owner
        # Ended, not merely closed: a connection whose write failed is still served the
        # calls already read, and its pools are its own until engine_gone.
        if not isinstance(owner, EngineConnection) or not owner.ended:
            return
        if self._d.pools.pools.get(pool.pool_id) is pool:
            self._scope.start(self._drop_orphan(pool, owner), f"drop-pool-{pool.pool_id}")

    async def _drop_orphan(self, pool: LocalPool, owner: EngineConnection) -> None:
        pool_id = pool.pool_id
        try:
            if self._d.pools.pools.get(pool_id) is not pool:
                return  # engine_gone dropped it meanwhile
            await self._d.pools.deregister(pool_id)
            await self._announce()
        except (PoolError, KvxferdError) as exc:
            log.error(
                "cannot deregister pool %s of a gone engine: %s",
                shown(pool_id, quote=False),
                shown(exc, TEXT_LIMIT, quote=False),
            )
        finally:
            self._settle_if_let_go(owner)


def _check_sharing(msg: RegisterPool) -> None:
    """How the pool is shared, per memory kind: exactly one way, and nothing of the other
    kind's (a message that mixes them is a client bug, refused before anything is opened)."""
    pool = f"pool {msg.pool_id!r}"
    if msg.memory not in device.POOL_MEMORY:
        raise RequestError(
            ApiError.BAD_REQUEST,
            f"{pool}: memory must be one of {', '.join(device.POOL_MEMORY)} "
            f"(got {shown(msg.memory, 40)})",
        )
    # Each kind's rules in order, as (broken, why): the first broken one refuses the call.
    rules: list[tuple[bool, str]]
    if msg.memory == "host":
        rules = [
            (
                bool(msg.ipc_handle or msg.device_uuid or msg.ipc_offset),
                f"{pool} is declared in host memory but carries a CUDA IPC handle, offset or "
                "device UUID; a GPU pool is registered with memory vram",
            ),
            (
                bool(msg.handoff) == bool(msg.shm_name),
                f"{pool}: give exactly one of handoff (a sealed memfd handed "
                "over first) and shm_name (a POSIX shm object)",
            ),
        ]
    else:
        rules = [
            (
                bool(msg.shm_name),
                f"{pool} is declared in GPU memory (vram) but names a shm object; a GPU pool is "
                "shared by a CUDA IPC handle (ipc_handle) or a CUDA VMM fd (handoff)",
            ),
            (
                bool(msg.handoff) == bool(msg.ipc_handle),
                f"{pool}: a GPU pool needs exactly one of ipc_handle (a CUDA IPC handle) and "
                "handoff (a CUDA VMM fd handed over first, kind cuda_vmm)",
            ),
            (
                bool(msg.ipc_handle) and len(msg.ipc_handle) != IPC_HANDLE_BYTES,
                f"{pool}: ipc_handle must be the {IPC_HANDLE_BYTES}-byte cudaIpcMemHandle_t "
                f"(got {len(msg.ipc_handle)} bytes)",
            ),
            (
                msg.ipc_offset < 0 or bool(msg.handoff and msg.ipc_offset),
                f"{pool}: ipc_offset {msg.ipc_offset} is invalid: it is the pool's non-negative "
                "offset in the allocation an IPC handle names (0 for a VMM fd)",
            ),
            (
                not msg.device_uuid,
                f"{pool}: a GPU pool names its device by UUID (device_uuid, as nvidia-smi -L "
                "prints it); ordinals differ between processes",
            ),
        ]
    for broken, why in rules:
        if broken:
            raise RequestError(ApiError.BAD_REQUEST, why)


def _check_daemon_name(peer: str) -> None:
    if not _DAEMON_NAME.fullmatch(peer):
        raise RequestError(
            ApiError.BAD_REQUEST,
            f"peer {shown(peer, 40)} is not a daemon name (1-128 letters, digits, '_', '.', '-')",
        )


def _check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > 256:
        raise RequestError(ApiError.BAD_REQUEST, "request_id must be 1 to 256 characters")


async def _pool_call(coro: Awaitable[object]) -> object:
    try:
        return await coro
    except PoolError as exc:
        raise RequestError(exc.code, str(exc)) from exc
