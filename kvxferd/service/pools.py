"""Engine KV pools mapped into the daemon and registered with the backend."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from kvxferd.backends.base import HOST, Backend, Memory, vram
from kvxferd.errors import KvxferdError
from kvxferd.memory.device import DeviceRegion, DeviceUnavailableError, ordinal_of
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
    # The GPU a device pool is on, as the engine named it ("" for host pools): the one
    # name of a device that holds in every process (ordinals depend on CUDA_VISIBLE_DEVICES).
    device_uuid: str = ""

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
    """The daemon's pools. `cuda_device` and `device_zero_copy` (engine.cuda_device,
    daemon.device_zero_copy) matter to device pools only: a device pool must be on the
    daemon's staging device, and is registered with the backend only when zero-copy is on."""

    def __init__(
        self, dataplane: DataPlane, *, cuda_device: int = 0, device_zero_copy: bool = False
    ) -> None:
        self._dp = dataplane
        self.pools: dict[str, LocalPool] = {}
        # Taken out of `pools` and still being deregistered (deregister).
        self.closing: set[LocalPool] = set()
        self._set_aside = 0
        self.cuda_device = cuda_device
        self.device_zero_copy = device_zero_copy
        # Zero-copy registration failures are logged once (NIXL's text is the same for every
        # pool of a daemon); later pools just stay copy-only.
        self._zero_copy_warned = False

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
        self._check_new(pool_id, nbytes, layout)
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

    def _check_new(self, pool_id: str, nbytes: int, layout: KvLayout) -> None:
        if pool_id in self.pools:
            raise PoolError("pool_exists", f"pool {pool_id!r} is already registered")
        if nbytes < layout.pool_bytes:
            raise PoolError(
                "bad_request",
                f"pool {pool_id!r}: {nbytes} bytes cannot hold {layout.num_blocks} blocks of "
                f"{layout.block_bytes} bytes ({layout.pool_bytes} bytes needed)",
            )

    async def register_device(
        self,
        pool_id: str,
        nbytes: int,
        layout: KvLayout,
        owner: object,
        tp: TpRank | None = None,
        *,
        device_uuid: str,
        ipc_handle: bytes = b"",
        ipc_offset: int = 0,
        vmm_fd: int | None = None,
    ) -> LocalPool:
        """Open an engine's device pool: by CUDA IPC handle (the allocation's, the pool
        `ipc_offset` bytes into it) or, with `vmm_fd`, by importing its VMM allocation (the
        caller closes the fd; the mapping keeps the memory). The daemon copies to and from
        it on the device; it registers it with the backend only when device_zero_copy is on
        and the backend accepts it, else the pool is copy-only (LocalPool.zero_copy False)."""
        self._check_new(pool_id, nbytes, layout)
        try:
            ordinal = ordinal_of(device_uuid)
        except DeviceUnavailableError as exc:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise PoolError(
                "device_unavailable",
                f"pool {pool_id!r} is on GPU {device_uuid!r}, which this daemon cannot use: "
                f"{exc} (the daemon's CUDA_VISIBLE_DEVICES is "
                f"{visible if visible is not None else 'unset'})",
            ) from exc
        if ordinal != self.cuda_device:
            # The daemon's copies run on its staging device; a pool elsewhere would need
            # peer-to-peer copies for every byte (a daemon serves one engine rank anyway).
            raise PoolError(
                "memory_mismatch",
                f"pool {pool_id!r} is on GPU {device_uuid} (cuda:{ordinal} for this daemon), "
                f"but the daemon's device staging is on cuda:{self.cuda_device} "
                f"(engine.cuda_device); set engine.cuda_device: {ordinal}, or run one daemon "
                "per GPU",
            )
        sharing = "cuda_vmm" if vmm_fd is not None else "cuda_ipc"
        try:
            if vmm_fd is not None:
                region = DeviceRegion.import_vmm(vmm_fd, layout.pool_bytes, ordinal)
            else:
                region = DeviceRegion.open_ipc(ipc_handle, ipc_offset, layout.pool_bytes, ordinal)
        except DeviceUnavailableError as exc:
            raise PoolError("device_unavailable", f"pool {pool_id!r}: {exc}") from exc
        except KvxferdError as exc:
            how = "importing its VMM fd" if vmm_fd is not None else "opening its IPC handle"
            raise PoolError("registration_failed", f"pool {pool_id!r}: {how}: {exc}") from exc
        memory = vram(ordinal)
        registration = await self._zero_copy_registration(pool_id, region, layout, memory)
        pool = LocalPool(
            pool_id,
            layout,
            region,
            registration,
            owner,
            tp=tp or TpRank(),
            sharing=sharing,
            memory=memory,
            zero_copy=registration is not None,
            device_uuid=device_uuid,
        )
        self.pools[pool_id] = pool
        log.info(
            "registered pool %s: %d blocks x %d bytes (%s, %d KV heads, %s) in VRAM on cuda:%d "
            "(%s, %s)",
            shown(pool_id, quote=False),
            layout.num_blocks,
            layout.block_bytes,
            layout.major,
            layout.num_kv_heads,
            pool.tp,
            ordinal,
            "CUDA VMM fd" if vmm_fd is not None else f"CUDA IPC handle, offset {ipc_offset}",
            "zero-copy" if pool.zero_copy else "copy-only: through the device staging",
        )
        return pool

    async def _zero_copy_registration(
        self, pool_id: str, region: DeviceRegion, layout: KvLayout, memory: Memory
    ) -> object | None:
        """The backend's registration of a device pool, or None (copy-only): off unless
        device_zero_copy, and None when the backend refuses memory another process
        allocated (unproven with NIXL/UCX: ../shared/GPU.md)."""
        if not self.device_zero_copy:
            return None
        try:
            return await self._dp.call(
                self._dp.backend.register, region.address, layout.pool_bytes, memory
            )
        except KvxferdError as exc:
            if not self._zero_copy_warned:
                self._zero_copy_warned = True
                log.warning(
                    "daemon.device_zero_copy is on, but the backend cannot register pool %s "
                    "(%s); it and later such pools are copy-only, through the device staging",
                    shown(pool_id, quote=False),
                    shown(exc, quote=False),
                )
            return None

    async def deregister(self, pool_id: str) -> None:
        pool = self.get(pool_id)
        if pool.users:
            drained = sum(1 for user in pool.users if user.startswith("tx-drain:"))
            raise PoolError(
                "pool_busy",
                f"pool {pool_id!r} still has {len(pool.users)} active request(s)"
                + (
                    f", {drained} of them a drained write whose blocks are held until its "
                    "`released` event"
                    if drained
                    else ""
                )
                + "; wait for their outcomes (and releases) or cancel them first",
            )
        del self.pools[pool_id]
        self.closing.add(pool)  # until its memory is let go of (ConnectionState)
        try:
            if pool.zero_copy:  # a copy-only device pool was never registered with the backend
                await self._dp.call(self._dp.backend.deregister, pool.registration)
            pool.region.close()
        finally:
            self.closing.discard(pool)
        log.info("deregistered pool %s", shown(pool_id, quote=False))
