"""vLLM's KV cache in a sealed memfd, and its layout as kvxferd describes it.

Runs in the vLLM environment (.venv-vllm, scripts/install-vllm.sh) in a subprocess: the
suite's own environment has no torch. The views are made the way vLLM 0.32's
allocate_kv_cache makes them on the CPU backend (one int8 buffer, per layer
[num_blocks, kv_heads, block_size, 2 * head_dim]); every byte of the layout kvxferd derives
is checked against what the attention kernel reads (per KV head, K rows then V rows).
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(),
    reason=f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm.sh to set it up",
)

SCRIPT = textwrap.dedent(
    """
    import fcntl, os
    import numpy as np
    import torch
    from kvxferd.integrations.vllm.memory import (
        KvBuffer, VllmLayoutError, describe_kv_caches, kv_in_memfd,
    )
    from kvxferd.memory.memfd import check_memfd

    L, NB, H, T, D = 3, 10, 2, 32, 32
    layer_elems = NB * H * T * 2 * D
    buf_holder = KvBuffer()
    with kv_in_memfd(buf_holder):
        other = torch.zeros(4, dtype=torch.float32)  # not the KV buffer: untouched
        buf = torch.zeros(L * layer_elems * 4, dtype=torch.int8, device="cpu")
    assert torch.zeros.__module__ == 'torch' or torch.zeros.__name__ == 'zeros'  # restored
    region = buf_holder.region
    assert region is not None and buf.data_ptr() == region.address
    check_memfd(region.fd, region.nbytes, "the KV buffer")  # sealed, as the daemon requires
    assert other.data_ptr() != region.address

    # As allocate_kv_cache: layer l of block b at l * layer_stride + b * block_stride.
    flat = buf.view(torch.float32)
    views = {
        f"model.layers.{l}.self_attn.attn": flat[l * layer_elems : (l + 1) * layer_elems].view(
            NB, H, T, 2 * D
        )
        for l in (2, 0, 1)  # registration order is not buffer order
    }
    layout = describe_kv_caches(views, region.address, region.nbytes)
    assert (layout.num_layers, layout.num_blocks, layout.num_kv_heads) == (L, NB, H)
    assert (layout.tokens_per_block, layout.head_dim, layout.dtype) == (T, D, "float32")
    assert layout.major == "layer,block,head,kv,token"

    torch.manual_seed(0)
    for v in views.values():
        v.copy_(torch.randn(v.shape))
    logical = layout.logical_view(region.array)  # (block, layer, kv, token, head, bytes)
    for l in range(L):
        v = views[f"model.layers.{l}.self_attn.attn"]
        for b in (0, 7):
            for h in range(H):
                rows = v[b, h].reshape(2 * T, D)  # the kernel's view: K rows, then V rows
                for kv in (0, 1):
                    want = rows[kv * T : (kv + 1) * T].numpy().view(np.uint8)
                    got = logical[b, l, kv, :, h, :]
                    assert np.array_equal(got, want), (l, b, h, kv)

    # A layout it does not know is refused, naming the layer.
    bad = dict(views)
    bad["model.layers.1.self_attn.attn"] = views["model.layers.1.self_attn.attn"].transpose(1, 2)
    try:
        describe_kv_caches(bad, region.address, region.nbytes)
    except VllmLayoutError as exc:
        assert "model.layers.1" in str(exc) and "strides" in str(exc), exc
    else:
        raise AssertionError("a transposed layer was accepted")
    print("ok")
    """
)


def test_kv_cache_in_a_sealed_memfd_with_its_real_layout() -> None:
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
