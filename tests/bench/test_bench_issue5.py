"""Issue 5's bench measurements, in tiny configurations: the fragmented layout with and without
the bounce buffer (--segment-bytes), and --pipeline-compare. Shapes and sanity only: no
timing is asserted."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_bench import TINY, bench

from kvxferd.bench.configs import resolve
from kvxferd.bench.fragmented import (
    SegmentError,
    bounce_region_mb,
    fit_bounce,
    segment_geometry,
    summary_lines,
)
from kvxferd.bench.pipeline import format_table, lengths_for
from kvxferd.bench.plan import Geometry

PIPELINE_KEYS = {
    "pipelined_exposed_ms", "pipelined_exposed_p99_ms", "sequential_exposed_ms",
    "sequential_exposed_p99_ms", "chunk_transfer_ms", "chunk_transfer_p99_ms",
}  # fmt: skip


def test_segment_bytes_choose_the_piece_size() -> None:
    lm = Geometry(layout="layer-major")
    for n, heads, dim in ((4096, 1, 64), (16384, 2, 128), (65536, 8, 128), (2048, 1, 32)):
        g = segment_geometry(n, lm)
        assert (g.kv_heads, g.head_dim) == (heads, dim)
        assert g.kv_layout(1).piece_bytes == n
        assert (g.layers, g.tokens_per_block) == (32, 32)
    with pytest.raises(SegmentError, match="--layout layer-major"):
        segment_geometry(4096, Geometry())
    with pytest.raises(SegmentError, match="multiple of tokens_per_block x itemsize"):
        segment_geometry(1000, lm)


def test_bounce_region_fits_the_requests_in_flight() -> None:
    g = segment_geometry(4096, Geometry(layout="layer-major"))  # 256 KiB blocks
    assert bounce_region_mb(g, [1000, 8000], 2) == 125 + 2  # 2 x 250 blocks, + slack
    configs = fit_bounce(resolve(["nixl-python", "nixl-python-bounce"]), g, [8000], 4)
    assert "kv_cache_bounce_size_mb" not in configs[0].transceiver
    assert configs[1].transceiver["kv_cache_bounce_size_mb"] == 250 + 4
    assert configs[1].name == "nixl-python-bounce"


def test_pipeline_lengths_put_one_chunk_first() -> None:
    assert lengths_for([100, 1000, 8000], 512) == [512, 1000, 8000]
    assert lengths_for([512, 513], 512) == [512, 513]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--segment-bytes", "4096"], "add --layout layer-major"),
        (["--layout", "layer-major", "--segment-bytes", "100"], "must be a positive multiple"),
        (["--pipeline-compare", "--small"], "two different measurements"),
        (["--pipeline-compare", "--tokens", "100", "--chunk-tokens", "128"],
         "no --tokens length is longer than one chunk"),
        (["--pipeline-compare", "--plot", "x.png"], "--plot does not apply"),
    ],
)  # fmt: skip
def test_issue5_usage_errors(args: list[str], message: str) -> None:
    proc = bench(*args, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_fragmented_with_and_without_bounce_in_one_run() -> None:
    proc = bench(
        "--layers", "2", "--layout", "layer-major", "--segment-bytes", "4096",
        "--configs", "nixl-python,nixl-python-bounce", "--tokens", "100", "--requests", "2",
        "--warmup", "1", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    g = report["geometry"]
    assert (g["kv_heads"], g["head_dim"], g["layout"]) == (1, 64, "layer-major")
    assert g["block_bytes"] == 2 * 2 * 4096
    assert report["segment_bytes"] == 4096
    per_block, bounce = report["results"]
    assert (per_block["config"], bounce["config"]) == ("nixl-python", "nixl-python-bounce")
    for r in (per_block, bounce):
        assert r["bytes"] == 4 * 2 * 2 * 4096 and r["verified"] == 2 and r["gbps"] > 0
        # 4 shuffled blocks x 4 pieces: a few neighbours may coalesce, most cannot.
        assert 8 <= r["descriptors"] <= 16
    # The bounce configuration really bounced: one send-region reservation per request
    # (warm-up included), none fell back; the per-block one has no bounce buffer.
    assert bounce["bounce_reservations"] == 3 and bounce["bounce_fallbacks"] == 0
    assert per_block["bounce_reservations"] == 0
    assert report["daemon_status"]["nixl-python"]["context"]["bounce"] is None
    gen_bounce = report["daemon_status"]["nixl-python-bounce"]["generation"]["bounce"]
    assert gen_bounce["reservations_made"] == 3
    assert gen_bounce["recv_in_use_bytes"] == 0  # nothing left reserved
    assert bounce["bounce_vs_per_block"] == pytest.approx(
        bounce["gbps"] / per_block["gbps"], rel=1e-3
    )
    assert "bounce_vs_per_block" not in per_block
    lines = summary_lines(report)
    assert lines[0].startswith("segments: 4096 bytes")
    assert "bounce / per-block at 100 tokens" in lines[1]


@pytest.mark.timeout(120)
def test_pipeline_compare_json_shape() -> None:
    proc = bench(
        *TINY, "--pipeline-compare", "--tokens", "50,200", "--chunk-tokens", "64",
        "--compute-ms", "5", "--requests", "2", "--warmup", "1", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    assert report["mode"] == "pipeline"
    assert report["configs"] == ["nixl-python-pipelined", "nixl-python"]
    assert (report["chunk_tokens"], report["compute_ms"]) == (64, 5.0)
    assert set(report) >= PIPELINE_KEYS
    (r,) = report["results"]  # 50 tokens is one chunk: nothing to pipeline
    assert (r["tokens"], r["chunks"], r["last_chunk_tokens"], r["blocks"]) == (200, 4, 8, 7)
    assert r["requests"] == 2 and r["verified"] == 4
    for key in PIPELINE_KEYS:
        assert r[key] == report[key]
        assert r[key] >= 0, (key, r)
    assert r["chunk_transfer_ms"] > 0 and r["sequential_exposed_ms"] > 0
    for name in ("pipelined_exposed", "sequential_exposed", "chunk_transfer"):
        assert r[f"{name}_p99_ms"] >= r[f"{name}_ms"]
    # The whole request takes at least its compute.
    assert r["pipelined_total_ms"] >= r["compute_total_ms"] == 4 * 5.0
    table = format_table(report)
    assert "pipelined p50" in table and "64 tokens each" in table
