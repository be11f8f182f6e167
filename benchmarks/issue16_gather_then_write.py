"""Issue 16, TP 1->2 under the PYTHON runtime: does a split leg gathered and written in
chunks of a few MiB beat one gathered whole and then written?

A split's context daemon gathers a leg (the receiving rank's heads of every token of the
request's blocks) into its send region, then writes that region into the receiver's
blocks. The guess tested here: in chunks small enough for the cache, the write would read
the gathered bytes from the cache instead of from memory. One thread does both steps (the
gather as HostCopier does it, one np.take of 256-byte elements; the write as a memcpy of
each receiver block, standing in for the transport's copy), at the demo geometry (256 KiB
blocks: 8 layers, K and V, 32 tokens, 4 heads of 64 fp16 dims; a leg takes 2 heads) for
128 scattered blocks (a 32 MiB leg) of a 1 GiB pool, the caches flushed before each run by
writing another 1 GiB.

Reported: GB/s of leg bytes (the best of --runs, and their median) per chunk size.

    .venv/bin/python benchmarks/issue16_gather_then_write.py [--runs 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

BLOCK = 256 << 10
TOKEN_ROW = 512  # one token's 4 heads of one (layer, K/V) piece
RUN = 256  # one leg's heads of it
POOL_BLOCKS = 4096
BLOCKS = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pool = np.ones(POOL_BLOCKS * BLOCK, np.uint8)
    receiver = np.ones(POOL_BLOCKS * BLOCK // 2, np.uint8)
    flush = np.ones(1 << 30, np.uint8)
    src_blocks = rng.choice(POOL_BLOCKS, BLOCKS, replace=False)
    dst_blocks = rng.choice(POOL_BLOCKS // 2, BLOCKS, replace=False)
    per_block = BLOCK // TOKEN_ROW
    offsets = (src_blocks[:, None] * BLOCK + np.arange(per_block)[None, :] * TOKEN_ROW).ravel()
    unit = np.dtype(f"V{RUN}")
    pool_units = pool.view(unit)
    index = offsets // RUN
    packed = np.empty(BLOCKS * per_block * RUN, np.uint8)
    packed_units = packed.view(unit)
    dst_block = BLOCK // 2  # the receiver's block: its 2 heads of every token

    def write(lo: int, hi: int) -> None:
        for j in range(lo // dst_block, hi // dst_block):
            d = int(dst_blocks[j]) * dst_block
            receiver[d : d + dst_block] = packed[j * dst_block : (j + 1) * dst_block]

    def chunked(chunk_bytes: int) -> None:
        per = chunk_bytes // RUN
        for i in range(0, index.size, per):
            share = slice(i, min(index.size, i + per))
            np.take(pool_units, index[share], out=packed_units[share], mode="clip")
            write(i * RUN, share.stop * RUN)

    cases: list[tuple[str, Callable[[], None]]] = [
        ("whole leg", lambda: chunked(packed.size)),
        ("chunks of 1 MiB", lambda: chunked(1 << 20)),
        ("chunks of 2 MiB", lambda: chunked(2 << 20)),
        ("chunks of 4 MiB", lambda: chunked(4 << 20)),
        ("whole leg again", lambda: chunked(packed.size)),
    ]
    for name, run in cases:
        times = []
        for r in range(args.runs):
            flush[:] = r
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        best, median = min(times), sorted(times)[len(times) // 2]
        rate = packed.size / 1e9
        print(f"{name:<16}: {rate / best:5.2f} GB/s (median {rate / median:.2f})")


if __name__ == "__main__":
    main()
