"""The worker's metrics on prometheus-client's own instruments, in a registry of the worker's (what the admin
endpoint's ``/metrics`` renders with prometheus-client's exposition).

Rule: every family is prometheus-client's ``Counter``, ``Gauge`` or ``Histogram``, except a figure another
home keeps and the scrape reads (``observe``: the job figures, the routes' stores, the archive lag), which a
small collector yields through prometheus-client's public collector API. A family's name is its
OpenTelemetry name as the OpenTelemetry-to-Prometheus rules write it (dots to underscores, the unit ``s``
as ``_seconds`` and ``By`` as ``_bytes``, an annotation such as ``{event}`` dropped, ``_total`` on a
counter), so the names on ``/metrics`` and over OTLP are one vocabulary; every duration is in seconds. A
label child is resolved once per label set and kept (per route and dialect for an attempt's figures, per
category, status or GenAI attribute set), so recording is the child's ``inc`` or ``observe``. The registry
also holds prometheus-client's ``ProcessCollector`` and ``PlatformCollector`` (``worker_registry``) and
``target_info`` (the service's name and instance). A label that one series of a family lacks is ``""``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.worker.observability.genai import GENAI_METRICS, metric_attribute_keys
from sluice.worker.observability.telemetry import DURATION_BUCKETS, LABELS, METRICS, Reading

__all__ = [
    "PromMetrics",
    "PromSeries",
    "label_name",
    "prometheus_name",
    "worker_registry",
]

# OpenTelemetry units with a Prometheus suffix (the OpenTelemetry-to-Prometheus rules); "{…}" annotations
# and the rest add none.
_UNITS = {"s": "seconds", "By": "bytes", "1": "ratio"}


def label_name(key: str) -> str:
    """An attribute key as a Prometheus label name (``error.category`` -> ``error_category``)."""
    return key.replace(".", "_")


def prometheus_name(name: str, unit: str) -> tuple[str, str]:
    """(family name, unit) of an OpenTelemetry instrument: prometheus-client appends the unit when the name
    does not end with it, and ``_total`` to a counter's samples."""
    return name.replace(".", "_"), _UNITS.get(unit, "")


