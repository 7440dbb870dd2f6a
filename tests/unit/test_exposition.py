"""sluice.worker.observability.exposition against prometheus-client itself: the same registry rendered by both, byte for
byte, in both formats a Prometheus server negotiates, before and after the cache is warm and values move;
every other request answered by prometheus-client's app.

Rule: the registry is the admin endpoint's (the OpenTelemetry reader over the worker's instruments, after
real attempts) plus a collector of the awkward cases the exposition formats name: every metric type,
label values with quotes, backslashes, newlines and UTF-8, a name with dots, units, timestamps, an exemplar.
The process collector is left out: its CPU figure moves between the two renderings being compared.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client import openmetrics as om
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from sluice.normalizer.stream import Normalizer
from sluice.worker.observability.exposition import MetricsApp
from sluice.worker.observability.genai import GenAICall
from sluice.worker.observability.histograms import own_collector, prometheus_reader
from sluice.worker.observability.telemetry import Telemetry, TelemetryConfig
from tests.helpers import info
from tests.unit.test_telemetry import CHUNKS

PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


class _Awkward(Collector):
    def __init__(self) -> None:
        self.exemplar = False
        # What the endpoint's gauges observe (``Telemetry.observe``): shard -> figure, its series may change.
        self.shards: dict[int, int] = {0: 3, 1: 5}

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily("jobs.done", 'done, "quoted"\\ and\nwrapped', labels=["route", "note"], unit="")
        c.add_metric(["claude", 'say "hi" \\ back\nnow'], 3, created=1_700_000_000.5)
        c.add_metric(["модель", ""], 1.5e21, timestamp=1_700_000_001.25)
        yield c
        g = GaugeMetricFamily("queue_depth", "depth", labels=["shard"], unit="seconds")
        g.add_metric(["0"], float("nan"))
        g.add_metric(["1"], float("inf"))
        g.add_metric(["2"], -0.0)
        yield g
        h = HistogramMetricFamily("latency_seconds", "lat", labels=["r"], unit="seconds")
        ex = Exemplar({"trace_id": "abc"}, 0.5, 1_700_000_000.0) if self.exemplar else None
        h.add_metric(["a"], [("0.5", 1), ("+Inf", 4)], sum_value=7.25, timestamp=None)
        h.samples.append(h.samples[0]._replace(name="latency_seconds_created", value=1_700_000_000.0))
        if ex is not None:
            h.samples[0] = h.samples[0]._replace(exemplar=ex)
        yield h
        gh = GaugeHistogramMetricFamily("inflight", "gh", buckets=[("1", 2), ("+Inf", 3)], gsum_value=4)
        yield gh
        yield InfoMetricFamily("build", "build info", value={"version": "1.2", "commit": "abc\n"})
        yield StateSetMetricFamily("mode", "mode", value={"draining": True, "ready": False})
        u = UnknownMetricFamily("odd", "no type", value=2)
        yield u


@pytest.fixture(params=["sdk", "own"])
def registry(request: pytest.FixtureRequest) -> Iterator[tuple[CollectorRegistry, _Awkward, Telemetry, Any]]:
    """``sdk``: the worker's instruments in the SDK (as with another exporter beside the endpoint); ``own``:
    as the admin endpoint has them with the exporter ``none`` (its own instruments' collector, the 4th)."""
    reg = CollectorRegistry(auto_describe=True)
    awkward = _Awkward()
    reg.register(awkward)
    own = request.param == "own"
    reader = prometheus_reader(reg) if own else PrometheusMetricReader(registry=reg, scope_info_enabled=False)
    tel = Telemetry.from_config(TelemetryConfig(), metric_readers=[reader])
    assert (own_collector(reader) is not None) is own
    # Instruments of the worker's other homes (the endpoint's, the routes'): observed and recorded.
    tel.observe(
        "sluice.jobs.waiting",
        "{job}",
        "jobs waiting",
        lambda: [(n, {"shard": str(i)}) for i, n in awkward.shards.items()],
    )
    tel.observe("sluice.route.admitted", "{job}", "admitted", lambda: [(7, {"route": "claude"})], counter=True)
    rtt = tel.histogram("sluice.redis.round_trip", "ms", "round trip", (0.5, 1, 5))
    assert rtt is not None
    for ms in (0.2, 0.7, 9.0):
        rtt.record(ms)
    _attempts(tel, 3)
    yield reg, awkward, tel, own_collector(reader)
    tel.shutdown()


def _attempts(tel: Telemetry, n: int) -> None:
    for i in range(n):
        call = GenAICall("anthropic", "claude-x", True, "api.anthropic.com", 443)
        route = ("claude", 'we"ird\\route')[i % 2]
        with tel.attempt(
            request_id=f"r{i}", route=route, dialect="anthropic", model="m", attempt=1, queued_at_ms=1, genai=call
        ) as a:
            norm = Normalizer("anthropic", info("anthropic", f"r{i}"))
            now = time.monotonic()
            for _, chunk in CHUNKS:
                raw, events = norm.feed(chunk, 0)
                a.firsts(now, len(raw), events)
            a.window(now, 1000, 0.25, norm.statistics)
            a.finish(norm.machine.terminal_event, norm.statistics())
        tel.request_finished(route=route, dialect="anthropic", status="completed", stop_reason="stop")


def test_both_formats_are_prometheus_clients_bytes_cold_warm_and_after_values_move(registry: Any) -> None:
    reg, _, tel, own = registry
    app = MetricsApp(reg, own)
    for _ in range(2):
        for _ in range(2):  # the second rendering from the warm cache
            text, openmetrics = app.render("text"), app.render("openmetrics")
            assert text == generate_latest(reg)
            assert openmetrics == om.exposition.generate_latest(reg)
        _attempts(tel, 2)
    assert text is not None and b'route="we\\"ird\\\\route"' in text and b"sluice_stream_events_total{" in text
    assert openmetrics is not None and openmetrics.endswith(b"# EOF\n") and b"# UNIT" in openmetrics


def _get(app: Any, accept: str | None = None, encoding: str | None = None, query: str = "", method: str = "GET") -> Any:
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": "/metrics", "QUERY_STRING": query}
    if accept is not None:
        environ["HTTP_ACCEPT"] = accept
    if encoding is not None:
        environ["HTTP_ACCEPT_ENCODING"] = encoding
    answer: list[Any] = []
    body = b"".join(app(environ, lambda status, headers: answer.extend([status, headers])))
    status, headers = answer
    if dict(headers).get("Content-Encoding") == "gzip":
        body = gzip.decompress(body)
    return status, headers, body


@pytest.mark.parametrize(
    ("accept", "encoding", "query", "method"),
    [
        (None, None, "", "GET"),
        ("*/*", "gzip", "", "GET"),
        (PROMETHEUS_ACCEPT, "gzip", "", "GET"),
        ("application/openmetrics-text", None, "", "GET"),
        ("application/openmetrics-text; version=1.0.0; escaping=allow-utf-8", None, "", "GET"),
        ("text/plain; version=1.0.0; escaping=underscores", None, "", "GET"),
        ("text/plain; version=1.0.0; escaping=dots", None, "", "GET"),
        ("*/*", None, "name[]=queue_depth", "GET"),
        ("*/*", None, "", "HEAD"),
    ],
)
def test_every_request_is_answered_as_prometheus_clients_app(
    registry: Any, accept: str | None, encoding: str | None, query: str, method: str
) -> None:
    reg, _, _, own = registry
    ours = _get(MetricsApp(reg, own), accept, encoding, query, method)
    theirs = _get(make_wsgi_app(reg), accept, encoding, query, method)
    assert ours == theirs


def test_a_sample_with_an_exemplar_is_prometheus_clients_to_render(registry: Any) -> None:
    reg, awkward, _, own = registry
    awkward.exemplar = True
    app = MetricsApp(reg, own)
    assert app.render("openmetrics") is None  # declined: prometheus-client composes exemplars
    assert app.render("text") == generate_latest(reg)  # the 0.0.4 text has no exemplars
    ours = _get(app, "application/openmetrics-text")
    assert ours == _get(make_wsgi_app(reg), "application/openmetrics-text")
    assert b"# {trace_id=" in ours[2]


def test_a_series_that_widens_its_instruments_labels_is_laid_out_again(registry: Any) -> None:
    # The exporter gives every series of an instrument the union of their label names ("" where one has
    # none): a new series with a new label changes the text of those before it.
    reg, _, tel, own = registry
    app = MetricsApp(reg, own)
    assert app.render("text") == generate_latest(reg)
    tel.request_finished(route="claude", dialect="anthropic", status="failed", category="upstream")
    text = app.render("text")
    assert text == generate_latest(reg)
    assert app.render("openmetrics") == om.exposition.generate_latest(reg)
    assert b'error_category="",' in text and b'error_category="upstream",' in text


class _Lying:
    """An own instrument whose rows are not what its metric says (a layout the exposition does not know)."""

    name = "sluice.lying"

    def snapshot(self) -> tuple[tuple[Any, ...], list[list[float]]]:
        return ("0", "1"), [[1.0], [2.0]]

    def metric(self, now_ns: int, *, last: bool = False) -> Any:
        from opentelemetry.sdk.metrics.export import AggregationTemporality, NumberDataPoint, Sum
        from opentelemetry.sdk.metrics.export import Metric as OtelMetric

        points = [NumberDataPoint({"k": str(i)}, 0, now_ns, 7) for i in range(2)]
        data = Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=True)
        return OtelMetric(name=self.name, description="d", unit="", data=data)


