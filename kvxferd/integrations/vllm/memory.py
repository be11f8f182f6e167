"""vLLM's KV cache in memory its daemon can map, described by its real layout.

vLLM (0.32) allocates a worker's whole KV cache as one backing tensor,
`torch.zeros(size, dtype=torch.int8, device=...)` inside `allocate_kv_cache`, and runs that
allocation inside the connector's `get_mem_pool_context()`. `kv_in_memfd` is that context:
the one int8 CPU allocation made inside it becomes a sealed memfd (kvxferd.memory.memfd),
viewed by torch without a copy, which the worker hands to its daemon over the engine socket.
The daemon then writes received KV straight into vLLM's blocks and reads sent KV straight
from them (zero-copy).

`describe_kv_caches` turns the per-layer views vLLM registers (`register_kv_caches`) into a
KvLayout, checking every assumption instead of trusting it: on the CPU backend a layer is
`[num_blocks, num_kv_heads, block_size, 2 * head_dim]` with C strides, read by the attention
kernel as `[num_kv_heads, 2 * block_size, head_dim]` per block (per KV head, its block_size K
rows, then its V rows), and the layers follow each other in the backing buffer. That is the
order `layer,block,head,kv,token`.

torch is imported inside the functions: kvxferd's own environment has none.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxferd.errors import KvxferdError
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.memfd import MemfdRegion

#: vLLM's CPU KV cache, outermost dimension first (head_dim innermost).
VLLM_CPU_ORDER = "layer,block,head,kv,token"

_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


class VllmLayoutError(KvxferdError):
    """vLLM's KV cache is not laid out as this connector knows how to describe."""


@dataclass
class KvBuffer:
    """The memfd holding one worker's KV cache (None until vLLM allocated it)."""

    region: MemfdRegion | None = None

    @property
    def base(self) -> int:
        if self.region is None:
            raise VllmLayoutError("vLLM allocated no KV cache inside the connector's context")
        return self.region.address


@contextlib.contextmanager
def kv_in_memfd(buffer: KvBuffer) -> Iterator[None]:
    """Make the KV backing allocation that vLLM runs inside this context a sealed memfd.

    Only the first one-dimensional int8 CPU `torch.zeros` inside is redirected (that is
    `allocate_kv_cache`'s buffer); anything else allocates as usual. A memfd starts zeroed,
    as torch.zeros would.
    """
    torch: Any = importlib.import_module("torch")  # typed loosely: no torch where mypy runs
    real = torch.zeros

    def zeros(*size: Any, **kw: Any) -> Any:
        shape = size[0] if len(size) == 1 and isinstance(size[0], tuple | list) else size
        device = kw.get("device")
        on_cpu = device is None or torch.device(device).type == "cpu"
        if buffer.region is None and kw.get("dtype") is torch.int8 and on_cpu and len(shape) == 1:
            region = MemfdRegion.create(int(shape[0]), name="vllm-kv-cache")
            buffer.region = region
            return torch.from_numpy(region.array.view(np.int8))
        return real(*size, **kw)

    torch.zeros = zeros
    try:
        yield
    finally:
        torch.zeros = real


def describe_kv_caches(kv_caches: Mapping[str, Any], base: int, nbytes: int) -> KvLayout:
    """The KvLayout of the per-layer KV views vLLM registered, all inside the buffer at
    `base` of `nbytes`; VllmLayoutError naming the layer and what differs otherwise.

    Layers are numbered by their place in the buffer, so both instances of a model number
    them alike whatever the order of the mapping.
    """
    if not kv_caches:
        raise VllmLayoutError("vLLM registered no KV cache layers")
    layers = sorted(kv_caches.items(), key=lambda item: int(item[1].data_ptr()))
    name, first = layers[0]
    if first.dim() != 4:
        raise VllmLayoutError(
            f"layer {name!r} has shape {tuple(first.shape)}; the CPU backend's "
            "[num_blocks, num_kv_heads, block_size, 2 * head_dim] was expected"
        )
    num_blocks, heads, tokens, twice_dim = (int(n) for n in first.shape)
    dtype = _DTYPES.get(str(first.dtype))
    if dtype is None or twice_dim % 2:
        raise VllmLayoutError(f"layer {name!r}: dtype {first.dtype}, last dimension {twice_dim}")
    itemsize = int(first.element_size())
    want_strides = (heads * tokens * twice_dim, tokens * twice_dim, twice_dim, 1)
    layer_bytes = num_blocks * heads * tokens * twice_dim * itemsize
    for i, (layer, view) in enumerate(layers):
        problems = []
        if tuple(view.shape) != tuple(first.shape) or view.dtype != first.dtype:
            problems.append(f"shape {tuple(view.shape)} {view.dtype}")
        if tuple(int(s) for s in view.stride()) != want_strides:
            problems.append(f"strides {tuple(view.stride())}, {want_strides} expected")
        offset = int(view.data_ptr()) - base
        if offset != i * layer_bytes:
            problems.append(f"at byte {offset} of the buffer, {i * layer_bytes} expected")
        if problems:
            raise VllmLayoutError(
                f"KV layer {layer!r} ({i} of {len(layers)}): " + "; ".join(problems)
            )
    layout = KvLayout(
        num_layers=len(layers),
        kv_factor=2,
        num_kv_heads=heads,
        head_dim=twice_dim // 2,
        tokens_per_block=tokens,
        dtype=dtype,
        major=VLLM_CPU_ORDER,
        num_blocks=num_blocks,
    )
    if layout.pool_bytes > nbytes:
        raise VllmLayoutError(
            f"the {len(layers)} KV layers need {layout.pool_bytes} bytes, the buffer has {nbytes}"
        )
    return layout
