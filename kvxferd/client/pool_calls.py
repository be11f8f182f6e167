"""The pool calls of AsyncClient: sharing a KV pool with the daemon (a sealed memfd or a GPU
VMM allocation handed over by fd, a GPU pool by CUDA IPC handle, a shm object by name) and
dropping it; and host_pool, which makes a host pool to share.

Mixed into AsyncClient, which owns the connection: these calls make their requests with its
`_ask` and hand fds over a second connection to its `socket_path`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Concatenate, ParamSpec

from kvxferd.api.handoff import hand_off_fd
from kvxferd.api.messages import DeregisterPool, EngineCall, RegisterPool
from kvxferd.client.errors import CallError, DaemonGoneError
from kvxferd.errors import ProtocolError
from kvxferd.memory.device import DevicePool
from kvxferd.memory.hugepages import HugePagesMode
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.memfd import MemfdRegion

P = ParamSpec("P")


def host_pool(
    nbytes: int, name: str = "kvxferd-pool", huge_pages: HugePagesMode = "auto"
) -> MemfdRegion:
    """A host KV pool of `nbytes` to pass to register_pool: a sealed memfd, on huge pages
    where the host allows them (a hugetlb memfd where enough pages are free, else
    transparent huge pages on shared memory, else normal pages; "required" raises
    HugePagesError saying what the host lacks, "off" takes normal pages). `.pages` says what
    it got; the daemon's status shows it too. A huge-page pool is sized in whole huge pages."""
    return MemfdRegion.create(nbytes, name, huge_pages=huge_pages)


