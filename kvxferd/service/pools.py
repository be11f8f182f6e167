"""Engine KV pools mapped into the daemon and registered with the backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvxferd.backends.base import Backend
from kvxferd.errors import KvxferdError
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.shm import ShmRegion
from kvxferd.peers.messages import PoolInfo
from kvxferd.transceiver.dataplane import DataPlane

log = logging.getLogger("kvxferd.pools")


class PoolError(KvxferdError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class LocalPool:
    pool_id: str
    layout: KvLayout
    region: ShmRegion
    registration: object
    owner: object  # the engine link that registered it
    users: set[str] = field(default_factory=set)  # active session keys holding blocks
    tp: TpRank = field(default_factory=TpRank)  # which heads of the model it holds

    @property
    def base(self) -> int:
        return self.region.address

    def info(self) -> PoolInfo:
        return PoolInfo(
            pool_id=self.pool_id,
            layout=dict(self.layout.to_wire()),
            base=self.base,
            nbytes=self.layout.pool_bytes,
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
        )


class PoolRegistry:
    def __init__(self, dataplane: DataPlane) -> None:
        self._dp = dataplane
        self.pools: dict[str, LocalPool] = {}

    def get(self, pool_id: str) -> LocalPool:
        pool = self.pools.get(pool_id)
        if pool is None:
            known = ", ".join(sorted(self.pools)) or "none"
            raise PoolError("unknown_pool", f"pool {pool_id!r} is not registered (known: {known})")
        return pool

    def infos(self) -> list[PoolInfo]:
        return [p.info() for p in self.pools.values()]

    async def register(
        self,
        pool_id: str,
        shm_name: str,
        nbytes: int,
        layout: KvLayout,
        owner: object,
        tp: TpRank | None = None,
    ) -> LocalPool:
        if pool_id in self.pools:
            raise PoolError("pool_exists", f"pool {pool_id!r} is already registered")
        if nbytes < layout.pool_bytes:
            raise PoolError(
                "bad_request",
                f"pool {pool_id!r}: {nbytes} bytes cannot hold {layout.num_blocks} blocks of "
                f"{layout.block_bytes} bytes ({layout.pool_bytes} bytes needed)",
            )
        try:
            region = ShmRegion.attach(shm_name, layout.pool_bytes)
        except KvxferdError as exc:
            raise PoolError("registration_failed", f"pool {pool_id!r}: {exc}") from exc
        backend: Backend = self._dp.backend
        try:
            registration = await self._dp.call(backend.register, region.address, layout.pool_bytes)
        except KvxferdError as exc:
            region.close()
            raise PoolError("registration_failed", f"pool {pool_id!r}: {exc}") from exc
        pool = LocalPool(pool_id, layout, region, registration, owner, tp=tp or TpRank())
        self.pools[pool_id] = pool
        log.info(
            "registered pool %s: %d blocks x %d bytes (%s, shm %s, %d KV heads, %s)",
            pool_id,
            layout.num_blocks,
            layout.block_bytes,
            layout.major,
            shm_name,
            layout.num_kv_heads,
            pool.tp,
        )
        return pool

    async def deregister(self, pool_id: str) -> None:
        pool = self.get(pool_id)
        if pool.users:
            raise PoolError(
                "pool_busy",
                f"pool {pool_id!r} still has {len(pool.users)} active request(s); "
                "wait for their outcomes or cancel them first",
            )
        del self.pools[pool_id]
        await self._dp.call(self._dp.backend.deregister, pool.registration)
        pool.region.close()
        log.info("deregistered pool %s", pool_id)
