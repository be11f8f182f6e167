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
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

C = TypeVar("C")


class _Children(Generic[C]):
    """A metric's children by label values, made by `make` on first use; an unlabelled
    metric has its one child from the start."""

    def __init__(self, kind: str, name: str, labelnames: Sequence[str], make: Callable[[], C]):
        self._what = f"{kind} {name}"
        self.labelnames = tuple(labelnames)
        self._make = make
        self.by_key: dict[tuple[str, ...], C] = {} if self.labelnames else {(): make()}

    def labels(self, labels: dict[str, str]) -> C:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self._what}: labels {sorted(labels)} are not "
                             f"{list(self.labelnames)}")  # fmt: skip
        key = tuple(str(labels[n]) for n in self.labelnames)
        child = self.by_key.get(key)
        if child is None:
            child = self.by_key[key] = self._make()
        return child

    @property
    def single(self) -> C | None:
        """The one child of a metric without labels; None for one with labels."""
        return None if self.labelnames else self.by_key[()]

    def unlabelled_use(self, verb: str) -> ValueError:
        """The error for `verb` asked of a metric with labels, not of one of its children."""
        return ValueError(f"{self._what} has labels: {verb} through labels()")


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
        self._children = _Children(
            "histogram", name, labelnames, lambda: LoopHistogramChild(self._bounds)
        )
        self._single = self._children.single  # observed per request: no lookup then
        if registry is not None:
            registry.register(self)

    def labels(self, **labels: str) -> LoopHistogramChild:
        return self._children.labels(labels)

    def observe(self, value: float) -> None:
        single = self._single
        if single is None:
            raise self._children.unlabelled_use("observe")
        single.observe(value)

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._children.labelnames)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._children.labelnames)
        for key, child in self._children.by_key.items():
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
        self._children = _Children("counter", name, labelnames, LoopCounterChild)
        self._single = self._children.single
        if registry is not None:
            registry.register(self)

    def labels(self, **labels: str) -> LoopCounterChild:
        return self._children.labels(labels)

    def inc(self, amount: float = 1.0) -> None:
        single = self._single
        if single is None:
            raise self._children.unlabelled_use("inc")
        single.inc(amount)

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._doc, labels=self._children.labelnames)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._children.labelnames)
        for key, child in self._children.by_key.items():
            family.add_metric(list(key), child.value)
        yield family
