"""Telemetry of the real worker: real Redis, the real fake provider over loopback, the SDK's in-memory
exporters and a prometheus-client registry injected through ``Worker(config, telemetry=...)`` (every figure
read from both, which must agree).

Rule: every number asserted is one the test can get independently (the events and raw entries stored in
Redis, the bytes the fake provider says it sent); nothing a producer or a provider sent in confidence (the
API key, the prompt, the model's output) appears in any span or metric.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, generate_latest

from sluice.schemas.errors import ConfigError
from sluice.schemas.events import BlockDelta
from sluice.schemas.keys import Keys
from sluice.worker.config import Config, load_config
from sluice.worker.observability.telemetry import DISABLED, SPAN_NAME, Telemetry, TelemetryConfig
from sluice.worker.pipeline.consumer import Worker
from tests.helpers import both_none, both_value, metric_points
from tests.integration.conftest import API_KEY, cleanup, client_for, make_config

PROMPT = "Quelle heure est-il? PROMPT-SECRET-31f"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
ROUTE = {"route": "anthropic", "dialect": "anthropic"}


@dataclass
class Otel:
    telemetry: Telemetry
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    registry: CollectorRegistry

    def finished(self) -> list[ReadableSpan]:
        """The attempts' CONSUMER spans (test_telemetry_genai.py checks their GenAI CLIENT children)."""
        return [s for s in self.spans.get_finished_spans() if s.name == SPAN_NAME]

    def clients(self) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name != SPAN_NAME]

    def points(self) -> dict[str, list[Any]]:
        return metric_points(self.reader)

    def value(self, name: str, **attrs: Any) -> Any:
        return both_value(self.reader, self.registry, name, **attrs)

    def none(self, name: str, **attrs: Any) -> None:
        both_none(self.reader, self.registry, name, **attrs)

    def dump(self) -> str:
        data = self.reader.get_metrics_data()
        spans = self.spans.get_finished_spans()
        text = "".join(s.to_json() for s in spans) + (data.to_json() if data else "")
        return text + generate_latest(self.registry).decode()


@pytest.fixture
def otel() -> Iterator[Otel]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    registry = CollectorRegistry()
    yield Otel(Telemetry.with_providers(tracer_provider, meter_provider, registry=registry), spans, reader, registry)
    tracer_provider.shutdown()
    meter_provider.shutdown()


@contextlib.asynccontextmanager
async def running_worker(config: Config, telemetry: Telemetry | None) -> AsyncIterator[Worker]:
    """The worker on the test's loop; leaving waits until it has stopped (all its spans ended)."""
    worker = Worker(config, telemetry=telemetry)
    async with anyio.create_task_group() as tg:
        ready = anyio.Event()
        tg.start_soon(lambda: worker.run(ready=ready.set))
        await ready.wait()
        try:
            yield worker
        finally:
            worker.stop()


def _job(model: str, route: str = "anthropic", trace: dict[str, str] | None = None) -> dict[str, Any]:
    request = {"messages": [{"role": "user", "content": PROMPT}]}
    job: dict[str, Any] = {"route": route, "model": model, "request": request}
    if trace is not None:
        job["trace"] = trace
    return job


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


