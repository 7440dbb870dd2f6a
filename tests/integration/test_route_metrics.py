"""The limited routes' metrics (``sluice.worker.capacity.gauges``) read back through the SDK's in-memory reader
and the prometheus-client registry (which must agree): a seeded capacity store's figures exactly, their
change after the store changes, nothing after a failed read, and the real worker reporting them on its own
for a route with limits (none for a route without)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import anyio
import msgspec
import pytest
import redis
import redis.asyncio as aioredis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from sluice.schemas.keys import Keys
from sluice.worker.capacity import gauges as route_gauges
from sluice.worker.capacity.gauges import ROUTE_METRICS, RouteGauges
from sluice.worker.observability.metrics import prometheus_name
from sluice.worker.observability.telemetry import Telemetry
from tests.helpers import metric_points
from tests.integration.conftest import cleanup, make_config
from tests.integration.test_cli_routes import FAR, _now_ms, _seed
from tests.integration.test_telemetry_worker import running_worker


class Reader:
    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.tracers = TracerProvider()
        self.registry = CollectorRegistry()
        self.telemetry = Telemetry.with_providers(self.tracers, self.meters, registry=self.registry)

    def points(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Route instrument -> sorted attributes -> value, from the SDK's reader, after checking the registry's
        samples (read at the same moment) are the same."""
        sdk = {
            name: {tuple(sorted(dict(p.attributes).items())): p.value for p in pts}
            for name, pts in metric_points(self.reader).items()
            if name in ROUTE_METRICS
        }
        assert self.prometheus() == sdk
        return sdk

    def prometheus(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """The same from the registry: each route instrument's samples under its Prometheus name."""
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        families = {f.name: f for f in self.registry.collect()}
        for name, (kind, unit, _) in ROUTE_METRICS.items():
            family, suffix = prometheus_name(name, unit)
            family = f"{family}_{suffix}" if suffix and not family.endswith(suffix) else family
            sample = family + ("_total" if kind == "counter" else "")
            got = {tuple(sorted(s.labels.items())): s.value for s in families[family].samples if s.name == sample}
            if got:
                out[name] = got
        return out


@pytest.fixture
def otel() -> Iterator[Reader]:
    r = Reader()
    yield r
    r.meters.shutdown()
    r.tracers.shutdown()


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _route(name: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"route": name, **extra}.items()))


def _expected(
    in_flight: int, cooldown_s: float, waiting: tuple[int, int]
) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    return {
        "sluice.route.admitted": {_route("claude"): 120},
        "sluice.route.refused": {
            _route("claude", reason="cooldown"): 0,
            _route("claude", reason="concurrency"): 14,
            _route("claude", reason="rate"): 2,
            _route("claude", reason="tokens"): 0,
        },
        "sluice.route.cooldowns": {_route("claude"): 3},
        "sluice.route.in_flight": {_route("claude"): in_flight},
        "sluice.route.waiting": {
            _route("claude", priority="interactive"): waiting[0],
            _route("claude", priority="batch"): waiting[1],
        },
        "sluice.route.cooldown": {_route("claude"): cooldown_s},
    }


@pytest.mark.asyncio
async def test_gauges_report_a_seeded_store_and_follow_it(
    otel: Reader, sync_redis: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    _seed(sync_redis, keys, "claude")  # no cooldown
    r = aioredis.Redis.from_url(redis_url)
    try:
        gauges = RouteGauges(otel.telemetry, r, keys, ["claude", "plain"])  # "plain": no store, no points
        assert otel.points() == {}  # nothing read yet: nothing reported
        await gauges.refresh()
        assert otel.points() == _expected(3, 0.0, (2, 10))
        rk = keys.route("claude")
        now = _now_ms(sync_redis)
        sync_redis.zadd(rk.permits, {"t9": now + 600_000})
        sync_redis.hset(rk.drr, mapping={"n:interactive:acme": 0, "n:batch:bulk": 8})
        sync_redis.hset(rk.state, "cooldown_until", FAR)
        await gauges.refresh()
        got = otel.points()
        cooldown = got["sluice.route.cooldown"][_route("claude")]
        assert (FAR - _now_ms(sync_redis)) / 1000 <= cooldown <= (FAR - now) / 1000
        got["sluice.route.cooldown"][_route("claude")] = 0.0
        assert got == _expected(4, 0.0, (0, 11))
    finally:
        await cleanup(r, key_prefix)
        await r.aclose()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_a_failed_read_reports_nothing(
    otel: Reader, sync_redis: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    _seed(sync_redis, keys, "claude")
    good = aioredis.Redis.from_url(redis_url)
    bad = aioredis.Redis.from_url(f"redis://127.0.0.1:{_closed_port()}/0", socket_connect_timeout=1)
    try:
        gauges = RouteGauges(otel.telemetry, good, keys, ["claude"])
        await gauges.refresh()
        assert otel.points()["sluice.route.in_flight"] == {_route("claude"): 3}
        gauges.redis = bad  # Redis away: the last read must not linger as if live
        await gauges.refresh()
        assert gauges.views == {} and otel.points() == {}
        gauges.redis = good
        await gauges.refresh()
        assert otel.points()["sluice.route.in_flight"] == {_route("claude"): 3}
    finally:
        await cleanup(good, key_prefix)
        await good.aclose()
        await bad.aclose()


@pytest.mark.asyncio
async def test_the_worker_reports_its_limited_routes(
    otel: Reader, sync_redis: redis.Redis, fake, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(route_gauges, "INTERVAL_S", 0.05)
    base = make_config(redis_url, key_prefix, fake.base_url)
    routes = {**base.routes, "claude": msgspec.structs.replace(base.routes["anthropic"], max_concurrency=20)}
    config = msgspec.structs.replace(base, routes=routes)
    keys = Keys(key_prefix)
    _seed(sync_redis, keys, "claude")
    r = aioredis.Redis.from_url(redis_url)
    try:
        async with running_worker(config, otel.telemetry):
            with anyio.fail_after(20):
                while _route("claude") not in otel.points().get("sluice.route.admitted", {}):  # noqa: ASYNC110
                    await anyio.sleep(0.05)  # the state is the reader's: nothing to wait on but a poll
            got = otel.points()
    finally:
        await cleanup(r, key_prefix)
        await r.aclose()
    # Only the limited route, labelled by route alone; the worker's own start may have rewritten the limits,
    # never the counters.
    assert {k for pts in got.values() for k in pts} <= {
        _route("claude"),
        *(_route("claude", reason=x) for x in ("cooldown", "concurrency", "rate", "tokens")),
        *(_route("claude", priority=p) for p in ("interactive", "batch")),
    }
    assert got["sluice.route.admitted"] == {_route("claude"): 120}
    assert got["sluice.route.cooldowns"] == {_route("claude"): 3}
