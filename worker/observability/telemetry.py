"""OpenTelemetry traces and metrics for the worker, chosen by configuration.

Rule: telemetry observes and never decides. Attributes carry identifiers, route names, dialects,
statuses, categories and counts, never secrets, prompts, model output, job metadata or error messages
(a provider's message may quote the prompt). Metric attributes stay bounded (configured route names,
dialects and the contract's vocabularies), so model names and request ids appear on spans only. With the
exporter ``none`` nothing of OpenTelemetry is imported or created: every method is an empty call, unless
the admin endpoint is on (``sluice.worker.observability.admin``): then no span is made (the attempts skip every span
call), and every instrument, this module's and those the other homes define through ``observe`` and
``histogram``, is the worker's own (``sluice.worker.observability.histograms``), read by the endpoint alone.

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
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, Self

import msgspec

from sluice.schemas.errors import ConfigError
from sluice.schemas.events import BlockDelta, Event, StreamDone, StreamError, StreamStart, Usage
from sluice.worker.observability.genai import SECONDS_BUCKETS, TOKEN_BUCKETS, GenAICall, latest_from_env

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.trace import Span, TracerProvider

    from sluice.worker.observability.histograms import OwnInstrument, Reading

__all__ = [
    "DISABLED",
    "GENAI_METRICS",
    "METRICS",
    "NO_ATTEMPT",
    "SPAN_NAME",
    "AttemptTelemetry",
    "Recorder",
    "Telemetry",
    "TelemetryConfig",
    "entry_time_ms",
]

SPAN_NAME = "sluice.attempt"
_SCOPE = "sluice.worker"
_TRACE_KEYS = ("traceparent", "tracestate")

# Instrument name -> (kind, unit, description). Durations are milliseconds.
METRICS: dict[str, tuple[str, str, str]] = {
    "sluice.queue.wait": ("histogram", "ms", "time from enqueue (the jobs-stream entry id) to the first attempt"),
    "sluice.attempt.time_to_first_byte": ("histogram", "ms", "attempt start to the first body byte"),
    "sluice.attempt.time_to_first_token": ("histogram", "ms", "attempt start to the first block.delta"),
    "sluice.stream.event_gap": (
        "histogram",
        "ms",
        "per stream, the longest time between reads that produced contract events, once per flush window (at most 5 s)",
    ),
    "sluice.stream.events": ("counter", "{event}", "contract events produced"),
    "sluice.provider.events": ("counter", "{event}", "raw provider (SSE) events received"),
    "sluice.provider.bytes": ("counter", "By", "response body bytes received"),
    "sluice.streams.in_flight": ("updown", "{stream}", "attempts running now"),
    "sluice.provider.unknown_events": ("counter", "{event}", "provider events the adapter did not know"),
    "sluice.retries": ("counter", "{retry}", "attempts that ended retryable and were retried"),
    "sluice.requests.terminal": ("counter", "{request}", "requests that reached their terminal status"),
    "sluice.cancel.close_time": ("histogram", "ms", "cancel requested to upstream closed"),
}
# The GenAI conventions' client metrics (seconds and tokens, their advisory buckets); time_to_first_chunk
# is v1.41.0's, emitted with OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental only.
GENAI_METRICS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "gen_ai.client.operation.duration": ("s", "GenAI operation duration.", SECONDS_BUCKETS),
    "gen_ai.client.token.usage": ("{token}", "Number of input and output tokens used.", TOKEN_BUCKETS),
    "gen_ai.client.operation.time_to_first_chunk": (
        "s",
        "Time to receive the first chunk, from when the request is issued.",
        SECONDS_BUCKETS,
    ),
}
# The body's figures (bytes, events, the longest gap) are handed over once per window: the counters as what
# the running totals grew by, to the worker's own counts (_Counts); the gap to its histogram (one SDK
# measurement costs about 6 µs, more than normalizing the event).
_FLUSH_S = 5.0
# LLM latencies reach minutes; the SDK's default boundaries stop at 10 s.
_MS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000)


class TelemetryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``exporter``: ``none`` (off), ``console`` (stdout) or ``otlp`` (OTLP/HTTP; needs the package
    ``opentelemetry-exporter-otlp-proto-http``). ``otlp_endpoint`` is the collector's base URL
    (``/v1/traces`` and ``/v1/metrics`` are appended); unset, the ``OTEL_EXPORTER_OTLP_*`` environment
    applies. ``sample_ratio`` samples root traces; a producer's sampled flag is always followed."""

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
    """A histogram as its homes record into it: the SDK's or the worker's own."""

    def record(self, amount: float, attributes: Mapping[str, Any] | None = None) -> None: ...


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
        config: TelemetryConfig, *, instance_id: str | None = None, metric_readers: Sequence[MetricReader] = ()
    ) -> Telemetry:
        """Build exporters and providers for ``config``; ``DISABLED`` for ``none`` without
        ``metric_readers``. The readers (the admin endpoint's Prometheus reader) see every instrument
        whatever the exporter: with ``none`` they are the only ones, and no span is recorded. Raises
        ``ConfigError`` when the OTLP exporter is asked for but not installed."""
        if config.exporter == "none" and not metric_readers:
            return DISABLED
        return _build(config, instance_id, metric_readers)

    @staticmethod
    def with_providers(
        tracer_provider: TracerProvider,
        meter_provider: MeterProvider,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = _wall_ms,
        genai_latest: bool | None = None,
        histograms_for: Sequence[MetricReader] = (),
        resource: Resource | None = None,
    ) -> Telemetry:
        """Telemetry on providers the caller built and shuts down (tests: in-memory exporters).
        ``clock`` (monotonic seconds) times attempts; ``wall_ms`` (unix ms) measures the queue wait;
        ``genai_latest``: the latest GenAI names (None: as ``OTEL_SEMCONV_STABILITY_OPT_IN`` says);
        ``histograms_for``: the meter provider's readers, when all are ``histograms.prometheus_reader``'s
        the instruments are the worker's own (as with the exporter ``none``), and ``resource`` their
        ``target_info``."""
        latest = latest_from_env() if genai_latest is None else genai_latest
        return _OtelTelemetry(
            tracer_provider,
            meter_provider,
            clock=clock,
            wall_ms=wall_ms,
            owned=False,
            genai_latest=latest,
            histograms_for=histograms_for,
            resource=resource,
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
    # ``sluice.worker.observability.archive_watch``): the SDK's, or the worker's own where its are (the admin endpoint
    # alone), so that a scrape then runs no SDK collection at all.

    def observe(
        self, name: str, unit: str, description: str, read: Reading, *, counter: bool = False, scope: str = _SCOPE
    ) -> None:
        """A gauge (or a cumulative ``counter``) whose series ``read`` gives as (value, attributes) at each
        collection; nothing when telemetry is off."""

    def histogram(
        self, name: str, unit: str, description: str, buckets: Sequence[float], *, scope: str = _SCOPE
    ) -> Recorder | None:
        """A histogram (``record(amount, attributes=None)``); None when telemetry is off."""
        return None

    def request_finished(
        self, *, route: str, dialect: str, status: str, stop_reason: str | None = None, category: str | None = None
    ) -> None:
        """A request's terminal status was stored (once per request). Pass ``route=""`` for a route that
        is not configured: a producer's arbitrary string must not become a metric attribute."""

    def shutdown(self) -> None:
        """Flush; shut down the providers this object built (blocking: run it in a thread from async code)."""


DISABLED = Telemetry()


# -- the OpenTelemetry implementation (imported lazily: "none" never loads OpenTelemetry) -----------


def _build(config: TelemetryConfig, instance_id: str | None, extra_readers: Sequence[MetricReader]) -> Telemetry:
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        MetricExporter,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace import NoOpTracerProvider

    attrs: dict[str, str] = {"service.name": config.service_name}
    if instance_id:
        attrs["service.instance.id"] = instance_id
    resource = Resource.create(attrs)
    if config.exporter == "none":
        # Metrics for the extra readers only; spans would go nowhere, so none is made (no-op tracer). Without
        # spans no exemplar is ever sampled: the filter that would ask for the current span on every
        # measurement is off.
        return _OtelTelemetry(
            NoOpTracerProvider(),
            MeterProvider(
                resource=resource, metric_readers=list(extra_readers), exemplar_filter=AlwaysOffExemplarFilter()
            ),
            clock=time.monotonic,
            wall_ms=_wall_ms,
            owned=True,
            genai_latest=latest_from_env(),
            histograms_for=extra_readers,
            resource=resource,
        )
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
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader, *extra_readers])
    return _OtelTelemetry(
        tracer_provider,
        meter_provider,
        clock=time.monotonic,
        wall_ms=_wall_ms,
        owned=True,
        flush_s=min(_FLUSH_S, config.metric_interval_ms / 1000),
        genai_latest=latest_from_env(),
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


class _OtelTelemetry(Telemetry):
    enabled = True

    def __init__(
        self,
        tracer_provider: TracerProvider,
        meter_provider: MeterProvider,
        *,
        clock: Callable[[], float],
        wall_ms: Callable[[], int],
        owned: bool,
        flush_s: float = _FLUSH_S,
        genai_latest: bool = False,
        histograms_for: Sequence[MetricReader] = (),
        resource: Resource | None = None,
    ) -> None:
        from opentelemetry.trace import NoOpTracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from sluice.worker.observability.histograms import OwnSum, attach, is_prometheus_reader

        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.clock = clock
        self.wall_ms = wall_ms
        self._owned = owned
        self.flush_s = flush_s
        self.genai_latest = genai_latest
        self.tracer = tracer_provider.get_tracer(_SCOPE)
        # A no-op tracer (the exporter ``none``: metrics for the admin endpoint alone) makes no span: the
        # attempts skip every span call, a third of an attempt's telemetry (docs/benchmarks.md).
        self.tracing = not isinstance(tracer_provider, NoOpTracerProvider)
        self.propagator = TraceContextTextMapPropagator()
        meter = meter_provider.get_meter(_SCOPE)
        self.instruments: dict[str, Any] = {}
        self.counts = _Counts()
        # The worker's own instruments when every reader is the admin endpoint's (observability.histograms):
        # then every instrument is, this module's and the homes' that ``observe`` and ``histogram`` make.
        own = bool(histograms_for) and all(is_prometheus_reader(r) for r in histograms_for)
        self._own_mode = own
        self._own: list[OwnInstrument] = []
        for name, (kind, unit, description) in METRICS.items():
            if kind == "histogram":
                self.instruments[name] = self.histogram(name, unit, description, _MS_BUCKETS)
            elif own:
                cells = self.counts.table(name)
                self._own.append(OwnSum(name, unit, description, monotonic=kind == "counter", cells=cells))
            elif kind == "counter":
                meter.create_observable_counter(name, [self.counts.callback(name)], unit=unit, description=description)
            else:
                meter.create_observable_up_down_counter(
                    name, [self.counts.callback(name)], unit=unit, description=description
                )
        for name, (unit, description, buckets) in GENAI_METRICS.items():
            self.instruments[name] = self.histogram(name, unit, description, buckets)
        for reader in histograms_for if own else ():
            attach(reader, self._own, _SCOPE, resource)

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
        metric_attrs = {"route": route, "dialect": dialect}
        wait = None
        if queued_at_ms is not None:
            wait = max(0, self.wall_ms() - queued_at_ms)
            self.instruments["sluice.queue.wait"].record(wait, metric_attrs)
        self.counts.add("sluice.streams.in_flight", metric_attrs, 1)
        if not self.tracing:
            return _OtelAttempt(self, None, metric_attrs, None, genai)

        from opentelemetry.context import Context
        from opentelemetry.trace import SpanKind, set_span_in_context

        # Header names are case-insensitive (W3C Trace Context §3.2); only the two known keys are read.
        carrier = {k.lower(): v for k, v in (trace or {}).items() if k.lower() in _TRACE_KEYS}
        # Without a producer context the span is a root, whatever span happens to be current.
        parent = self.propagator.extract(carrier, context=Context()) if carrier else Context()
        span_attrs: dict[str, str | int] = {**metric_attrs, "attempt": attempt, "request_id": request_id}
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
        return _OtelAttempt(self, span, metric_attrs, client, genai)

    def _own_named(self, name: str) -> OwnInstrument | None:
        """The worker's own instrument of that name, if one is defined: a name defined again keeps the
        first, as the SDK keeps it."""
        return next((i for i in self._own if i.name == name), None)

    def observe(
        self, name: str, unit: str, description: str, read: Reading, *, counter: bool = False, scope: str = _SCOPE
    ) -> None:
        if self._own_mode:
            from sluice.worker.observability.histograms import OwnObserved

            if self._own_named(name) is None:  # defined again (two workers of one process): the first stays
                self._own.append(
                    OwnObserved(name, unit, description, kind="counter" if counter else "gauge", read=read)
                )
            return
        from opentelemetry.metrics import Observation

        def callback(_options: CallbackOptions) -> list[Observation]:
            return [Observation(value, attrs) for value, attrs in read()]

        meter = self.meter_provider.get_meter(scope)
        create = meter.create_observable_counter if counter else meter.create_observable_gauge
        create(name, [callback], unit=unit, description=description)

    def histogram(
        self, name: str, unit: str, description: str, buckets: Sequence[float], *, scope: str = _SCOPE
    ) -> Recorder:
        if self._own_mode:
            from sluice.worker.observability.histograms import OwnHistogram

            if isinstance(known := self._own_named(name), OwnHistogram):  # defined again: the same one
                return known
            self._own.append(h := OwnHistogram(name, unit, description, buckets))
            return h
        meter = self.meter_provider.get_meter(scope)
        return meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets
        )

    def request_finished(
        self, *, route: str, dialect: str, status: str, stop_reason: str | None = None, category: str | None = None
    ) -> None:
        attrs = {"route": route, "dialect": dialect, "status": status}
        if stop_reason:
            attrs["stop_reason"] = stop_reason
        if category:
            attrs["error.category"] = category
        self.counts.add("sluice.requests.terminal", attrs, 1)

    def shutdown(self) -> None:
        # The no-op tracer provider (metrics only) has neither shutdown nor force_flush.
        if self._owned:
            getattr(self.tracer_provider, "shutdown", lambda: None)()
            self.meter_provider.shutdown()  # type: ignore[attr-defined]
        else:
            self.tracer_provider.force_flush()  # type: ignore[attr-defined]
            self.meter_provider.force_flush()  # type: ignore[attr-defined]


