"""device_rows' kernel and DeviceCopier.on_loop on a real GPU, against numpy.

Skipped where no usable CUDA device is (every CI host): benchmarks/gpu_session.sh runs it on
the GPU machine. The host-side logic (what the kernel takes or declines, launch shapes, the
loop's waiting) is tested everywhere in test_device_paths.py with a stand-in.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from kvxferd.memory import device as device_mod
from kvxferd.transceiver.device_copy import DeviceCopier
from kvxferd.transceiver.device_rows import RowKernel

found = device_mod.probe()
pytestmark = pytest.mark.skipif(not found.available, reason=f"no usable CUDA device: {found.why}")


@pytest.fixture(scope="module")
def cp() -> Any:
    import cupy

    return cupy


# (rows in the pool, rows copied, bytes per row): whole 4 MiB blocks, layer pieces, rows
# that are not a multiple of the unrolled stride, and more rows than one grid holds.
SHAPES = [(300, 250, 4 << 20), (4000, 3000, 4096), (50, 37, 528), (80_000, 70_000, 512)]


@pytest.mark.parametrize(("pool_rows", "count", "unit"), SHAPES)
@pytest.mark.parametrize("into_pool", [False, True])
def test_the_row_kernel_copies_what_numpy_copies(
    cp: Any, pool_rows: int, count: int, unit: int, into_pool: bool
) -> None:
    rng = np.random.default_rng(pool_rows + count)
    index = rng.permutation(pool_rows)[:count].astype(np.int64)
    pool = rng.integers(0, 256, pool_rows * unit, dtype=np.uint8)
    packed = rng.integers(0, 256, count * unit, dtype=np.uint8)
    d_pool, d_packed = cp.asarray(pool), cp.asarray(packed)
    assert RowKernel(cp)(d_pool, d_packed, cp.asarray(index), unit, into_pool)
    cp.cuda.get_current_stream().synchronize()
    rows_of = pool.reshape(pool_rows, unit)
    if into_pool:
        rows_of[index] = packed.reshape(count, unit)
        assert np.array_equal(cp.asnumpy(d_pool), pool)
    else:
        assert np.array_equal(cp.asnumpy(d_packed), rows_of[index].ravel())
        assert np.array_equal(cp.asnumpy(d_pool), pool)  # a gather leaves the pool alone


def test_a_copy_on_the_loop_ends_with_the_bytes_in_place(cp: Any) -> None:
    from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout
    from kvxferd.transceiver.bounce import HostCopier

    layout = KvLayout(
        num_layers=32, kv_factor=2, num_kv_heads=8, head_dim=128, tokens_per_block=32,
        dtype="float16", major=BLOCK_MAJOR, num_blocks=64,
    )  # fmt: skip
    blocks = [int(b) for b in np.random.default_rng(3).permutation(64)[:40]]
    pool = np.random.default_rng(4).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    want = np.zeros(len(blocks) * layout.block_bytes, np.uint8)
    HostCopier(threads=1).gather(pool, layout, blocks, want)
    copier = DeviceCopier(0)
    copier.warm()
    d_pool, d_out = cp.asarray(pool), cp.zeros(want.size, dtype=cp.uint8)
    # As an engine does before `send`: the pool's bytes (and the zeroed output) are in place
    # before the copier, whose stream does not wait for the default one, reads them.
    cp.cuda.Device().synchronize()

    async def gather() -> None:
        await copier.on_loop(copier.gather, d_pool, layout, blocks, d_out)
        # No synchronise here: on_loop's return is the promise that the bytes are in place.
        assert np.array_equal(cp.asnumpy(d_out), want)

    asyncio.run(gather())
    copier.close()
