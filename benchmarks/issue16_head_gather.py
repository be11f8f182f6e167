"""Issue 16, TP 1->2: does a gather of both legs' head slices in one pass over the source
blocks beat two gathers, one per leg?

A 1->2 head-split's context daemon gathers, per leg, the 256-byte run of that leg's heads
out of every (block, layer, K/V, token) of the source blocks (HostCopier.gather_heads: one
np.take of 256-byte elements). The stop-37 notes guessed that reading the source once for
both legs would save much of that gather's cost. This measures it on one thread, at the
demo's geometry (256 KiB blocks: 8 layers, K and V, 32 tokens, 4 heads of 64 fp16 dims; a
leg takes 2 heads), for 256 scattered blocks (64 MiB) of a 1 GiB pool, the caches flushed
before each run by writing another 1 GiB:

  two passes     leg 0's take over all blocks, then leg 1's (what the daemon does);
  per block      both legs of one block, block after block (the source read once, from
                 cache for the second leg);
  chunks of K    both legs of K blocks at a time, as takes;
  whole blocks   a take of the whole blocks (what equal sizes would copy, if they copied);
  gather_heads x2  HostCopier.gather_heads per leg, one thread (the daemon until stop 46);
  gather_slices    HostCopier.gather_slices, one thread: both legs in one pass, a block run
                 at a time, each leg's heads copied as one 256-byte element per token row
                 (transceiver/head_gather.py; the daemon since stop 46).

"per block" above copies uint8 rows (numpy's strided loop, byte elements); gather_slices
copies the same bytes as whole 256-byte elements, which is where its gain comes from.

Reported: GB/s of source bytes (the best of 5 runs) and CPU s/GB.

    .venv/bin/python benchmarks/issue16_head_gather.py [--runs 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout
from kvxferd.transceiver.bounce import HostCopier

BLOCK = 256 << 10
RUN = 256  # one leg's heads of one token: 2 heads x 64 dims x 2 bytes
POOL_BLOCKS = 4096
BLOCKS = 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    pool = np.ones(POOL_BLOCKS * BLOCK, np.uint8)
    flush = np.ones(POOL_BLOCKS * BLOCK, np.uint8)
    blocks = np.random.default_rng(0).permutation(POOL_BLOCKS)[:BLOCKS]
    units = pool.view(f"V{RUN}")  # unit index: block * 2 * rows + row * 2 + leg
    rows = BLOCK // (2 * RUN)
    index = [
        (blocks[:, None] * (2 * rows) + np.arange(rows)[None, :] * 2 + leg).ravel()
        for leg in (0, 1)
    ]
    out = [np.ones(BLOCKS * rows * RUN, np.uint8) for _ in (0, 1)]
    out_units = [o.view(f"V{RUN}") for o in out]
    whole = np.ones(BLOCKS * BLOCK, np.uint8)

    def two_passes() -> None:
        for leg in (0, 1):
            np.take(units, index[leg], out=out_units[leg], mode="clip")

    def per_block() -> None:
        for i, b in enumerate(blocks):
            src = pool[b * BLOCK : (b + 1) * BLOCK].reshape(rows, 2, RUN)
            for leg in (0, 1):
                dst = out[leg][i * rows * RUN : (i + 1) * rows * RUN].reshape(rows, RUN)
                np.copyto(dst, src[:, leg, :])

    def chunks(k: int) -> Callable[[], None]:
        def run() -> None:
            for s in range(0, BLOCKS * rows, k * rows):
                part = slice(s, s + k * rows)
                for leg in (0, 1):
                    np.take(units, index[leg][part], out=out_units[leg][part], mode="clip")

        return run

    def whole_blocks() -> None:
        np.take(pool.view(f"V{BLOCK}"), blocks, out=whole.view(f"V{BLOCK}"), mode="clip")

    layout = KvLayout(8, 2, 4, 64, 32, "float16", BLOCK_MAJOR, POOL_BLOCKS)
    assert layout.block_bytes == BLOCK
    copier = HostCopier(threads=1)
    ids = blocks.tolist()

    def gather_heads_x2() -> None:
        for leg in (0, 1):
            copier.gather_heads(pool, layout, ids, (2 * leg, 2 * leg + 2), out[leg])

    def gather_slices() -> None:
        copier.gather_slices(pool, layout, ids, [((0, 2), out[0]), ((2, 4), out[1])])

    ways: dict[str, Callable[[], None]] = {
        "two passes": two_passes,
        "per block": per_block,
        "chunks of 4": chunks(4),
        "chunks of 16": chunks(16),
        "whole blocks": whole_blocks,
        "gather_heads x2": gather_heads_x2,
        "gather_slices": gather_slices,
    }
    nbytes = BLOCKS * BLOCK
    for name, way in ways.items():
        best = float("inf")
        for _ in range(args.runs):
            flush += 1  # out of the caches
            t0 = time.perf_counter()
            way()
            best = min(best, time.perf_counter() - t0)
        print(f"{name:15s}: {nbytes / best / 1e9:5.2f} GB/s, {best / nbytes * 1e9:.3f} s/GB")
    copier.close()


if __name__ == "__main__":
    main()
