"""The device data path as far as a host without a GPU can check it honestly.

* DeviceCopier refuses to exist without a usable device, saying why (the probe's reason).
* With a host stand-in for cupy (numpy arrays, and a `cuda` namespace that records
  devices, streams and synchronisations) it gives HostCopier's bytes, runs each copy under
  its device and its own stream made in the copy thread, and returns only after the
  stream synchronised: so a scatter's return (and the receive's `done`) means the bytes
  are in place.
* BounceBuffers on a backing (the device staging's shape) report and carry their memory.
* The movers pass memory kinds on every post, write a copy-only pool only through the
  bounce buffer, refuse clearly when it cannot, and a receiver always reserves for one.

The posts go to a recording fake backend: which memory kinds NIXL is asked for is an
inspection a real NIXL on a host without CUDA cannot show. Nothing here claims a GPU ran:
scripts/gpu-check.sh measures that on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from types import ModuleType, SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_harness import Heads, copies, sliced_blocks, tiny_layout
from mover_harness import RecordingBackend, writes_over
from mover_harness import peer_conn as _conn
from mover_harness import pool as _pool
from mover_harness import tx_session as _session

from kvxferd.backends.base import HOST, Memory, vram
from kvxferd.errors import StartupError
from kvxferd.memory import device as device_mod
from kvxferd.memory.device import DeviceUnavailableError
from kvxferd.memory.heads import tp_rank
from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout
from kvxferd.peers.messages import PoolInfo
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver import staging as staging_mod
from kvxferd.transceiver import writes as writes_mod
from kvxferd.transceiver.bounce import BounceBuffers, HostCopier
from kvxferd.transceiver.copyplan import copy_plan
from kvxferd.transceiver.device_copy import DeviceCopier, device_buffers
from kvxferd.transceiver.device_rows import launch_shape
from kvxferd.transceiver.direct import DirectMover
from kvxferd.transceiver.direct_rx import DirectReceive, copy_only
from kvxferd.transceiver.leg_targets import must_bounce, peer_memory
from kvxferd.transceiver.legs import RxLeg
from kvxferd.transceiver.sessions import RxSession, TxSession
from kvxferd.transceiver.staged import StagedMover
from kvxferd.transceiver.staged_rx import StagedReceive
from kvxferd.transceiver.writes import Writes

# ------------------------------------------------------------------ the host stand-in


class _FakeCuda:
    """cupy.cuda's surface DeviceCopier uses, recording what happens in `events`."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.stream_threads: list[int] = []
        outer = self

        class Device:
            def __init__(self, device: int) -> None:
                self.device = device

            def __enter__(self) -> Device:
                outer.events.append(f"device {self.device}")
                return self

            def __exit__(self, *exc: object) -> None:
                outer.events.append("device exit")

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                assert non_blocking, "the daemon's stream must not sync with the default stream"
                outer.stream_threads.append(threading.get_ident())
                outer.events.append("stream made")

            def __enter__(self) -> Stream:
                outer.events.append("stream")
                return self

            def __exit__(self, *exc: object) -> None:
                outer.events.append("stream exit")

            def synchronize(self) -> None:
                outer.events.append("synchronize")

        class Event:
            """Done once it has been asked `outer.polls_until_done` times after recording."""

            def __init__(self, block: bool = True, disable_timing: bool = False) -> None:
                assert not block, "a blocking event would sleep the loop's thread"
                self.asked = -1  # not recorded yet

            def record(self, stream: Stream) -> None:
                outer.events.append("record")
                self.asked = 0

            @property
            def done(self) -> bool:
                assert self.asked >= 0, "polled before it was recorded"
                self.asked += 1
                finished = self.asked > outer.polls_until_done
                if finished:
                    outer.events.append("event done")
                return finished

        self.Device = Device
        self.Stream = Stream
        self.Event = Event
        self.polls_until_done = 0


def host_stand_in() -> tuple[ModuleType, list[str], _FakeCuda]:
    """A module with cupy's calls DeviceCopier makes (`take`, `asarray`, `cuda`) over
    numpy; `asarray` (called inside every copy) records "copy"."""
    events: list[str] = []
    xp = ModuleType("cupy_host_stand_in")
    cuda = _FakeCuda(events)

    def asarray(a: Any) -> Any:
        events.append("copy")
        return np.asarray(a)

    xp.asarray = asarray  # type: ignore[attr-defined]
    xp.take = np.take  # type: ignore[attr-defined]
    xp.cuda = cuda  # type: ignore[attr-defined]
    xp.RawKernel = _RowKernelStandIn.made_by(events)  # type: ignore[attr-defined]
    return xp, events, cuda


