"""Traces and metrics for the worker, chosen by configuration: the admin endpoint's metrics on
prometheus-client, the OpenTelemetry SDK where an OpenTelemetry exporter is configured.

Rule: telemetry observes and never decides. Attributes carry identifiers, route names, dialects,
statuses, categories and counts, never secrets, prompts, model output, job metadata or error messages
(a provider's message may quote the prompt). Metric attributes stay bounded (configured route names,
dialects and the contract's vocabularies), so model names and request ids appear on spans only.

Two sinks take the same figures, each only where something reads it: with the admin endpoint on, the
worker's prometheus-client instruments (``sluice.worker.observability.metrics``, what ``/metrics`` renders);
with the exporter ``console`` or ``otlp``, the OpenTelemetry SDK's (exported every ``metric_interval_ms``),
with its spans. With the exporter ``none`` and the endpoint off nothing of either is imported or created:
every method is an empty call (``DISABLED``); with ``none`` and the endpoint on, OpenTelemetry is not
imported and no span is made (the attempts skip every span call).

A span per attempt (``sluice.attempt``, kind CONSUMER, the sluice attributes) is parented to the
producer's W3C trace context from ``Job.trace`` when there is one (else it is a root span), and never
propagated to the provider: a third party gets no trace ids of ours. Given the request's ``GenAICall``, the
attempt also has a child CLIENT span ``chat {model}`` and the ``gen_ai.client.*`` metrics of the GenAI
semantic conventions (``sluice.worker.observability.genai`` says which version and names).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, Self

import msgspec

from sluice.schemas.errors import ConfigError
from sluice.schemas.events import BlockDelta, Event, StreamDone, StreamError, StreamStart, Usage
from sluice.worker.observability.genai import GENAI_METRICS, GenAICall, latest_from_env

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
    from opentelemetry.trace import Span, TracerProvider
    from prometheus_client import CollectorRegistry

    from sluice.worker.observability.metrics import PromMetrics

__all__ = [
    "DISABLED",
    "DURATION_BUCKETS",
    "LABELS",
    "METRICS",
    "NO_ATTEMPT",
    "SPAN_NAME",
    "AttemptTelemetry",
    "Reading",
    "Recorder",
    "Telemetry",
    "TelemetryConfig",
    "entry_time_ms",
]

SPAN_NAME = "sluice.attempt"
_SCOPE = "sluice.worker"
_TRACE_KEYS = ("traceparent", "tracestate")

# Instrument name -> (kind, unit, description): the attempt's and the request's figures. Durations are
# seconds (on /metrics ``_seconds``: ``sluice.worker.observability.metrics`` says how a name is written).
METRICS: dict[str, tuple[str, str, str]] = {
    "sluice.queue.wait": ("histogram", "s", "time from enqueue (the jobs-stream entry id) to the first attempt"),
    "sluice.attempt.time_to_first_byte": ("histogram", "s", "attempt start to the first body byte"),
    "sluice.attempt.time_to_first_token": ("histogram", "s", "attempt start to the first block.delta"),
    "sluice.stream.event_gap": (
        "histogram",
        "s",
        "per stream, the longest time between reads that produced contract events, once per flush window (at most 5 s)",
    ),
    "sluice.stream.events": ("counter", "{event}", "contract events produced"),
    "sluice.provider.events": ("counter", "{event}", "raw provider (SSE) events received"),
    "sluice.provider.bytes": ("counter", "By", "response body bytes received"),
    "sluice.streams.in_flight": ("updown", "{stream}", "attempts running now"),
    "sluice.provider.unknown_events": ("counter", "{event}", "provider events the adapter did not know"),
    "sluice.retries": ("counter", "{retry}", "attempts that ended retryable and were retried"),
    "sluice.requests.terminal": ("counter", "{request}", "requests that reached their terminal status"),
    "sluice.cancel.close_time": ("histogram", "s", "cancel requested to upstream closed"),
}
# Each instrument's attributes; the others have route and dialect. A terminal's stop_reason and
# error.category, where it has none, are left out of the SDK's attributes and ``""`` on /metrics.
LABELS: dict[str, tuple[str, ...]] = {
    "sluice.retries": ("route", "dialect", "error.category"),
    "sluice.requests.terminal": ("route", "dialect", "status", "stop_reason", "error.category"),
}
# LLM latencies reach minutes; the SDK's default boundaries stop at 10 s.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The body's figures (bytes, events, the longest gap) are handed over once per window: the counters as what
# the running totals grew by; the gap to its histogram (a call per read cost more than normalizing the event).
_FLUSH_S = 5.0

# An observed instrument's series at one collection: (value, attributes).
Reading = Callable[[], Iterable[tuple[float, Mapping[str, Any]]]]


class TelemetryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``exporter``: ``none`` (no traces; metrics only on the admin endpoint, when it is on), ``console``
    (stdout) or ``otlp`` (OTLP/HTTP; needs the package ``opentelemetry-exporter-otlp-proto-http``).
    ``otlp_endpoint`` is the collector's base URL (``/v1/traces`` and ``/v1/metrics`` are appended); unset,
    the ``OTEL_EXPORTER_OTLP_*`` environment applies. ``sample_ratio`` samples root traces; a producer's
    sampled flag is always followed. ``metric_interval_ms``: how often ``console`` and ``otlp`` export
    metrics (accepted and unused with ``none``: the endpoint's are read when scraped)."""

    exporter: Literal["none", "console", "otlp"] = "none"
    service_name: str = "sluice-worker"
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    otlp_endpoint: str | None = None
    metric_interval_ms: Annotated[int, msgspec.Meta(ge=100)] = 60_000

    def check(self) -> None:
        """Raises ``ConfigError`` when the chosen exporter is not installed (call it when loading the
        configuration, so a worker fails before it starts, with one line)."""
        if self.exporter == "otlp":
            _otlp_exporters()


