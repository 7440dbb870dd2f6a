"""``sluice bench admin``: the admin endpoint's two costs, each measured alone in this process.

Rule: an attempt is the worker's own body reader (``worker/pipeline/upstream.py`` ``_read_body``) over a synthetic
Anthropic stream of ``--deltas`` text deltas (default 20, a short answer, where what an attempt costs
weighs most) read one provider event per read (the paced shape), with the
telemetry the admin endpoint makes (the exporter ``none``, the Prometheus reader) against telemetry off;
after ``--requests`` attempts on two routes, one scrape is the admin endpoint's app (``observability/exposition.py``)
against prometheus-client's own, for the 0.0.4 text and OpenMetrics, gzip asked. CPU is this thread's
(``time.thread_time``), the best of ``--repeat`` timed runs, the two settings interleaved after a warm-up
run of each. The two apps' bodies are checked equal after
gzip (a check, not a measurement: a difference fails the run). Numbers are measurements, never assertions.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import anyio
from rich.console import Console
from rich.table import Table

from sluice.harness.fake.render import Script, Text, render_tagged

__all__ = ["run_admin"]

OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"


class _Reads:
    """A 200 response whose body the reader receives one provider event at a time, then its end."""

    status_code = 200
    headers: Mapping[str, str] = {}

    def __init__(self, events: list[bytes]) -> None:
        self._events = iter(events)

    async def receive(self, deadline: float | None = None) -> bytes | None:
        return next(self._events, b"")

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        for event in self._events:
            yield event

    async def aclose(self) -> None:
        return None


def _body(deltas: int) -> list[bytes]:
    rng = random.Random(7)
    words = ("the", "model", "said", "Привет", "café", "🙂", "and", "then")
    script = Script(
        model="bench-model",
        blocks=(Text(tuple(" ".join(rng.choices(words, k=rng.randint(3, 8))) + " " for _ in range(deltas))),),
        stop="stop",
        input_tokens=200,
        output_tokens=deltas * 5,
        id="bench",
    )
    return [data for _, data in render_tagged("anthropic", script)]


def _attempts(telemetry: Any, body: list[bytes], n: int) -> float:
    """CPU µs per attempt of ``n`` attempts read through the worker's body reader."""
    from sluice.normalizer.machine import StreamInfo
    from sluice.normalizer.redact import Redactor
    from sluice.normalizer.stream import Normalizer
    from sluice.worker.config import Timeouts
    from sluice.worker.observability.genai import GenAICall
    from sluice.worker.pipeline import upstream

    timeouts = Timeouts(first_byte=1e9, idle=1e9, total=1e9)

    async def emit(_batch: Any) -> None:
        return None

    def no_timer(name: str, seconds: float) -> Any:
        raise RuntimeError(f"the {name} timer fired")

    async def go() -> float:
        cpu = time.thread_time()
        for i in range(n):
            route = ("claude", "claude-eu")[i % 2]
            rid = f"bench-{i}"
            norm = Normalizer("anthropic", StreamInfo(f"{rid}:1", rid, "", "anthropic"))
            call = GenAICall("anthropic", "bench-model", True, "api.anthropic.com", 443)
            with telemetry.attempt(
                request_id=rid, route=route, dialect="anthropic", model="bench-model", attempt=1, genai=call
            ) as tel:
                tel.on_response(200)
                await upstream._read_body(
                    _Reads(body), norm, emit, timeouts, math.inf, math.inf, no_timer, tel, Redactor(()).stream()
                )
                tel.finish(norm.machine.terminal_event, norm.statistics(), response_id=norm.machine.response_id)
            telemetry.request_finished(route=route, dialect="anthropic", status="completed", stop_reason="stop")
        return (time.thread_time() - cpu) / n * 1e6

    return anyio.run(go)


def _get(app: Callable[..., Iterable[bytes]], accept: str) -> bytes:
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/metrics",
        "QUERY_STRING": "",
        "HTTP_ACCEPT": accept,
        "HTTP_ACCEPT_ENCODING": "gzip",
    }
    return b"".join(app(environ, lambda status, headers: None))


def _scrape_ms(app: Callable[..., Iterable[bytes]], accept: str, repeat: int, n: int = 40) -> float:
    best = math.inf
    for _ in range(repeat):
        cpu = time.thread_time()
        for _ in range(n):
            _get(app, accept)
        best = min(best, (time.thread_time() - cpu) / n * 1000)
    return best


_HELD_FDS = 400