class _RowKernelStandIn:
    """cupy.RawKernel for device_rows' kernel, run in numpy as the CUDA source would run
    it (every row, every vector), after checking the launch is one CUDA would accept."""

    events: list[str]

    @classmethod
    def made_by(cls, events: list[str]) -> type[_RowKernelStandIn]:
        return type("RawKernel", (cls,), {"events": events})

    def __init__(self, code: str, name: str) -> None:
        assert f"void {name}(" in code

    def compile(self) -> None:
        self.events.append("kernel compiled")

    def __call__(self, grid: tuple[int, int], block: tuple[int], args: tuple[Any, ...]) -> None:
        src, dst, index, rows, vecs, gather = args
        assert grid[0] >= 1 and 1 <= grid[1] <= 65535 and grid[1] <= rows
        assert block[0] % 32 == 0 and 32 <= block[0] <= 1024
        assert src.ctypes.data % 16 == 0 and dst.ctypes.data % 16 == 0
        n = int(vecs) * 16
        for r in range(int(rows)):
            at = int(index[r])
            s, d = (at, r) if gather else (r, at)
            dst[d * n : (d + 1) * n] = src[s * n : (s + 1) * n]
        self.events.append(f"kernel {'gather' if gather else 'scatter'} {int(rows)} rows")


class HostStandInBacking:
    """A region backing (RegionBacking) of host memory standing in for device staging:
    defined here only; nothing in kvxferd can select it."""

    def __init__(self, nbytes: int, label: str) -> None:
        self.label = label
        self.nbytes = nbytes
        self.array = np.zeros(nbytes, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.closed = False

    def close(self) -> None:
        self.closed = True


# ------------------------------------------------------------------ the copier


def test_device_copier_without_a_device_says_why() -> None:
    found = device_mod.probe()
    if found.available:
        pytest.skip("this host has a usable CUDA device; the refusal cannot be shown here")
    with pytest.raises(DeviceUnavailableError) as info:
        DeviceCopier(0)
    assert str(info.value) == found.why and found.why
    with pytest.raises(DeviceUnavailableError, match=found.why[:20]):
        device_buffers(1 << 20, 0)  # the copier first: no region is allocated


def cases() -> st.SearchStrategy[tuple[KvLayout, list[int], Heads]]:
    return sliced_blocks(layers=3, heads=4, max_blocks=5, min_count=1)


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(0, 2**32 - 1))
def test_device_copier_with_a_host_stand_in_gives_host_copiers_bytes(
    case: tuple[KvLayout, list[int], Heads], seed: int
) -> None:
    layout, blocks, heads = case
    xp, _, _ = host_stand_in()
    dev, host = DeviceCopier(1, xp=xp), HostCopier(threads=1)
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    n = len(blocks) * (
        layout.block_bytes
        if heads is None
        else layout.block_bytes // layout.num_kv_heads * (heads[1] - heads[0])
    )
    got, want = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    (dev_gather, dev_scatter), (host_gather, host_scatter) = copies(dev, heads), copies(host, heads)
    dev_gather(pool, layout, blocks, got)
    host_gather(pool, layout, blocks, want)
    assert np.array_equal(got, want)
    packed = rng.integers(0, 256, n, dtype=np.uint8)
    into_dev, into_host = pool.copy(), pool.copy()
    dev_scatter(packed, into_dev, layout, blocks)
    host_scatter(packed, into_host, layout, blocks)
    assert np.array_equal(into_dev, into_host)
    host.close()


@st.composite
def big_rows(draw: st.DrawFn) -> tuple[KvLayout, list[int], Heads, int]:
    """Layouts whose units are 512 B or more (what the row kernel takes), blocks, maybe a
    head slice (whose smaller rows it declines), and an offset of the packed buffer (8:
    not 16-byte aligned, which it declines too)."""
    major = draw(st.sampled_from([BLOCK_MAJOR, LAYER_MAJOR]))
    layout = tiny_layout(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=2,
        head_dim=draw(st.sampled_from([8, 16, 24])),
        tokens_per_block=draw(st.sampled_from([8, 16])),
        dtype=draw(st.sampled_from(["float16", "float32"])),
        major=major,
        num_blocks=6,
    )
    blocks = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True))
    heads = draw(st.sampled_from([None, None, (0, 1), (1, 2)]))
    return layout, blocks, heads, draw(st.sampled_from([0, 0, 16, 8]))


@settings(max_examples=60, deadline=None)
@given(big_rows(), st.integers(0, 2**32 - 1))
def test_the_row_kernel_gives_host_copiers_bytes_or_declines(
    case: tuple[KvLayout, list[int], Heads, int], seed: int
) -> None:
    layout, blocks, heads, offset = case
    xp, events, _ = host_stand_in()
    dev, host = DeviceCopier(0, xp=xp), HostCopier(threads=1)
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    per_block = (
        layout.block_bytes
        if heads is None
        else layout.block_bytes // layout.num_kv_heads * (heads[1] - heads[0])
    )
    n = len(blocks) * per_block
    room = np.zeros(n + 16, np.uint8)
    start = (-room.ctypes.data) % 16 + offset  # a 16-byte aligned start, moved by offset
    got, want = room[start : start + n], np.zeros(n, np.uint8)
    (dev_gather, dev_scatter), (host_gather, host_scatter) = copies(dev, heads), copies(host, heads)
    dev_gather(pool, layout, blocks, got)
    host_gather(pool, layout, blocks, want)
    assert np.array_equal(got, want)
    into_dev, into_host = pool.copy(), pool.copy()
    dev_scatter(got, into_dev, layout, blocks)
    host_scatter(want, into_host, layout, blocks)
    assert np.array_equal(into_dev, into_host)
    host.close()
    unit = copy_plan(layout, blocks, heads).unit
    took = [e for e in events if e.startswith("kernel ")]
    if unit >= 512 and unit % 16 == 0 and offset % 16 == 0:
        assert took == [f"kernel gather {n // unit} rows", f"kernel scatter {n // unit} rows"]
    else:
        assert took == []


