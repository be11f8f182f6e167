"""The bench's pure parts: busy time, the plan every process shares, the config registry."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvxferd.bench.configs import REGISTRY, BenchConfigError, from_flags, known_names, resolve
from kvxferd.bench.engine import GenerationSide
from kvxferd.bench.plan import SMALL, SWEEP, Geometry, Plan
from kvxferd.bench.stats import Timing, busy_ns, percentile
from kvxferd.memory.memfd import MemfdRegion


def test_busy_time_is_the_union_of_intervals() -> None:
    assert busy_ns([]) == 0
    assert busy_ns([(0, 10)]) == 10
    assert busy_ns([(0, 10), (20, 25)]) == 15  # a gap does not count
    assert busy_ns([(0, 10), (5, 12), (11, 13)]) == 13  # overlaps count once
    assert busy_ns([(5, 6), (0, 10)]) == 10  # nested, any order


def test_timing_sequential_is_sum_of_latencies() -> None:
    t = Timing.of([(0, 1_000_000), (5_000_000, 7_000_000)], 3_000_000)
    assert t.busy_s == pytest.approx(0.003)
    assert t.gbps == pytest.approx(1.0)
    assert t.p50_ms == pytest.approx(1.5)
    assert percentile([], 50) == 0.0


def plan(mode: str = SWEEP, in_flight: int = 3) -> Plan:
    return Plan.build(
        mode=mode,
        geometry=Geometry(layers=2, kv_heads=2, head_dim=16),
        lengths=[33, 100],
        requests=5,
        warmup=1,
        in_flight=in_flight,
        seconds=1.0,
        run_id="r",
        seed=7,
    )


def test_plan_slots_do_not_share_blocks_and_round_trip(tmp_path: Path) -> None:
    p = plan()
    per_slot = 4  # 100 tokens at 32 per block
    assert p.pool_blocks == 3 * per_slot + 8
    for lists in (p.src_blocks, p.dst_blocks):
        flat = [b for slot in lists for b in slot]
        assert len(flat) == len(set(flat)) == 3 * per_slot
        assert all(0 <= b < p.pool_blocks for b in flat)
    again = plan()
    assert again.src_blocks == p.src_blocks  # deterministic
    path = tmp_path / "plan.json"
    p.save(path)
    assert Plan.load(path) == p


def test_plan_groups_cover_every_request_once() -> None:
    p = plan()
    groups = p.groups()
    assert [(g.tokens, g.phase, g.count) for g in groups] == [
        (33, "warmup", 1), (33, "timed", 5), (100, "warmup", 1), (100, "timed", 5),
    ]  # fmt: skip
    timed = groups[1]
    items = [i for s in range(3) for i in timed.slot_items(s, 3)]
    assert sorted(i.request_id for i in items) == sorted(f"{timed.key}-{j}" for j in range(5))
    assert all(i.blocks == 2 and i.timed for i in items)


def test_small_plan_is_one_block_and_open_ended() -> None:
    p = plan(SMALL, in_flight=2)
    assert p.lengths == [32]
    timed = p.groups()[-1]
    assert timed.count is None and timed.blocks == 1
    first = [i.request_id for _, i in zip(range(3), timed.slot_items(1, 2), strict=False)]
    assert first == [f"{timed.key}-1", f"{timed.key}-3", f"{timed.key}-5"]


def test_registry_resolution() -> None:
    pytest.importorskip("nixl_cu12")
    assert known_names()[:3] == ["nixl-python", "nixl-python-bounce", "nixl-python-pipelined"]
    assert {"ucx-cpp", "mpi-cpp", "mooncake-cpp"} <= set(known_names())
    assert [c.name for c in resolve(["nixl-python", " nixl-python "])] == ["nixl-python"]
    for c in REGISTRY:
        assert c.transceiver, c.name
    with pytest.raises(BenchConfigError, match="unknown configuration 'x'; known"):
        resolve(["x"])
    with pytest.raises(BenchConfigError, match="no configuration given"):
        resolve([""])


def test_a_backend_without_an_adapter_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxferd.backends import registry

    monkeypatch.delitem(registry.TWO_SIDED, "UCX")
    with pytest.raises(BenchConfigError, match="'ucx-cpp' is not available in this build: this "
                       "build has no UCX adapter"):  # fmt: skip
        resolve(["ucx-cpp"])
    with pytest.raises(BenchConfigError, match="--backend UCX --runtime CPP cannot run"):
        from_flags("UCX", "CPP")


def test_flags_build_the_configuration_a_user_would_write() -> None:
    pytest.importorskip("nixl_cu12")
    # Registered settings keep their registered name, so results compare across runs.
    assert from_flags("NIXL", "CPP").name == "nixl-cpp"
    assert from_flags("NIXL", "PYTHON").name == "nixl-python"
    auto = from_flags("DEFAULT", "auto")
    assert auto.name == "default-auto"
    assert dict(auto.transceiver) == {
        "backend": "DEFAULT",
        "transceiver_runtime": "auto",
        "kv_transfer_timeout_ms": 60000,
    }
    with pytest.raises(BenchConfigError, match="--runtime PYTHON moves KV over NIXL only"):
        from_flags("MOONCAKE", "PYTHON")
    with pytest.raises(BenchConfigError, match="--backend must be one of"):
        from_flags("RDMA", "CPP")


def test_a_gone_context_engine_fails_the_generation_run_saying_so() -> None:
    """The bench's generation engine batches its notifications to the context engine at the
    end of a loop turn; a notify pipe whose reader is gone must fail the run with the
    reason, not raise into the event loop's handler and leave the run to time out."""
    p = plan()
    region = MemfdRegion.create(p.layout().pool_bytes, "bench-notify-test")
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the context engine is gone
    loop_errors: list[dict[str, object]] = []
    try:
        side = GenerationSide(
            None,  # type: ignore[arg-type]  # the client is not used by notifications
            p, region, "pool", peer="ctx", notify_fd=write_fd, progress_fd=None, wait_s=1.0,
        )  # fmt: skip

        async def main() -> None:
            asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
            side._notify("0 req-1")
            await asyncio.sleep(0)  # the end of the loop turn: the batched write
            await asyncio.sleep(0)

        asyncio.run(main())
    finally:
        os.close(write_fd)
        region.close()
    assert loop_errors == []
    assert "could not notify the context engine" in side.error, side.error
    assert "Broken pipe" in side.error