class Recorder(Protocol):
    """A histogram without attributes as another home records into it (``Telemetry.histogram``)."""

    def record(self, amount: float) -> None: ...


def entry_time_ms(entry_id: str) -> int | None:
    """The unix-ms time Redis stamped into an auto-generated stream entry id (``<ms>-<seq>``): the
    enqueue time of a job, whoever produced it (the client and a bare ``XADD`` alike)."""
    ms, sep, seq = entry_id.partition("-")
    if not sep or not ms.isdigit() or not seq.isdigit():
        return None
    return int(ms)


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class AttemptTelemetry:
    """One attempt's span and per-attempt metrics; use it as a context manager around the attempt.

    This base class is the no-op used when telemetry is off (one shared instance, nothing recorded)."""

    __slots__ = ()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    @property
    def trace_id(self) -> str | None:
        """The span's trace id (32 hex digits) for log correlation; None when off."""
        return None

    def on_response(self, status_code: int) -> None:
        """The provider answered with response headers."""

    # The body's reader (worker/pipeline/upstream.py) keeps its per-read figures in its _ReadWindow and calls these
    # two only a few times per attempt and once per window: on the paced path a call per read cost more than
    # normalizing the event.

    @property
    def window_end(self) -> float:
        """When the first window ends (``time.monotonic()`` seconds); infinity when nothing is recorded."""
        return math.inf

    def firsts(self, now: float, n_raw: int, events: Sequence[Event]) -> bool:
        """A read at ``now`` (``n_raw=0``, no events), or feeding (part of) it completed ``n_raw`` provider
        events and produced ``events``: the first byte, first chunk, response model and first token are
        taken from these. Returns whether any is still to be seen; once False, the reader stops calling."""
        return False

    def window(self, now: float, received: int, gap: float, stats: Callable[[], Mapping[str, int]]) -> float:
        """A window ended at ``now`` (or the body did): ``received`` is the body's byte count so far,
        ``gap`` the window's longest time in seconds between reads that produced events (-1: none),
        ``stats`` the normalizer's ``statistics``. Returns when the next window ends."""
        return math.inf

    def record_cancel(self, requested_at: float | None, closed_at: float | None) -> None:
        """A cancel closed the upstream; both are ``time.monotonic()`` seconds (ignored if either is None)."""

    def finish(
        self,
        terminal: Event | None,
        stats: Mapping[str, int],
        *,
        retrying: bool = False,
        response_id: str | None = None,
    ) -> None:
        """The attempt ended with ``terminal``; ``stats`` is ``Normalizer.statistics()``. ``retrying``: the
        worker will run another attempt; ``response_id``: the provider's id of its response. Ends the
        span; a second call does nothing."""


NO_ATTEMPT = AttemptTelemetry()  # the shared no-op attempt (a default argument for code that takes one)