def run_admin(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app

    from sluice.worker.config import Config
    from sluice.worker.observability.admin import Admin
    from sluice.worker.observability.exposition import MetricsApp
    from sluice.worker.observability.histograms import own_collector
    from sluice.worker.observability.process_metrics import ProcessMetrics
    from sluice.worker.observability.telemetry import DISABLED, Telemetry, TelemetryConfig

    n = args.requests or (50 if args.quick else 200)
    repeat = args.repeat or (2 if args.quick else 5)
    deltas = args.deltas or (10 if args.quick else 20)  # a short answer: the per-attempt costs show
    body = _body(deltas)
    # The worker's endpoint as it is built: its registry, reader and instruments.
    endpoint = Admin(Config(admin_port=0))
    assert endpoint.registry is not None
    registry, reader = endpoint.registry, endpoint.readers[0]
    admin = Telemetry.from_config(TelemetryConfig(), metric_readers=[reader])
    endpoint.instruments(admin)
    # The same telemetry on the exporter's plain reader: the SDK's histograms, as with another exporter.
    sdk = Telemetry.from_config(
        TelemetryConfig(),
        metric_readers=[PrometheusMetricReader(registry=CollectorRegistry(), scope_info_enabled=False)],
    )
    settings = {"off": DISABLED, "admin": admin, "admin, SDK histograms": sdk}
    try:
        for tel in settings.values():  # warm-up: the first runs pay for imports, caches and new series
            _attempts(tel, body, n)
        cpu = dict.fromkeys(settings, math.inf)
        for _ in range(repeat):  # interleaved, so a slower minute of the machine weighs on each
            for name, tel in settings.items():
                cpu[name] = min(cpu[name], _attempts(tel, body, n))
        ours, theirs = MetricsApp(registry, own=own_collector(reader)), make_wsgi_app(registry)
        scrapes: dict[str, dict[str, float]] = {}
        for label, accept in (("text 0.0.4", "*/*"), ("OpenMetrics 1.0.0", OPENMETRICS_ACCEPT)):
            # ProcessCollector's figures move between two scrapes: compared without its lines.
            a, b = (gzip.decompress(_get(app, accept)).decode() for app in (ours, theirs))
            if _without_process(a) != _without_process(b):
                raise RuntimeError(f"the admin endpoint's {label} differs from prometheus-client's")
            scrapes[label] = {
                "prometheus_client_ms": _scrape_ms(theirs, accept, repeat),
                "sluice_ms": _scrape_ms(ours, accept, repeat),
                "bytes": len(a),
                "samples": sum(1 for line in a.splitlines() if line and not line.startswith("#")),
            }
        # The process's figures: prometheus-client's collector against the endpoint's (observability.process_metrics).
        # With the descriptors a loaded worker holds (a socket per stream in flight, about 450 at 200).
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(_HELD_FDS)]
        try:
            theirs_us = _collect_us(ProcessCollector(registry=None), repeat)
            ours_us = _collect_us(ProcessMetrics(), repeat)
            open_fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
        finally:
            for fd in held:
                os.close(fd)
    finally:
        admin.shutdown()
        sdk.shutdown()
    reads = len(body)  # one read per provider event; the last makes the stream terminal, so no end read
    result = {
        "attempts": n,
        "deltas": deltas,
        "reads_per_attempt": reads,
        "attempt_cpu_us": cpu,
        "admin_minus_off_us": cpu["admin"] - cpu["off"],
        "sdk_histograms_minus_off_us": cpu["admin, SDK histograms"] - cpu["off"],
        "scrape": scrapes,
        "process_figures": {"prometheus_client_us": theirs_us, "sluice_us": ours_us, "open_fds": open_fds},
    }
    table = Table(title=f"admin endpoint alone ({n} attempts of {deltas} deltas, one read per event; best of {repeat})")
    for col in ("what", "CPU", "over telemetry off"):
        table.add_column(col, justify="right")
    for name, us in cpu.items():
        extra = "" if name == "off" else f"+{us - cpu['off']:.0f} µs (+{(us - cpu['off']) / reads:.2f} / read)"
        table.add_row(f"µs per attempt, telemetry {name}", f"{us:.0f}", extra)
    for label, s in scrapes.items():
        table.add_row(
            f"ms per scrape, {label}, prometheus-client ({s['samples']} samples)",
            f"{s['prometheus_client_ms']:.2f}",
            "",
        )
        table.add_row(
            f"ms per scrape, {label}, sluice",
            f"{s['sluice_ms']:.2f}",
            f"{s['sluice_ms'] / s['prometheus_client_ms']:.2f}x",
        )
    table.add_row(
        f"µs per collection of the process's figures, prometheus-client ({open_fds} descriptors open)",
        f"{theirs_us:.0f}",
        "",
    )
    table.add_row("µs per collection of the process's figures, sluice", f"{ours_us:.0f}", f"{ours_us / theirs_us:.2f}x")
    console.print(table)
    return result


def _collect_us(collector: Any, repeat: int, n: int = 200) -> float:
    """CPU µs of one ``collector.collect()``, best of ``repeat`` runs of ``n``."""
    best = math.inf
    for _ in range(repeat):
        start = time.thread_time_ns()
        for _ in range(n):
            list(collector.collect())
        best = min(best, (time.thread_time_ns() - start) / n / 1000)
    return best


def _without_process(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if not line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith("process_")
    ]
