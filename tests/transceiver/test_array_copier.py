"""ArrayCopier with numpy as its array module (the host stand-in for cupy: same calls, same
plan) gives exactly HostCopier's bytes, runs every copy through its `run` hook once and
returns only after it, and refuses bad arguments with HostCopier's own messages. This
proves the device copier's interface and arithmetic, not that a GPU copies: only
scripts/gpu-check.sh on a GPU measures that."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_harness import Heads, copies, sliced_blocks, tiny_layout

from kvxferd.memory.heads import slice_block_bytes
from kvxferd.memory.layout import LAYER_MAJOR, KvLayout
from kvxferd.transceiver.bounce import ArrayCopier, HostCopier


def cases() -> st.SearchStrategy[tuple[KvLayout, list[int], Heads]]:
    return sliced_blocks(layers=4, heads=6, max_blocks=6)


@settings(max_examples=200, deadline=None)
@given(case=cases(), offset=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_array_copier_moves_exactly_host_copiers_bytes(
    case: tuple[KvLayout, list[int], Heads], offset: int, seed: int
) -> None:
    layout, blocks, heads = case
    count = layout.num_kv_heads if heads is None else heads[1] - heads[0]
    nbytes = len(blocks) * slice_block_bytes(layout, count)
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, layout.pool_bytes + 3, dtype=np.uint8)  # a pool may be longer
    host, array = HostCopier(1), ArrayCopier(np)
    try:
        # The packed buffer starts `offset` bytes into an allocation: reservations are
        # page-aligned, but nothing in the copier may depend on it.
        want = np.full(nbytes + 5, 0xEE, dtype=np.uint8)
        backing = np.full(offset + nbytes + 5, 0xEE, dtype=np.uint8)
        got = backing[offset:]
        host_gather, host_scatter = copies(host, heads)
        array_gather, array_scatter = copies(array, heads)
        host_gather(pool, layout, blocks, want)
        array_gather(pool, layout, blocks, got)
        assert np.array_equal(got, want)
        assert (backing[:offset] == 0xEE).all() and (got[nbytes:] == 0xEE).all()

        packed = rng.integers(0, 256, nbytes, dtype=np.uint8)
        into_host = rng.integers(0, 256, pool.size, dtype=np.uint8)
        into_array = into_host.copy()
        host_scatter(packed, into_host, layout, blocks)
        array_scatter(packed, into_array, layout, blocks)
        # The same bytes written, and every other byte (heads outside the slice, other
        # blocks, the pool's tail) left as it was.
        assert np.array_equal(into_array, into_host)
    finally:
        host.close()
        array.close()


def test_heads_outside_a_slice_are_untouched() -> None:
    layout = tiny_layout(num_kv_heads=5, head_dim=4, tokens_per_block=3)
    heads = (1, 3)
    blocks = [2, 0]
    pool = np.zeros(layout.pool_bytes, dtype=np.uint8)
    packed = np.full(len(blocks) * slice_block_bytes(layout, 2), 0xAB, dtype=np.uint8)
    ArrayCopier(np).scatter_heads(packed, pool, layout, blocks, heads)
    view = pool.reshape(layout.num_blocks, layout.pieces_per_block, 3, 5, 4 * 2)
    assert (view[blocks][:, :, :, 1:3] == 0xAB).all()
    untouched = np.ones(view.shape, dtype=bool)
    untouched[np.ix_(blocks, range(layout.pieces_per_block), range(3), [1, 2])] = False
    assert not view[untouched].any()


def test_each_copy_runs_once_through_the_hook_and_returns_after_it() -> None:
    events: list[str] = []

    def run(copy: Callable[[], None]) -> None:
        events.append("enter")
        copy()
        events.append("done")  # a device copier synchronises its stream here

    layout = tiny_layout(num_layers=1, num_kv_heads=2, major=LAYER_MAJOR, num_blocks=3)
    copier = ArrayCopier(np, run=run)
    pool = np.arange(layout.pool_bytes, dtype=np.uint8)
    out = np.zeros(2 * layout.block_bytes, dtype=np.uint8)
    half = np.zeros(2 * slice_block_bytes(layout, 1), dtype=np.uint8)
    calls: list[Callable[[], None]] = [
        lambda: copier.gather(pool, layout, [2, 0], out),
        lambda: copier.scatter(out, pool, layout, [1, 2]),
        lambda: copier.gather_heads(pool, layout, [0, 1], (1, 2), half),
        lambda: copier.scatter_heads(half, pool, layout, [2, 1], (0, 1)),
    ]
    for i, call in enumerate(calls):
        call()
        events.append(f"returned {i}")
    assert events == [e for i in range(4) for e in ("enter", "done", f"returned {i}")]


def test_bad_arguments_are_refused_with_host_copiers_messages() -> None:
    layout = tiny_layout(num_layers=1, head_dim=4)
    calls: list[Callable[[], None]] = []
    ran: list[int] = []
    array = ArrayCopier(np, run=lambda copy: ran.append(1))
    host = HostCopier(1)
    short_pool = np.zeros(layout.pool_bytes - 1, np.uint8)
    pool_2d = np.zeros((2, layout.pool_bytes), np.uint8)
    wrong_dtype = np.zeros(layout.pool_bytes, np.uint16)
    pool = np.zeros(layout.pool_bytes, np.uint8)
    short_packed = np.zeros(layout.block_bytes * 2 - 1, np.uint8)
    try:
        for c in (host, array):
            for bad in (short_pool, pool_2d, wrong_dtype):
                calls.append(
                    lambda c=c, bad=bad: c.gather(bad, layout, [0], np.zeros(99, np.uint8))
                )
            calls.append(lambda c=c: c.scatter(short_packed, pool, layout, [0, 1]))
            calls.append(lambda c=c: c.gather_heads(pool, layout, [0, 1], (0, 1), short_packed))
        messages = []
        for call in calls:
            with pytest.raises(ValueError) as caught:
                call()
            messages.append(str(caught.value))
        half = len(messages) // 2
        assert messages[:half] == messages[half:]  # HostCopier's, word for word
        assert messages[0].startswith("pool must be a 1-D uint8 array of at least")
        assert messages[-1] == f"the packed buffer holds {short_packed.size} bytes, 64 needed"
        assert ran == []  # refused before anything ran
    finally:
        host.close()


def test_a_split_gathers_each_leg_as_gather_heads_does_and_checks_every_leg_first() -> None:
    # The planned copiers' gather_slices (the device path): one gather_heads-like copy per
    # leg, none launched until every leg's buffer was found to hold its bytes.
    layout = tiny_layout(num_layers=2, num_kv_heads=4, head_dim=4, num_blocks=6)
    pool = np.random.default_rng(1).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    blocks = [4, 1, 5]
    leg = len(blocks) * slice_block_bytes(layout, 2)
    ran: list[int] = []
    array = ArrayCopier(np, run=lambda copy: (ran.append(1), copy()))
    outs = [np.zeros(leg, np.uint8), np.zeros(leg, np.uint8)]
    array.gather_slices(pool, layout, blocks, [((0, 2), outs[0]), ((2, 4), outs[1])])
    for heads, out in zip(((0, 2), (2, 4)), outs, strict=True):
        alone = np.zeros(leg, np.uint8)
        HostCopier(1).gather_heads(pool, layout, blocks, heads, alone)
        assert np.array_equal(out, alone)
    assert len(ran) == 2
    ran.clear()
    with pytest.raises(ValueError, match=f"holds {leg - 1} bytes, {leg} needed"):
        array.gather_slices(
            pool, layout, blocks, [((0, 2), outs[0]), ((2, 4), np.zeros(leg - 1, np.uint8))]
        )
    assert ran == []