class Telemetry:
    """The worker's telemetry. This base class is the no-op used when telemetry is off (``DISABLED``)."""

    enabled = False

    @staticmethod
    def from_config(
        config: TelemetryConfig, *, instance_id: str | None = None, registry: CollectorRegistry | None = None
    ) -> Telemetry:
        """Build what ``config`` asks for; ``registry``: the admin endpoint's, when it is on (the worker's
        instruments are made in it). ``DISABLED`` for ``none`` without a registry. Raises ``ConfigError``
        when the OTLP exporter is asked for but not installed."""
        if config.exporter == "none" and registry is None:
            return DISABLED
        return _build(config, instance_id, registry)

    @staticmethod
    def with_providers(
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = _wall_ms,
        genai_latest: bool | None = None,
        target: Mapping[str, str] | None = None,
    ) -> Telemetry:
        """Telemetry on providers the caller built and shuts down (tests: in-memory exporters), and with
        ``registry``, prometheus-client instruments in it (``target``: its ``target_info``). No tracer
        provider: no spans. ``clock`` (monotonic seconds) times attempts; ``wall_ms`` (unix ms) measures the
        queue wait; ``genai_latest``: the latest GenAI names (None: as ``OTEL_SEMCONV_STABILITY_OPT_IN`` says)."""
        return _Telemetry(
            tracer_provider,
            meter_provider,
            registry,
            clock=clock,
            wall_ms=wall_ms,
            owned=False,
            genai_latest=latest_from_env() if genai_latest is None else genai_latest,
            target=target or {},
        )

    def attempt(
        self,
        *,
        request_id: str,
        route: str,
        dialect: str,
        model: str | None,
        attempt: int,
        trace: Mapping[str, str] | None = None,
        queued_at_ms: int | None = None,
        genai: GenAICall | None = None,
    ) -> AttemptTelemetry:
        """Start an attempt's span (parented to ``trace``, the job's W3C context) and count it in flight.
        ``route`` must be a configured route name (it becomes a metric attribute). ``queued_at_ms``: the
        enqueue time, given for the first attempt a fresh claim runs; records the queue wait. ``genai``:
        the request as the GenAI conventions see it (a CLIENT span and the ``gen_ai.client.*`` metrics)."""
        return NO_ATTEMPT

    # Instruments defined beside what they observe (``observability.admin``, ``sluice.worker.capacity.gauges``,
    # ``sluice.worker.observability.archive_watch``), in every sink.

    def observe(
        self, name: str, unit: str, description: str, read: Reading, *, counter: bool = False, scope: str = _SCOPE
    ) -> None:
        """A gauge (or a cumulative ``counter``) whose series ``read`` gives as (value, attributes) at each
        collection; nothing when telemetry is off. A name defined again keeps the first."""

    def histogram(
        self, name: str, unit: str, description: str, buckets: Sequence[float], *, scope: str = _SCOPE
    ) -> Recorder | None:
        """A histogram without attributes (``record(amount)``); None when telemetry is off."""
        return None

    def request_finished(
        self, *, route: str, dialect: str, status: str, stop_reason: str | None = None, category: str | None = None
    ) -> None:
        """A request's terminal status was stored (once per request). Pass ``route=""`` for a route that
        is not configured: a producer's arbitrary string must not become a metric attribute."""

    def shutdown(self) -> None:
        """Flush; shut down the providers this object built (blocking: run it in a thread from async code)."""


DISABLED = Telemetry()


# -- the sinks: prometheus-client's instruments (metrics.PromMetrics) and the SDK's (_SdkMetrics) -------------


class _Series(Protocol):
    """An attempt's figures for one route and dialect, in one sink."""

    def queue_wait(self, seconds: float) -> None: ...
    def first_byte(self, seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def event_gap(self, seconds: float) -> None: ...
    def cancel_close(self, seconds: float) -> None: ...
    def received(self, n_bytes: int, n_raw: int, n_events: int) -> None: ...
    def unknown(self, n: int) -> None: ...
    def retried(self, category: str) -> None: ...
    def in_flight(self, delta: int) -> None: ...


class _Sink(Protocol):
    def series(self, route: str, dialect: str) -> _Series: ...
    def genai(self, name: str, attributes: Mapping[str, str | int], value: float) -> None: ...
    def terminal(self, route: str, dialect: str, status: str, stop_reason: str, category: str) -> None: ...


def _build(config: TelemetryConfig, instance_id: str | None, registry: CollectorRegistry | None) -> Telemetry:
    target = {"service.name": config.service_name}
    if instance_id:
        target["service.instance.id"] = instance_id
    if config.exporter == "none":
        # The admin endpoint's metrics alone: nothing of OpenTelemetry, no span.
        return _Telemetry(None, None, registry, owned=True, genai_latest=latest_from_env(), target=target)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create(target)
    span_exporter: SpanExporter
    metric_exporter: MetricExporter
    if config.exporter == "otlp":
        OTLPSpanExporter, OTLPMetricExporter = _otlp_exporters()
        base = config.otlp_endpoint.rstrip("/") if config.otlp_endpoint else None
        span_exporter = OTLPSpanExporter(endpoint=f"{base}/v1/traces" if base else None)
        metric_exporter = OTLPMetricExporter(endpoint=f"{base}/v1/metrics" if base else None)
    else:
        # sys.stdout as it is now (the exporters' defaults bind the one at import time).
        span_exporter, metric_exporter = ConsoleSpanExporter(out=sys.stdout), ConsoleMetricExporter(out=sys.stdout)

    # ParentBased: a producer's sampling decision wins; the ratio applies to traces that start here.
    tracer_provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=config.metric_interval_ms)
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    return _Telemetry(
        tracer_provider,
        meter_provider,
        registry,
        owned=True,
        flush_s=min(_FLUSH_S, config.metric_interval_ms / 1000),
        genai_latest=latest_from_env(),
        target=target,
    )