@pytest.mark.parametrize("rows", [1, 7, 250, 65535, 65536, 300_000])
@pytest.mark.parametrize("vecs", [32, 33, 100, 256, 4096, 262_144])
def test_launch_shapes_stay_in_cudas_limits_and_fill_the_device(rows: int, vecs: int) -> None:
    (grid_x, grid_y), (threads,) = launch_shape(rows, vecs)
    assert threads % 32 == 0 and 32 <= threads <= 256
    assert threads >= min(vecs, 256) - 31  # a row's vectors are not left to a few threads
    assert 1 <= grid_y <= min(rows, 65535)
    assert grid_x >= 1
    # A small plan gets no more blocks than its vectors need; a big one about 2048 or more.
    blocks_needed = rows * -(-vecs // (threads * 4))
    assert grid_x * grid_y >= min(blocks_needed, 2048)
    assert grid_x * threads * 4 <= max(vecs, threads * 4) + threads * 4


def test_warm_compiles_the_row_kernel_and_a_failure_falls_back_to_take(
    caplog: pytest.LogCaptureFixture,
) -> None:
    xp, events, _ = host_stand_in()
    copier = DeviceCopier(0, xp=xp)
    copier.warm()
    assert events == ["device 0", "kernel compiled", "device exit"] and copier.rows is not None

    def broken() -> None:
        raise RuntimeError("nvrtc: libnvrtc.so.13 not found")

    copier._kernel._kernel.compile = broken  # type: ignore[attr-defined]
    with caplog.at_level("WARNING", logger="kvxferd.device"):
        copier.warm()
    assert copier.rows is None
    assert "row kernel did not compile (nvrtc: libnvrtc.so.13 not found)" in caplog.text
    layout = tiny_layout(num_kv_heads=2, head_dim=16, tokens_per_block=16, num_blocks=2)
    pool = np.arange(layout.pool_bytes, dtype=np.uint64).astype(np.uint8)
    out = np.zeros(layout.block_bytes, np.uint8)
    events.clear()
    copier.gather(pool, layout, [1], out)  # take, not the kernel
    assert np.array_equal(out, pool[layout.block_bytes :]) and not any(
        e.startswith("kernel ") for e in events
    )


def _layout(num_blocks: int = 4) -> KvLayout:
    # 2 layers x K/V x 4 tokens x 2 heads x 4 dims x fp16: 64-byte pieces, 256-byte blocks.
    return tiny_layout(
        num_kv_heads=2, head_dim=4, tokens_per_block=4, major=LAYER_MAJOR, num_blocks=num_blocks
    )


def test_each_copy_runs_on_its_device_and_stream_and_returns_synchronised() -> None:
    xp, events, cuda = host_stand_in()
    copier = DeviceCopier(3, xp=xp)
    layout = _layout()
    pool = np.arange(layout.pool_bytes, dtype=np.uint64).astype(np.uint8)
    out = np.zeros(2 * layout.block_bytes, np.uint8)

    def two_copies() -> None:
        copier.gather(pool, layout, [2, 0], out)
        copier.scatter(out, pool, layout, [1, 3])

    worker = threading.Thread(target=two_copies)
    worker.start()
    worker.join()
    one = ["device 3", "stream", "copy", "stream exit", "synchronize", "device exit"]
    # The stream is made once, lazily, in the copying thread, under the device.
    assert events == ["device 3", "stream made", *one[1:], *one]
    assert cuda.stream_threads == [worker.ident]
    copier.close()
    assert events[-1] == "synchronize"  # nothing of ours still runs once closed


# ------------------------------------------------------------------ device staging


def _round_trip(
    bounce: BounceBuffers, ours: list[int], theirs: list[int], seed: int, between: Any = None
) -> None:
    """Gather `ours` of a random pool into a send reservation, copy it region to region (the
    one NIXL write), call `between()`, scatter into `theirs` of an empty pool, and check
    that each block arrived whole."""
    layout = _layout()
    src = np.random.default_rng(seed).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    nbytes = len(ours) * layout.block_bytes

    async def run() -> None:
        tx, rx = bounce.send.reserve(nbytes), bounce.recv.reserve(nbytes)
        assert tx is not None and rx is not None
        await bounce.gather(src, layout, ours, tx, nbytes)
        bounce.recv.view(rx, nbytes)[:] = bounce.send.view(tx, nbytes)
        if between is not None:
            between()
        await bounce.scatter(rx, nbytes, dst, layout, theirs)

    asyncio.run(run())
    for mine, yours in zip(ours, theirs, strict=True):
        a, b = layout.block_segments([mine]), layout.block_segments([yours])
        for (ao, n), (bo, _) in zip(a.tolist(), b.tolist(), strict=True):
            assert np.array_equal(dst[bo : bo + n], src[ao : ao + n])


def test_bounce_buffers_on_a_backing_carry_their_memory_and_scatter_returns_synchronised() -> None:
    xp, events, _ = host_stand_in()
    backings: list[HostStandInBacking] = []

    def backing(nbytes: int, label: str) -> HostStandInBacking:
        backings.append(HostStandInBacking(nbytes, label))
        return backings[-1]

    bounce = BounceBuffers(1 << 16, DeviceCopier(2, xp=xp), memory=vram(2), backing=backing)
    assert [b.label for b in backings] == ["send", "recv"]
    assert bounce.send.memory == bounce.recv.memory == vram(2)
    assert bounce.send.address == backings[0].address and bounce.send.array is backings[0].array
    assert bounce.status()["memory"] == "vram"
    try:
        _round_trip(bounce, [3, 1, 0], [0, 2, 1], seed=5, between=events.clear)
        assert events[-2:] == ["synchronize", "device exit"]  # done only after the device
    finally:
        bounce.close()
    assert all(b.closed for b in backings)


def test_a_copy_on_the_loop_is_launched_there_and_awaited_until_the_device_ends() -> None:
    xp, events, cuda = host_stand_in()
    cuda.polls_until_done = 3
    copier, host = DeviceCopier(2, xp=xp), HostCopier(threads=1)
    layout = _layout()
    pool = np.random.default_rng(7).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    out, want = (
        np.zeros(2 * layout.block_bytes, np.uint8),
        np.zeros(2 * layout.block_bytes, np.uint8),
    )
    host.gather(pool, layout, [2, 0], want)
    host.close()

    asyncio.run(copier.on_loop(copier.gather, pool, layout, [2, 0], out))
    assert np.array_equal(out, want)
    # Launched on the loop's thread, an event recorded after the copy, no synchronise: the
    # loop awaited the event, which ended only after it was asked 3 times.
    assert events == [
        "device 2", "stream made", "stream", "copy", "stream exit", "record", "device exit",
        "event done",
    ]  # fmt: skip
    assert cuda.stream_threads == [threading.get_ident()]
    # Called directly (not through on_loop), a copy still returns synchronised.
    events.clear()
    copier.scatter(out, pool, layout, [1, 3])
    assert events[-2:] == ["synchronize", "device exit"] and "record" not in events


def test_a_cancelled_copy_on_the_loop_ends_only_once_the_device_let_go() -> None:
    xp, events, cuda = host_stand_in()
    cuda.polls_until_done = 40
    copier = DeviceCopier(0, xp=xp)
    layout = _layout()
    pool = np.zeros(layout.pool_bytes, np.uint8)
    packed = np.ones(layout.block_bytes, np.uint8)

    async def cancel_mid_copy() -> None:
        task = asyncio.ensure_future(copier.on_loop(copier.scatter, packed, pool, layout, [1]))
        await asyncio.sleep(0)  # launched; now polling its event
        assert "record" in events and "event done" not in events
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The cancel came through only after the device finished with the buffers.
        assert events[-1] == "event done"

    asyncio.run(cancel_mid_copy())


def test_a_cancel_gives_up_on_a_hung_device_after_a_bound(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvxferd.transceiver import device_copy

    xp, events, cuda = host_stand_in()
    cuda.polls_until_done = 10**9  # never
    monkeypatch.setattr(device_copy, "CANCELLED_WAIT_S", 0.05)
    copier = DeviceCopier(0, xp=xp)
    layout = _layout()
    pool, packed = np.zeros(layout.pool_bytes, np.uint8), np.ones(layout.block_bytes, np.uint8)

    async def cancel_a_hung_copy() -> None:
        task = asyncio.ensure_future(copier.on_loop(copier.scatter, packed, pool, layout, [1]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)  # ends: the bound, not the device

    with caplog.at_level("ERROR", logger="kvxferd.device"):
        asyncio.run(cancel_a_hung_copy())
    assert "event done" not in events
    assert "a cancelled device copy has not finished" in caplog.text


def test_a_copy_refused_on_the_loop_launches_nothing_and_leaves_the_copier_as_it_was() -> None:
    xp, events, _ = host_stand_in()
    copier = DeviceCopier(0, xp=xp)
    layout = _layout()
    pool = np.zeros(layout.pool_bytes, np.uint8)
    too_small = np.zeros(layout.block_bytes - 1, np.uint8)
    with pytest.raises(Exception, match="packed"):
        asyncio.run(copier.on_loop(copier.gather, pool, layout, [0], too_small))
    assert "record" not in events and "copy" not in events
    copier.gather(pool, layout, [0], np.zeros(layout.block_bytes, np.uint8))
    assert events[-2:] == ["synchronize", "device exit"]  # not left launching without waiting


def test_device_staging_copies_from_the_loop_not_a_copy_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvxferd.transceiver import device_copy

    xp, events, cuda = host_stand_in()
    monkeypatch.setattr(device_copy, "_cupy_for", lambda device: xp)
    monkeypatch.setattr(
        device_copy.DeviceRegion, "allocate", lambda n, device, label: HostStandInBacking(n, label)
    )
    bounce = device_buffers(1 << 16, 1)
    try:
        _round_trip(bounce, [3, 0], [1, 2], seed=9)
    finally:
        bounce.close()
    assert cuda.stream_threads == [threading.get_ident()]  # one stream, the loop's
    assert events.count("record") == 2 and events.count("event done") == 2


def test_host_bounce_buffers_are_as_before() -> None:
    bounce = BounceBuffers(1 << 16)
    try:
        assert bounce.memory == bounce.send.memory == HOST
        assert bounce.status()["memory"] == "host"
        assert isinstance(bounce.copier, HostCopier)
    finally:
        bounce.close()


# ------------------------------------------------------------------ movers


def _gathered(pool: np.ndarray, layout: KvLayout, blocks: list[int]) -> np.ndarray:
    """What the host path packs for `blocks`: the bytes a bounce write must carry."""
    out = np.zeros(len(blocks) * layout.block_bytes, np.uint8)
    copier = HostCopier(threads=1)
    copier.gather(pool, layout, blocks, out)
    copier.close()
    return out


def _run(coro_fn: Any, *closing: BounceBuffers | None) -> None:
    """Run `coro_fn()`, then close every buffer in `closing` (None: there is none)."""
    try:
        asyncio.run(coro_fn())
    finally:
        for buffers in closing:
            if buffers is not None:
                buffers.close()


def test_memory_helpers() -> None:
    assert peer_memory("host", 0) == HOST
    assert peer_memory("vram", 3) == vram(3)
    assert peer_memory("hbm", 0) is None
    layout = _layout()
    host = _pool(layout, np.zeros(layout.pool_bytes, np.uint8))
    copy_only_pool = _pool(layout, np.zeros(layout.pool_bytes, np.uint8), vram(0), False)
    info = PoolInfo("p0", {}, 0, 0)
    assert not must_bounce(host, info)
    assert must_bounce(copy_only_pool, info)
    assert must_bounce(host, PoolInfo("p0", {}, 0, 0, memory="vram", writable=False))


@contextlib.asynccontextmanager
async def _writes() -> AsyncIterator[tuple[Writes, RecordingBackend]]:
    """Writes whose backend records every post."""
    backend = RecordingBackend()
    async with writes_over(backend) as writes:
        yield writes, backend


async def _direct(
    pool: LocalPool,
    conn: Any,
    bounce: BounceBuffers | None,
    blocks: list[int],
    pending_polls: int = 0,
    **req: Any,
) -> tuple[TxSession, RecordingBackend]:
    async with _writes() as (writes, backend):
        backend.pending_polls = pending_polls
        mover = DirectMover(writes, bounce, pipelined=False)
        s = _session(pool, conn, blocks, blocks, **req)
        await mover.write_slice(s, 0, len(blocks), True)
        return s, backend


def test_host_to_host_per_block_writes_are_posted_as_before() -> None:
    layout = _layout()
    src = np.random.default_rng(1).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    conn = _conn(layout, dst)

    async def go() -> None:
        s, backend = await _direct(_pool(layout, src), conn, None, [0, 2])
        assert s.terminal is None and s.written == 2
        # No memory keywords: the call every backend took before device memory existed,
        # with the peer's announced regions as the only hint (prepared descriptors).
        assert [p["kinds"] for p in backend.posts] == [{"remote_regions": conn.regions}]

    _run(go)
    assert np.array_equal(dst, np.where(np.isin(np.arange(dst.size) // 64 % 4, [0, 2]), src, 0))


def test_device_pools_per_block_name_both_sides_memory() -> None:
    layout = _layout()
    src = np.random.default_rng(2).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    conn = _conn(layout, dst, memory="vram", device=3)

    async def go() -> None:
        pool = _pool(layout, src, vram(1), zero_copy=True)  # registered: per block is fine
        s, backend = await _direct(pool, conn, None, [1])
        assert s.terminal is None
        assert [p["kinds"] for p in backend.posts] == [
            {"local_memory": vram(1), "remote_memory": vram(3)}
        ]

    _run(go)


def test_direct_mover_refuses_a_per_block_write_into_a_copy_only_pool() -> None:
    layout = _layout()
    src = np.ones(layout.pool_bytes, np.uint8)
    dst = np.zeros_like(src)
    conn = _conn(layout, dst, memory="vram", writable=False)  # no bounce buffer offered

    async def go() -> None:
        s, backend = await _direct(_pool(layout, src, vram(0)), conn, None, [0, 1])
        assert backend.posts == []  # not one byte written into the pool's blocks
        assert s.terminal is not None and s.terminal.reason == "block_mismatch"
        assert "copy-only" in s.terminal.message and "bounce buffer" in s.terminal.message

    _run(go)
    assert not dst.any()


def test_direct_mover_refuses_a_copy_only_request_its_receiver_offered_too_little() -> None:
    layout = _layout()
    src = np.ones(layout.pool_bytes, np.uint8)
    dst, peer_bounce = np.zeros_like(src), np.zeros(1 << 16, np.uint8)
    conn = _conn(layout, dst, memory="vram", writable=False, bounce=peer_bounce)
    bounce = BounceBuffers(1 << 16)

    async def go() -> None:
        s, backend = await _direct(
            _pool(layout, src), conn, bounce, [0, 1], bounce_offset=0, bounce_nbytes=256
        )
        assert backend.posts == []
        assert s.terminal is not None and s.terminal.reason == "block_mismatch"
        assert "offered a reservation of 256 bytes" in s.terminal.message

    _run(go, bounce)


def test_copy_only_pools_move_through_the_bounce_with_its_memory_kinds() -> None:
    layout = _layout()
    src = np.random.default_rng(3).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    dst, peer_bounce = np.zeros_like(src), np.zeros(1 << 16, np.uint8)
    conn = _conn(
        layout,
        dst,
        memory="vram",
        writable=False,
        bounce=peer_bounce,
        bounce_memory="vram",
        bounce_device=2,
    )
    xp, _, _ = host_stand_in()
    bounce = BounceBuffers(
        1 << 16, DeviceCopier(0, xp=xp), memory=vram(0), backing=HostStandInBacking
    )
    nbytes = layout.block_bytes  # one contiguous block: never "worth bouncing" on its own

    async def go() -> None:
        pool = _pool(layout, src, vram(0), zero_copy=False)
        s, backend = await _direct(pool, conn, bounce, [2], bounce_offset=0, bounce_nbytes=nbytes)
        assert s.terminal is None and s.written == 1
        assert backend.posts == [
            {"descriptors": 1, "kinds": {"local_memory": vram(0), "remote_memory": vram(2)}}
        ]
        assert conn.sent[-1].bounced is True and conn.sent[-1].nbytes == nbytes
        assert bounce.send.in_use_bytes == 0  # released once the write was quiescent

    _run(go, bounce)
    assert np.array_equal(peer_bounce[:nbytes], _gathered(src, layout, [2]))
    assert not dst.any()  # the receiver's blocks are its own scatter's to fill


@pytest.mark.parametrize("device", [False, True])
def test_a_write_is_polled_on_its_memorys_schedule(
    monkeypatch: pytest.MonkeyPatch, device: bool
) -> None:
    """A write still in progress is polled again after writes.next_pause, told whether the
    write moves device memory: a host per-block write says no, a copy-only device request
    (one write between two device bounce regions) says yes."""
    told: list[bool] = []
    real = writes_mod.next_pause

    def next_pause(pause_s: float, waited_s: float, on_device: bool) -> float:
        told.append(on_device)
        return real(pause_s, waited_s, on_device)

    monkeypatch.setattr(writes_mod, "next_pause", next_pause)
    layout = _layout()
    src = np.random.default_rng(7).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    dst, peer_bounce = np.zeros_like(src), np.zeros(1 << 16, np.uint8)
    xp, _, _ = host_stand_in()
    bounce = BounceBuffers(
        1 << 16, DeviceCopier(0, xp=xp), memory=vram(0), backing=HostStandInBacking
    )
    if device:
        conn = _conn(layout, dst, writable=False, bounce=peer_bounce, bounce_memory="vram")
        pool, req = _pool(layout, src, vram(0), zero_copy=False), {"bounce_nbytes": 1 << 16}
    else:
        conn, pool, req = _conn(layout, dst), _pool(layout, src), {}

    async def go() -> None:
        s, _ = await _direct(pool, conn, bounce, [2, 0], 3, bounce_offset=0, **req)
        assert s.terminal is None and s.written == 2

    _run(go, bounce)
    assert told == [device] * 4  # a pause before each poll: three in progress, then done
    landed = peer_bounce[: 2 * layout.block_bytes] if device else dst
    assert landed.any()


def test_a_copy_only_head_merge_bounces_our_slice_of_the_receivers_blocks() -> None:
    """We hold head 1 of 2 (tensor-parallel rank 1 of 2) in a copy-only pool; the receiver
    holds both heads. One write carries our blocks whole (half of each receiver block),
    packed as the gather packs them, and the Result names those bytes."""
    layout = tiny_layout(
        num_kv_heads=1, head_dim=4, tokens_per_block=4, major=LAYER_MAJOR, num_blocks=4
    )
    dst_layout = _layout()
    src = np.random.default_rng(6).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    dst, peer_bounce = np.zeros(dst_layout.pool_bytes, np.uint8), np.zeros(1 << 16, np.uint8)
    conn = _conn(dst_layout, dst, memory="vram", bounce=peer_bounce, bounce_memory="vram")
    xp, _, _ = host_stand_in()
    bounce = BounceBuffers(
        1 << 16, DeviceCopier(0, xp=xp), memory=vram(0), backing=HostStandInBacking
    )
    blocks = [3, 1, 2]
    nbytes = len(blocks) * layout.block_bytes
    assert nbytes * 2 == len(blocks) * dst_layout.block_bytes

    async def go() -> None:
        pool = _pool(layout, src, vram(0), zero_copy=False)
        pool.tp = tp_rank(1, 2)
        s, backend = await _direct(
            pool, conn, bounce, blocks, bounce_offset=0, bounce_nbytes=nbytes
        )
        assert s.terminal is None and s.written == len(blocks)
        assert [p["descriptors"] for p in backend.posts] == [1]
        assert conn.sent[-1].bounced is True and conn.sent[-1].nbytes == nbytes

    _run(go, bounce)
    assert np.array_equal(peer_bounce[:nbytes], _gathered(src, layout, blocks))
    assert not peer_bounce[nbytes:].any()


def test_a_pipelined_slice_of_a_copy_only_request_is_refused() -> None:
    layout = _layout()
    src = np.ones(layout.pool_bytes, np.uint8)
    dst = np.zeros_like(src)
    conn = _conn(layout, dst, writable=False)

    async def go() -> None:
        async with _writes() as (writes, backend):
            mover = DirectMover(writes, None, pipelined=True)
            s = _session(_pool(layout, src), conn, [0, 1], [0, 1])
            s.last_seen = False
            await mover.write_slice(s, 0, 1, False)
            assert backend.posts == []
            assert s.terminal is not None and "enable_pipelined_transfer" in s.terminal.message

    _run(go)


async def _staged(
    staging: BounceBuffers, pool: LocalPool, conn: Any, blocks: list[int], reservation: int
) -> tuple[TxSession, list[dict[str, Any]]]:
    """One whole request through a StagedMover into a receiver's reservation of
    `reservation` bytes: the session and the posts its writes made."""
    async with _writes() as (writes, backend):
        mover = StagedMover(writes, staging, False, lambda *a: None)
        s = _session(pool, conn, blocks, blocks, bounce_offset=0, bounce_nbytes=reservation)
        await mover.write_slice(s, 0, len(blocks), True)
        return s, backend.posts


def test_staged_rounds_name_the_staging_memory_on_both_sides() -> None:
    layout = _layout()
    src = np.random.default_rng(4).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    dst, peer_staging = np.zeros_like(src), np.zeros(1 << 16, np.uint8)
    conn = _conn(layout, dst, bounce=peer_staging, bounce_memory="vram", bounce_device=1)
    xp, _, _ = host_stand_in()
    staging = BounceBuffers(
        1 << 16, DeviceCopier(0, xp=xp), memory=vram(0), backing=HostStandInBacking
    )

    async def go() -> None:
        pool = _pool(layout, src, vram(0), zero_copy=False)
        s, posts = await _staged(staging, pool, conn, [0, 3], 1 << 16)
        assert s.terminal is None
        assert [p["kinds"] for p in posts] == [{"local_memory": vram(0), "remote_memory": vram(1)}]

    _run(go, staging)
    assert np.array_equal(peer_staging[: 2 * layout.block_bytes], _gathered(src, layout, [0, 3]))


@pytest.mark.parametrize(
    ("memory", "region_blocks", "ring_blocks", "posts"),
    [
        (HOST, 16, 4, 4),  # host: rounds of one block (the targets shrunk to one block)
        (vram(0), 16, 4, 2),  # device: the whole leg, split only to half the reservation
        (vram(0), 8, 8, 4),  # device: at most a quarter of our send region per round
    ],
)
def test_device_staging_moves_a_leg_in_the_fewest_rounds(
    monkeypatch: pytest.MonkeyPatch,
    memory: Memory,
    region_blocks: int,
    ring_blocks: int,
    posts: int,
) -> None:
    """Rounds of one block on host staging (the targets shrunk to one block here); on device
    staging the whole leg is the target, bounded by half the receiver's reservation and a
    quarter of our own send region."""
    # 4 KiB blocks: a reservation takes whole pages (bounce.RESERVATION_ALIGN).
    layout = tiny_layout(
        num_kv_heads=2, head_dim=64, tokens_per_block=4, major=LAYER_MAJOR, num_blocks=ring_blocks
    )
    monkeypatch.setattr(staging_mod, "ROUND_BYTES", layout.block_bytes)
    monkeypatch.setattr(staging_mod, "ONE_SIDED_ROUND_MAX_BYTES", layout.block_bytes)
    src = np.random.default_rng(5).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    ring = ring_blocks * layout.block_bytes
    dst, peer_staging = np.zeros_like(src), np.zeros(ring, np.uint8)
    conn = _conn(layout, dst, bounce=peer_staging, bounce_memory="vram", bounce_device=1)
    conn.info.round_offsets = True  # rounds through the reservation as a ring
    xp, _, _ = host_stand_in()
    staging = BounceBuffers(
        region_blocks * layout.block_bytes,
        DeviceCopier(0, xp=xp),
        memory=memory,
        backing=HostStandInBacking,
    )
    blocks = list(np.random.default_rng(8).permutation(ring_blocks).tolist())

    async def go() -> None:
        pool = _pool(layout, src, vram(0), zero_copy=False)
        s, made = await _staged(staging, pool, conn, blocks, ring)
        assert s.terminal is None
        assert len(made) == posts

    _run(go, staging)
    assert np.array_equal(peer_staging, _gathered(src, layout, blocks))


def test_two_sided_transports_refuse_device_staging() -> None:
    staging = BounceBuffers(1 << 16, memory=vram(0), backing=HostStandInBacking)
    try:
        transport = cast(Any, SimpleNamespace(name="UCX"))
        with pytest.raises(StartupError, match="backend UCX moves host memory only"):
            StagedMover(cast(Any, None), staging, False, lambda *a: None).attach(transport)
        with pytest.raises(StartupError, match="device pools need NIXL"):
            StagedReceive(staging).attach(transport)
    finally:
        staging.close()
    host = BounceBuffers(1 << 16)
    try:
        StagedReceive(host).attach(cast(Any, SimpleNamespace(name="UCX")))  # as before
    finally:
        host.close()


# ------------------------------------------------------------------ the receiver's offer


def _rx(pool: LocalPool, conn: Any, blocks: list[int]) -> RxSession:
    s = RxSession(request_id="r1", engine=None, legs=[RxLeg("ctx", conn=conn)], rx_token=1)
    s.pool, s.blocks = pool, blocks
    return s


def _rx_conn(bounce_nbytes: int = 1 << 16, writable: bool = True) -> Any:
    pools = {} if writable else {"c0": PoolInfo("c0", {}, 0, 0, memory="vram", writable=False)}
    return SimpleNamespace(
        pools=pools,
        layouts={},
        info=SimpleNamespace(bounce_nbytes=bounce_nbytes),
        peer=SimpleNamespace(name="ctx"),
    )


def test_direct_receive_always_offers_a_reservation_for_a_copy_only_pool() -> None:
    layout = _layout()
    bounce = BounceBuffers(1 << 16)
    rx = DirectReceive(bounce, pipelined=False)
    array = np.zeros(layout.pool_bytes, np.uint8)

    async def go() -> None:
        # A host pool: one contiguous block is not worth bouncing (unchanged).
        s = _rx(_pool(layout, array), _rx_conn(), [1])
        await rx.make_offer(s, s.legs[0].conn, time.monotonic() + 1)
        assert s.terminal is None and s.legs[0].offer is None
        # The same request into a copy-only pool, and from a peer with copy-only pools.
        for pool, conn in (
            (_pool(layout, array, vram(0), zero_copy=False), _rx_conn()),
            (_pool(layout, array), _rx_conn(writable=False)),
        ):
            assert copy_only(pool, conn)
            s = _rx(pool, conn, [1])
            await rx.make_offer(s, conn, time.monotonic() + 1)
            assert s.terminal is None and s.legs[0].offer is not None
            assert s.legs[0].offer.nbytes == layout.block_bytes
            assert s.legs[0].res is not None
            rx.release(s.legs[0].res)

    _run(go, bounce)


def test_a_copy_only_offer_waits_for_room_up_to_the_deadline() -> None:
    layout = _layout()
    bounce = BounceBuffers(1 << 16)
    rx = DirectReceive(bounce, pipelined=False)
    pool = _pool(layout, np.zeros(layout.pool_bytes, np.uint8), vram(0), zero_copy=False)

    async def go() -> None:
        full = bounce.recv.reserve(1 << 16)
        assert full is not None
        s = _rx(pool, _rx_conn(), [0])
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, bounce.recv.release, full)
        await rx.make_offer(s, s.legs[0].conn, time.monotonic() + 2)
        assert s.terminal is None and s.legs[0].res is not None
        # Full again, and nothing frees: the receive ends timed out at its deadline.
        rx.release(s.legs[0].res)
        full = bounce.recv.reserve(1 << 16)
        s = _rx(pool, _rx_conn(), [0])
        await rx.make_offer(s, s.legs[0].conn, time.monotonic() + 0.05)
        assert s.terminal is not None and s.terminal.reason == "receiver_timeout"
        assert "bounce buffer" in s.terminal.message

    _run(go, bounce)


@pytest.mark.parametrize(
    ("bounce_bytes", "peer_bounce", "blocks", "words"),
    [
        (0, 1 << 16, [0], "has none"),
        (1 << 16, 0, [0], "has no bounce buffer"),
        (4096, 1 << 16, list(range(32)), "exceeds the bounce region"),
    ],
)
def test_a_copy_only_receive_that_cannot_bounce_ends_saying_why(
    bounce_bytes: int, peer_bounce: int, blocks: list[int], words: str
) -> None:
    layout = _layout(num_blocks=32)
    bounce = BounceBuffers(bounce_bytes) if bounce_bytes else None
    rx = DirectReceive(bounce, pipelined=False)
    pool = _pool(layout, np.zeros(layout.pool_bytes, np.uint8), vram(0), zero_copy=False)

    async def go() -> None:
        s = _rx(pool, _rx_conn(peer_bounce), blocks)
        await rx.make_offer(s, s.legs[0].conn, time.monotonic() + 1)
        assert s.terminal is not None and s.terminal.reason == "block_mismatch"
        assert "copy-only" in s.terminal.message and words in s.terminal.message

    _run(go, bounce)
