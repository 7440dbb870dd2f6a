"""Fallback routes with capacity (docs/design-capacity.md B.7, docs/notes/cap-merge.md), real Redis and the
fake provider: a job whose limited route is cooling at admission goes to its fallback at once (one without
fallbacks waits on its own route); a fallback attempt on a limited route holds a permit there while it runs
and gives it back after; a fallback route that is full is skipped; a 429 from a fallback route cools that
route; every route's store ends empty (no permit, lease, reservation or waiting job left)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sluice.schemas.keys import Keys
from sluice.worker.config import RetryPolicy, Route
from tests.integration.conftest import KEY_ENV, client_for, make_config, running_worker
from tests.integration.test_failures import FAST

pytestmark = pytest.mark.asyncio

QUICK = RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.1, max_total=20.0)


def _route(dialect: str, base_url: str, model: str | None = None, **extra: Any) -> Route:
    return Route(dialect=dialect, base_url=base_url, model=model, api_key_env=KEY_ENV, send_request_id=True, **extra)


def _job(model: str, **extra: object) -> dict[str, object]:
    return {
        "route": "claude",
        "model": model,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
        "timeouts": FAST,
        **extra,
    }


async def _until(predicate: Callable[[], Awaitable[bool]]) -> None:
    with anyio.fail_after(30):
        while not await predicate():  # noqa: ASYNC110 - the state is in Redis
            await anyio.sleep(0.02)


async def _assert_stores_empty(redis_client: aioredis.Redis, prefix: str, routes: list[str]) -> None:
    for name in routes:
        rk = Keys(prefix).route(name)
        left = {
            "permits": await redis_client.zcard(rk.permits),
            "reserved": await redis_client.zcard(rk.reserved),
            "lease": await redis_client.hlen(rk.lease),
            "held": await redis_client.zcard(rk.held),
            "waiting": await redis_client.hlen(rk.waiting),
        }
        assert left == dict.fromkeys(left, 0), (name, left)


async def _redis_ms(redis_client: aioredis.Redis) -> int:
    secs, micros = await redis_client.time()
    return int(secs) * 1000 + int(micros) // 1000


def _seen(fake: Any, rid: str) -> list[tuple[str | None, int]]:
    return [(r.dialect, r.status) for r in fake.stats.find(request_id=rid)]


async def test_a_route_cooling_at_admission_sends_a_job_with_fallbacks_to_its_fallback_and_parks_one_without(
    fake, redis_url, key_prefix, redis_client
):  # type: ignore[no-untyped-def]
    routes = {
        "claude": _route("anthropic", fake.base_url, max_concurrency=4, fallbacks=["gpt"]),
        "gpt": _route("openai-chat", fake.base_url, "synthetic;deltas=2;text=from%20gpt", max_concurrency=2),
    }
    config = make_config(redis_url, key_prefix, fake.base_url, routes=routes, retry=QUICK)
    claude = Keys(key_prefix).route("claude")
    async with running_worker(config), client_for(config) as client:
        await redis_client.hset(claude.state, "cooldown_until", await _redis_ms(redis_client) + 600_000)
        sent = await client.enqueue(_job("synthetic;deltas=1"))
        result = await client.result(sent, timeout=30)
        status = await client.status(sent)
        assert result.status == "completed" and result.dialect == "openai-chat"
        assert (status.route, status.attempt_route, status.routes_tried) == ("claude", "gpt", ["gpt"])
        assert _seen(fake, sent) == [("openai-chat", 200)]  # nothing was sent into the cooling route

        parked = await client.enqueue(_job("synthetic;deltas=1", fallbacks=[]))
        record = Keys(key_prefix).request(parked).status

        async def waits_on_cooldown() -> bool:
            return await redis_client.hget(record, "waiting_on") == b"cooldown"

        await _until(waits_on_cooldown)
        assert await redis_client.hget(record, "waiting_route") == b"claude"
        assert await redis_client.hexists(claude.waiting, parked)
        assert _seen(fake, parked) == []
        await redis_client.hset(claude.state, "cooldown_until", 0)  # the cooldown ends: it runs on its own route
        result = await client.result(parked, timeout=30)
        status = await client.status(parked)
        assert result.status == "completed" and result.dialect == "anthropic"
        assert status.routes_tried == ["claude"]
    await _assert_stores_empty(redis_client, key_prefix, ["claude", "gpt"])
    assert await redis_client.zcard(Keys(key_prefix).route("gpt").rpm) == 1


async def test_a_fallback_attempt_holds_a_permit_on_its_limited_route_and_a_full_fallback_is_skipped(
    fake, redis_url, key_prefix, redis_client
):  # type: ignore[no-untyped-def]
    # The job's own route has no limits: its fallback's permits are taken all the same.
    routes = {
        "claude": _route("anthropic", fake.base_url, fallbacks=["gpt"]),
        "gpt": _route("openai-chat", fake.base_url, "synthetic;deltas=2;hold=g;text=from%20gpt", max_concurrency=1),
    }
    config = make_config(redis_url, key_prefix, fake.base_url, routes=routes, retry=QUICK)
    gpt = Keys(key_prefix).route("gpt")
    async with running_worker(config), client_for(config) as client:
        first = await client.enqueue(_job("synthetic;status=529;seed=1"))
        with anyio.fail_after(30):
            await fake.stats.wait_until(lambda s: s.limiter.in_flight == 1)
        assert await redis_client.zcard(gpt.permits) == 1  # held at the provider: its permit is out
        # gpt is full: the second job's hop skips it and the retry policy resumes on its own route.
        second = await client.enqueue(_job("synthetic;status=529;seed=2"))
        failed = await client.result(second, timeout=30)
        status = await client.status(second)
        assert failed.status == "failed" and status.routes_tried == ["claude", "claude"]
        assert _seen(fake, second) == [("anthropic", 529), ("anthropic", 529)]
        assert await redis_client.zcard(gpt.permits) == 1 and await redis_client.zcard(gpt.reserved) == 0
        fake.release("g")
        result = await client.result(first, timeout=30)
        status = await client.status(first)
        assert result.status == "completed" and status.routes_tried == ["claude", "gpt"]
        assert [r.request_id for r in fake.stats.requests if r.dialect == "openai-chat"] == [first]
    await _assert_stores_empty(redis_client, key_prefix, ["gpt"])
    assert int(await redis_client.hget(gpt.state, "refused_concurrency") or 0) == 1


async def test_a_429_on_the_fallback_route_cools_that_route(fake, redis_url, key_prefix, redis_client):  # type: ignore[no-untyped-def]
    routes = {
        "claude": _route(
            "anthropic",
            fake.base_url,
            max_concurrency=4,
            cooldown_min_ms=50,
            cooldown_base_ms=50,
            cooldown_max_ms=200,
            fallbacks=["gpt"],
        ),
        "gpt": _route("openai-chat", fake.base_url, "synthetic;status=429;retry_after=7", max_concurrency=2),
    }
    config = make_config(redis_url, key_prefix, fake.base_url, routes=routes, retry=QUICK)
    gpt = Keys(key_prefix).route("gpt")
    async with running_worker(config), client_for(config) as client:
        before = await _redis_ms(redis_client)
        rid = await client.enqueue(_job("synthetic;status=529;times=1;seed=3"))
        result = await client.result(rid, timeout=30)
        status = await client.status(rid)
        assert result.status == "completed" and result.dialect == "anthropic"
        assert status.routes_tried == ["claude", "gpt", "claude"]
        assert _seen(fake, rid) == [("anthropic", 529), ("openai-chat", 429), ("anthropic", 200)]
        until = int(await redis_client.hget(gpt.state, "cooldown_until") or 0)
        assert before + 7000 <= until <= await _redis_ms(redis_client) + 7000  # its retry-after, for the fleet
        assert await redis_client.hmget(gpt.state, ["cooldown_reason", "provider_429"]) == [b"rate_limit", b"1"]
        claude = Keys(key_prefix).route("claude")
        assert await redis_client.hget(claude.state, "cooldown_reason") == b"overloaded"  # its 529 cooled it
    await _assert_stores_empty(redis_client, key_prefix, ["claude", "gpt"])


async def test_a_job_of_a_limited_route_naming_an_unknown_fallback_is_refused_before_its_offer(
    fake, redis_url, key_prefix, redis_client
):  # type: ignore[no-untyped-def]
    routes = {"claude": _route("anthropic", fake.base_url, max_concurrency=2)}
    config = make_config(redis_url, key_prefix, fake.base_url, routes=routes, retry=QUICK)
    async with running_worker(config), client_for(config) as client:
        rid = await client.enqueue(_job("synthetic;deltas=1", fallbacks=["gtp"]))
        result = await client.result(rid, timeout=30)
        assert result.status == "failed" and result.error is not None
        assert (result.error.category, result.error.message) == (
            "invalid_request",
            "invalid job: fallbacks names an unknown route 'gtp'",
        )
        assert _seen(fake, rid) == []
    claude = Keys(key_prefix).route("claude")
    assert int(await redis_client.hget(claude.state, "parked") or 0) == 0 and await redis_client.zcard(claude.rpm) == 0
    await _assert_stores_empty(redis_client, key_prefix, ["claude"])