def _otlp_exporters() -> tuple[Any, Any]:
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            "telemetry exporter 'otlp' needs the package opentelemetry-exporter-otlp-proto-http "
            "(or opentelemetry-exporter-otlp); install it or choose 'console' or 'none'"
        ) from None
    return OTLPSpanExporter, OTLPMetricExporter


class _Cell:
    __slots__ = ("attrs", "value")

    def __init__(self, attrs: dict[str, str]) -> None:
        self.attrs = attrs
        self.value = 0


class _Counts:
    """The SDK sink's counters' running totals (counters and up-down counters alike), read by the SDK's
    collections through observable instruments: adding is a lookup and a sum, where one SDK measurement
    costs about 6 µs (it cleans and hashes the attributes each time), and the counters are read only when an
    export asks. Written on the event loop, read on the exporter's thread: a name's table is replaced, never
    changed in place, when an attribute set first appears (rare: the attributes are bounded), so a
    collection iterates a table nothing mutates; a value is one int read."""

    def __init__(self) -> None:
        self._tables: dict[str, dict[frozenset[tuple[str, str]], _Cell]] = {
            name: {} for name, (kind, _, _) in METRICS.items() if kind != "histogram"
        }

    def add(self, name: str, attrs: Mapping[str, str], n: int, key: frozenset[tuple[str, str]] | None = None) -> None:
        """``key``: ``frozenset(attrs.items())``, when the caller keeps it (an attempt's attributes)."""
        if key is None:
            key = frozenset(attrs.items())
        table = self._tables[name]
        cell = table.get(key)
        if cell is None:
            cell = _Cell(dict(attrs))
            self._tables[name] = {**table, key: cell}
        cell.value += n

    def callback(self, name: str) -> Callable[[CallbackOptions], list[Observation]]:
        from opentelemetry.metrics import Observation

        def observe(_options: CallbackOptions) -> list[Observation]:
            return [Observation(cell.value, cell.attrs) for cell in self._tables[name].values()]

        return observe


class _SdkSeries:
    """An attempt's figures for one route and dialect on the SDK's instruments and ``_Counts``."""

    __slots__ = ("_attrs", "_counts", "_inst", "_key")

    def __init__(self, sink: _SdkMetrics, route: str, dialect: str) -> None:
        self._inst, self._counts = sink.instruments, sink.counts
        self._attrs = {"route": route, "dialect": dialect}
        self._key = frozenset(self._attrs.items())  # the counts' key of attrs, made once

    def queue_wait(self, seconds: float) -> None:
        self._inst["sluice.queue.wait"].record(seconds, self._attrs)

    def first_byte(self, seconds: float) -> None:
        self._inst["sluice.attempt.time_to_first_byte"].record(seconds, self._attrs)

    def first_token(self, seconds: float) -> None:
        self._inst["sluice.attempt.time_to_first_token"].record(seconds, self._attrs)

    def event_gap(self, seconds: float) -> None:
        self._inst["sluice.stream.event_gap"].record(seconds, self._attrs)

    def cancel_close(self, seconds: float) -> None:
        self._inst["sluice.cancel.close_time"].record(seconds, self._attrs)

    def received(self, n_bytes: int, n_raw: int, n_events: int) -> None:
        for name, n in (
            ("sluice.provider.bytes", n_bytes),
            ("sluice.provider.events", n_raw),
            ("sluice.stream.events", n_events),
        ):
            if n:
                self._counts.add(name, self._attrs, n, self._key)

    def unknown(self, n: int) -> None:
        self._counts.add("sluice.provider.unknown_events", self._attrs, n, self._key)

    def retried(self, category: str) -> None:
        self._counts.add("sluice.retries", {**self._attrs, "error.category": category}, 1)

    def in_flight(self, delta: int) -> None:
        self._counts.add("sluice.streams.in_flight", self._attrs, delta, self._key)


