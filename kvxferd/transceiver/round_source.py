"""What a staged round's write reads: a gather into the send region, or the pool itself.

The staged runtime packs each round into the receiver's reservation (staged.py). The
sender used to gather every round into its send region first, so that the round crossed
as one descriptor. Over NIXL (the one-sided backend where it measured faster) a round of
whole blocks whose runs in the pool are long is instead written straight out of the pool,
one descriptor per run, into the same packed slots: the receiver sees the same bytes in
the same place, and the sender saves a copy of every byte (a memcpy pass, on a host where
CPU is transfer time). A round of short runs (a head slice of a tensor-parallel leg, small
layer-major pieces) is still gathered: there the transport's cost per descriptor outweighs
the copy. Over Mooncake every round is gathered (POOL_ROUND_BACKENDS).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxferd.backends.base import Segments
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.bounce import Reservation
from kvxferd.transceiver.copyplan import Heads, copy_plan, whole_blocks

# Runs of the pool a round is written from must average at least this many bytes, and be
# at most POOL_ROUND_MAX_RUNS in number, for the round to skip its gather. Staged NIXL,
# 8000-token requests, against gathering (docs/benchmarks.md, "rounds written from the
# pool"): runs of 4 MiB moved ~8 % more, of 256 KiB ~28 % more, of 32 KiB (layer-major
# pieces of 16-token blocks) no more (2.74 against 2.82 GB/s, within the passes' spread).
POOL_ROUND_MIN_RUN_BYTES = 128 << 10
POOL_ROUND_MAX_RUNS = 1024
# The backends whose rounds skip the gather, by measurement (benchmarks/issue16_staged.py,
# docs/benchmarks.md "rounds written from the pool"): staged NIXL moved ~8 % more, with
# ~13 % less daemon CPU per GB. Staged Mooncake moved ~5 % less in 7 alternating passes: its
# TCP transport submits each run as a batch of its own, which costs more than the gather
# saves there.
POOL_ROUND_BACKENDS = frozenset({"NIXL"})


@dataclass(frozen=True)
class RoundSource:
    """Where a round's bytes are read from: `res`, the send reservation it was gathered
    into, or, with `res` None, `runs` of the (host) pool ((address, length), absolute, in
    packed order)."""

    res: Reservation | None
    runs: Segments | None = None


def pool_runs(
    pool: LocalPool, blocks: list[int], heads: Heads | None, backend: str
) -> Segments | None:
    """The pool's runs a round of `blocks` can be written from without a gather, or None
    when it should be gathered: a backend not in POOL_ROUND_BACKENDS, a head slice (runs
    of a token's heads), a pool the backend cannot read itself (copy-only device memory),
    a device pool (its staging is on the device already, and this path was never measured
    there), or runs too short."""
    if backend not in POOL_ROUND_BACKENDS:
        return None
    if not whole_blocks(pool.layout, heads):
        return None
    if not pool.zero_copy or pool.memory.on_device or not blocks:
        return None
    runs = copy_plan(pool.layout, blocks).segments()
    total = int(runs[:, 1].sum())
    if len(runs) > POOL_ROUND_MAX_RUNS or total < len(runs) * POOL_ROUND_MIN_RUN_BYTES:
        return None
    runs[:, 0] += pool.base
    return runs


def packed_targets(lengths: Segments, base: int) -> Segments:
    """(address, length) of the slots runs of `lengths` fill one after the other from
    `base`: a one-sided write pairs every local run with a remote one of its size."""
    out = np.empty((len(lengths), 2), dtype=np.int64)
    out[:, 1] = lengths
    out[0, 0] = base
    np.cumsum(lengths[:-1], out=out[1:, 0])
    out[1:, 0] += base
    return out
