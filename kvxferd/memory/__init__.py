"""KV memory: pool layouts, block -> segment math, host pools (sealed memfds, or shared
memory by name), device pools (kvxferd.memory.device: cupy is imported only when used)."""

from kvxferd.memory.device import (
    DeviceError,
    DevicePool,
    DeviceProbe,
    DeviceRegion,
    DeviceUnavailableError,
)
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import (
    BLOCK_MAJOR,
    DTYPE_ITEMSIZE,
    LAYER_MAJOR,
    MAJORS,
    BlockIds,
    KvLayout,
    LayoutError,
    Segments,
    pair_segments,
)
from kvxferd.memory.memfd import HostRegion, MemfdError, MemfdRegion, UnsealedMemfdError
from kvxferd.memory.shm import (
    ShmError,
    ShmExistsError,
    ShmNotFoundError,
    ShmRegion,
    ShmTooSmallError,
)

__all__ = [
    "BLOCK_MAJOR",
    "DTYPE_ITEMSIZE",
    "LAYER_MAJOR",
    "MAJORS",
    "BlockIds",
    "DeviceError",
    "DevicePool",
    "DeviceProbe",
    "DeviceRegion",
    "DeviceUnavailableError",
    "HostRegion",
    "KvLayout",
    "LayoutError",
    "MemfdError",
    "MemfdRegion",
    "Segments",
    "ShmError",
    "ShmExistsError",
    "ShmNotFoundError",
    "ShmRegion",
    "ShmTooSmallError",
    "TpRank",
    "UnsealedMemfdError",
    "pair_segments",
]
