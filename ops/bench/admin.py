"""``sluice bench admin``: the admin endpoint's two costs, each measured alone in this process.

Rule: an attempt is the worker's own body reader (``worker/pipeline/upstream.py`` ``_read_body``) over a
synthetic Anthropic stream of ``--deltas`` text deltas (default 20, a short answer, where what an attempt
costs weighs most) read one provider event per read (the paced shape), with the telemetry the admin
endpoint makes (the exporter ``none``: the worker's prometheus-client instruments) against telemetry off;
after ``--requests`` attempts on two routes, one scrape is the endpoint's ``/metrics`` app
(prometheus-client's ``make_wsgi_app`` over the worker's registry), for the 0.0.4 text and OpenMetrics,
gzip asked, with 400 descriptors open (prometheus-client's process collector counts them). CPU is this
thread's (``time.thread_time``), the best of ``--repeat`` timed runs, the two settings interleaved after a
warm-up run of each. Numbers are measurements, never assertions.
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
    from prometheus_client import make_wsgi_app

    from sluice.worker.config import Config
    from sluice.worker.observability.admin import Admin
    from sluice.worker.observability.telemetry import DISABLED, Telemetry, TelemetryConfig

    n = args.requests or (50 if args.quick else 200)
    repeat = args.repeat or (2 if args.quick else 5)
    deltas = args.deltas or (10 if args.quick else 20)  # a short answer: the per-attempt costs show
    body = _body(deltas)
    # The worker's endpoint as it is built: its registry and its instruments.
    endpoint = Admin(Config(admin_port=0))
    assert endpoint.registry is not None
    registry = endpoint.registry
    admin = Telemetry.from_config(TelemetryConfig(), instance_id="bench", registry=registry)
    endpoint.instruments(admin)
    settings = {"off": DISABLED, "admin": admin}
    for tel in settings.values():  # warm-up: the first runs pay for imports, caches and new series
        _attempts(tel, body, n)
    cpu = dict.fromkeys(settings, math.inf)
    for _ in range(repeat):  # interleaved, so a slower minute of the machine weighs on each
        for name, tel in settings.items():
            cpu[name] = min(cpu[name], _attempts(tel, body, n))
    app = make_wsgi_app(registry)
    scrapes: dict[str, dict[str, float]] = {}
    # With the descriptors a loaded worker holds (a socket per stream in flight, about 450 at 200):
    # prometheus-client's process collector counts them at each scrape.
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(_HELD_FDS)]
    try:
        open_fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
        for label, accept in (("text 0.0.4", "*/*"), ("OpenMetrics 1.0.0", OPENMETRICS_ACCEPT)):
            text = gzip.decompress(_get(app, accept)).decode()
            scrapes[label] = {
                "ms": _scrape_ms(app, accept, repeat),
                "bytes": len(text),
                "samples": sum(1 for line in text.splitlines() if line and not line.startswith("#")),
            }
    finally:
        for fd in held:
            os.close(fd)
    reads = len(body)  # one read per provider event; the last makes the stream terminal, so no end read
    result = {
        "attempts": n,
        "deltas": deltas,
        "reads_per_attempt": reads,
        "attempt_cpu_us": cpu,
        "admin_minus_off_us": cpu["admin"] - cpu["off"],
        "scrape": scrapes,
        "open_fds": open_fds,
    }
    table = Table(title=f"admin endpoint alone ({n} attempts of {deltas} deltas, one read per event; best of {repeat})")
    for col in ("what", "CPU", "over telemetry off"):
        table.add_column(col, justify="right")
    for name, us in cpu.items():
        extra = "" if name == "off" else f"+{us - cpu['off']:.0f} µs (+{(us - cpu['off']) / reads:.2f} / read)"
        table.add_row(f"µs per attempt, telemetry {name}", f"{us:.0f}", extra)
    for label, sc in scrapes.items():
        fds = f", {open_fds} descriptors open" if open_fds is not None else ""
        table.add_row(f"ms per scrape, {label}, gzip ({sc['samples']:.0f} samples{fds})", f"{sc['ms']:.2f}", "")
    console.print(table)
    return result