class PoolCalls:
    """AsyncClient's calls that share pools with the daemon (see the module's text)."""

    if TYPE_CHECKING:  # what AsyncClient provides
        socket_path: str
        _writer: asyncio.StreamWriter

        async def _ask(
            self, call: Callable[Concatenate[int, P], EngineCall], *args: P.args, **kw: P.kwargs
        ) -> str: ...

    async def register_pool(
        self,
        pool_id: str,
        pool: MemfdRegion | DevicePool | str,
        layout: KvLayout,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """Share a pool with the daemon, which maps and registers it.

        `pool`: a MemfdRegion (the safe way: its sealed memfd is handed over, see
        register_memfd_pool), a DevicePool (GPU memory, see register_device_pool), or the
        name of a POSIX shm object (legacy). A pool shared by
        name is not protected against its engine: shrinking the object (ftruncate) while the
        daemon maps it makes the daemon's next access to it die of SIGBUS (the daemon then
        refuses new requests on a pool it sees shrunk, but cannot stop an access already
        under way; systemd restarts it and every request in flight fails).

        With tensor parallelism, the pool of rank `tp_rank` of `tp_size` holds the KV heads
        [tp_rank * h, (tp_rank + 1) * h), h being `layout.num_kv_heads`.
        """
        if isinstance(pool, MemfdRegion):
            await self.register_memfd_pool(pool_id, pool.fd, layout, tp_rank, tp_size)
            return
        if isinstance(pool, DevicePool):
            await self.register_device_pool(pool_id, pool, layout, tp_rank, tp_size)
            return
        await self._register(pool_id, layout, tp_rank, tp_size, shm_name=pool)

    async def register_memfd_pool(
        self,
        pool_id: str,
        fd: int,
        layout: KvLayout,
        tp_rank: int = 0,
        tp_size: int = 1,
        timeout_s: float = 10.0,
    ) -> None:
        """Share a pool that is a memfd sealed against shrinking (F_SEAL_SHRINK; what
        kvxferd.memory.MemfdRegion.create makes) and holds at least `layout.pool_bytes`.

        The fd goes to the daemon over a second, short-lived connection (SCM_RIGHTS); the
        daemon checks its seals and answers a one-time token, which this connection's
        RegisterPool then names. `fd` stays open here: the engine keeps its own mapping.
        Raises CallError `unsealed_pool` for an fd that is not such a memfd.
        """
        token = await self._hand_off(pool_id, fd, layout, timeout_s, "memfd")
        await self._register(pool_id, layout, tp_rank, tp_size, handoff=token)

    async def register_device_pool(
        self,
        pool_id: str,
        pool: DevicePool,
        layout: KvLayout,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """Share a pool in GPU memory (kvxferd.memory.DevicePool) with a daemon configured
        with engine.kv_memory vram, beside the same GPU: by its VMM fd when it was created
        with vmm=True (register_vmm_pool), else by its CUDA IPC handle (register_ipc_pool).

        The engine must have finished writing (synchronised its stream) before each `send`
        of blocks of this pool: the daemon copies them on its own stream and cannot see the
        engine's. Needs CUDA here (the IPC handle is exported by the driver); without it,
        raises kvxferd.memory.DeviceUnavailableError saying why."""
        if pool.nbytes < layout.pool_bytes:
            raise ValueError(
                f"pool {pool_id!r}: the device pool holds {pool.nbytes} bytes, the layout "
                f"needs {layout.pool_bytes}"
            )
        if pool.fd >= 0:
            await self.register_vmm_pool(
                pool_id, pool.fd, layout, pool.device_uuid, tp_rank, tp_size
            )
            return
        handle, offset = pool.ipc()
        await self.register_ipc_pool(
            pool_id, handle, offset, layout, pool.device_uuid, tp_rank, tp_size
        )

    async def register_ipc_pool(
        self,
        pool_id: str,
        ipc_handle: bytes,
        ipc_offset: int,
        layout: KvLayout,
        device_uuid: str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """Share a GPU pool by the CUDA IPC handle of the allocation it lies in: the 64-byte
        cudaIpcMemHandle_t, the pool starting `ipc_offset` bytes into that allocation
        (allocators hand out sub-allocations; with torch, `storage._share_cuda_()` gives
        both), on the GPU `device_uuid` names (nvidia-smi -L's "GPU-..."; an ordinal would
        mean another device in the daemon if CUDA_VISIBLE_DEVICES differ). Needs nothing
        CUDA here: the daemon opens the handle, and refuses with CallError
        `device_unavailable` when it has no usable device."""
        await self._register(
            pool_id,
            layout,
            tp_rank,
            tp_size,
            memory="vram",
            device_uuid=device_uuid,
            ipc_handle=bytes(ipc_handle),
            ipc_offset=ipc_offset,
        )

    async def register_vmm_pool(
        self,
        pool_id: str,
        fd: int,
        layout: KvLayout,
        device_uuid: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        timeout_s: float = 10.0,
    ) -> None:
        """Share a GPU pool that is a CUDA VMM allocation exported as a POSIX fd
        (cuMemExportToShareableHandle; kvxferd.memory.vmm.create_exportable makes one), on
        the GPU `device_uuid` names. The fd goes over a second connection, as a memfd does
        (a PoolHandoff of kind cuda_vmm); the daemon imports and maps the allocation. `fd`
        stays open here."""
        token = await self._hand_off(pool_id, fd, layout, timeout_s, "cuda_vmm")
        await self._register(
            pool_id,
            layout,
            tp_rank,
            tp_size,
            memory="vram",
            device_uuid=device_uuid,
            handoff=token,
        )

    async def _hand_off(
        self, pool_id: str, fd: int, layout: KvLayout, timeout_s: float, kind: str
    ) -> str:
        """Hand `fd` to the daemon over a second connection; the one-time token it answers."""
        try:
            os.fstat(fd)
        except OSError as exc:
            raise ValueError(f"pool {pool_id!r}: fd {fd} is not an open file descriptor") from exc
        path = self.socket_path or str(self._writer.get_extra_info("peername") or "")
        try:
            reply = await asyncio.to_thread(
                hand_off_fd, path, fd, pool_id, layout.pool_bytes, timeout_s, kind
            )
        except (ProtocolError, OSError) as exc:
            raise DaemonGoneError(
                f"cannot hand pool {pool_id!r} to the daemon at {path}: {exc}"
            ) from exc
        if not reply.ok:
            raise CallError(reply.error, reply.message)
        return reply.result

    async def _register(
        self,
        pool_id: str,
        layout: KvLayout,
        tp_rank: int,
        tp_size: int,
        *,
        shm_name: str = "",
        handoff: str = "",
        memory: str = "host",
        device_uuid: str = "",
        ipc_handle: bytes = b"",
        ipc_offset: int = 0,
    ) -> None:
        """RegisterPool, of a shm object by name, of a handed-over fd by its token, or of a
        GPU pool by IPC handle."""
        await self._ask(
            RegisterPool,
            pool_id=pool_id,
            shm_name=shm_name,
            nbytes=layout.pool_bytes,
            layout=dict(layout.to_wire()),
            tp_rank=tp_rank,
            tp_size=tp_size,
            handoff=handoff,
            memory=memory,
            device_uuid=device_uuid,
            ipc_handle=ipc_handle,
            ipc_offset=ipc_offset,
        )

    async def deregister_pool(self, pool_id: str) -> None:
        await self._ask(DeregisterPool, pool_id=pool_id)
