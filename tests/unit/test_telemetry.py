"""observability.telemetry with the SDK's in-memory exporters and a prometheus-client registry side by side:
span attributes and parenting, exact metric values under a hand-driven clock, the no-op path, the admin
endpoint's metrics alone, configuration and exporters.

Rule: attempts are driven through worker/pipeline/upstream.py's body reader, with a real Normalizer, over a
hand-written Anthropic body read by read under a hand-driven clock; every expected number below is worked
out by hand from that body, and every figure is read from both sinks (the SDK's data points and the
registry's samples, which must agree, bucket for bucket).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from unittest.mock import patch

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest

from sluice.normalizer.redact import Redactor
from sluice.normalizer.stream import Normalizer
from sluice.schemas.errors import ConfigError
from sluice.worker.append.log import PendingBatch
from sluice.worker.config import Timeouts
from sluice.worker.observability.telemetry import (
    DISABLED,
    DURATION_BUCKETS,
    METRICS,
    SPAN_NAME,
    AttemptTelemetry,
    Telemetry,
    TelemetryConfig,
    entry_time_ms,
)
from sluice.worker.pipeline import upstream
from tests.helpers import both_none, both_value, brief, info, metric_points, prom_histogram, prom_value

OUTPUT = "SECRET-OUTPUT-7f3a"


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _delta(text: str) -> bytes:
    return _sse(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
    )


# Four reads: (monotonic time, bytes). The attempt starts at t=10.0.
CHUNKS: list[tuple[float, bytes]] = [
    (
        10.25,
        _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": "claude-x",
                    "content": [],
                    "stop_reason": None,
                    "usage": {"input_tokens": 12, "output_tokens": 1},
                },
            },
        )
        + _sse("ping", {"type": "ping"}),
    ),
    (
        10.5,
        _sse(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )
        + _delta(OUTPUT + " Привет"),
    ),
    (
        11.0,
        _sse("mystery_event", {"type": "mystery_event"})
        + _delta(" мир")
        + _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ),
    (
        11.125,
        _sse(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 7}},
        )
        + _sse("message_stop", {"type": "message_stop"}),
    ),
]
BODY_BYTES = sum(len(c) for _, c in CHUNKS)
ROUTE = {"route": "claude", "dialect": "anthropic"}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass
class Clock:
    now: float = 10.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    telemetry: Telemetry
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    registry: CollectorRegistry
    clock: Clock
    wall: list[int]
    latest: bool = False  # the GenAI conventions' latest names

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def metrics(self) -> dict[str, list[Any]]:
        """Instrument name -> its SDK data points (all attribute sets)."""
        return metric_points(self.reader)

    def value(self, name: str, **attrs: Any) -> Any:
        """The one SDK data point of ``name`` with exactly these attributes (sum, or the histogram point),
        after checking the registry's samples of the same series hold the same figures."""
        return both_value(self.reader, self.registry, name, latest=self.latest, **attrs)

    def none(self, name: str, **attrs: Any) -> None:
        """Nothing was recorded into ``name``'s series of ``attrs`` (default: the route's), in either sink."""
        both_none(self.reader, self.registry, name, latest=self.latest, **(attrs or ROUTE))


@pytest.fixture
def h() -> Iterator[Harness]:
    with _harness() as harness:
        yield harness


@contextmanager
def _harness() -> Iterator[Harness]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    registry = CollectorRegistry()
    clock = Clock()
    wall = [1_700_000_001_500]
    tel = Telemetry.with_providers(
        tracer_provider, meter_provider, registry=registry, clock=clock, wall_ms=lambda: wall[0]
    )
    yield Harness(tel, spans, reader, registry, clock, wall)
    tracer_provider.shutdown()
    meter_provider.shutdown()


def _start(h: Harness, **kw: Any) -> AttemptTelemetry:
    args: dict[str, Any] = {
        "request_id": "req_1",
        "route": "claude",
        "dialect": "anthropic",
        "model": "claude-x",
        "attempt": 1,
        **kw,
    }
    return h.telemetry.attempt(**args)


_NO_TIMERS = Timeouts(first_byte=1e9, idle=1e9, total=1e9)


class _Leave(Exception):
    """Raised by a check between reads: the body is left there, as a cancel or a fence leaves it."""


@dataclass
class _Body:
    """A response body as the reader sees it: each ``receive`` returns the next read and sets the clock to
    its time; ``b""`` once the reads are out. ``before(n)`` runs ahead of each ``receive``, ``n`` reads in."""

    reads: list[tuple[float, bytes]]
    clock: Clock
    before: Callable[[int], None]
    n: int = 0

    async def receive(self, deadline: float | None = None) -> bytes | None:
        self.before(self.n)
        if self.n == len(self.reads):
            return b""
        t, data = self.reads[self.n]
        self.n += 1
        self.clock.now = t
        return data