class _SdkMetrics:
    """The OpenTelemetry SDK's instruments on ``meter_provider`` (the exporter ``console`` or ``otlp``)."""

    def __init__(self, meter_provider: MeterProvider, genai_latest: bool) -> None:
        self.meter_provider = meter_provider
        meter = meter_provider.get_meter(_SCOPE)
        self.instruments: dict[str, Any] = {}
        self.counts = _Counts()
        for name, (kind, unit, description) in METRICS.items():
            if kind == "histogram":
                self.instruments[name] = meter.create_histogram(
                    name, unit=unit, description=description, explicit_bucket_boundaries_advisory=DURATION_BUCKETS
                )
            elif kind == "counter":
                meter.create_observable_counter(name, [self.counts.callback(name)], unit=unit, description=description)
            else:
                meter.create_observable_up_down_counter(
                    name, [self.counts.callback(name)], unit=unit, description=description
                )
        for name, (unit, description, buckets, _, latest_only) in GENAI_METRICS.items():
            if genai_latest or not latest_only:
                self.instruments[name] = meter.create_histogram(
                    name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets
                )

    def series(self, route: str, dialect: str) -> _SdkSeries:
        return _SdkSeries(self, route, dialect)

    def genai(self, name: str, attributes: Mapping[str, str | int], value: float) -> None:
        if (instrument := self.instruments.get(name)) is not None:
            instrument.record(value, attributes)

    def terminal(self, route: str, dialect: str, status: str, stop_reason: str, category: str) -> None:
        attrs = {"route": route, "dialect": dialect, "status": status}
        if stop_reason:
            attrs["stop_reason"] = stop_reason
        if category:
            attrs["error.category"] = category
        self.counts.add("sluice.requests.terminal", attrs, 1)

    def observe(self, name: str, unit: str, description: str, read: Reading, *, counter: bool, scope: str) -> None:
        from opentelemetry.metrics import Observation

        def callback(_options: CallbackOptions) -> list[Observation]:
            return [Observation(value, attrs) for value, attrs in read()]

        meter = self.meter_provider.get_meter(scope)
        create = meter.create_observable_counter if counter else meter.create_observable_gauge
        create(name, [callback], unit=unit, description=description)

    def histogram(self, name: str, unit: str, description: str, buckets: Sequence[float], *, scope: str) -> Recorder:
        meter = self.meter_provider.get_meter(scope)
        return meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets
        )


class _Recorders:
    """One histogram in every sink."""

    __slots__ = ("_each",)

    def __init__(self, each: Sequence[Recorder]) -> None:
        self._each = tuple(each)

    def record(self, amount: float) -> None:
        for r in self._each:
            r.record(amount)