class _Cell:
    __slots__ = ("attrs", "value")

    def __init__(self, attrs: dict[str, str]) -> None:
        self.attrs = attrs
        self.value = 0


class _Counts:
    """The counters' running totals (counters and up-down counters alike), kept here and read by the SDK's
    collections through observable instruments: adding is a lookup and a sum, where one SDK measurement costs
    about 6 µs (it cleans and hashes the attributes each time), and the counters are read only when a
    scrape or an export asks. Written on the event loop, read on the exporter's or the scrape's thread: a
    name's table is replaced, never changed in place, when an attribute set first appears (rare: the
    attributes are bounded), so a collection iterates a table nothing mutates; a value is one int read."""

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

    def table(self, name: str) -> Callable[[], Mapping[frozenset[tuple[str, str]], _Cell]]:
        """Reads ``name``'s table as it is now (``histograms.OwnSum``'s cells)."""
        return lambda: self._tables[name]

    def callback(self, name: str) -> Callable[[CallbackOptions], list[Observation]]:
        from opentelemetry.metrics import Observation

        def observe(_options: CallbackOptions) -> list[Observation]:
            return [Observation(cell.value, cell.attrs) for cell in self._tables[name].values()]

        return observe


class _OtelAttempt(AttemptTelemetry):
    __slots__ = (
        "_attrs",
        "_call",
        "_client",
        "_finished",
        "_first_byte",
        "_first_chunk",
        "_first_token",
        "_key",
        "_model_seen",
        "_sent_bytes",
        "_sent_events",
        "_sent_raw",
        "_span",
        "_start",
        "_t",
        "_token",
    )

    def __init__(
        self,
        telemetry: _OtelTelemetry,
        span: Span | None,
        attrs: dict[str, str],
        client: Span | None = None,
        call: GenAICall | None = None,
    ) -> None:
        self._t = telemetry
        self._span = span  # None: no tracing (then no CLIENT span either), the metrics alone
        self._attrs = attrs
        self._key = frozenset(attrs.items())  # the counts' key of attrs, made once
        self._client = client  # the GenAI CLIENT span, a child of the attempt's
        self._call = call
        self._start = telemetry.clock()
        self._first_byte: float | None = None
        self._first_chunk: float | None = None
        self._first_token: float | None = None
        self._model_seen = False  # the first call with events was looked at for the response's model
        self._finished = False
        self._token: object | None = None
        # The totals already added to the worker's counts: a window hands over the differences.
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
            self._t.instruments["sluice.attempt.time_to_first_byte"].record((now - self._start) * 1000, self._attrs)
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
            self._t.instruments["sluice.attempt.time_to_first_token"].record((now - self._start) * 1000, self._attrs)
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
            self._t.instruments["sluice.stream.event_gap"].record(gap * 1000, self._attrs)
        return now + self._t.flush_s

    def _hand_over(self, n_bytes: int, n_raw: int, n_events: int) -> None:
        """Add what the running totals grew by since the last hand-over to the worker's counts."""
        counts, attrs, key = self._t.counts, self._attrs, self._key
        for name, n in (
            ("sluice.provider.bytes", n_bytes - self._sent_bytes),
            ("sluice.provider.events", n_raw - self._sent_raw),
            ("sluice.stream.events", n_events - self._sent_events),
        ):
            if n > 0:
                counts.add(name, attrs, n, key)
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
            self._t.instruments["gen_ai.client.operation.time_to_first_chunk"].record(seconds, metric)

    def _record_genai(self, error_type: str | None, usage: Usage | None) -> None:
        """The GenAI duration and token metrics, once, at the attempt's end."""
        if self._call is None:
            return
        attrs = self._call.metric_attributes(self._t.genai_latest)
        inst = self._t.instruments
        duration = {**attrs, "error.type": error_type} if error_type else attrs
        inst["gen_ai.client.operation.duration"].record(self._t.clock() - self._start, duration)
        if usage is not None:
            for kind, n in (("input", usage.input_tokens), ("output", usage.output_tokens)):
                if n is not None:
                    inst["gen_ai.client.token.usage"].record(n, {**attrs, "gen_ai.token.type": kind})

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
        ms = max(0.0, (closed_at - requested_at) * 1000)
        self._t.instruments["sluice.cancel.close_time"].record(ms, self._attrs)
        if self._span is not None:
            self._span.set_attribute("cancel_to_close_ms", ms)

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
        attrs, counts = self._attrs, self._t.counts
        # What the body's last window did not hand over: events made outside it (an HTTP error status, a
        # timer, a cancel, the end of input's) and the provider events the end of input completed.
        self._hand_over(
            self._sent_bytes, stats.get("sse_events", self._sent_raw), stats.get("events", self._sent_events)
        )
        unknown = stats.get("unknown_events", 0)
        if unknown:
            counts.add("sluice.provider.unknown_events", attrs, unknown, self._key)
        error_type = None  # the GenAI error.type: the failure's category (a cancel on request is no fault)
        if isinstance(terminal, StreamError):
            category = terminal.error.category
            if retrying:
                counts.add("sluice.retries", {**attrs, "error.category": category}, 1)
            if category != "cancelled":
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
        self._t.counts.add("sluice.streams.in_flight", self._attrs, -1, self._key)
