"""Instruments the worker aggregates itself, for the telemetry that feeds the admin endpoint alone.

Rule: with the exporter ``none`` and the admin endpoint on, every instrument of the worker is one of these:
the histograms of ``observability.telemetry`` and of the other homes (``OwnHistogram``), its counters as its
own running totals (``OwnSum`` over its counts), and the gauges and counters the other homes observe (the
job figures, the routes' stores, the archive lag: ``OwnObserved``, read at each collection). ``record`` is a
bucket search and a few sums under a lock, where one SDK measurement cleans, copies and hashes its
attributes (several µs, about 9 per attempt), and a scrape then runs no SDK collection at all. The
histograms follow the SDK's explicit-bucket aggregation (a value goes in the first bucket whose bound it
does not exceed; negative and non-finite values are dropped with the SDK's warning; 2,000 attribute sets at
most, the rest in one overflow set). Each instrument can give itself in the SDK's data model, cumulative
(``metric``), which the OpenTelemetry Prometheus exporter translates as if the SDK had made it: the names,
labels and buckets on ``/metrics`` are the exporter's (tests/unit/test_histograms.py holds the two paths
equal), and ``target_info`` is the exporter's rendering of the resource. ``OwnCollector`` puts them in the
endpoint's prometheus-client registry that way; a scrape in the two formats a Prometheus server asks for
renders them from a ``snapshot`` instead, with the text the exporter gave each series kept
(``sluice.worker.observability.exposition``): a scrape then runs neither the SDK's collection nor the exporter's
translation. With another exporter the SDK's instruments stay, exemplars and all.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics.export import Metric, MetricReader
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric as Family

__all__ = [
    "OwnCollector",
    "OwnHistogram",
    "OwnInstrument",
    "OwnObserved",
    "OwnSum",
    "attach",
    "is_prometheus_reader",
    "own_collector",
    "prometheus_reader",
]

log = logging.getLogger(__name__)

Snapshot = tuple[tuple[Any, ...], list[list[float]]]  # (each series' identity, its values), series in order
Reading = Callable[[], Iterable[tuple[float, Mapping[str, Any]]]]  # an observed instrument's (value, attributes)

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

    def snapshot(self) -> Snapshot:
        """Per series (attribute set, in the order they appeared), its values in the order of the exporter's
        samples: the cumulative bucket counts, the count, the sum."""
        with self._lock:
            return tuple(self._cells), [[*accumulate(c.counts), c.count, c.sum] for c in self._cells.values()]

    def metric(self, now_ns: int, *, last: bool = False) -> Metric | None:
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


class OwnSum:
    """A counter (``monotonic``) or an up-down counter whose running totals the worker keeps: ``cells`` gives
    its table (attribute set -> a cell with ``attrs`` and ``value``), replaced whole when a set appears."""

    __slots__ = ("_cells", "_start_ns", "description", "monotonic", "name", "unit")

    def __init__(
        self, name: str, unit: str, description: str, *, monotonic: bool, cells: Callable[[], Mapping[Any, Any]]
    ) -> None:
        self.name, self.unit, self.description, self.monotonic = name, unit, description, monotonic
        self._cells = cells
        self._start_ns = time.time_ns()

    def snapshot(self) -> Snapshot:
        cells = self._cells()
        return tuple(cells), [[c.value] for c in cells.values()]

    def metric(self, now_ns: int, *, last: bool = False) -> Metric | None:
        """As the SDK's observable instrument would report the totals at ``now_ns`` (None: no series yet)."""
        from opentelemetry.sdk.metrics.export import AggregationTemporality, Metric, NumberDataPoint, Sum

        points = [
            NumberDataPoint(
                attributes=dict(c.attrs), start_time_unix_nano=self._start_ns, time_unix_nano=now_ns, value=c.value
            )
            for c in self._cells().values()
        ]
        if not points:
            return None
        data = Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=self.monotonic)
        return Metric(name=self.name, description=self.description, unit=self.unit, data=data)


class OwnObserved:
    """A gauge, or (``kind="counter"``) a monotonic counter whose cumulative totals another home keeps (a
    route store's counters), read by ``read`` at each collection, as the SDK's observable instruments are:
    ``read`` gives (value, attributes) per series; the series it gives may change from one read to the next."""

    __slots__ = ("_last", "_read", "_start_ns", "description", "kind", "name", "unit")

    def __init__(
        self, name: str, unit: str, description: str, *, kind: Literal["gauge", "counter"], read: Reading
    ) -> None:
        self.name, self.unit, self.description, self.kind = name, unit, description, kind
        self._read = read
        self._start_ns = time.time_ns()
        self._last: list[tuple[float, Mapping[str, Any]]] = []

    def snapshot(self) -> Snapshot:
        self._last = points = list(self._read())
        return tuple(frozenset(a.items()) for _, a in points), [[v] for v, _ in points]

    def metric(self, now_ns: int, *, last: bool = False) -> Metric | None:
        """The series as the SDK's observable instrument would report them at ``now_ns``; ``last``: those of
        the last ``snapshot`` (a value such as an age moves between two reads), not a new read."""
        from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Metric, NumberDataPoint, Sum

        points = [
            NumberDataPoint(
                attributes=dict(attrs), start_time_unix_nano=self._start_ns, time_unix_nano=now_ns, value=value
            )
            for value, attrs in (self._last if last else self._read())
        ]
        if not points:
            return None
        data: Gauge | Sum
        if self.kind == "counter":
            data = Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=True)
        else:
            data = Gauge(points)
        return Metric(name=self.name, description=self.description, unit=self.unit, data=data)


