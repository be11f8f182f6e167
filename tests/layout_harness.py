"""Small KV layouts for the memory and transceiver tests.

Imported as a top-level module (`from layout_harness import tiny_layout`): tests/ has
no __init__.py and holds the suite's conftest.py, so pytest puts it on sys.path.
"""

from __future__ import annotations

from typing import Any

from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout

# 2 layers, K and V, 1 head of 2 fp16, 2 tokens per block, 4 blocks: token 4 bytes,
# piece 8 bytes, block 32 bytes, pool 128 bytes.
TINY: dict[str, Any] = dict(
    num_layers=2,
    kv_factor=2,
    num_kv_heads=1,
    head_dim=2,
    tokens_per_block=2,
    dtype="float16",
    major=BLOCK_MAJOR,
    num_blocks=4,
)


def tiny_layout(**fields: Any) -> KvLayout:
    """TINY with `fields` in place of its own."""
    return KvLayout(**{**TINY, **fields})
