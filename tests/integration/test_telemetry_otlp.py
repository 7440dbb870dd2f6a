"""The worker's telemetry as a collector receives it: OTLP/HTTP (protobuf) to an in-process receiver on
loopback, from a worker whose telemetry is built from its own configuration (``exporter = "otlp"``), with
the GenAI conventions' latest names opted into (``OTEL_SEMCONV_STABILITY_OPT_IN``). The receiver decodes
the exported requests with OpenTelemetry's own protobuf messages; the test checks the GenAI attributes of
the CLIENT span and the GenAI metrics against what Redis stored of the request."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from sluice.worker.observability.telemetry import TelemetryConfig
from tests.integration.conftest import cleanup, client_for, make_config
from tests.integration.test_telemetry_worker import running_worker

pytestmark = pytest.mark.asyncio


class _Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bodies: dict[str, list[bytes]] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        with self.server.lock:
            self.server.bodies.setdefault(self.path, []).append(body)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _spans(receiver: _Receiver) -> list[Span]:
    out: list[Span] = []
    for body in receiver.bodies.get("/v1/traces", []):
        req = ExportTraceServiceRequest.FromString(body)
        out += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    return out


def _metric_units(receiver: _Receiver) -> dict[str, str]:
    units: dict[str, str] = {}
    for body in receiver.bodies.get("/v1/metrics", []):
        req = ExportMetricsServiceRequest.FromString(body)
        units |= {m.name: m.unit for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    return units


async def test_a_collector_receives_the_genai_client_span_and_metrics(
    fake, receiver, redis_url, key_prefix, redis_client, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
    telemetry = TelemetryConfig(exporter="otlp", otlp_endpoint=receiver.url, service_name="otlp-e2e")
    config = make_config(redis_url, key_prefix, fake.base_url, telemetry=telemetry)
    model = "synthetic;deltas=3"
    job = {"route": "anthropic", "model": model, "request": {"messages": [{"role": "user", "content": "hi"}]}}
    try:
        # The worker owns its telemetry: leaving shuts it down, which flushes spans and metrics.
        async with running_worker(config, None), client_for(config) as client:
            rid = await client.enqueue(job)
            result = await client.result(rid, timeout=30)
    finally:
        await cleanup(redis_client, key_prefix)
    assert result.status == "completed" and result.usage is not None
    spans = _spans(receiver)
    (chat,) = [s for s in spans if s.kind == Span.SPAN_KIND_CLIENT]
    (consumer,) = [s for s in spans if s.name == "sluice.attempt"]
    assert chat.name == f"chat {model}" and chat.parent_span_id == consumer.span_id
    attrs = {a.key: _value(a.value) for a in chat.attributes}
    assert {k: attrs[k] for k in attrs if k.startswith("gen_ai.") and k != "gen_ai.response.time_to_first_chunk"} == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": model,
        "gen_ai.request.stream": True,
        "gen_ai.response.model": attrs["gen_ai.response.model"],
        "gen_ai.response.id": attrs["gen_ai.response.id"],
        "gen_ai.response.finish_reasons": ("end_turn",),
        "gen_ai.usage.input_tokens": result.usage.input_tokens,
        "gen_ai.usage.output_tokens": result.usage.output_tokens,
        **{k: attrs[k] for k in attrs if k.startswith("gen_ai.usage.") and k.count(".") > 2},
    }
    assert attrs["gen_ai.response.model"] and attrs["gen_ai.response.id"]
    assert attrs["server.address"] == "127.0.0.1" and "error.type" not in attrs
    units = _metric_units(receiver)
    assert {
        "gen_ai.client.token.usage": "{token}",
        "gen_ai.client.operation.duration": "s",
        "gen_ai.client.operation.time_to_first_chunk": "s",
        # sluice's own durations are seconds over OTLP too
        "sluice.attempt.time_to_first_byte": "s",
        "sluice.attempt.time_to_first_token": "s",
        "sluice.queue.wait": "s",
        "sluice.stream.events": "{event}",
    }.items() <= units.items()
