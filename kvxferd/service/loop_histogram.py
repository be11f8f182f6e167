"""Histograms and counters fed and read on the daemon's event loop, without locks.

prometheus_client's Histogram takes a lock for its sum and another for the bucket it
counts, and walks its buckets in Python: ~2-3 us an observation, and a daemon makes two or
three per request (py-spy: 3-5 % of each daemon's samples at 32 one-block requests in
flight, kvxferd bench --small). Every observation here happens on the event loop, and so
does every scrape (kvxferd.service.http), so a plain list of counts is enough: one bisect
and two additions. The exposition is the same as prometheus_client's (le labels spelled
alike, cumulative buckets, _sum and _count; no _created series, as the daemon disables
them). The counters a request feeds are kept the same way (LoopCounter).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class LoopHistogramChild:
    """One label set's counts; `observe` only from the event loop's thread."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # le is inclusive: the first bucket whose bound is >= value.
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class LoopHistogram(Collector):
    """A histogram with prometheus_client's `labels(...)`/`observe` and exposition."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        if len(set(bounds)) != len(bounds):
            raise ValueError(f"histogram {name}: buckets repeat: {buckets}")
        self._bounds = tuple(bounds)
        self._le = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        if not self._labelnames:
            self._children[()] = LoopHistogramChild(self._bounds)
        if registry is not None:
            registry.register(self)

    def labels(self, **labels: str) -> LoopHistogramChild:
        if set(labels) != set(self._labelnames):
            raise ValueError(f"histogram {self._name}: labels {sorted(labels)} are not "
                             f"{list(self._labelnames)}")  # fmt: skip
        key = tuple(str(labels[n]) for n in self._labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = LoopHistogramChild(self._bounds)
        return child

    def observe(self, value: float) -> None:
        if self._labelnames:
            raise ValueError(f"histogram {self._name} has labels: observe through labels()")
        self._children[()].observe(value)

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in self._children.items():
            total, buckets = 0, []
            for le, count in zip(self._le, child.counts, strict=True):
                total += count
                buckets.append((le, float(total)))
            family.add_metric(list(key), buckets, child.sum)
        yield family


class LoopCounterChild:
    """One label set's total; `inc` only from the event loop's thread."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopCounter(Collector):
    """A counter with prometheus_client's `labels(...)`/`inc` and exposition (`<name>_total`),
    for the series a daemon counts per request: prometheus_client's Counter takes a lock and
    checks its labels on every `inc` (four Python calls), this one adds."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], LoopCounterChild] = {}
        if not self._labelnames:
            self._children[()] = LoopCounterChild()
        if registry is not None:
            registry.register(self)

    def labels(self, **labels: str) -> LoopCounterChild:
        if set(labels) != set(self._labelnames):
            raise ValueError(f"counter {self._name}: labels {sorted(labels)} are not "
                             f"{list(self._labelnames)}")  # fmt: skip
        key = tuple(str(labels[n]) for n in self._labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = LoopCounterChild()
        return child

    def inc(self, amount: float = 1.0) -> None:
        if self._labelnames:
            raise ValueError(f"counter {self._name} has labels: inc through labels()")
        self._children[()].inc(amount)

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in self._children.items():
            family.add_metric(list(key), child.value)
        yield family
