"""Histograms the worker aggregates itself, for the telemetry that feeds the admin endpoint alone.

Rule: with the exporter ``none`` and the admin endpoint on, the histograms of ``sluice.worker.telemetry``
are these, not the SDK's: ``record`` is a bucket search and a few sums under a lock, where one SDK
measurement cleans, copies and hashes its attributes (several µs, about 9 per attempt). They follow the
SDK's explicit-bucket aggregation (a value goes in the first bucket whose bound it does not exceed;
negative and non-finite values are dropped with the SDK's warning; 2,000 attribute sets at most, the rest
in one overflow set) and are read at each collection of the admin endpoint's reader into the SDK's own
data model, cumulative, which the OpenTelemetry Prometheus exporter then translates as if the SDK had made
them: the names, labels and buckets on ``/metrics`` are the exporter's (tests/unit/test_histograms.py
holds the two paths equal). With another exporter the SDK's histograms stay, exemplars and all.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics.export import Metric, MetricReader, MetricsData
    from prometheus_client import CollectorRegistry

__all__ = ["OwnHistogram", "attach", "is_prometheus_reader", "prometheus_reader"]

log = logging.getLogger(__name__)

# The SDK's default cardinality limit, and the attributes its overflow series carries.
_CARDINALITY_LIMIT = 2000
_OVERFLOW = {"otel.metric.overflow": True}


class _Cell:
    __slots__ = ("attrs", "count", "counts", "max", "min", "start_ns", "sum")

    def __init__(self, attrs: dict[str, Any], buckets: int) -> None:
        self.attrs = attrs
        self.counts = [0] * buckets
        self.sum: float = 0
        self.count = 0
        self.min = math.inf
        self.max = -math.inf
        self.start_ns = time.time_ns()


class OwnHistogram:
    """One histogram, recorded like the SDK's instrument (``record(amount, attributes)``) on the event loop
    and read by ``metric`` on the collecting thread."""

    __slots__ = ("_bounds", "_cells", "_lock", "description", "name", "unit")

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float]) -> None:
        self.name, self.unit, self.description = name, unit, description
        self._bounds = tuple(bounds)  # as given, as the SDK keeps them (the exporter prints them)
        self._cells: dict[frozenset[tuple[str, Any]], _Cell] = {}
        self._lock = threading.Lock()

    def record(self, amount: float, attributes: Mapping[str, Any] | None = None) -> None:
        if not math.isfinite(amount):
            log.warning("Record amount %s is not finite on Histogram %s, ignoring measurement.", amount, self.name)
            return
        if amount < 0:
            log.warning("Record amount must be non-negative on Histogram %s.", self.name)
            return
        key = frozenset(attributes.items()) if attributes else frozenset()
        with self._lock:
            cell = self._cells.get(key)
            if cell is None:
                if len(self._cells) >= _CARDINALITY_LIMIT:
                    key, attributes = frozenset(_OVERFLOW.items()), _OVERFLOW
                    cell = self._cells.get(key)
                if cell is None:
                    cell = self._cells[key] = _Cell(dict(attributes or {}), len(self._bounds) + 1)
            cell.counts[bisect_left(self._bounds, amount)] += 1
            cell.sum += amount
            cell.count += 1
            if amount < cell.min:
                cell.min = amount
            if amount > cell.max:
                cell.max = amount

    def metric(self, now_ns: int) -> Metric | None:
        """The histogram as the SDK's data model would hold it at ``now_ns`` (None: nothing recorded yet)."""
        from opentelemetry.sdk.metrics.export import AggregationTemporality, Histogram, HistogramDataPoint, Metric

        with self._lock:
            points = [
                HistogramDataPoint(
                    attributes=dict(c.attrs),
                    start_time_unix_nano=c.start_ns,
                    time_unix_nano=now_ns,
                    count=c.count,
                    sum=c.sum,
                    bucket_counts=tuple(c.counts),
                    explicit_bounds=self._bounds,
                    min=c.min,
                    max=c.max,
                )
                for c in self._cells.values()
            ]
        if not points:
            return None
        data = Histogram(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE)
        return Metric(name=self.name, description=self.description, unit=self.unit, data=data)


def prometheus_reader(registry: CollectorRegistry) -> MetricReader:
    """The admin endpoint's reader: the OpenTelemetry Prometheus exporter's, on ``registry``, without
    ``otel_scope_*`` labels; ``Telemetry.from_config`` gives it the worker's own histograms to add to each
    collection when the exporter is ``none``."""
    return _reader_class()(registry=registry, scope_info_enabled=False)


def is_prometheus_reader(reader: object) -> bool:
    return isinstance(reader, _reader_class())


def attach(reader: object, metrics: Callable[[], list[Metric]], scope: str) -> bool:
    """Give ``reader`` the worker's own histograms (``metrics``, added to ``scope`` at each collection);
    False when it is not ``prometheus_reader``'s (its collections hold only what the SDK has)."""
    if not is_prometheus_reader(reader):
        return False
    reader.own, reader.scope = metrics, scope  # type: ignore[attr-defined]
    return True


@cache
def _reader_class() -> type[PrometheusMetricReader]:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    class _Reader(PrometheusMetricReader):
        own: Callable[[], list[Metric]] | None = None
        scope = ""

        def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
            if metrics_data is not None and self.own is not None:  # None: the SDK had nothing to collect
                metrics_data = _with(metrics_data, self.own(), self.scope)
            super()._receive_metrics(metrics_data, timeout_millis, **kwargs)

    return _Reader


def _with(data: MetricsData, metrics: list[Metric], scope: str) -> MetricsData:
    """``data`` with ``metrics`` added to ``scope`` of its first resource."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    if not metrics or not data.resource_metrics:
        return data
    first, *rest = data.resource_metrics
    scopes = list(first.scope_metrics)
    at = next((i for i, s in enumerate(scopes) if s.scope.name == scope), None)
    if at is None:
        scopes.append(ScopeMetrics(scope=InstrumentationScope(scope), metrics=metrics, schema_url=""))
    else:
        s = scopes[at]
        scopes[at] = ScopeMetrics(scope=s.scope, metrics=[*s.metrics, *metrics], schema_url=s.schema_url)
    resource = ResourceMetrics(resource=first.resource, scope_metrics=scopes, schema_url=first.schema_url)
    return MetricsData(resource_metrics=[resource, *rest])