def test_observed_series_that_come_and_go_are_laid_out_again(registry: Any) -> None:
    reg, awkward, _, own = registry
    app = MetricsApp(reg, own)
    for shards in ({0: 3, 1: 5}, {1: 5, 2: 7}, {2: 8}, {}, {0: 1, 1: 2, 2: 3}):  # as many series, others; fewer
        awkward.shards = shards
        for _ in range(2):
            text = app.render("text")
            assert text == generate_latest(reg)
            assert app.render("openmetrics") == om.exposition.generate_latest(reg)
        assert text is not None
        lines = [line for line in text.decode().splitlines() if line.startswith("sluice_jobs_waiting{")]
        assert lines == [f'sluice_jobs_waiting{{shard="{i}"}} {n:.1f}' for i, n in shards.items()]


def test_a_figure_that_moves_between_reads_is_written_from_one_read() -> None:
    """An age moves between the scrape's read and the translation the layout is checked against: the
    layout is made from the same read, so the scrape is still rendered here, with that read's value."""
    reg = CollectorRegistry(auto_describe=True)
    reader = prometheus_reader(reg)
    tel = Telemetry.from_config(TelemetryConfig(), metric_readers=[reader])
    reads = []

    def age() -> list[tuple[float, dict[str, str]]]:
        reads.append(len(reads) + 0.5)
        return [(reads[-1], {})]

    tel.observe("sluice.jobs.figures_age", "s", "age", age)
    app = MetricsApp(reg, own_collector(reader))
    for _ in range(3):
        text = app.render("text")
        assert text is not None  # not declined to prometheus-client
        assert f"sluice_jobs_figures_age_seconds {reads[-1]}\n" in text.decode()
    assert reads == [0.5, 1.5, 2.5]  # one read a scrape: the layout's translation took the scrape's


