"""Percentiles and bandwidth over per-request timings.

Bandwidth is bytes of the timed requests over *busy time*: the length of the union of their
[start, end] intervals. Untimed work between requests (filling, clearing, verifying) is then
left out; with one request in flight busy time is the sum of the latencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation); 0.0 for no values."""
    if not values:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def busy_ns(intervals: Sequence[tuple[int, int]]) -> int:
    """Length of the union of [start, end] intervals (nanoseconds)."""
    total = 0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


@dataclass(frozen=True)
class Timing:
    """Summary of a set of timed requests."""

    count: int
    nbytes: int
    busy_s: float
    span_s: float
    gbps: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float

    @classmethod
    def of(cls, intervals: Sequence[tuple[int, int]], nbytes: int) -> Timing:
        lat = [(end - start) / 1e6 for start, end in intervals]
        busy = busy_ns(intervals) / 1e9
        span = (
            (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e9
            if intervals
            else 0.0
        )
        return cls(
            count=len(intervals),
            nbytes=nbytes,
            busy_s=busy,
            span_s=span,
            gbps=nbytes / busy / 1e9 if busy > 0 else 0.0,
            p50_ms=percentile(lat, 50),
            p99_ms=percentile(lat, 99),
            mean_ms=float(np.mean(lat)) if lat else 0.0,
            max_ms=max(lat) if lat else 0.0,
        )


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0