class _Telemetry(Telemetry):
    enabled = True

    def __init__(
        self,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
        registry: CollectorRegistry | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = _wall_ms,
        owned: bool,
        flush_s: float = _FLUSH_S,
        genai_latest: bool = False,
        target: Mapping[str, str],
    ) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.clock = clock
        self.wall_ms = wall_ms
        self._owned = owned
        self.flush_s = flush_s
        self.genai_latest = genai_latest
        self._prom: PromMetrics | None = None
        self._sdk: _SdkMetrics | None = None
        if registry is not None:
            from sluice.worker.observability.metrics import PromMetrics

            self._prom = PromMetrics(registry, genai_latest=genai_latest, target=target)
        if meter_provider is not None:
            self._sdk = _SdkMetrics(meter_provider, genai_latest)
        self.sinks: tuple[_Sink, ...] = tuple(s for s in (self._prom, self._sdk) if s is not None)
        self._series: dict[tuple[str, str], tuple[_Series, ...]] = {}  # (route, dialect) -> each sink's
        # A no-op tracer makes no span: the attempts skip every span call, a third of an attempt's telemetry.
        self.tracing = False
        if tracer_provider is not None:
            from opentelemetry.trace import NoOpTracerProvider
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self.tracing = not isinstance(tracer_provider, NoOpTracerProvider)
            self.tracer = tracer_provider.get_tracer(_SCOPE)
            self.propagator = TraceContextTextMapPropagator()

    def series(self, route: str, dialect: str) -> tuple[_Series, ...]:
        """Each sink's figures of ``route`` and ``dialect``, made at its first attempt and kept."""
        if (series := self._series.get((route, dialect))) is None:
            series = self._series[(route, dialect)] = tuple(s.series(route, dialect) for s in self.sinks)
        return series

    def attempt(
        self,
        *,
        request_id: str,
        route: str,
        dialect: str,
        model: str | None,
        attempt: int,
        trace: Mapping[str, str] | None = None,
        queued_at_ms: int | None = None,
        genai: GenAICall | None = None,
    ) -> AttemptTelemetry:
        series = self.series(route, dialect)
        wait = None
        if queued_at_ms is not None:
            wait = max(0, self.wall_ms() - queued_at_ms)
            for s in series:
                s.queue_wait(wait / 1000)
        for s in series:
            s.in_flight(1)
        if not self.tracing:
            return _Attempt(self, series, None, None, genai)

        from opentelemetry.context import Context
        from opentelemetry.trace import SpanKind, set_span_in_context

        # Header names are case-insensitive (W3C Trace Context §3.2); only the two known keys are read.
        carrier = {k.lower(): v for k, v in (trace or {}).items() if k.lower() in _TRACE_KEYS}
        # Without a producer context the span is a root, whatever span happens to be current.
        parent = self.propagator.extract(carrier, context=Context()) if carrier else Context()
        span_attrs: dict[str, str | int] = {"route": route, "dialect": dialect}
        span_attrs |= {"attempt": attempt, "request_id": request_id}
        if model:
            span_attrs["model"] = model
        if wait is not None:
            span_attrs["queue_wait_ms"] = wait
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.CONSUMER, attributes=span_attrs)
        client = None
        if genai is not None:
            client = self.tracer.start_span(
                genai.span_name(),
                context=set_span_in_context(span),
                kind=SpanKind.CLIENT,
                attributes=genai.span_attributes(self.genai_latest),
            )
        return _Attempt(self, series, span, client, genai)

    def observe(
        self, name: str, unit: str, description: str, read: Reading, *, counter: bool = False, scope: str = _SCOPE
    ) -> None:
        if self._prom is not None:
            self._prom.observe(name, unit, description, read, counter=counter)
        if self._sdk is not None:
            self._sdk.observe(name, unit, description, read, counter=counter, scope=scope)

    def histogram(
        self, name: str, unit: str, description: str, buckets: Sequence[float], *, scope: str = _SCOPE
    ) -> Recorder:
        recorders: list[Recorder] = []
        if self._prom is not None:
            recorders.append(self._prom.histogram(name, unit, description, buckets))
        if self._sdk is not None:
            recorders.append(self._sdk.histogram(name, unit, description, buckets, scope=scope))
        return recorders[0] if len(recorders) == 1 else _Recorders(recorders)

    def request_finished(
        self, *, route: str, dialect: str, status: str, stop_reason: str | None = None, category: str | None = None
    ) -> None:
        for sink in self.sinks:
            sink.terminal(route, dialect, status, stop_reason or "", category or "")

    def shutdown(self) -> None:
        # Ours: shut down; the caller's: flushed. prometheus-client's instruments need neither, and the no-op
        # tracer provider has neither method.
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                getattr(provider, "shutdown" if self._owned else "force_flush", lambda: None)()