def _read(
    h: Harness,
    tel: AttemptTelemetry,
    norm: Normalizer,
    reads: list[tuple[float, bytes]],
    *,
    before: Callable[[int], None] = lambda n: None,
    slice_size: int | None = None,
) -> list[PendingBatch]:
    """Read ``reads`` through ``upstream._read_body`` (fed in slices of ``slice_size`` bytes); returns the
    batches it stored."""
    stored: list[PendingBatch] = []

    async def emit(batch: PendingBatch) -> None:
        stored.append(batch)

    def no_timer(name: str, seconds: float) -> PendingBatch:
        raise AssertionError(f"the {name} timer fired")

    body = _Body(reads, h.clock, before)
    redacting = Redactor(()).stream()
    with patch.object(upstream, "_SLICE", slice_size or upstream._SLICE):
        args = (body, norm, emit, _NO_TIMERS, math.inf, math.inf, no_timer, tel, redacting, h.clock)
        anyio.run(upstream._read_body, *args)
    return stored


def _leave_at(reads: int) -> Callable[[int], None]:
    def before(n: int) -> None:
        if n == reads:
            raise _Leave

    return before


def _body_events() -> list[str]:
    """The body's contract events, fed to a normalizer alone."""
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    return [brief(e) for _, chunk in CHUNKS for e in norm.feed(chunk, 0)[1]]


def _hist(point: Any) -> tuple[int, float, float, float]:
    return point.count, point.sum, point.min, point.max


def test_completed_attempt_span_and_metrics(h: Harness) -> None:
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    with _start(h, trace={"traceparent": TRACEPARENT}) as tel:
        tel.on_response(200)
        _read(h, tel, norm, CHUNKS)
        tel.finish(norm.machine.terminal_event, norm.statistics())
    # The body as the normalizer sees it (7 events from 9 raw events, one of them unknown).
    assert _body_events() == [
        "start claude-x",
        "open 0 text",
        f"delta 0 text '{OUTPUT} Привет'",
        "delta 0 text ' мир'",
        "stop 0",
        "warning unknown_events_skipped 1",
        "done stop end_turn",
    ]

    [span] = h.finished()
    assert span.name == SPAN_NAME and span.kind == SpanKind.CONSUMER
    assert dict(span.attributes or {}) == {
        "route": "claude",
        "dialect": "anthropic",
        "model": "claude-x",
        "attempt": 1,
        "request_id": "req_1",
        "http.response.status_code": 200,
        "status": "completed",
        "stop_reason": "stop",
        "unknown_events": 1,
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 7,
    }
    assert [e.name for e in span.events] == ["first_byte", "first_token"]
    assert span.status.status_code == StatusCode.UNSET

    assert h.value("sluice.provider.bytes", **ROUTE) == BODY_BYTES
    assert h.value("sluice.provider.events", **ROUTE) == 9
    assert h.value("sluice.stream.events", **ROUTE) == 7
    assert h.value("sluice.provider.unknown_events", **ROUTE) == 1
    assert h.value("sluice.streams.in_flight", **ROUTE) == 0
    assert _hist(h.value("sluice.attempt.time_to_first_byte", **ROUTE)) == (1, 0.25, 0.25, 0.25)
    assert _hist(h.value("sluice.attempt.time_to_first_token", **ROUTE)) == (1, 0.5, 0.5, 0.5)
    # gaps between reads that produced events: 10.25 -> 10.5 -> 11.0 -> 11.125, all in the first 5 s
    # window: its longest, 0.5 s, is recorded once (at the end of the attempt)
    assert _hist(h.value("sluice.stream.event_gap", **ROUTE)) == (1, 0.5, 0.5, 0.5)
    # bucket (0.25, 0.5] holds it
    assert tuple(h.value("sluice.stream.event_gap", **ROUTE).bucket_counts[:9]) == (0, 0, 0, 0, 0, 0, 0, 1, 0)
    # nothing recorded that did not happen
    assert set(h.metrics()) == {
        "sluice.provider.bytes",
        "sluice.provider.events",
        "sluice.stream.events",
        "sluice.provider.unknown_events",
        "sluice.streams.in_flight",
        "sluice.attempt.time_to_first_byte",
        "sluice.attempt.time_to_first_token",
        "sluice.stream.event_gap",
    }
    for name in ("sluice.queue.wait", "sluice.cancel.close_time", "sluice.retries", "sluice.requests.terminal"):
        h.none(name)


