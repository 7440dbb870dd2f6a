"""sluice.worker.observability.histograms against the SDK's own histograms: the same attempts, read through the worker's
body reader under one hand-driven clock, recorded once into the SDK's histograms (the OpenTelemetry
exporter's plain reader) and once into the worker's own (``prometheus_reader``), give the same ``/metrics``
families, sample for sample, in both exposition formats; the edge cases the SDK defines (values on a bound,
negative and non-finite values, the cardinality limit) come out as the SDK's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import openmetrics as om
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from sluice.normalizer.stream import Normalizer
from sluice.worker.observability import histograms
from sluice.worker.observability.genai import GenAICall
from sluice.worker.observability.histograms import OwnHistogram, prometheus_reader
from sluice.worker.observability.telemetry import Telemetry
from tests.helpers import info
from tests.unit.test_telemetry import CHUNKS, Clock, Harness, _Leave, _leave_at, _read


def _run(own: bool, script: Callable[[Telemetry, Harness], None], traced: bool = False) -> CollectorRegistry:
    """``script`` on telemetry whose metrics go to a Prometheus registry; ``traced``: with a real tracer
    (spans to memory), else the no-op tracer of the exporter ``none``."""
    registry = CollectorRegistry(auto_describe=True)
    reader = prometheus_reader(registry) if own else PrometheusMetricReader(registry=registry, scope_info_enabled=False)
    provider = MeterProvider(metric_readers=[reader], exemplar_filter=AlwaysOffExemplarFilter())
    spans = InMemorySpanExporter()
    tracer_provider: Any = NoOpTracerProvider()
    if traced:
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    clock = Clock()
    wall = [1_700_000_001_500]
    tel = Telemetry.with_providers(
        tracer_provider, provider, clock=clock, wall_ms=lambda: wall[0], genai_latest=True, histograms_for=[reader]
    )
    assert bool(tel._own) is own and tel.tracing is traced  # type: ignore[attr-defined]
    script(tel, Harness(tel, spans, InMemoryMetricReader(), clock, wall))
    assert bool(spans.get_finished_spans()) is traced
    return registry


def _families(text: str, parse: Callable[[str], Any]) -> list[tuple[Any, ...]]:
    """The families but target_info: the SDK's reader writes it only when the SDK collected something, and
    the own side writes it only when given the resource (``_run`` gives none)."""
    out = []
    for f in parse(text):
        if f.name in ("target", "target_info"):  # OpenMetrics and the 0.0.4 text
            continue
        samples = sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples)
        out.append((f.name, f.type, f.documentation, f.unit, samples))
    return sorted(out)


def _attempts(tel: Telemetry, h: Harness) -> None:
    for i in range(6):
        route = ("claude", "claude-eu")[i % 2]
        call = GenAICall("anthropic", "claude-x", True, "api.anthropic.com", 443)
        h.clock.now = 10.0
        with tel.attempt(
            request_id=f"r{i}",
            route=route,
            dialect="anthropic",
            model="m",
            attempt=1,
            queued_at_ms=1_700_000_000_000 + 250 * i,
            genai=call,
        ) as a:
            norm = Normalizer("anthropic", info("anthropic", f"r{i}"))
            # times on the buckets' bounds (250 ms, 500 ms, 1 s) and between them, a window past 5 s
            reads = [
                (10.0 + 0.25 * (i + 1), CHUNKS[0][1]),
                (10.5 + i, CHUNKS[1][1]),
                (16.0 + i, CHUNKS[2][1]),
                (17.0 + i, CHUNKS[3][1]),
            ]
            if i == 5:
                with pytest.raises(_Leave):
                    _read(h, a, norm, reads, before=_leave_at(2))
                norm.interrupt("cancelled", "cancelled on request", 0)
                a.record_cancel(100.0, 100.0625)
            else:
                _read(h, a, norm, reads)
            a.finish(norm.machine.terminal_event, norm.statistics(), retrying=i == 3, response_id="msg_1")
    # what the SDK drops with a warning, and a value exactly on the last bound
    inst = tel.instruments  # type: ignore[attr-defined]
    for value in (-1.0, math.nan, math.inf, 600_000):
        inst["sluice.queue.wait"].record(value, {"route": "claude", "dialect": "anthropic"})


@pytest.mark.parametrize(
    ("render", "parse"), [(generate_latest, parse_text), (om.exposition.generate_latest, parse_openmetrics)]
)
def test_own_histograms_expose_as_the_sdks(render: Callable[[Any], bytes], parse: Callable[[str], Any]) -> None:
    sdk = _families(render(_run(False, _attempts)).decode(), parse)
    own = _families(render(_run(True, _attempts)).decode(), parse)
    histogram_names = {f[0] for f in sdk if f[1] == "histogram"}
    assert {
        "sluice_queue_wait_milliseconds",
        "sluice_attempt_time_to_first_byte_milliseconds",
        "sluice_attempt_time_to_first_token_milliseconds",
        "sluice_stream_event_gap_milliseconds",
        "sluice_cancel_close_time_milliseconds",
        "gen_ai_client_operation_duration_seconds",
        "gen_ai_client_token_usage",
        "gen_ai_client_operation_time_to_first_chunk_seconds",
    } <= histogram_names
    assert own == sdk


@pytest.mark.parametrize("own", [False, True])
def test_without_a_tracer_the_metrics_are_the_traced_ones(own: bool) -> None:
    """The exporter ``none`` makes no span, so its attempts skip every span call: the metrics they record
    are the same, sample for sample, as with spans."""
    traced = _families(generate_latest(_run(own, _attempts, traced=True)).decode(), parse_text)
    metrics_only = _families(generate_latest(_run(own, _attempts)).decode(), parse_text)
    names = {"sluice_streams_in_flight", "sluice_provider_bytes", "sluice_cancel_close_time_milliseconds"}
    assert {f[0] for f in traced} >= {*names, "gen_ai_client_token_usage"}
    assert metrics_only == traced


def _homes(tel: Telemetry, h: Harness) -> None:
    """What the worker's other homes define through ``observe`` and ``histogram`` (the endpoint's job figures
    and round trip, the routes' counters and gauges, the archive lag)."""
    shards = {0: 4, 2: 9}
    tel.observe("sluice.jobs.waiting", "{job}", "waiting", lambda: [(n, {"shard": str(i)}) for i, n in shards.items()])
    tel.observe("sluice.jobs.figures_age", "s", "age", lambda: [(1.25, {})], scope="sluice.worker.observability.admin")
    tel.observe("sluice.archive.lag", "ms", "lag", lambda: [])  # no check yet: no series
    refused = [(3, {"route": "claude", "reason": "rate"}), (0, {"route": "claude", "reason": "tokens"})]
    tel.observe("sluice.route.refused", "{refusal}", "refused", lambda: refused, counter=True)
    rtt = tel.histogram(
        "sluice.redis.round_trip", "ms", "round trip", (0.1, 1, 10), scope="sluice.worker.observability.admin"
    )
    assert rtt is not None
    for ms in (0.05, 0.1, 3, 50):
        rtt.record(ms)
    # Defined again (two workers of one process): the first stays, one family each.
    tel.observe("sluice.jobs.waiting", "{job}", "waiting", lambda: [(99, {"shard": "7"})])
    again = tel.histogram(
        "sluice.redis.round_trip", "ms", "round trip", (0.1, 1, 10), scope="sluice.worker.observability.admin"
    )
    assert again is not None
    again.record(0.5)


