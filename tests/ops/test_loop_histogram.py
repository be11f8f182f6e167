"""The daemon's lock-free histograms (kvxferd.service.loop_histogram) expose exactly what
prometheus_client's Histogram exposes for the same observations, bucket edges included."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvxferd.service.loop_histogram import LoopCounter, LoopHistogram

BUCKETS = (0.0, 0.001, 0.01, 0.1, 1.0, 10.0)
# Below, on and between the bounds, past the last one, and a negative wait.
VALUES = (0.0, 0.0005, 0.001, 0.0010001, 0.05, 0.1, 1.0, 9.99, 10.0, 11.0, 1e9, -1.0)


def _pair(labels: tuple[str, ...]) -> tuple[bytes, bytes]:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "Doc text.", labels, buckets=BUCKETS, registry=theirs)
    mine = LoopHistogram("x_seconds", "Doc text.", labels, buckets=BUCKETS, registry=ours)
    for i, v in enumerate(VALUES):
        if labels:
            h.labels(side=("send", "recv")[i % 2]).observe(v)
            mine.labels(side=("send", "recv")[i % 2]).observe(v)
        else:
            h.observe(v)
            mine.observe(v)
    return generate_latest(theirs), generate_latest(ours)


@pytest.mark.parametrize("labels", [(), ("side",)])
def test_exposition_matches_prometheus_client(labels: tuple[str, ...]) -> None:
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # type: ignore[no-untyped-call]  # as the daemon does
    theirs, ours = _pair(labels)
    assert ours == theirs
    assert b'le="+Inf"' in ours and b"x_seconds_count" in ours


def test_misuse_is_named() -> None:
    h = LoopHistogram("y", "Doc.", ("side",), buckets=(1.0, math.inf))
    with pytest.raises(ValueError, match="observe through labels"):
        h.observe(1.0)
    with pytest.raises(ValueError, match="labels"):
        h.labels(peer="a")
    with pytest.raises(ValueError, match="repeat"):
        LoopHistogram("z", "Doc.", buckets=(1.0, 1.0))


@pytest.mark.parametrize("labels", [(), ("side", "status")])
def test_counters_expose_what_prometheus_client_exposes(labels: tuple[str, ...]) -> None:
    from prometheus_client import Counter, disable_created_metrics

    disable_created_metrics()  # type: ignore[no-untyped-call]  # as the daemon does
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    c = Counter("x_bytes", "Doc text.", labels, registry=theirs)
    mine = LoopCounter("x_bytes", "Doc text.", labels, registry=ours)
    if labels:
        c.labels(side="recv", status="ok")  # a series made before anything counts: 0
        mine.labels(side="recv", status="ok")
    for i, amount in enumerate((1, 2.5, 32768, 0, 1e12)):
        if labels:
            c.labels(side=("send", "recv")[i % 2], status="done").inc(amount)
            mine.labels(side=("send", "recv")[i % 2], status="done").inc(amount)
        else:
            c.inc(amount)
            mine.inc(amount)
    assert generate_latest(ours) == generate_latest(theirs)
    assert b"x_bytes_total" in generate_latest(ours)


def test_counter_misuse_is_named() -> None:
    c = LoopCounter("x", "Doc.", ["side"])
    with pytest.raises(ValueError, match="counter x: labels"):
        c.labels(peer="a")
    with pytest.raises(ValueError, match="counter x has labels"):
        c.inc()
    assert LoopCounter("y", "Doc.").labels().value == 0.0