def test_per_read_figures_are_handed_over_once_per_window_and_at_the_end(h: Harness) -> None:
    """Counters are running totals handed over when a read finds the 5 s window passed (so they are live
    during a long stream), and the rest at the end; the gap histogram gets each window's longest gap: a
    stall shows whole, and a stream costs a few calls per window, not one per read."""
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    last = CHUNKS[3][1]
    # the same reads, the last split in two: its first half comes 5 s after the third read, past 15.0
    reads = [*CHUNKS[:3], (16.0, last[:40]), (16.25, last[40:])]

    def before(n: int) -> None:
        if n == 3:  # still in the first window: nothing handed over
            h.none("sluice.provider.bytes")
        if n == 4:  # the read at 16.0 handed the first window over, its own bytes too (half an event)
            assert h.value("sluice.provider.bytes", **ROUTE) == BODY_BYTES - len(last[40:])
            assert (h.value("sluice.provider.events", **ROUTE), h.value("sluice.stream.events", **ROUTE)) == (7, 5)
            assert _hist(h.value("sluice.stream.event_gap", **ROUTE)) == (1, 0.5, 0.5, 0.5)

    with _start(h) as tel:
        _read(h, tel, norm, reads, before=before)
        tel.finish(norm.machine.terminal_event, norm.statistics())
    assert h.value("sluice.provider.bytes", **ROUTE) == BODY_BYTES
    assert (h.value("sluice.provider.events", **ROUTE), h.value("sluice.stream.events", **ROUTE)) == (9, 7)
    # the second window's one gap: 11.0 -> 16.25 (the read at 16.0 made no event)
    assert _hist(h.value("sluice.stream.event_gap", **ROUTE)) == (2, 5.75, 0.5, 5.25)


def test_a_read_fed_in_slices_is_one_read(h: Harness) -> None:
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    # three reads: the middle one carries chunks 2 and 3 and is fed in slices of 100 bytes
    reads = [(10.25, CHUNKS[0][1]), (10.5, CHUNKS[1][1] + CHUNKS[2][1]), (11.125, CHUNKS[3][1])]
    with _start(h) as tel:
        stored = _read(h, tel, norm, reads, slice_size=100)
        tel.finish(norm.machine.terminal_event, norm.statistics())
    assert len(stored) > len(reads)  # slices of one read are stored apart
    assert _hist(h.value("sluice.stream.event_gap", **ROUTE)) == (1, 0.625, 0.625, 0.625)  # 250, then 625 ms
    assert _hist(h.value("sluice.attempt.time_to_first_token", **ROUTE)) == (1, 0.5, 0.5, 0.5)
    assert (h.value("sluice.stream.events", **ROUTE), h.value("sluice.provider.events", **ROUTE)) == (7, 9)
    assert h.value("sluice.provider.bytes", **ROUTE) == BODY_BYTES


def test_slices_across_window_ends_count_once_and_the_end_hands_over_the_rest(h: Harness) -> None:
    """The first read takes the first byte even when it comes after a whole window (and then hands that
    window over at once), a later read past the window's end hands over what earlier reads' slices made
    (its own bytes too, its events not yet fed), and the attempt's end hands over the rest, events made
    outside the body included."""
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    last = CHUNKS[3][1]
    # 16.0 is 6 s after the start, past the first window; 17.0 inside the one that began at 16.0; 21.5 past
    # 21.0, with half an event; 21.75 the rest
    reads = [(16.0, CHUNKS[0][1]), (17.0, CHUNKS[1][1] + CHUNKS[2][1]), (21.5, last[:40]), (21.75, last[40:])]

    def before(n: int) -> None:
        if n in (1, 2):
            assert _hist(h.value("sluice.attempt.time_to_first_byte", **ROUTE)) == (1, 6.0, 6.0, 6.0)
            assert h.value("sluice.provider.bytes", **ROUTE) == len(CHUNKS[0][1])
            h.none("sluice.provider.events")  # the first read's events: the next window's
        if n == 3:
            assert h.value("sluice.provider.bytes", **ROUTE) == BODY_BYTES - len(last[40:])
            assert (h.value("sluice.provider.events", **ROUTE), h.value("sluice.stream.events", **ROUTE)) == (7, 5)
            # the window's one gap: 16.0 -> 17.0
            assert _hist(h.value("sluice.stream.event_gap", **ROUTE)) == (1, 1.0, 1.0, 1.0)

    with _start(h) as tel:
        _read(h, tel, norm, reads, before=before, slice_size=100)
        h.none("sluice.provider.unknown_events")  # handed over at the end only
        tel.finish(norm.machine.terminal_event, norm.statistics())
    assert h.value("sluice.provider.bytes", **ROUTE) == BODY_BYTES
    assert (h.value("sluice.provider.events", **ROUTE), h.value("sluice.stream.events", **ROUTE)) == (9, 7)
    assert h.value("sluice.provider.unknown_events", **ROUTE) == 1
    assert _hist(h.value("sluice.attempt.time_to_first_token", **ROUTE)) == (1, 7.0, 7.0, 7.0)
    # the read at 21.5 (half an event) made none, the one at 21.75 did: a gap of 17.0 -> 21.75
    assert _hist(h.value("sluice.stream.event_gap", **ROUTE)) == (2, 5.75, 1.0, 4.75)