def test_target_info_is_the_resources_once_whichever_instruments_there_are(registry: Any) -> None:
    reg, _, _, own = registry
    families = [f for f in parse_text(generate_latest(reg).decode()) if f.name in ("target", "target_info")]
    assert len(families) == 1
    (sample,) = families[0].samples
    assert sample.labels["service_name"] == "sluice-worker" and sample.labels["telemetry_sdk_language"] == "python"
    if own is not None:  # the worker's own: written by its collector, at its place in the fast path too
        assert own.target is not None
        assert MetricsApp(reg, own).render("text") == generate_latest(reg)


def test_own_rows_that_do_not_match_the_exporters_samples_are_prometheus_clients_to_render() -> None:
    from sluice.worker.observability.histograms import OwnCollector

    reg = CollectorRegistry(auto_describe=True)
    own = OwnCollector([_Lying()], "sluice.worker")
    reg.register(own)
    app = MetricsApp(reg, own)
    assert app.render("text") is None and app.render("openmetrics") is None
    ours = _get(app, "*/*")
    assert ours == _get(make_wsgi_app(reg), "*/*")
    assert b'sluice_lying_total{k="1"} 7.0' in ours[2]


def test_the_same_request_within_reuse_s_gets_the_same_answer_and_later_a_new_one(registry: Any) -> None:
    reg, _, tel, own = registry
    now = [100.0]
    app = MetricsApp(reg, own, reuse_s=0.25, clock=lambda: now[0])
    first = _get(app, PROMETHEUS_ACCEPT, "gzip")
    text = _get(app, "*/*")  # another request: its own answer
    assert first[2].startswith(b"# HELP") and text[2] != first[2]
    _attempts(tel, 2)  # values move
    now[0] += 0.24
    assert _get(app, PROMETHEUS_ACCEPT, "gzip") == first  # reused, headers and all
    assert _get(app, "*/*", query="name[]=queue_depth")[2] != text[2]  # another query: rendered now
    now[0] += 0.01
    fresh = _get(app, PROMETHEUS_ACCEPT, "gzip")
    assert fresh != first and fresh == _get(make_wsgi_app(reg), PROMETHEUS_ACCEPT, "gzip")


def test_a_client_asking_in_a_loop_costs_one_rendering_per_reuse_s(registry: Any) -> None:
    reg, _, _, own = registry
    renders = []

    class Counting(MetricsApp):
        def render(self, fmt: Any) -> bytes | None:
            renders.append(fmt)
            return super().render(fmt)

    now = [0.0]
    app = Counting(reg, own, reuse_s=0.25, clock=lambda: now[0])
    for _ in range(40):  # 40 requests over a second of the clock: 4 windows
        _get(app, PROMETHEUS_ACCEPT, "gzip")
        now[0] += 0.025
    assert renders == ["openmetrics"] * 4


@given(
    st.one_of(
        st.integers(min_value=-(10**17), max_value=10**17),
        st.sampled_from([0, -1, 999_999, 1_000_000, 1_000_001, -(10**15) + 1, -(10**15), -(10**16), 10**15]),
        st.floats(allow_nan=True, allow_infinity=True),
    )
)
def test_a_value_is_written_as_prometheus_client_writes_it(v: float) -> None:
    from prometheus_client.utils import floatToGoString

    from sluice.worker.observability.exposition import _go_float

    assert _go_float(v) == floatToGoString(v)