@pytest.mark.asyncio
async def test_completed_request_span_and_metrics(fake, otel, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    model = "synthetic;deltas=9;chunk=11;pace_ms=5"  # paced: the body comes in several reads
    rk = None
    try:
        async with running_worker(config, otel.telemetry), client_for(config) as client:
            rid = await client.enqueue(_job(model, trace={"traceparent": TRACEPARENT, "tracestate": "sluice=t1"}))
            result = await client.result(rid, timeout=30)
        rk = Keys(key_prefix).request(rid)
        stored_events = await redis_client.xrange(rk.events)
        stored_raw = await redis_client.xrange(rk.raw)
    finally:
        await cleanup(redis_client, key_prefix)
    assert result.status == "completed" and rk is not None
    [span] = otel.finished()
    attrs = _attrs(span)
    assert isinstance(attrs.pop("queue_wait_ms"), int)
    usage = {k: attrs.pop(k) for k in list(attrs) if k.startswith("gen_ai.usage.")}
    assert result.usage is not None and usage == {
        k: v
        for k, v in {
            "gen_ai.usage.input_tokens": result.usage.input_tokens,
            "gen_ai.usage.output_tokens": result.usage.output_tokens,
        }.items()
        if v is not None
    }
    assert attrs == {
        "route": "anthropic",
        "dialect": "anthropic",
        "model": model,
        "attempt": 1,
        "request_id": rid,
        "http.response.status_code": 200,
        "status": "completed",
        "stop_reason": "stop",
    }
    assert [e.name for e in span.events] == ["first_byte", "first_token"]
    assert span.parent is not None and span.parent.span_id == 0x00F067AA0BA902B7
    assert span.context is not None and span.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert span.context.trace_state.to_header() == "sluice=t1"

    [served] = fake.stats.find(request_id=rid)
    assert otel.value("sluice.provider.bytes", **ROUTE) == served.bytes_sent
    assert otel.value("sluice.provider.events", **ROUTE) == sum(1 for _, f in stored_raw if f[b"kind"] == b"sse")
    assert otel.value("sluice.stream.events", **ROUTE) == len(stored_events)
    assert otel.value("sluice.streams.in_flight", **ROUTE) == 0
    assert otel.value("sluice.requests.terminal", **ROUTE, status="completed", stop_reason="stop") == 1
    for name in ("sluice.queue.wait", "sluice.attempt.time_to_first_byte", "sluice.attempt.time_to_first_token"):
        assert otel.value(name, **ROUTE).count == 1, name
    ttfb = otel.value("sluice.attempt.time_to_first_byte", **ROUTE).sum
    assert 0 < ttfb <= otel.value("sluice.attempt.time_to_first_token", **ROUTE).sum
    assert otel.value("sluice.stream.event_gap", **ROUTE).count >= 1  # the body came in many reads
    otel.none("sluice.cancel.close_time", **ROUTE)
    assert "sluice.retries" not in otel.points()
    assert not [s for f in otel.registry.collect() for s in f.samples if s.name == "sluice_retries_total"]

    output = "".join(b.text or "" for b in result.blocks)
    assert len(output) > 20
    dumped = otel.dump()
    for secret in (API_KEY, PROMPT, output, output[:20]):
        assert secret not in dumped


@pytest.mark.asyncio
async def test_retry_makes_two_sibling_attempt_spans(fake, otel, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with running_worker(config, otel.telemetry), client_for(config) as client:
            rid = await client.enqueue(
                _job("synthetic;deltas=3;status=529;times=1;id=tel", trace={"traceparent": TRACEPARENT})
            )
            result = await client.result(rid, timeout=30)
    finally:
        await cleanup(redis_client, key_prefix)
    assert result.status == "completed"
    first, second = otel.finished()
    a1, a2 = _attrs(first), _attrs(second)
    assert (a1["attempt"], a1["status"], a1["error.category"], a1["retrying"]) == (1, "failed", "overloaded", True)
    assert a1["http.response.status_code"] == 529 and "queue_wait_ms" in a1
    assert first.status.status_code == StatusCode.ERROR and first.status.description == "overloaded"
    assert first.events == ()
    assert (a2["attempt"], a2["status"], a2["stop_reason"]) == (2, "completed", "stop")
    assert "retrying" not in a2 and "queue_wait_ms" not in a2
    assert first.parent and second.parent and first.parent.span_id == second.parent.span_id == 0x00F067AA0BA902B7
    assert otel.value("sluice.retries", **ROUTE, **{"error.category": "overloaded"}) == 1
    assert otel.value("sluice.queue.wait", **ROUTE).count == 1
    assert otel.value("sluice.requests.terminal", **ROUTE, status="completed", stop_reason="stop") == 1
    assert [p.attributes["status"] for p in otel.points()["sluice.requests.terminal"]] == ["completed"]
    terminals = [s for f in otel.registry.collect() for s in f.samples if s.name == "sluice_requests_terminal_total"]
    assert [(s.labels["status"], s.value) for s in terminals] == [("completed", 1.0)]


@pytest.mark.asyncio
async def test_cancel_times_the_close(fake, otel, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with running_worker(config, otel.telemetry), client_for(config) as client:
            rid = await client.enqueue(_job("synthetic;deltas=400;pace_ms=20"))
            async for ev in client.events(rid):
                if isinstance(ev, BlockDelta):
                    break
            assert await client.cancel(rid)
            result = await client.result(rid, timeout=30)
    finally:
        await cleanup(redis_client, key_prefix)
    assert result.status == "interrupted" and result.error is not None and result.error.category == "cancelled"
    [span] = otel.finished()
    attrs = _attrs(span)
    assert (attrs["status"], attrs["error.category"]) == ("interrupted", "cancelled")
    assert span.status.status_code == StatusCode.UNSET  # a cancel on request is not a fault
    assert span.parent is None  # the producer sent no trace context
    close = otel.value("sluice.cancel.close_time", **ROUTE)
    assert close.count == 1 and close.sum * 1000 == attrs["cancel_to_close_ms"] and 0 <= close.sum < 5
    assert otel.value("sluice.requests.terminal", **ROUTE, status="interrupted", **{"error.category": "cancelled"}) == 1
    assert otel.value("sluice.streams.in_flight", **ROUTE) == 0


@pytest.mark.asyncio
async def test_unknown_route_is_counted_without_its_name(fake, otel, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with running_worker(config, otel.telemetry), client_for(config) as client:
            rid = await client.enqueue(_job("synthetic", route="no-such-route-8d1"))
            result = await client.result(rid, timeout=30)
    finally:
        await cleanup(redis_client, key_prefix)
    assert result.status == "failed"
    assert otel.finished() == []  # nothing was attempted
    [point] = otel.points()["sluice.requests.terminal"]
    expected = {"route": "", "dialect": "", "status": "failed", "error.category": "invalid_request"}
    assert dict(point.attributes) == expected
    assert otel.value("sluice.requests.terminal", **expected) == 1 and "no-such-route-8d1" not in otel.dump()


@pytest.mark.asyncio
async def test_worker_builds_telemetry_from_its_config(fake, redis_url, key_prefix, redis_client, capsys) -> None:
    assert Worker(make_config(redis_url, key_prefix, fake.base_url)).telemetry is DISABLED
    config = make_config(
        redis_url, key_prefix, fake.base_url, telemetry=TelemetryConfig(exporter="console", service_name="tel-e2e")
    )
    try:
        async with running_worker(config, None) as worker, client_for(config) as client:
            assert worker.telemetry.enabled
            rid = await client.enqueue(_job("synthetic;deltas=2"))
            assert (await client.result(rid, timeout=30)).status == "completed"
    finally:
        await cleanup(redis_client, key_prefix)
    # The worker shut its own telemetry down on the way out: the batched span and the metrics are out.
    out = capsys.readouterr().out
    assert '"name": "sluice.attempt"' in out and rid in out and '"service.name": "tel-e2e"' in out
    assert '"name": "sluice.requests.terminal"' in out


def test_config_file_telemetry_section(tmp_path, monkeypatch) -> None:
    path = tmp_path / "sluice.toml"
    path.write_text('[telemetry]\nexporter = "console"\nservice_name = "w"\nsample_ratio = 0.5\n')
    assert load_config(path, env={}).telemetry == TelemetryConfig(
        exporter="console", service_name="w", sample_ratio=0.5
    )
    path.write_text('[telemetry]\nexporter = "zipkin"\n')
    with pytest.raises(ConfigError, match="exporter"):
        load_config(path, env={})
    # An exporter that is not installed fails the load (one line from the CLI), not the worker's start.
    for mod in (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    ):
        monkeypatch.setitem(sys.modules, mod, None)
    path.write_text('[telemetry]\nexporter = "otlp"\n')
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-http"):
        load_config(path, env={})


@pytest.mark.asyncio
async def test_the_worker_emits_the_genai_client_span(fake, redis_url, key_prefix, redis_client) -> None:
    """Through the worker and the fake provider, with the latest GenAI names: the CLIENT span's exact
    attributes (the route's address, the job's parameters, the provider's answer), and the metrics."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    registry = CollectorRegistry()
    telemetry = Telemetry.with_providers(tracer_provider, meter_provider, registry=registry, genai_latest=True)
    config = make_config(redis_url, key_prefix, fake.base_url)
    model = "synthetic;deltas=4"
    job = _job(model)
    job["request"] = {**job["request"], "max_tokens": 64, "temperature": 0.25}
    try:
        async with running_worker(config, telemetry), client_for(config) as client:
            rid = await client.enqueue(job)
            result = await client.result(rid, timeout=30)
    finally:
        await cleanup(redis_client, key_prefix)
        tracer_provider.shutdown()
    assert result.status == "completed" and result.usage is not None
    (consumer,) = [s for s in spans.get_finished_spans() if s.name == SPAN_NAME]
    (chat,) = [s for s in spans.get_finished_spans() if s.name != SPAN_NAME]
    assert chat.name == f"chat {model}" and chat.parent is not None and consumer.context is not None
    assert chat.parent.span_id == consumer.context.span_id
    attrs = dict(chat.attributes or {})
    ttfc = attrs.pop("gen_ai.response.time_to_first_chunk")
    assert isinstance(ttfc, float) and ttfc > 0
    usage = {
        "gen_ai.usage.input_tokens": result.usage.input_tokens,
        "gen_ai.usage.output_tokens": result.usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": result.usage.cache_read_tokens,
        "gen_ai.usage.cache_creation.input_tokens": result.usage.cache_write_tokens,
        "gen_ai.usage.reasoning.output_tokens": result.usage.reasoning_tokens,
    }
    host = fake.base_url.split("//", 1)[1].split("/", 1)[0]
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "server.address": host.rsplit(":", 1)[0],
        "server.port": int(host.rsplit(":", 1)[1]),
        "gen_ai.request.model": model,
        "gen_ai.request.stream": True,
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.25,
        "http.response.status_code": 200,
        "gen_ai.response.model": attrs["gen_ai.response.model"],
        "gen_ai.response.id": attrs["gen_ai.response.id"],
        "gen_ai.response.finish_reasons": ("end_turn",),
        **{k: v for k, v in usage.items() if v is not None},
    }
    assert attrs["gen_ai.response.model"] and attrs["gen_ai.response.id"]
    metric = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "server.address": attrs["server.address"],
        "server.port": attrs["server.port"],
    }  # no gen_ai.request.model: the job's own model string, not the route's, stays off metrics
    assert both_value(reader, registry, "gen_ai.client.operation.duration", latest=True, **metric).count == 1
    ttfc_point = both_value(reader, registry, "gen_ai.client.operation.time_to_first_chunk", latest=True, **metric)
    assert ttfc_point.sum == ttfc
    output = {**metric, "gen_ai.token.type": "output"}
    tokens = both_value(reader, registry, "gen_ai.client.token.usage", latest=True, **output)
    assert tokens.sum == result.usage.output_tokens
    meter_provider.shutdown()
    assert PROMPT not in "".join(s.to_json() for s in spans.get_finished_spans())