def test_events_made_after_the_body_was_left_are_counted_at_the_end(h: Harness) -> None:
    """Leaving the body mid-stream hands over what it made; a cancel's stream.error, made after that,
    reaches the total through finish."""
    norm = Normalizer("anthropic", info("anthropic", "req_1"))

    with _start(h) as tel:
        with pytest.raises(_Leave):
            _read(h, tel, norm, CHUNKS, before=_leave_at(2), slice_size=50)
        assert h.value("sluice.stream.events", **ROUTE) == 3  # start, open, delta
        assert h.value("sluice.provider.bytes", **ROUTE) == len(CHUNKS[0][1] + CHUNKS[1][1])
        assert [brief(e) for e in norm.interrupt("cancelled", "cancelled on request", 0)] == [
            "interrupted cancelled None retryable=False"
        ]
        tel.finish(norm.machine.terminal_event, norm.statistics())
    assert h.value("sluice.stream.events", **ROUTE) == 4
    assert h.value("sluice.provider.events", **ROUTE) == 4
    assert _hist(h.value("sluice.stream.event_gap", **ROUTE)) == (1, 0.25, 0.25, 0.25)


def test_telemetry_changes_nothing_the_reader_stores(h: Harness) -> None:
    """The same reads stored with telemetry on and off: the same events and raw counts, in the same slices."""
    out: list[list[tuple[list[tuple[int, str]], int]]] = []
    for tel in (_start(h), DISABLED.attempt(request_id="r", route="x", dialect="anthropic", model=None, attempt=1)):
        norm = Normalizer("anthropic", info("anthropic", "req_1"))
        with tel:
            stored = _read(h, tel, norm, [(10.0 + i, c) for i, (_, c) in enumerate(CHUNKS)], slice_size=64)
            tel.finish(norm.machine.terminal_event, norm.statistics())
        out.append([([(seq, tag) for seq, tag, _, _ in b.events], len(b.raw)) for b in stored])
    on, off = out
    assert len(on) > len(CHUNKS)
    assert on == off


@settings(max_examples=150, deadline=None)
@given(
    cuts=st.lists(st.integers(1, BODY_BYTES - 1), max_size=20, unique=True),
    steps=st.lists(st.sampled_from([0.0, 0.125, 0.5, 0.75, 1.0, 2.5, 4.0, 4.5, 5.0, 7.5]), min_size=21, max_size=21),
    slice_size=st.sampled_from([7, 50, 100, BODY_BYTES]),
)
def test_figures_whatever_the_reads_slices_and_windows(cuts: list[int], steps: list[float], slice_size: int) -> None:
    """The body cut into any reads at any times, each fed in slices: the totals are the body's, first byte
    and first token are their reads' times, and the gap histogram holds, per 5 s window (the first ends 5 s
    after the start; a read at or past a window's end closes it, and each window ends 5 s after the read
    that closed the last), the longest gap between consecutive reads that produced events, worked out here
    from the read times alone."""
    body = b"".join(c for _, c in CHUNKS)
    bounds = [0, *sorted(cuts), len(body)]
    reads, t = [], 10.0
    for i in range(len(bounds) - 1):
        t += steps[i]
        reads.append((t, body[bounds[i] : bounds[i + 1]]))
    expected_gaps: list[float] = []
    window_end, longest, last_events_at, first_token = 15.0, -1.0, None, None
    model = Normalizer("anthropic", info("anthropic", "req_1"))  # what each read makes, fed whole
    for t, data in reads:
        if t >= window_end:
            if longest >= 0:
                expected_gaps.append(longest)
            window_end, longest = t + 5.0, -1.0
        made = model.feed(data, 0)[1]
        if made:
            if last_events_at is not None:
                longest = max(longest, t - last_events_at)
            last_events_at = t
            if first_token is None and any(brief(e).startswith("delta") for e in made):
                first_token = t
    with _harness() as h:
        norm = Normalizer("anthropic", info("anthropic", "req_1"))
        with _start(h) as tel:
            _read(h, tel, norm, reads, slice_size=slice_size)
            tel.finish(norm.machine.terminal_event, norm.statistics())
        if longest >= 0:
            expected_gaps.append(longest)
        assert norm.machine.terminal_event is not None and first_token is not None
        stats = norm.statistics()  # the windows' cheaper read of the two totals is the same
        assert norm.counts() == {"sse_events": stats["sse_events"], "events": stats["events"]}
        assert h.value("sluice.provider.bytes", **ROUTE) == BODY_BYTES
        assert (h.value("sluice.provider.events", **ROUTE), h.value("sluice.stream.events", **ROUTE)) == (9, 7)
        ttfb = reads[0][0] - 10.0
        assert _hist(h.value("sluice.attempt.time_to_first_byte", **ROUTE)) == (1, ttfb, ttfb, ttfb)
        ttft = first_token - 10.0
        assert _hist(h.value("sluice.attempt.time_to_first_token", **ROUTE)) == (1, ttft, ttft, ttft)
        if expected_gaps:
            point = h.value("sluice.stream.event_gap", **ROUTE)
            assert (point.count, point.min, point.max) == (len(expected_gaps), min(expected_gaps), max(expected_gaps))
            assert point.sum == pytest.approx(sum(expected_gaps))
        else:
            h.none("sluice.stream.event_gap")


