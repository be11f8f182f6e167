"""KV memory: pool layouts, block -> segment math, host pools in shared memory."""

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
    "KvLayout",
    "LayoutError",
    "Segments",
    "ShmError",
    "ShmExistsError",
    "ShmNotFoundError",
    "ShmRegion",
    "ShmTooSmallError",
    "TpRank",
    "pair_segments",
]
