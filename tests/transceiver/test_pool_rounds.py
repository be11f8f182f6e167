"""A one-sided staged round of long pool runs is written straight out of the pool, packed
into the same slots of the receiver's reservation as a gathered round
(transceiver/round_source.py); every other round is still gathered."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from layout_harness import tiny_layout
from mover_harness import RecordingBackend, acking, peer_conn, pool, tx_session, writes_over

from kvxferd.backends.base import vram
from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout
from kvxferd.peers.messages import Result
from kvxferd.transceiver import round_source
from kvxferd.transceiver import staging as staging_mod
from kvxferd.transceiver.bounce import BounceBuffers, HostCopier
from kvxferd.transceiver.round_source import RoundSource, packed_targets, pool_runs
from kvxferd.transceiver.staged import StagedMover


def _layout(major: str = BLOCK_MAJOR) -> KvLayout:
    # 4 KiB blocks: a reservation takes whole pages (bounce.RESERVATION_ALIGN).
    return tiny_layout(num_kv_heads=2, head_dim=64, tokens_per_block=4, major=major, num_blocks=8)


@pytest.fixture
def short_runs_suffice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of one 4 KiB block are long enough to skip the gather."""
    monkeypatch.setattr(round_source, "POOL_ROUND_MIN_RUN_BYTES", 4096)


def _src(layout: KvLayout, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, layout.pool_bytes, dtype=np.uint8)


# ------------------------------------------------------------------ which rounds


def test_long_runs_of_whole_blocks_are_named_in_packed_order_and_coalesced(
    short_runs_suffice: None,
) -> None:
    layout = _layout()
    src = _src(layout)
    p = pool(layout, src)
    runs = pool_runs(p, [5, 6, 2, 7], None, "NIXL")
    assert runs is not None
    size = layout.block_bytes
    base = int(src.ctypes.data)
    assert runs.tolist() == [
        [base + 5 * size, 2 * size],
        [base + 2 * size, size],
        [base + 7 * size, size],
    ]
    # Every head of the pool is the whole block too.
    same = pool_runs(p, [5, 6, 2, 7], (0, layout.num_kv_heads), "NIXL")
    assert same is not None and np.array_equal(same, runs)