def test_no_secret_prompt_or_output_in_any_attribute(h: Harness) -> None:
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    with _start(h) as tel:
        _read(h, tel, norm, CHUNKS)
        tel.finish(norm.machine.terminal_event, norm.statistics())
    h.telemetry.request_finished(route="claude", dialect="anthropic", status="completed", stop_reason="stop")
    [span] = h.finished()
    dumped = span.to_json() + h.reader.get_metrics_data().to_json()  # type: ignore[union-attr]
    dumped += generate_latest(h.registry).decode()
    assert OUTPUT not in dumped and "Привет" not in dumped and "\\u041f" not in dumped


def test_span_is_parented_to_the_producer_trace_context(h: Harness) -> None:
    trace = {"Traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE", "baggage": "user=someone"}
    with _start(h, trace=trace) as tel:
        tel.finish(None, {})
    [span] = h.finished()
    assert span.context is not None and span.parent is not None
    assert span.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert tel.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.parent.span_id == 0x00F067AA0BA902B7 and span.parent.is_remote
    assert span.context.trace_state.to_header() == "congo=t61rcWkgMzE"
    assert span.context.span_id != span.parent.span_id


@pytest.mark.parametrize(
    "trace",
    [
        {},
        {"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"},  # all-zero trace id: invalid
        {"traceparent": "not a traceparent"},
        {"tracestate": "congo=t61rcWkgMzE"},  # state without a parent means nothing
    ],
)
def test_without_a_valid_producer_context_the_span_is_a_root(h: Harness, trace: dict[str, str]) -> None:
    with _start(h, trace=trace) as outer:
        # ...even when another span is current: the attempt's own span is current inside it.
        with _start(h, trace=trace, attempt=2) as inner:
            inner.finish(None, {})
        outer.finish(None, {})
    inner_span, outer_span = h.finished()
    assert inner_span.parent is None and outer_span.parent is None
    assert inner.trace_id != outer.trace_id


def test_attempts_of_one_request_share_the_producer_trace(h: Harness) -> None:
    for attempt in (1, 2):
        with _start(h, attempt=attempt, trace={"traceparent": TRACEPARENT}) as tel:
            tel.finish(None, {})
    first, second = h.finished()
    assert first.context and second.context and first.parent and second.parent
    assert first.context.trace_id == second.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert first.parent.span_id == second.parent.span_id == 0x00F067AA0BA902B7
    assert [s.attributes["attempt"] for s in (first, second)] == [1, 2]  # type: ignore[index]


def test_http_error_before_any_byte_is_retried(h: Harness) -> None:
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    with _start(h) as tel:
        tel.on_response(529)
        h.clock.now = 10.5
        term_events = norm.fail("overloaded", "Overloaded (the prompt was: tell me a secret)", 0, retryable=True)
        tel.finish(norm.machine.terminal_event, norm.statistics(), retrying=True)
    assert [brief(e) for e in term_events] == ["start None", "failed overloaded None retryable=True"]
    [span] = h.finished()
    assert dict(span.attributes or {}) == {
        "route": "claude",
        "dialect": "anthropic",
        "model": "claude-x",
        "attempt": 1,
        "request_id": "req_1",
        "http.response.status_code": 529,
        "status": "failed",
        "error.category": "overloaded",
        "retrying": True,
    }
    assert span.status.status_code == StatusCode.ERROR and span.status.description == "overloaded"
    assert span.events == ()  # no byte of a body, no token
    assert "secret" not in span.to_json()
    assert h.value("sluice.retries", **ROUTE, **{"error.category": "overloaded"}) == 1
    assert h.value("sluice.stream.events", **ROUTE) == 2  # stream.start and stream.error, made outside the body
    h.none("sluice.attempt.time_to_first_byte")
    h.none("sluice.provider.bytes")