@pytest.mark.parametrize(
    ("render", "parse"), [(generate_latest, parse_text), (om.exposition.generate_latest, parse_openmetrics)]
)
def test_the_other_homes_instruments_expose_as_the_sdks(
    render: Callable[[Any], bytes], parse: Callable[[str], Any]
) -> None:
    sdk = _families(render(_run(False, _homes)).decode(), parse)
    own = _families(render(_run(True, _homes)).decode(), parse)
    assert {f[0] for f in sdk} >= {
        "sluice_jobs_waiting",
        "sluice_jobs_figures_age_seconds",
        "sluice_route_refused",
        "sluice_redis_round_trip_milliseconds",
    }
    assert not any(f[0].startswith("sluice_archive") for f in sdk)
    assert own == sdk


def test_nothing_recorded_is_no_family_either_way() -> None:
    def nothing(tel: Telemetry, h: Harness) -> None:
        return None

    for own in (False, True):
        text = generate_latest(_run(own, nothing)).decode()
        assert "milliseconds_bucket" not in text and "seconds_bucket" not in text


def test_past_the_cardinality_limit_values_go_to_the_sdks_overflow_series(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(histograms, "_CARDINALITY_LIMIT", 2)
    h = OwnHistogram("x", "ms", "x", (1, 10))
    for route, value in (("a", 0.5), ("a", 0.75), ("b", 5), ("c", 50), ("d", 10)):
        h.record(value, {"route": route})
    metric = h.metric(1)
    assert metric is not None
    points = {
        tuple(sorted(p.attributes.items())): (p.bucket_counts, p.sum, p.count, p.min, p.max)
        for p in metric.data.data_points
    }
    assert points == {
        (("route", "a"),): ((2, 0, 0), 1.25, 2, 0.5, 0.75),
        (("route", "b"),): ((0, 1, 0), 5, 1, 5, 5),
        (("otel.metric.overflow", True),): ((0, 1, 1), 60, 2, 10, 50),  # 10 sits on its bound: the second bucket
    }
