"""KV memory: pool layouts, block -> segment math, host pools (sealed memfds, or shared
memory by name)."""

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