def worker_registry() -> CollectorRegistry:
    """A registry of the worker's own, with prometheus-client's process and platform collectors."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class PromSeries:
    """An attempt's figures for one route and dialect: the label children, each resolved once."""

    __slots__ = (
        "_bytes",
        "_cancel",
        "_events",
        "_first_byte",
        "_first_token",
        "_gap",
        "_in_flight",
        "_labels",
        "_queue",
        "_raw",
        "_retried",
        "_retries",
        "_unknown",
    )

    def __init__(self, families: Mapping[str, Any], route: str, dialect: str) -> None:
        def child(name: str) -> Any:
            return families[name].labels(route, dialect)

        self._queue = child("sluice.queue.wait")
        self._first_byte = child("sluice.attempt.time_to_first_byte")
        self._first_token = child("sluice.attempt.time_to_first_token")
        self._gap = child("sluice.stream.event_gap")
        self._cancel = child("sluice.cancel.close_time")
        self._bytes = child("sluice.provider.bytes")
        self._raw = child("sluice.provider.events")
        self._events = child("sluice.stream.events")
        self._unknown = child("sluice.provider.unknown_events")
        self._in_flight = child("sluice.streams.in_flight")
        self._retries = families["sluice.retries"]
        self._labels = (route, dialect)
        self._retried: dict[str, Any] = {}  # error category -> its child

    def queue_wait(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def first_byte(self, seconds: float) -> None:
        self._first_byte.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self._first_token.observe(seconds)

    def event_gap(self, seconds: float) -> None:
        self._gap.observe(seconds)

    def cancel_close(self, seconds: float) -> None:
        self._cancel.observe(seconds)

    def received(self, n_bytes: int, n_raw: int, n_events: int) -> None:
        """What the body's running totals grew by (each ≥ 0)."""
        if n_bytes:
            self._bytes.inc(n_bytes)
        if n_raw:
            self._raw.inc(n_raw)
        if n_events:
            self._events.inc(n_events)

    def unknown(self, n: int) -> None:
        self._unknown.inc(n)

    def retried(self, category: str) -> None:
        if (child := self._retried.get(category)) is None:
            child = self._retried[category] = self._retries.labels(*self._labels, category)
        child.inc()

    def in_flight(self, delta: int) -> None:
        self._in_flight.inc(delta)


class _Recorder:
    """A histogram of another home (``PromMetrics.histogram``), recorded as the SDK's is."""

    __slots__ = ("_histogram",)

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram

    def record(self, amount: float) -> None:
        self._histogram.observe(amount)


class _Observed(Collector):
    """A gauge or a cumulative counter whose series ``read`` gives at each collection; its label names are
    those of the series read (sorted), ``""`` where a series lacks one."""

    def __init__(self, name: str, unit: str, description: str, *, counter: bool, read: Reading) -> None:
        self._name, self._unit = prometheus_name(name, unit)
        self._description, self._counter, self._read = description, counter, read

    def _family(self, labels: Sequence[str]) -> CounterMetricFamily | GaugeMetricFamily:
        kind = CounterMetricFamily if self._counter else GaugeMetricFamily
        return kind(self._name, self._description, labels=labels, unit=self._unit)

    def describe(self) -> list[Metric]:
        # The registry's check for duplicated names, without reading the figures at registration.
        return [self._family(())]

    def collect(self) -> list[Metric]:
        points = list(self._read())
        keys = sorted({k for _, attrs in points for k in attrs})
        family = self._family([label_name(k) for k in keys])
        for value, attrs in points:
            family.add_metric([str(attrs.get(k, "")) for k in keys], value)
        return [family]


class PromMetrics:
    """The worker's instruments in ``registry``. ``genai_latest``: the GenAI conventions' latest names (the
    label ``gen_ai_provider_name`` and the time-to-first-chunk family) instead of v1.36.0's; ``target``: the
    resource's attributes, written as ``target_info``."""

    def __init__(self, registry: CollectorRegistry, *, genai_latest: bool, target: Mapping[str, str]) -> None:
        self.registry = registry
        self.families: dict[str, Any] = {}
        for name, (kind, unit, description) in METRICS.items():
            labels = [label_name(k) for k in LABELS.get(name, ("route", "dialect"))]
            self.families[name] = _instrument(registry, name, kind, unit, description, labels, DURATION_BUCKETS)
        # The GenAI families: the attribute keys each child's label values are read from, in label order.
        self._genai_keys: dict[str, tuple[str, ...]] = {}
        common = metric_attribute_keys(genai_latest)
        for name, (unit, description, buckets, extra, latest_only) in GENAI_METRICS.items():
            if latest_only and not genai_latest:
                continue
            keys = self._genai_keys[name] = (*common, *extra)
            labels = [label_name(k) for k in keys]
            self.families[name] = _instrument(registry, name, "histogram", unit, description, labels, buckets)
        self._genai: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._terminal: dict[tuple[str, ...], Any] = {}
        self._series: dict[tuple[str, str], PromSeries] = {}
        self._defined: dict[str, _Recorder | None] = {}  # the other homes' instruments by name
        if target:
            info = Info("target", "Target metadata", registry=registry)
            info.info({label_name(k): v for k, v in target.items()})

    def series(self, route: str, dialect: str) -> PromSeries:
        if (series := self._series.get((route, dialect))) is None:
            series = self._series[(route, dialect)] = PromSeries(self.families, route, dialect)
        return series

    def genai(self, name: str, attributes: Mapping[str, str | int], value: float) -> None:
        """A GenAI histogram's value (nothing for a family this naming does not have)."""
        keys = self._genai_keys.get(name)
        if keys is None:
            return
        values = tuple(str(attributes.get(k, "")) for k in keys)
        if (child := self._genai.get((name, values))) is None:
            child = self._genai[(name, values)] = self.families[name].labels(*values)
        child.observe(value)

    def terminal(self, route: str, dialect: str, status: str, stop_reason: str, category: str) -> None:
        values = (route, dialect, status, stop_reason, category)
        if (child := self._terminal.get(values)) is None:
            child = self._terminal[values] = self.families["sluice.requests.terminal"].labels(*values)
        child.inc()

    def observe(self, name: str, unit: str, description: str, read: Reading, *, counter: bool = False) -> None:
        """A gauge (or a cumulative ``counter``) another home keeps, read at each scrape. A name defined again
        (two workers on one telemetry) keeps the first."""
        if name not in self._defined:
            self._defined[name] = None
            self.registry.register(_Observed(name, unit, description, counter=counter, read=read))

    def histogram(self, name: str, unit: str, description: str, buckets: Sequence[float]) -> _Recorder:
        """A histogram without labels another home records into; the same one when defined again."""
        if (known := self._defined.get(name)) is not None:
            return known
        recorder = _Recorder(_instrument(self.registry, name, "histogram", unit, description, (), buckets))
        self._defined[name] = recorder
        return recorder


def _instrument(
    registry: CollectorRegistry,
    name: str,
    kind: str,
    unit: str,
    description: str,
    labels: Sequence[str],
    buckets: Sequence[float],
) -> Any:
    family, suffix = prometheus_name(name, unit)
    common: dict[str, Any] = {"labelnames": labels, "unit": suffix, "registry": registry}
    if kind == "histogram":
        return Histogram(family, description, buckets=buckets, **common)
    if kind == "counter":
        return Counter(family, description, **common)
    return Gauge(family, description, **common)