def test_cancel_is_not_an_error_and_times_the_close(h: Harness) -> None:
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    with _start(h) as tel:
        with pytest.raises(_Leave):
            _read(h, tel, norm, [(10.25, CHUNKS[0][1] + CHUNKS[1][1])], before=_leave_at(1))
        assert [brief(e) for e in norm.interrupt("cancelled", "cancelled on request", 0)] == [
            "interrupted cancelled None retryable=False"
        ]
        tel.record_cancel(100.0, 100.0625)
        tel.record_cancel(None, 100.0)  # the upstream never opened: nothing to time
        tel.finish(norm.machine.terminal_event, norm.statistics())
    [span] = h.finished()
    attrs = dict(span.attributes or {})
    assert (attrs["status"], attrs["error.category"], attrs["cancel_to_close_ms"]) == ("interrupted", "cancelled", 62.5)
    assert span.status.status_code == StatusCode.UNSET
    assert _hist(h.value("sluice.cancel.close_time", **ROUTE)) == (1, 0.0625, 0.0625, 0.0625)
    # start, open, delta from the body; stream.error added by the interrupt
    assert h.value("sluice.stream.events", **ROUTE) == 4
    assert _hist(h.value("sluice.attempt.time_to_first_token", **ROUTE)) == (1, 0.25, 0.25, 0.25)
    h.none("sluice.stream.event_gap")  # one read: no gap yet
    h.none("sluice.retries")


def test_queue_wait_from_the_entry_id(h: Harness) -> None:
    queued = entry_time_ms("1700000000000-7")
    assert queued == 1_700_000_000_000
    with _start(h, queued_at_ms=queued) as tel:
        tel.finish(None, {})
    h.wall[0] = 1_699_999_999_000  # a producer clock ahead of ours never gives a negative wait
    with _start(h, attempt=1, queued_at_ms=queued) as tel:
        tel.finish(None, {})
    with _start(h, attempt=2) as tel:  # later attempts record no queue wait
        tel.finish(None, {})
    assert _hist(h.value("sluice.queue.wait", **ROUTE)) == (2, 1.5, 0.0, 1.5)
    assert [s.attributes.get("queue_wait_ms") for s in h.finished()] == [1500, 0, None]  # type: ignore[union-attr]


@pytest.mark.parametrize("entry_id", ["", "abc", "1700000000000", "1700000000000-x", "-1", "12-3-4"])
def test_entry_time_of_a_non_time_id_is_none(entry_id: str) -> None:
    assert entry_time_ms(entry_id) is None


def test_in_flight_counts_open_attempts_and_exceptions_end_the_span(h: Harness) -> None:
    a = _start(h).__enter__()
    b = _start(h, request_id="req_2", route="gpt", dialect="openai-chat").__enter__()
    assert h.value("sluice.streams.in_flight", **ROUTE) == 1
    assert h.value("sluice.streams.in_flight", route="gpt", dialect="openai-chat") == 1
    with pytest.raises(RuntimeError), b:
        raise RuntimeError("redis went away with the prompt in this message")
    assert h.value("sluice.streams.in_flight", route="gpt", dialect="openai-chat") == 0

    class Cancelled(BaseException):  # stands for the event loop's cancellation
        pass

    with pytest.raises(Cancelled), a:
        raise Cancelled
    assert h.value("sluice.streams.in_flight", **ROUTE) == 0
    failed, cancelled = h.finished()
    assert failed.attributes["error.type"] == "RuntimeError"  # type: ignore[index]
    assert failed.status.status_code == StatusCode.ERROR and "prompt" not in failed.to_json()
    assert "error.type" not in (cancelled.attributes or {})
    assert cancelled.status.status_code == StatusCode.UNSET


def test_finish_twice_and_exit_after_finish_end_once(h: Harness) -> None:
    with _start(h) as tel:
        tel.finish(None, {"events": 3, "unknown_events": 2})
        tel.finish(None, {"events": 9, "unknown_events": 9}, retrying=True)
    assert len(h.finished()) == 1
    assert h.value("sluice.stream.events", **ROUTE) == 3
    assert h.value("sluice.provider.unknown_events", **ROUTE) == 2
    assert h.value("sluice.streams.in_flight", **ROUTE) == 0
    h.none("sluice.retries")


def test_request_terminal_statuses_by_category(h: Harness) -> None:
    t = h.telemetry
    t.request_finished(route="claude", dialect="anthropic", status="completed", stop_reason="tool_use")
    t.request_finished(route="claude", dialect="anthropic", status="completed", stop_reason="tool_use")
    t.request_finished(route="claude", dialect="anthropic", status="failed", category="overloaded")
    t.request_finished(route="", dialect="", status="failed", category="invalid_request")
    assert h.value("sluice.requests.terminal", **ROUTE, status="completed", stop_reason="tool_use") == 2
    assert h.value("sluice.requests.terminal", **ROUTE, status="failed", **{"error.category": "overloaded"}) == 1
    unknown_route = {"route": "", "dialect": "", "status": "failed", "error.category": "invalid_request"}
    assert h.value("sluice.requests.terminal", **unknown_route) == 1