class OwnInstrument(Protocol):
    """What ``OwnCollector`` and the exposition read of an instrument the worker aggregates itself."""

    @property
    def name(self) -> str: ...
    def snapshot(self) -> Snapshot:
        """Each series' identity and its values in the order of the exporter's samples, both in the order
        of the exporter's series."""
        ...

    def metric(self, now_ns: int, *, last: bool = False) -> Metric | None:
        """The instrument in the SDK's data model (None: no series); ``last``: as of the last ``snapshot``
        (an observed instrument reads again otherwise; the others' state does not move between the two on
        the event loop)."""
        ...


class OwnCollector:
    """A prometheus-client collector of the worker's own instruments: each collection translates them with
    the OpenTelemetry Prometheus exporter (no scope labels: as the endpoint's reader), so prometheus-client's
    own renderers and ``generate_latest`` see what the SDK path would give, ``target_info`` first (the
    resource's, as the exporter writes it; no SDK instrument exists beside these, so it is written once).
    ``instruments`` grows as the worker's homes add theirs. The fast scrape (``sluice.worker.observability.exposition``)
    collects the registry inside ``apart`` and renders these itself."""

    def __init__(self, instruments: list[OwnInstrument], scope: str, resource: Resource | None = None) -> None:
        self.instruments = instruments
        self._scope = scope
        self._apart = False
        self._translator: Any = None
        self.target = _target_info(resource) if resource is not None else None

    def collect(self) -> list[Family]:
        if self._apart:
            return []
        now = time.time_ns()
        families = self.families([m for i in self.instruments if (m := i.metric(now)) is not None])
        return families if self.target is None else [self.target, *families]

    def families(self, metrics: list[Metric]) -> list[Family]:
        """``metrics`` as the exporter translates them, one family per metric, in their order."""
        if not metrics:
            return []
        if self._translator is None:
            self._translator = _translator_class()()
        return self._translator.translate(metrics, self._scope)  # type: ignore[no-any-return]

    @contextmanager
    def apart(self) -> Iterator[None]:
        """Collections of the registry inside yield nothing of this collector (the caller renders it).
        Scrapes run on the event loop, one at a time."""
        self._apart = True
        try:
            yield
        finally:
            self._apart = False


def prometheus_reader(registry: CollectorRegistry) -> MetricReader:
    """The admin endpoint's reader: the OpenTelemetry Prometheus exporter's, on ``registry``, without
    ``otel_scope_*`` labels; ``Telemetry.from_config`` adds the worker's own instruments beside it (``attach``)
    when the exporter is ``none``."""
    return _reader_class()(registry=registry, scope_info_enabled=False)


def is_prometheus_reader(reader: object) -> bool:
    return isinstance(reader, _reader_class())


def attach(reader: object, instruments: list[OwnInstrument], scope: str, resource: Resource | None = None) -> bool:
    """Register the worker's own ``instruments`` (as of ``scope``; the list may grow) in ``reader``'s
    registry, beside what the SDK collects, with ``resource`` as ``target_info``; False when ``reader`` is
    not ``prometheus_reader``'s."""
    if not is_prometheus_reader(reader):
        return False
    collector = OwnCollector(instruments, scope, resource)
    reader.registry.register(collector)  # type: ignore[attr-defined]
    reader.own = collector  # type: ignore[attr-defined]
    return True


def own_collector(reader: object) -> OwnCollector | None:
    """The worker's own instruments ``attach`` put beside ``reader``, if any."""
    return getattr(reader, "own", None) if is_prometheus_reader(reader) else None


@cache
def _reader_class() -> type[PrometheusMetricReader]:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    class _Reader(PrometheusMetricReader):
        own: OwnCollector | None = None

        def __init__(self, *, registry: CollectorRegistry, scope_info_enabled: bool) -> None:
            super().__init__(registry=registry, scope_info_enabled=scope_info_enabled)
            self.registry = registry

    return _Reader


def _target_info(resource: Resource) -> Family | None:
    """``resource`` as the exporter's ``target_info`` family (None: the exporter gives none)."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics

    translator = _translator_class()(target_info=True)
    translator._receive_metrics(
        MetricsData(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[], schema_url="")])
    )
    families = list(translator.registry_of_one.collect())
    return families[0] if len(families) == 1 else None


@cache
def _translator_class() -> type[Any]:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from prometheus_client import CollectorRegistry

    class _Translator(PrometheusMetricReader):
        """The exporter's translation alone, on a registry of its own: ``translate`` hands the exporter the
        metrics as a collection would, then collects the registry. The reader belongs to a meter provider
        with no instrument, so the collection's own call back into the SDK finds nothing (an unregistered
        reader would log a warning each time)."""

        def __init__(self, *, target_info: bool = False) -> None:
            self.registry_of_one = CollectorRegistry(auto_describe=False)
            super().__init__(
                disable_target_info=not target_info, scope_info_enabled=False, registry=self.registry_of_one
            )
            self._provider = MeterProvider(metric_readers=[self], shutdown_on_exit=False)

        def translate(self, metrics: list[Metric], scope: str) -> list[Family]:
            scopes = [ScopeMetrics(scope=InstrumentationScope(scope), metrics=metrics, schema_url="")]
            resource = ResourceMetrics(resource=Resource.get_empty(), scope_metrics=scopes, schema_url="")
            self._receive_metrics(MetricsData(resource_metrics=[resource]))
            return list(self.registry_of_one.collect())

    return _Translator
