"""The fragmented-layout measurement (`kvxferd bench --segment-bytes N --layout layer-major`).

In a layer-major pool a block is `layers x 2` pieces (one per layer and K/V) that lie far
apart, so a request of n shuffled blocks is `n x layers x 2` segments of one piece each:
nothing coalesces, and the per-block path hands NIXL that many small descriptors. The bounce
buffer gathers them into one contiguous reservation, writes it with ONE descriptor and
scatters it on the other side. Running `--configs nixl-python,nixl-python-bounce` moves the
same bytes with the same segments through both paths in one run, beside raw NIXL.

`--segment-bytes N` picks the geometry whose piece is N bytes:
`tokens_per_block x kv_heads x head_dim x itemsize = N`. The layers and tokens per block stay
as given; head_dim stays as given when it divides `N / (tokens_per_block x itemsize)` (else
it becomes that quotient) and kv_heads makes up the rest. With the defaults (32 tokens per
block, float16, head_dim 128): 4096 -> 1 KV head x head_dim 64; 16384 -> 2 x 128;
65536 -> 8 x 128 (the default geometry).

This module also fits the bounce configuration's region to the run (room for every request
in flight at the longest length, so that no request falls back for lack of room), reads the
daemons' bounce counters into the report, and computes the bounce/per-block ratio.
"""

from __future__ import annotations

import dataclasses
import json
import math
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvxferd.bench.configs import BOUNCE_KEY, BenchConfig
from kvxferd.bench.plan import Geometry

PER_BLOCK = "nixl-python"
BOUNCE = "nixl-python-bounce"


class SegmentError(ValueError):
    """--segment-bytes cannot be met with this geometry (a usage error)."""


def segment_geometry(segment_bytes: int, geometry: Geometry) -> Geometry:
    """`geometry` with kv_heads and head_dim chosen so that one layer-major piece (one layer,
    K or V, of one block) is `segment_bytes` bytes."""
    if geometry.layout != "layer-major":
        raise SegmentError(
            "--segment-bytes sets the size of one (layer, K/V) piece of a layer-major block; "
            "add --layout layer-major (in block-major a block is one segment)"
        )
    itemsize = geometry.kv_layout(1).itemsize
    per_token = geometry.tokens_per_block * itemsize
    if segment_bytes <= 0 or segment_bytes % per_token:
        raise SegmentError(
            f"--segment-bytes must be a positive multiple of tokens_per_block x itemsize "
            f"({geometry.tokens_per_block} x {itemsize} = {per_token}), got {segment_bytes}"
        )
    elements = segment_bytes // per_token  # kv_heads x head_dim
    head_dim = geometry.head_dim if elements % geometry.head_dim == 0 else elements
    return dataclasses.replace(geometry, kv_heads=elements // head_dim, head_dim=head_dim)


def bounce_region_mb(geometry: Geometry, lengths: Sequence[int], in_flight: int) -> int:
    """MiB per bounce region that hold `in_flight` requests of the longest length at once
    (reservations are rounded up to 4 KiB: one MiB of slack per request covers it)."""
    longest = max(geometry.request_bytes(t) for t in lengths)
    return math.ceil(in_flight * longest / 2**20) + in_flight


def fit_bounce(
    configs: Sequence[BenchConfig], geometry: Geometry, lengths: Sequence[int], in_flight: int
) -> list[BenchConfig]:
    """The configurations, each bounce one's region sized for this run (bigger than the
    registry's default where the run needs it, smaller where it does not)."""
    mb = bounce_region_mb(geometry, lengths, in_flight)
    out = []
    for c in configs:
        if c.transceiver.get(BOUNCE_KEY, 0) > 0:
            c = dataclasses.replace(c, transceiver={**c.transceiver, BOUNCE_KEY: mb})
        out.append(c)
    return out


def daemon_status(http_address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The daemon's /v1/status (empty when it does not answer: the counters are a check,
    not a reason to fail a run whose bytes were all verified)."""
    if not http_address:
        return {}
    try:
        with urllib.request.urlopen(f"http://{http_address}/v1/status", timeout=timeout_s) as r:
            status: dict[str, Any] = json.loads(r.read())
    except (OSError, ValueError):
        return {}
    return status


def bounce_counters(status: dict[str, Any]) -> dict[str, Any]:
    """The part of a daemon's status the report keeps: its bounce counters (None: off)."""
    bounce = status.get("bounce")
    return {"bounce": bounce} if status else {}


def annotate(report: dict[str, Any]) -> None:
    """Per record: the daemons' bounce counters for its configuration's run, and for a
    bounce record the ratio of its bandwidth to the per-block path's at the same length."""
    statuses: dict[str, dict[str, Any]] = report.get("daemon_status", {})
    per_block = {r["tokens"]: r for r in report["results"] if r["config"] == PER_BLOCK}
    for r in report["results"]:
        st = statuses.get(r["config"], {})
        ctx = (st.get("context") or {}).get("bounce") or {}
        gen = (st.get("generation") or {}).get("bounce") or {}
        # Counted over the configuration's whole run (every length, warm-up included): the
        # context daemon reserves once in its send region per request it bounced.
        r["bounce_reservations"] = int(ctx.get("reservations_made", 0))
        r["bounce_fallbacks"] = int(ctx.get("fallbacks", 0)) + int(gen.get("fallbacks", 0))
        base = per_block.get(r["tokens"])
        if r["config"] == BOUNCE and base is not None and base["gbps"] > 0:
            r["bounce_vs_per_block"] = float(f"{r['gbps'] / base['gbps']:.4g}")


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The table's extra lines: segment size and the bounce/per-block ratios."""
    lines: list[str] = []
    seg = report.get("segment_bytes")
    if seg:
        lines.append(
            f"segments: {seg} bytes (one layer, K or V, of one block; layer-major, "
            f"{report['block_order']} blocks)"
        )
    ratios = [r for r in report.get("results", []) if "bounce_vs_per_block" in r]
    for r in ratios:
        lines.append(
            f"bounce / per-block at {r['tokens']} tokens: {r['bounce_vs_per_block']:.2f}x "
            f"({r['gbps']:.2f} vs {r['gbps'] / r['bounce_vs_per_block']:.2f} GB/s; "
            f"{r['bounce_reservations']} requests bounced, {r['bounce_fallbacks']} fell back, "
            "whole run)"
        )
    return lines
