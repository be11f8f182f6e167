"""The data-plane adapter contract shared by every backend.

A backend is the only code that imports its transport library. Adapters are
synchronous and NOT thread-safe; the daemon drives each one from a single
worker thread (kvxferd.transceiver.dataplane) so that a slow library call never
blocks the event loop and the library never sees two calls at once.

An adapter whose library takes calls from any thread, one at a time, may say so with a
class attribute `inline_calls = True`: its cheap calls (small posts, polls, releases)
are then made on the event loop's thread when the worker is idle, under the same lock.
Without the attribute every call goes through the worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np
import numpy.typing as npt

# (N, 2) int64 arrays of absolute (address, length) pairs.
Segments = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Memory:
    """Where a registered range lives, as NIXL names it ("DRAM" or "VRAM").

    `device` is the CUDA ordinal in the registering process (0 and unused for DRAM): what
    NIXL's descriptors carry in their device column. A peer's memory arrives by name on the
    wire (PoolInfo.memory "host"/"vram" and .device); the mover turns it into one of these.
    """

    kind: str = "DRAM"  # "DRAM" | "VRAM"
    device: int = 0
    # Whether it is device memory: a field set once, not a property, because every write
    # asks it of both sides (a property is a Python call each time).
    on_device: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("DRAM", "VRAM"):
            raise ValueError(f"memory kind must be DRAM or VRAM, got {self.kind!r}")
        if self.device < 0:
            raise ValueError(f"a CUDA device ordinal is never negative, got {self.device}")
        object.__setattr__(self, "on_device", self.kind == "VRAM")


#: Host memory: what every pool and region was before device pools, and the default.
HOST = Memory()


def vram(device: int) -> Memory:
    """GPU memory on CUDA device `device` (the registering process's ordinal)."""
    return Memory("VRAM", device)


def host_only(backend: str, *memories: Memory) -> str | None:
    """Why a backend that moves host memory only refuses these memories, or None."""
    if any(m.on_device for m in memories):
        return f"backend {backend} moves host memory only; device pools need NIXL"
    return None


class XferStatus(IntEnum):
    """What a posted transfer is doing; translated from the library's own states."""

    IN_PROGRESS = 0
    DONE = 1
    ERROR = 2


@dataclass
class XferHandle:
    """A posted transfer. `native` is the library's handle; `released` is set once
    the library confirmed that no byte of this transfer can still move."""

    native: object
    peer_agent: str
    nbytes: int
    descriptors: int
    released: bool = False


class Backend(Protocol):
    name: str
    agent_name: str

    def register(self, address: int, nbytes: int, memory: Memory = HOST) -> object:
        """Register [address, +nbytes) of `memory` for one-sided writes; StartupError if
        the backend cannot (including a memory kind it does not move)."""
        ...

    def deregister(self, registration: object) -> None: ...

    def metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def remove_peer(self, agent_name: str) -> None: ...

    def connect(self, agent_name: str) -> None: ...

    def post_write(
        self,
        local: Segments,
        remote: Segments,
        agent_name: str,
        notif: bytes = b"",
        *,
        local_memory: Memory = HOST,
        remote_memory: Memory = HOST,
        remote_regions: Sequence[tuple[int, int]] = (),
    ) -> tuple[XferHandle, XferStatus]:
        """Post one WRITE of `local` (ours, in `local_memory`) into `remote` (the peer's, in
        `remote_memory` as the peer registered it); TransferError if it cannot be posted.
        `remote_regions`: the (address, nbytes) regions the peer announced, a hint a backend
        may use to prepare descriptors once per region, never to decide what is written."""
        ...

    def poll(self, handle: XferHandle) -> XferStatus: ...

    def release(self, handle: XferHandle) -> None: ...

    def close(self) -> None: ...