def test_layer_major_runs_are_its_pieces(
    short_runs_suffice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = _layout(LAYER_MAJOR)
    p = pool(layout, _src(layout))
    monkeypatch.setattr(round_source, "POOL_ROUND_MIN_RUN_BYTES", layout.piece_bytes)
    runs = pool_runs(p, [3], None, "NIXL")
    assert runs is not None and len(runs) == layout.block_bytes // layout.piece_bytes
    assert set(runs[:, 1].tolist()) == {layout.piece_bytes}


@pytest.mark.parametrize(
    "why",
    [
        "a head slice",
        "runs too short",
        "too many runs",
        "copy-only device pool",
        "device pool",
        "Mooncake",
    ],
)
def test_other_rounds_are_gathered(
    why: str, short_runs_suffice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = _layout()
    src = _src(layout)
    p = pool(layout, src)
    heads: tuple[int, int] | None = None
    blocks = [1, 3, 5]
    assert pool_runs(p, blocks, None, "NIXL") is not None  # the same round, as it is
    if why == "a head slice":
        heads = (0, 1)
    elif why == "runs too short":
        monkeypatch.setattr(round_source, "POOL_ROUND_MIN_RUN_BYTES", layout.block_bytes + 1)
    elif why == "too many runs":
        monkeypatch.setattr(round_source, "POOL_ROUND_MAX_RUNS", 2)
    elif why == "copy-only device pool":
        p = pool(layout, src, memory=vram(0), zero_copy=False)
    elif why == "device pool":
        p = pool(layout, src, memory=vram(0), zero_copy=True)
    backend = "MOONCAKE" if why == "Mooncake" else "NIXL"
    assert pool_runs(p, blocks, heads, backend) is None


def test_packed_targets_fill_the_slot_run_after_run() -> None:
    lengths = np.array([8192, 4096, 4096], dtype=np.int64)
    assert packed_targets(lengths, 1000).tolist() == [[1000, 8192], [9192, 4096], [13288, 4096]]
    one = packed_targets(np.array([5], dtype=np.int64), 7)
    assert one.tolist() == [[7, 5]]


def test_two_sided_rounds_are_always_gathered(short_runs_suffice: None) -> None:
    """A send takes one buffer: a round for UCX or MPI is gathered even when its runs are
    long (the crossing asserts it)."""
    layout = _layout()
    src = _src(layout)
    staging = BounceBuffers(8 * layout.block_bytes, HostCopier(threads=1))
    conn = peer_conn(layout, np.zeros_like(src), bounce=np.zeros(4 * layout.block_bytes, np.uint8))
    s = tx_session(pool(layout, src), conn, [5, 6], [5, 6], bounce_offset=0, bounce_nbytes=0)

    async def go() -> RoundSource | None:
        async with writes_over(RecordingBackend()) as writes:
            mover = StagedMover(writes, staging, False, lambda *a: None)
            mover.crossing.transport = object()  # type: ignore[assignment]
            got = await mover._gather_ahead(s, None, layout.block_bytes, (0, 2, 0), 1e18)
            assert got is not None
            staging.send.release(got.res)  # type: ignore[arg-type]
            return got

    try:
        got = asyncio.run(go())
        assert got is not None and got.res is not None
        assert staging.gathers == 1 and staging.pool_rounds == 0
    finally:
        staging.close()


# ------------------------------------------------------------------ a leg moved


@pytest.mark.parametrize("major", [BLOCK_MAJOR, LAYER_MAJOR])
def test_a_leg_of_long_runs_lands_as_a_gathered_one_would(
    major: str, short_runs_suffice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds of two blocks through a reservation of four: every write reads the pool
    (nothing is gathered, no send reservation is made), lands in the packed slots, and the
    Results say the same rounds as a gathered leg's."""
    layout = _layout(major)
    monkeypatch.setattr(round_source, "POOL_ROUND_MIN_RUN_BYTES", layout.piece_bytes)
    monkeypatch.setattr(staging_mod, "ROUND_BYTES", 2 * layout.block_bytes)
    monkeypatch.setattr(staging_mod, "ONE_SIDED_ROUND_MAX_BYTES", 2 * layout.block_bytes)
    src = _src(layout, 3)
    blocks = [6, 7, 2, 0]
    backend = RecordingBackend()
    staging = BounceBuffers(8 * layout.block_bytes, HostCopier(threads=1))
    ring = np.zeros(4 * layout.block_bytes, np.uint8)
    conn = peer_conn(layout, np.zeros_like(src), bounce=ring)
    conn.info.round_offsets = True
    s = tx_session(
        pool(layout, src), conn, blocks, blocks, bounce_offset=0, bounce_nbytes=ring.nbytes
    )
    acking(conn, s)
    sent: list[tuple[int, int]] = []
    post = backend.post_write

    def recording(local: Any, remote: Any, agent: str, notif: bytes = b"", **kinds: Any) -> Any:
        lo, hi = int(src.ctypes.data), int(src.ctypes.data) + src.nbytes
        assert all(lo <= a and a + n <= hi for a, n in local.tolist())  # read from the pool
        sent.append((int(remote[0, 0]), int(remote[:, 1].sum())))
        return post(local, remote, agent, notif, **kinds)

    backend.post_write = recording  # type: ignore[method-assign]

    async def go() -> None:
        async with writes_over(backend) as writes:
            mover = StagedMover(writes, staging, False, lambda *a: None)
            await mover.write_slice(s, 0, len(blocks), True)

    try:
        asyncio.run(go())
        assert s.terminal is None and not s.xfers and s.posting == 0
        assert staging.gathers == 0 and staging.pool_rounds == 2
        assert staging.send.reservations == 0 and staging.send.in_use_bytes == 0
    finally:
        staging.close()
    base, size = int(ring.ctypes.data), layout.block_bytes
    assert sent == [(base, 2 * size), (base + 2 * size, 2 * size)]
    results = [m for m in conn.sent if isinstance(m, Result)]
    assert [(r.first_block, r.end_block) for r in results] == [(0, 2), (2, 4)]
    want = np.zeros_like(ring)
    copier = HostCopier(threads=1)
    copier.gather(src, layout, blocks, want)
    copier.close()
    assert np.array_equal(ring, want)