class _Attempt(AttemptTelemetry):
    __slots__ = (
        "_call",
        "_client",
        "_finished",
        "_first_byte",
        "_first_chunk",
        "_first_token",
        "_model_seen",
        "_sent_bytes",
        "_sent_events",
        "_sent_raw",
        "_series",
        "_span",
        "_start",
        "_t",
        "_token",
    )

    def __init__(
        self,
        telemetry: _Telemetry,
        series: tuple[_Series, ...],
        span: Span | None,
        client: Span | None = None,
        call: GenAICall | None = None,
    ) -> None:
        self._t = telemetry
        self._series = series  # each sink's figures of the attempt's route and dialect
        self._span = span  # None: no tracing (then no CLIENT span either), the metrics alone
        self._client = client  # the GenAI CLIENT span, a child of the attempt's
        self._call = call
        self._start = telemetry.clock()
        self._first_byte: float | None = None
        self._first_chunk: float | None = None
        self._first_token: float | None = None
        self._model_seen = False  # the first call with events was looked at for the response's model
        self._finished = False
        self._token: object | None = None
        # The totals already handed over: a window hands over the differences.
        self._sent_bytes = self._sent_raw = self._sent_events = 0

    def __enter__(self) -> Self:
        if self._span is None:
            return self
        from opentelemetry import context
        from opentelemetry.trace import set_span_in_context

        # Current for the attempt, so logs and any instrumented client see it (child tasks inherit it):
        # the CLIENT span when there is one, so an instrumented HTTP client nests under the model call.
        self._token = context.attach(set_span_in_context(self._client or self._span))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._finished:
            # Left without finish(): fenced, Redis gone, a bug, or cancelled (not an error of the attempt).
            if exc_type is not None and issubclass(exc_type, Exception):
                if self._span is not None:
                    from opentelemetry.trace import Status, StatusCode

                    for span in (self._span, self._client):
                        if span is not None:
                            span.set_attribute("error.type", exc_type.__name__)
                            span.set_status(Status(StatusCode.ERROR, exc_type.__name__))
                self._record_genai(exc_type.__name__, None)
            self._end()
        if self._token is not None:
            from opentelemetry import context

            context.detach(self._token)  # type: ignore[arg-type]
            self._token = None

    @property
    def trace_id(self) -> str | None:
        return None if self._span is None else f"{self._span.get_span_context().trace_id:032x}"

    def on_response(self, status_code: int) -> None:
        if self._span is not None:
            self._span.set_attribute("http.response.status_code", status_code)
        if self._client is not None:
            self._client.set_attribute("http.response.status_code", status_code)

    @property
    def window_end(self) -> float:
        return self._start + self._t.flush_s

    def firsts(self, now: float, n_raw: int, events: Sequence[Event]) -> bool:
        client, span, call = self._client, self._span, self._call
        if self._first_byte is None:
            self._first_byte = now
            for s in self._series:
                s.first_byte(now - self._start)
            if span is not None:
                span.add_event("first_byte")
        if n_raw and self._first_chunk is None and call is not None:
            self._first_chunk_at(now)
        if events and not self._model_seen:
            self._model_seen = True
            first = events[0]
            if client is not None and isinstance(first, StreamStart) and first.model:
                # The provider's model when its stream names one, else the requested one.
                client.set_attribute("gen_ai.response.model", first.model)
        if events and self._first_token is None and any(isinstance(e, BlockDelta) for e in events):
            self._first_token = now
            for s in self._series:
                s.first_token(now - self._start)
            if span is not None:
                span.add_event("first_token")
        # Traced, the CLIENT span exists exactly when the GenAI call does.
        return (
            self._first_token is None
            or (call is not None and self._first_chunk is None)
            or (client is not None and not self._model_seen)
        )

    def window(self, now: float, received: int, gap: float, stats: Callable[[], Mapping[str, int]]) -> float:
        totals = stats()
        self._hand_over(received, totals.get("sse_events", self._sent_raw), totals.get("events", self._sent_events))
        if gap >= 0:
            for s in self._series:
                s.event_gap(gap)
        return now + self._t.flush_s

    def _hand_over(self, n_bytes: int, n_raw: int, n_events: int) -> None:
        """Hand over what the running totals grew by since the last hand-over."""
        grew = (
            max(0, n_bytes - self._sent_bytes),
            max(0, n_raw - self._sent_raw),
            max(0, n_events - self._sent_events),
        )
        if any(grew):
            for s in self._series:
                s.received(*grew)
        self._sent_bytes = max(self._sent_bytes, n_bytes)
        self._sent_raw = max(self._sent_raw, n_raw)
        self._sent_events = max(self._sent_events, n_events)

    def _first_chunk_at(self, now: float) -> None:
        """The first complete provider event (a chunk, in the conventions' words) arrived at ``now``."""
        self._first_chunk = now
        if self._t.genai_latest and self._call is not None:
            seconds = now - self._start
            if self._client is not None:
                self._client.set_attribute("gen_ai.response.time_to_first_chunk", seconds)
            metric = self._call.metric_attributes(latest=True)
            for sink in self._t.sinks:
                sink.genai("gen_ai.client.operation.time_to_first_chunk", metric, seconds)

    def _record_genai(self, error_type: str | None, usage: Usage | None) -> None:
        """The GenAI duration and token metrics, once, at the attempt's end."""
        if self._call is None:
            return
        attrs = self._call.metric_attributes(self._t.genai_latest)
        duration = {**attrs, "error.type": error_type} if error_type else attrs
        seconds = self._t.clock() - self._start
        tokens = []
        if usage is not None:
            for kind, n in (("input", usage.input_tokens), ("output", usage.output_tokens)):
                if n is not None:
                    tokens.append(({**attrs, "gen_ai.token.type": kind}, n))
        for sink in self._t.sinks:
            sink.genai("gen_ai.client.operation.duration", duration, seconds)
            for token_attrs, n in tokens:
                sink.genai("gen_ai.client.token.usage", token_attrs, n)

    def _finish_client(self, client: Span, terminal: Event | None, usage: Usage | None, error_type: str | None) -> None:
        """The CLIENT span's response attributes (``error_type``: the GenAI ``error.type``, None: no error)."""
        from opentelemetry.trace import Status, StatusCode

        if isinstance(terminal, StreamDone):
            client.set_attribute(
                "gen_ai.response.finish_reasons", [terminal.provider_stop_reason or terminal.stop_reason]
            )
        elif error_type is not None:
            client.set_attribute("error.type", error_type)
            client.set_status(Status(StatusCode.ERROR, error_type))
        if usage is not None:
            counts = [
                ("gen_ai.usage.input_tokens", usage.input_tokens),
                ("gen_ai.usage.output_tokens", usage.output_tokens),
            ]
            if self._t.genai_latest:
                counts += [
                    ("gen_ai.usage.cache_read.input_tokens", usage.cache_read_tokens),
                    ("gen_ai.usage.cache_creation.input_tokens", usage.cache_write_tokens),
                    ("gen_ai.usage.reasoning.output_tokens", usage.reasoning_tokens),
                ]
            for key, n in counts:
                if n is not None:
                    client.set_attribute(key, n)

    def record_cancel(self, requested_at: float | None, closed_at: float | None) -> None:
        if requested_at is None or closed_at is None:
            return
        seconds = max(0.0, closed_at - requested_at)
        for s in self._series:
            s.cancel_close(seconds)
        if self._span is not None:
            self._span.set_attribute("cancel_to_close_ms", seconds * 1000)

    def finish(
        self,
        terminal: Event | None,
        stats: Mapping[str, int],
        *,
        retrying: bool = False,
        response_id: str | None = None,
    ) -> None:
        if self._finished:
            return
        # What the body's last window did not hand over: events made outside it (an HTTP error status, a
        # timer, a cancel, the end of input's) and the provider events the end of input completed.
        self._hand_over(
            self._sent_bytes, stats.get("sse_events", self._sent_raw), stats.get("events", self._sent_events)
        )
        unknown = stats.get("unknown_events", 0)
        error_type = None  # the GenAI error.type: the failure's category (a cancel on request is no fault)
        category = terminal.error.category if isinstance(terminal, StreamError) else None
        for s in self._series:
            if unknown:
                s.unknown(unknown)
            if category is not None and retrying:
                s.retried(category)
        if category is not None and category != "cancelled":
            error_type = category
        usage = terminal.usage if isinstance(terminal, StreamDone | StreamError) else None
        if self._span is not None:
            self._finish_span(self._span, terminal, unknown, usage, error_type, retrying=retrying)
        if self._client is not None:
            if response_id:
                self._client.set_attribute("gen_ai.response.id", response_id)
            self._finish_client(self._client, terminal, usage, error_type)
        self._record_genai(error_type, usage)
        self._end()

    def _finish_span(
        self,
        span: Span,
        terminal: Event | None,
        unknown: int,
        usage: Usage | None,
        error_type: str | None,
        *,
        retrying: bool,
    ) -> None:
        """The attempt span's outcome attributes (``error_type``: set when the attempt failed by fault)."""
        from opentelemetry.trace import Status, StatusCode

        if unknown:
            span.set_attribute("unknown_events", unknown)
        if isinstance(terminal, StreamDone):
            span.set_attribute("status", "completed")
            span.set_attribute("stop_reason", terminal.stop_reason)
        elif isinstance(terminal, StreamError):
            category = terminal.error.category
            span.set_attribute("status", terminal.status)
            span.set_attribute("error.category", category)
            if error_type is not None:
                span.set_status(Status(StatusCode.ERROR, error_type))
        if retrying:
            span.set_attribute("retrying", True)
        if usage is not None:
            # Token counts only (GenAI semantic conventions); never the text they measure.
            if usage.input_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
            if usage.output_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)

    def _end(self) -> None:
        self._finished = True
        if self._client is not None:
            self._client.end()
        if self._span is not None:
            self._span.end()
        for s in self._series:
            s.in_flight(-1)
