"""The GenAI semantic conventions on the worker's telemetry (observability.genai), read back from the SDK's
in-memory exporters and the prometheus-client registry: the CLIENT span ``chat {model}`` under the attempt's
CONSUMER span with its exact attributes, and the ``gen_ai.client.*`` metrics with their exact values in both
sinks, in both namings (the v1.36.0 default and v1.41.0 behind
``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``).

The attempt is the hand-written Anthropic body of tests/unit/test_telemetry.py under its hand-driven clock:
it starts at t=10.0, the first read (10.25 s) completes two provider events, the last read is at 11.125 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from sluice.normalizer.stream import Normalizer
from sluice.schemas.events import ErrorInfo, StreamDone, StreamError, Usage
from sluice.schemas.request import GenerateRequest
from sluice.worker.observability.genai import (
    GENAI_METRICS,
    SECONDS_BUCKETS,
    TOKEN_BUCKETS,
    genai_call,
    latest_from_env,
    provider_name,
)
from sluice.worker.observability.telemetry import SPAN_NAME, Telemetry
from tests.helpers import info, metric_points, metric_value
from tests.unit.test_telemetry import CHUNKS, OUTPUT, Clock, Harness, _read

REQUEST = msgspec.convert(
    {
        "system": "SECRET-SYSTEM-PROMPT",
        "messages": [{"role": "user", "content": "SECRET-PROMPT-9c1d"}],
        "max_tokens": 256,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["END"],
    },
    GenerateRequest,
)
COMMON = {
    "gen_ai.operation.name": "chat",
    "server.address": "api.anthropic.com",
    "server.port": 443,
}
REQUEST_ATTRS = {
    "gen_ai.request.model": "claude-x",
    "gen_ai.request.max_tokens": 256,
    "gen_ai.request.temperature": 0.5,
    "gen_ai.request.top_p": 0.9,
    "gen_ai.request.stop_sequences": ("END",),
}


def _harness(latest: bool) -> Iterator[Harness]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    registry = CollectorRegistry()
    clock = Clock()
    wall = [1_700_000_001_500]
    tel = Telemetry.with_providers(
        tracer_provider, meter_provider, registry=registry, clock=clock, wall_ms=lambda: wall[0], genai_latest=latest
    )
    yield Harness(tel, spans, reader, registry, clock, wall, latest)
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture
def latest() -> Iterator[Harness]:
    yield from _harness(True)


@pytest.fixture
def v136() -> Iterator[Harness]:
    yield from _harness(False)


def _attempt(h: Harness, *, model: str = "claude-x", configured: str | None = "claude-x") -> Any:
    call = genai_call(
        dialect="anthropic",
        base_url="https://api.anthropic.com",
        request=REQUEST,
        model=model,
        configured_model=configured,
    )
    return h.telemetry.attempt(
        request_id="req_1", route="claude", dialect="anthropic", model=model, attempt=1, genai=call
    )


def _spans(h: Harness) -> tuple[ReadableSpan, ReadableSpan]:
    consumer, client = sorted(h.finished(), key=lambda s: s.name != SPAN_NAME)
    return consumer, client


def _run(h: Harness, terminal_usage: Usage | None = None) -> None:
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    with _attempt(h) as tel:
        tel.on_response(200)
        _read(h, tel, norm, CHUNKS)
        term = norm.machine.terminal_event
        assert isinstance(term, StreamDone)
        if terminal_usage is not None:
            term = msgspec.structs.replace(term, usage=terminal_usage)
        tel.finish(term, norm.statistics(), response_id=norm.machine.response_id)


FULL_USAGE = Usage(input_tokens=12, output_tokens=7, cache_read_tokens=30, cache_write_tokens=5, reasoning_tokens=3)


def test_latest_names_on_the_client_span_and_metrics(latest: Harness) -> None:
    _run(latest, FULL_USAGE)
    consumer, client = _spans(latest)
    assert (client.name, client.kind, consumer.kind) == ("chat claude-x", SpanKind.CLIENT, SpanKind.CONSUMER)
    assert client.parent is not None and consumer.context is not None
    assert (client.parent.span_id, client.context.trace_id) == (consumer.context.span_id, consumer.context.trace_id)
    assert dict(client.attributes or {}) == {
        **COMMON,
        "gen_ai.provider.name": "anthropic",
        **REQUEST_ATTRS,
        "gen_ai.request.stream": True,
        "http.response.status_code": 200,
        "gen_ai.response.model": "claude-x",
        "gen_ai.response.id": "msg_1",
        "gen_ai.response.time_to_first_chunk": 0.25,
        "gen_ai.response.finish_reasons": ("end_turn",),
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 7,
        "gen_ai.usage.cache_read.input_tokens": 30,
        "gen_ai.usage.cache_creation.input_tokens": 5,
        "gen_ai.usage.reasoning.output_tokens": 3,
    }
    assert client.status.status_code == StatusCode.UNSET
    # The sluice span keeps its own attributes; no gen_ai name but the usage it always carried.
    assert {k for k in consumer.attributes or {} if k.startswith("gen_ai.")} == {
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
    }
    metric = {**COMMON, "gen_ai.provider.name": "anthropic", "gen_ai.request.model": "claude-x"}
    duration = latest.value("gen_ai.client.operation.duration", **metric)
    assert (duration.count, duration.sum) == (1, 1.125)
    assert tuple(duration.explicit_bounds) == SECONDS_BUCKETS
    ttfc = latest.value("gen_ai.client.operation.time_to_first_chunk", **metric)
    assert (ttfc.count, ttfc.sum) == (1, 0.25)
    tokens = {
        kind: latest.value("gen_ai.client.token.usage", **metric, **{"gen_ai.token.type": kind})
        for kind in ("input", "output")
    }
    assert {k: (p.count, p.sum) for k, p in tokens.items()} == {"input": (1, 12), "output": (1, 7)}
    assert tuple(tokens["input"].explicit_bounds) == TOKEN_BUCKETS
    units = {
        m.name: m.unit
        for rm in latest.reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert {n: units[n] for n in GENAI_METRICS} == {
        "gen_ai.client.operation.duration": "s",
        "gen_ai.client.token.usage": "{token}",
        "gen_ai.client.operation.time_to_first_chunk": "s",
    }


def test_the_default_is_the_v1_36_naming(v136: Harness) -> None:
    _run(v136, FULL_USAGE)
    _, client = _spans(v136)
    assert dict(client.attributes or {}) == {
        **COMMON,
        "gen_ai.system": "anthropic",
        **REQUEST_ATTRS,
        "http.response.status_code": 200,
        "gen_ai.response.model": "claude-x",
        "gen_ai.response.id": "msg_1",
        "gen_ai.response.finish_reasons": ("end_turn",),
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 7,
    }
    metric = {**COMMON, "gen_ai.system": "anthropic", "gen_ai.request.model": "claude-x"}
    assert v136.value("gen_ai.client.operation.duration", **metric).sum == 1.125
    assert v136.value("gen_ai.client.token.usage", **metric, **{"gen_ai.token.type": "output"}).sum == 7
    assert "gen_ai.client.operation.time_to_first_chunk" not in metric_points(v136.reader)
    families = {f.name for f in v136.registry.collect()}
    assert "gen_ai_client_operation_duration_seconds" in families
    assert "gen_ai_client_operation_time_to_first_chunk_seconds" not in families


def test_errors_cancels_and_unconfigured_models(latest: Harness) -> None:
    err = StreamError(
        stream_id="req_1:1",
        request_id="req_1",
        seq=1,
        ts=0,
        status="failed",
        error=ErrorInfo(category="rate_limit", retryable=True, message="SECRET-PROVIDER-MESSAGE"),
    )
    with _attempt(latest) as tel:
        latest.clock.now = 10.5
        tel.finish(err, {})
    cancelled = msgspec.structs.replace(
        err, status="interrupted", error=ErrorInfo(category="cancelled", retryable=False, message="by request")
    )
    with _attempt(latest, model="job-chosen-model") as tel:  # the job's own model: not on metrics
        latest.clock.now = 11.0
        tel.finish(cancelled, {})
    with pytest.raises(RuntimeError), _attempt(latest) as tel:
        latest.clock.now = 12.0
        raise RuntimeError("SECRET-BUG-DETAIL")
    clients = [s for s in latest.finished() if s.name != SPAN_NAME]
    assert [(s.name, s.status.status_code, (s.attributes or {}).get("error.type")) for s in clients] == [
        ("chat claude-x", StatusCode.ERROR, "rate_limit"),
        ("chat job-chosen-model", StatusCode.UNSET, None),
        ("chat claude-x", StatusCode.ERROR, "RuntimeError"),
    ]
    assert clients[1].attributes is not None and clients[1].attributes["gen_ai.request.model"] == "job-chosen-model"
    base = {**COMMON, "gen_ai.provider.name": "anthropic"}
    points = metric_points(latest.reader)["gen_ai.client.operation.duration"]
    assert sorted((dict(p.attributes).get("error.type", ""), p.sum) for p in points) == [
        ("", 0.5),  # the cancel (10.5 -> 11.0), without the job's model
        ("RuntimeError", 1.0),  # 11.0 -> 12.0
        ("rate_limit", 0.5),  # 10.0 -> 10.5
    ]
    assert metric_value(latest.reader, "gen_ai.client.operation.duration", **base).sum == 0.5
    # The same three series on /metrics, error_type "" for the cancel, and no job-chosen model.
    samples = [
        s
        for f in latest.registry.collect()
        for s in f.samples
        if s.name == "gen_ai_client_operation_duration_seconds_sum"
    ]
    assert sorted((s.labels["error_type"], s.labels["gen_ai_request_model"], s.value) for s in samples) == [
        ("", "", 0.5),
        ("RuntimeError", "claude-x", 1.0),
        ("rate_limit", "claude-x", 0.5),
    ]
    for error_type in ("rate_limit", "RuntimeError"):
        latest.value(
            "gen_ai.client.operation.duration",
            **base,
            **{"gen_ai.request.model": "claude-x"},
            **{"error.type": error_type},
        )
    dumped = "".join(s.to_json() for s in latest.finished())
    for secret in ("SECRET-PROVIDER-MESSAGE", "SECRET-BUG-DETAIL", "SECRET-PROMPT-9c1d", "SECRET-SYSTEM-PROMPT"):
        assert secret not in dumped


def test_no_content_reaches_the_spans(latest: Harness) -> None:
    _run(latest)
    dumped = "".join(s.to_json() for s in latest.finished())
    for secret in (OUTPUT, "SECRET-PROMPT-9c1d", "SECRET-SYSTEM-PROMPT", "Привет"):
        assert secret not in dumped
    assert not [k for s in latest.finished() for k in s.attributes or {} if "message" in k or "instruction" in k]


def test_without_a_call_there_is_no_client_span(latest: Harness) -> None:
    with latest.telemetry.attempt(request_id="r", route="claude", dialect="anthropic", model="m", attempt=1) as tel:
        tel.finish(None, {})
    assert [s.name for s in latest.finished()] == [SPAN_NAME]
    assert "gen_ai.client.operation.duration" not in metric_points(latest.reader)
    assert not [
        s for f in latest.registry.collect() for s in f.samples if s.name.startswith("gen_ai_client_operation_duration")
    ]


@pytest.mark.parametrize(
    ("dialect", "host", "expected"),
    [
        ("anthropic", "api.anthropic.com", "anthropic"),
        ("openai-chat", "api.openai.com", "openai"),
        ("openai-responses", "my-res.openai.azure.com", "azure.ai.openai"),
        ("openai-chat", "api.groq.com", "groq"),
        ("openai-chat", "api.deepseek.com", "deepseek"),
        ("gemini", "generativelanguage.googleapis.com", "gcp.gemini"),
        ("gemini", "us-central1-aiplatform.googleapis.com", "gcp.vertex_ai"),
        ("openai-chat", "127.0.0.1", "openai"),  # a local server on the OpenAI API: the dialect's best guess
        ("bedrock-converse", "bedrock-runtime.us-east-1.amazonaws.com", "aws.bedrock"),
        ("some-new-dialect", None, "some-new-dialect"),
    ],
)
def test_provider_names_are_the_conventions_well_known_values(dialect: str, host: str | None, expected: str) -> None:
    assert provider_name(dialect, host) == expected


def test_the_opt_in_is_read_from_a_comma_separated_list() -> None:
    assert latest_from_env({"OTEL_SEMCONV_STABILITY_OPT_IN": "http, gen_ai_latest_experimental"}) is True
    assert latest_from_env({"OTEL_SEMCONV_STABILITY_OPT_IN": "gen_ai_latest_experimental_x,http"}) is False
    assert latest_from_env({}) is False


def test_server_address_and_port_come_from_the_route() -> None:
    call = genai_call(
        dialect="openai-chat",
        base_url="http://127.0.0.1:8089/v1",
        request=REQUEST,
        model=None,
        configured_model=None,
    )
    assert call.span_name() == "chat"
    assert call.metric_attributes(True) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "server.address": "127.0.0.1",
        "server.port": 8089,
    }


@pytest.mark.parametrize(
    ("dialect", "body", "response_id"),
    [
        (
            "openai-chat",
            b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"gpt-x",'
            b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
            "chatcmpl-1",
        ),
        (
            "openai-responses",
            b'event: response.created\ndata: {"type":"response.created",'
            b'"response":{"id":"resp_1","model":"gpt-x","status":"in_progress"}}\n\n',
            "resp_1",
        ),
        (
            "gemini",
            b'data: {"candidates":[{"content":{"parts":[{"text":"hi"}],"role":"model"}}],'
            b'"modelVersion":"gemini-x","responseId":"gem-1"}\n\n',
            "gem-1",
        ),
    ],
)
def test_each_dialect_reads_the_response_id(dialect: str, body: bytes, response_id: str) -> None:
    norm = Normalizer(dialect, info(dialect, "req_1"))
    _, events = norm.feed(body, 0)
    assert events and norm.machine.response_id == response_id
