"""Engine KV pools mapped into the daemon and registered with the backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvxferd.backends.base import HOST, Backend, Memory
from kvxferd.errors import KvxferdError
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.memfd import HostRegion, MemfdRegion, UnsealedMemfdError
from kvxferd.memory.shm import ShmRegion
from kvxferd.peers.messages import PoolInfo
from kvxferd.service.logs import shown
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
    region: HostRegion
    registration: object
    owner: object  # the engine link that registered it
    users: set[str] = field(default_factory=set)  # active session keys holding blocks
    tp: TpRank = field(default_factory=TpRank)  # which heads of the model it holds
    # "memfd" (sealed, handed over) or "shm" (legacy, by name); device pools: "cuda_ipc"
    # (opened from an IPC handle) or "cuda_vmm" (an imported VMM allocation).
    sharing: str = "memfd"
    # Where the pool lives, in this daemon's terms (a device pool: VRAM on our ordinal).
    memory: Memory = HOST
    # Whether the backend can read and write the pool itself (it is registered). A device
    # pool the daemon opened but did not register is copy-only: every byte goes through
    # the bounce/staging regions, and peers learn it from PoolInfo.writable.
    zero_copy: bool = True

    @property
    def base(self) -> int:
        return self.region.address

    def check_intact(self) -> None:
        """Refuse new work on a shm-name pool its engine has shrunk.

        Touching the mapping past the object's new end would raise SIGBUS and kill the
        daemon. This check (one fstat) stops new requests on such a pool, but cannot stop a
        shrink racing an access already under way; only a sealed memfd rules that out.
        """
        if not isinstance(self.region, ShmRegion):
            return  # a sealed memfd cannot shrink
        size = self.region.size_now()
        if size is not None and size < self.layout.pool_bytes:
            raise PoolError(
                "pool_shrunk",
                f"pool {self.pool_id!r}: its shared memory object shrank to {size} bytes "
                f"({self.layout.pool_bytes} registered); the daemon takes no new request on it "
                "(touching it would crash the daemon with SIGBUS). Deregister it, and share "
                "pools as sealed memfds (docs/engine-integration.md)",
            )

    def info(self) -> PoolInfo:
        return PoolInfo(
            pool_id=self.pool_id,
            layout=dict(self.layout.to_wire()),
            base=self.base,
            nbytes=self.layout.pool_bytes,
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
            memory="vram" if self.memory.on_device else "host",
            device=self.memory.device,
            writable=self.zero_copy,
        )


class PoolRegistry:
    def __init__(self, dataplane: DataPlane) -> None:
        self._dp = dataplane
        self.pools: dict[str, LocalPool] = {}
        self._set_aside = 0

    def set_aside(self, pool_id: str) -> str:
        """Keep a pool registered under a new id (`ID@held-N`) so that its own id is free:
        its engine is gone, but a write may still land there until its holds are fenced,
        and the restarted engine registers its pool under the same id."""
        pool = self.pools.pop(pool_id)
        self._set_aside += 1
        pool.pool_id = f"{pool_id}@held-{self._set_aside}"
        self.pools[pool.pool_id] = pool
        return pool.pool_id

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
        fd: int | None = None,
    ) -> LocalPool:
        """Map and register a pool: the memfd `fd` (handed over; the caller closes it, the
        mapping keeps the memory) or, without it, the POSIX shm object `shm_name`."""
        if pool_id in self.pools:
            raise PoolError("pool_exists", f"pool {pool_id!r} is already registered")
        if nbytes < layout.pool_bytes:
            raise PoolError(
                "bad_request",
                f"pool {pool_id!r}: {nbytes} bytes cannot hold {layout.num_blocks} blocks of "
                f"{layout.block_bytes} bytes ({layout.pool_bytes} bytes needed)",
            )
        region: HostRegion
        try:
            if fd is not None:
                # Seals were checked at the handoff; this checks the size against the layout.
                region = MemfdRegion.attach(fd, layout.pool_bytes, f"pool {pool_id!r}")
            else:
                # The fd is kept so that check_intact can see a shrink (fstat).
                region = ShmRegion.attach(shm_name, layout.pool_bytes, keep_fd=True)
        except UnsealedMemfdError as exc:
            raise PoolError("unsealed_pool", str(exc)) from exc
        except KvxferdError as exc:
            msg = str(exc) if fd is not None else f"pool {pool_id!r}: {exc}"
            raise PoolError("registration_failed", msg) from exc
        backend: Backend = self._dp.backend
        try:
            registration = await self._dp.call(backend.register, region.address, layout.pool_bytes)
        except KvxferdError as exc:
            region.close()
            raise PoolError("registration_failed", f"pool {pool_id!r}: {exc}") from exc
        sharing = "memfd" if fd is not None else "shm"
        pool = LocalPool(
            pool_id, layout, region, registration, owner, tp=tp or TpRank(), sharing=sharing
        )
        self.pools[pool_id] = pool
        log.info(
            "registered pool %s: %d blocks x %d bytes (%s, %s, %d KV heads, %s)",
            shown(pool_id, quote=False),
            layout.num_blocks,
            layout.block_bytes,
            layout.major,
            "sealed memfd" if fd is not None else f"shm {shown(shm_name)}",
            layout.num_kv_heads,
            pool.tp,
        )
        if fd is None:
            log.warning(
                "pool %s is shared by shm name: if its engine shrinks the object, this daemon "
                "dies of SIGBUS at its next access to it; hand pools over as sealed memfds "
                "(docs/engine-integration.md, 'Handing a pool to the daemon')",
                shown(pool_id, quote=False),
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
        log.info("deregistered pool %s", shown(pool_id, quote=False))
