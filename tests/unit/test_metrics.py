"""observability.metrics: the worker's prometheus-client instruments, read back from the registry and from
prometheus-client's own exposition and parser.

Rule: every expected value is exact; the figures other homes keep (``observe``) are read at each collection,
with the label names of the series read; a name defined again keeps the first definition.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sluice.worker.observability.metrics import PromMetrics, prometheus_name, worker_registry


def _metrics(registry: CollectorRegistry | None = None, **target: str) -> PromMetrics:
    return PromMetrics(registry or CollectorRegistry(), genai_latest=False, target=target)


def _family(registry: CollectorRegistry, name: str) -> Any:
    (family,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode()) if f.name == name]
    return family


@pytest.mark.parametrize(
    ("name", "unit", "expected"),
    [
        ("sluice.queue.wait", "s", ("sluice_queue_wait", "seconds")),
        ("sluice.provider.bytes", "By", ("sluice_provider_bytes", "bytes")),
        ("sluice.stream.events", "{event}", ("sluice_stream_events", "")),
        ("gen_ai.client.token.usage", "{token}", ("gen_ai_client_token_usage", "")),
        ("sluice.route.cooldown", "s", ("sluice_route_cooldown", "seconds")),
    ],
)
def test_a_name_is_the_opentelemetry_one_as_prometheus_writes_it(
    name: str, unit: str, expected: tuple[str, str]
) -> None:
    assert prometheus_name(name, unit) == expected


def test_observed_series_are_read_at_each_scrape_with_their_own_label_names() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    figures: list[tuple[float, dict[str, Any]]] = []
    metrics.observe("sluice.archive.lag", "s", "the archivers' lag", lambda: list(figures))
    assert _family(registry, "sluice_archive_lag_seconds").samples == []  # nothing read yet: no series
    figures[:] = [(1.5, {"group": "a"}), (0.25, {"group": "b", "error.category": "x"})]
    family = _family(registry, "sluice_archive_lag_seconds")
    assert (family.type, family.documentation) == ("gauge", "the archivers' lag")
    assert [(s.labels, s.value) for s in family.samples] == [
        ({"error_category": "", "group": "a"}, 1.5),
        ({"error_category": "x", "group": "b"}, 0.25),
    ]
    figures[:] = [(3.0, {"group": "a"})]  # series come and go with the home's figures
    assert [(s.labels, s.value) for s in _family(registry, "sluice_archive_lag_seconds").samples] == [
        ({"group": "a"}, 3.0)
    ]


def test_an_observed_counter_is_a_counter_and_a_name_defined_again_keeps_the_first() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    metrics.observe("sluice.route.admitted", "{job}", "admitted", lambda: [(120, {"route": "claude"})], counter=True)
    metrics.observe("sluice.route.admitted", "{job}", "again", lambda: [(7, {"route": "other"})], counter=True)
    family = _family(registry, "sluice_route_admitted")
    assert (family.type, family.documentation) == ("counter", "admitted")
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("sluice_route_admitted_total", {"route": "claude"}, 120.0)
    ]


def test_another_homes_histogram_records_seconds_and_is_the_same_when_defined_again() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    rtt = metrics.histogram("sluice.redis.round_trip", "s", "round trip", (0.001, 0.01))
    assert metrics.histogram("sluice.redis.round_trip", "s", "round trip", (0.5,)) is rtt
    for seconds in (0.0005, 0.001, 0.002, 0.5):
        rtt.record(seconds)
    get = registry.get_sample_value
    assert [get("sluice_redis_round_trip_seconds_bucket", {"le": le}) for le in ("0.001", "0.01", "+Inf")] == [
        2.0,
        3.0,
        4.0,
    ]
    assert (get("sluice_redis_round_trip_seconds_count"), get("sluice_redis_round_trip_seconds_sum")) == (4.0, 0.5035)


def test_a_routes_children_are_made_once_and_start_at_zero() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    series = metrics.series("claude", "anthropic")
    assert metrics.series("claude", "anthropic") is series
    route = {"route": "claude", "dialect": "anthropic"}
    get = registry.get_sample_value
    assert get("sluice_provider_bytes_total", route) == 0.0
    assert get("sluice_attempt_time_to_first_byte_seconds_count", route) == 0.0
    series.received(10, 2, 0)
    series.received(5, 0, 3)
    series.retried("overloaded")
    series.retried("overloaded")
    series.in_flight(1)
    series.first_byte(0.25)
    assert [get(f"sluice_{n}_total", route) for n in ("provider_bytes", "provider_events", "stream_events")] == [
        15.0,
        2.0,
        3.0,
    ]
    assert get("sluice_retries_total", {**route, "error_category": "overloaded"}) == 2.0
    assert get("sluice_streams_in_flight", route) == 1.0
    assert get("sluice_attempt_time_to_first_byte_seconds_bucket", {**route, "le": "0.25"}) == 1.0
    assert get("sluice_attempt_time_to_first_byte_seconds_bucket", {**route, "le": "0.1"}) == 0.0


def test_genai_and_terminal_series_fill_a_missing_label_with_nothing() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.system": "anthropic", "server.port": 443}
    metrics.genai("gen_ai.client.operation.duration", attrs, 1.25)
    metrics.genai("gen_ai.client.operation.time_to_first_chunk", attrs, 0.5)  # not in the v1.36.0 naming
    metrics.terminal("claude", "anthropic", "failed", "", "timeout")
    labels = {
        "gen_ai_operation_name": "chat",
        "gen_ai_system": "anthropic",
        "server_address": "",
        "server_port": "443",
        "gen_ai_request_model": "",
        "error_type": "",
    }
    assert registry.get_sample_value("gen_ai_client_operation_duration_seconds_sum", labels) == 1.25
    assert "gen_ai_client_operation_time_to_first_chunk_seconds" not in {f.name for f in registry.collect()}
    terminal = {"route": "claude", "dialect": "anthropic", "status": "failed", "stop_reason": "", "error_category": ""}
    assert registry.get_sample_value("sluice_requests_terminal_total", terminal) is None
    terminal["error_category"] = "timeout"
    assert registry.get_sample_value("sluice_requests_terminal_total", terminal) == 1.0


def test_the_workers_registry_has_prometheus_clients_process_and_platform_collectors() -> None:
    registry = worker_registry()
    _metrics(registry, **{"service.name": "sluice-worker", "service.instance.id": "w-1"})
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert {"python_info", "target_info"} <= names
    # prometheus-client reads the process's figures from /proc, and gives none where there is none
    assert ("process_cpu_seconds" in names) == os.path.isdir("/proc/self")
    target = {"service_name": "sluice-worker", "service_instance_id": "w-1"}
    assert registry.get_sample_value("target_info", target) == 1.0