def test_instruments_have_their_declared_units(h: Harness) -> None:
    norm = Normalizer("anthropic", info("anthropic", "req_1"))
    with _start(h, queued_at_ms=1_700_000_000_000) as tel:
        _read(h, tel, norm, CHUNKS)
        tel.record_cancel(1.0, 2.0)
        tel.finish(norm.machine.terminal_event, norm.statistics())
    h.telemetry.request_finished(route="claude", dialect="anthropic", status="completed", stop_reason="stop")
    data = h.reader.get_metrics_data()
    assert data is not None
    units = {m.name: m.unit for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert units == {name: unit for name, (_, unit, _) in METRICS.items() if name != "sluice.retries"}


def test_the_registry_holds_the_families_under_their_prometheus_names(h: Harness) -> None:
    """The OpenTelemetry names as /metrics writes them: dots to underscores, seconds as ``_seconds``, bytes
    as ``_bytes``, ``_total`` on counters; each with its labels, every duration a histogram in seconds."""
    families = {
        f.name: (f.type, f.unit, f.documentation)
        for f in h.registry.collect()
        if f.name.startswith(("sluice_", "gen_ai_"))
    }
    assert {name: kind_unit[:2] for name, kind_unit in families.items()} == {
        "sluice_queue_wait_seconds": ("histogram", "seconds"),
        "sluice_attempt_time_to_first_byte_seconds": ("histogram", "seconds"),
        "sluice_attempt_time_to_first_token_seconds": ("histogram", "seconds"),
        "sluice_stream_event_gap_seconds": ("histogram", "seconds"),
        "sluice_stream_events": ("counter", ""),
        "sluice_provider_events": ("counter", ""),
        "sluice_provider_bytes": ("counter", "bytes"),
        "sluice_streams_in_flight": ("gauge", ""),
        "sluice_provider_unknown_events": ("counter", ""),
        "sluice_retries": ("counter", ""),
        "sluice_requests_terminal": ("counter", ""),
        "sluice_cancel_close_time_seconds": ("histogram", "seconds"),
        # the GenAI conventions' (v1.36.0 names: no time to first chunk)
        "gen_ai_client_operation_duration_seconds": ("histogram", "seconds"),
        "gen_ai_client_token_usage": ("histogram", ""),
    }
    assert families["sluice_queue_wait_seconds"][2] == METRICS["sluice.queue.wait"][2]
    # One attempt and one terminal: the label names of each family's samples.
    with _start(h) as tel:
        tel.finish(None, {})
    h.telemetry.request_finished(route="claude", dialect="anthropic", status="failed", category="timeout")
    labels = {
        s.name: sorted(s.labels)
        for f in h.registry.collect()
        for s in f.samples
        if s.name in ("sluice_streams_in_flight", "sluice_requests_terminal_total", "sluice_queue_wait_seconds_bucket")
    }
    assert labels == {
        "sluice_streams_in_flight": ["dialect", "route"],
        "sluice_requests_terminal_total": ["dialect", "error_category", "route", "status", "stop_reason"],
        "sluice_queue_wait_seconds_bucket": ["dialect", "le", "route"],
    }
    assert prom_histogram(h.registry, "sluice.queue.wait", **ROUTE)[2] == [0] * (len(DURATION_BUCKETS) + 1)
    terminal = {"route": "claude", "dialect": "anthropic", "status": "failed", "error.category": "timeout"}
    assert prom_value(h.registry, "sluice.requests.terminal", **terminal) == 1


# -- off ---------------------------------------------------------------------------------------------


def test_none_is_the_shared_no_op() -> None:
    tel = Telemetry.from_config(TelemetryConfig())
    assert tel is DISABLED and not tel.enabled
    a = tel.attempt(request_id="r", route="x", dialect="anthropic", model=None, attempt=1, trace={"a": "b"})
    assert a is tel.attempt(request_id="s", route="y", dialect="gemini", model="m", attempt=2)
    with a as entered:
        assert entered is a and a.trace_id is None
        a.on_response(200)
        assert a.window_end == math.inf
        assert a.firsts(1.0, 1, []) is False
        assert a.window(1.0, 10, 0.5, dict) == math.inf
        a.record_cancel(1.0, 2.0)
        a.finish(None, {"events": 1})
    tel.request_finished(route="x", dialect="anthropic", status="completed")
    tel.shutdown()


def test_none_never_imports_opentelemetry() -> None:
    code = (
        "import sys\n"
        "from sluice.worker.observability.telemetry import Telemetry, TelemetryConfig\n"
        "t = Telemetry.from_config(TelemetryConfig())\n"
        "with t.attempt(request_id='r', route='x', dialect='anthropic', model=None, attempt=1) as a:\n"
        "    a.firsts(1.0, 1, []); a.window(1.0, 1, -1.0, dict); a.finish(None, {})\n"
        "t.shutdown()\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_endpoint_alone_never_imports_opentelemetry_and_makes_no_span() -> None:
    """The exporter ``none`` with the admin endpoint's registry: prometheus-client's instruments alone."""
    code = (
        "import sys\n"
        "from prometheus_client import CollectorRegistry\n"
        "from sluice.worker.observability.telemetry import Telemetry, TelemetryConfig\n"
        "r = CollectorRegistry()\n"
        "t = Telemetry.from_config(TelemetryConfig(), instance_id='w-1', registry=r)\n"
        "with t.attempt(request_id='r', route='x', dialect='anthropic', model=None, attempt=1) as a:\n"
        "    a.window(1.0, 10, 0.5, lambda: {'events': 3}); a.finish(None, {'events': 4})\n"
        "t.shutdown()\n"
        "route = {'route': 'x', 'dialect': 'anthropic'}\n"
        "print(t.enabled, a.trace_id, sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
        "print(r.get_sample_value('sluice_provider_bytes_total', route),"
        " r.get_sample_value('sluice_stream_events_total', route),"
        " r.get_sample_value('sluice_stream_event_gap_seconds_sum', route),"
        " r.get_sample_value('sluice_streams_in_flight', route))\n"
        "print(r.get_sample_value('target_info', {'service_name': 'sluice-worker', 'service_instance_id': 'w-1'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.splitlines() == ["True None []", "10.0 4.0 0.5 0.0", "1.0"]


# -- configuration and exporters --------------------------------------------------------------------


def test_config_decodes_and_refuses_bad_values() -> None:
    cfg = msgspec.convert({"exporter": "console", "service_name": "w", "sample_ratio": 0.25}, TelemetryConfig)
    assert cfg == TelemetryConfig(exporter="console", service_name="w", sample_ratio=0.25)
    for bad in (
        {"exporter": "jaeger"},
        {"sample_ratio": 1.5},
        {"sample_ratio": -0.1},
        {"metric_interval_ms": 0},
        {"endpoint": "http://x"},
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, TelemetryConfig)


def test_console_exports_sampled_spans_and_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    tel = Telemetry.from_config(
        TelemetryConfig(exporter="console", service_name="sluice-test", sample_ratio=0.0), instance_id="w-1"
    )
    assert tel.enabled
    # ratio 0 drops traces that start here; a producer's sampled flag is followed all the same.
    with tel.attempt(request_id="req_unsampled", route="r", dialect="anthropic", model=None, attempt=1) as a:
        a.finish(None, {})
    trace = {"traceparent": TRACEPARENT}
    with tel.attempt(request_id="req_sampled", route="r", dialect="anthropic", model=None, attempt=1, trace=trace) as a:
        a.finish(None, {"events": 4})
    tel.shutdown()
    out = capsys.readouterr().out
    assert "req_sampled" in out and "req_unsampled" not in out
    assert '"service.name": "sluice-test"' in out and '"service.instance.id": "w-1"' in out
    assert '"name": "sluice.attempt"' in out
    assert '"name": "sluice.stream.events"' in out  # metrics do not depend on sampling


def test_otlp_without_the_exporter_package_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    ):
        monkeypatch.setitem(sys.modules, mod, None)  # None in sys.modules makes the import fail
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-http"):
        TelemetryConfig(exporter="otlp").check()
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-http"):
        Telemetry.from_config(TelemetryConfig(exporter="otlp"))
    TelemetryConfig(exporter="console").check()
    TelemetryConfig().check()


class _Collector(BaseHTTPRequestHandler):
    paths: list[str] = []  # noqa: RUF012 - one collector per test, shared with the handler

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.paths.append(self.path)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_exports_to_the_configured_endpoint() -> None:
    pytest.importorskip(
        "opentelemetry.exporter.otlp.proto.http", reason="the optional OTLP exporter package is not installed"
    )
    _Collector.paths = []
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tel = Telemetry.from_config(
            TelemetryConfig(exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{server.server_port}/")
        )
        with tel.attempt(request_id="r", route="r", dialect="anthropic", model=None, attempt=1) as a:
            a.finish(None, {"events": 1})
        tel.shutdown()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert sorted(set(_Collector.paths)) == ["/v1/metrics", "/v1/traces"]
