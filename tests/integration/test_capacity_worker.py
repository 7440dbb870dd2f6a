"""Route limits through the worker against the fake provider (which enforces the same limits itself): the
provider's peak concurrency never passes the route's cap across workers, no job fails, parked jobs say what
they wait on, one worker's 429 cools the route for the others, and tenants and priorities are served in the
discipline's order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from sluice.harness.fake.limits import ProviderLimits
from sluice.harness.fake.provider import serve_fake_provider
from sluice.schemas.keys import Keys
from sluice.worker.config import Config, Route

from .conftest import API_KEY, KEY_ENV, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio


def _limited(redis_url: str, prefix: str, base_url: str, consumer: str, **limits: int) -> Config:
    route = Route(
        dialect="anthropic",
        base_url=base_url,
        model="synthetic",
        api_key_env=KEY_ENV,
        send_request_id=True,
        **limits,  # type: ignore[arg-type]
    )
    return make_config(redis_url, prefix, base_url, routes={"claude": route}, consumer=consumer, max_in_flight=16)


def _job(scenario: str, **extra: object) -> dict[str, object]:
    return {"route": "claude", "model": scenario, "request": {"messages": [{"role": "user", "content": "hi"}]}, **extra}


async def _wait_for(predicate: Callable[[], Awaitable[bool]]) -> None:
    async with asyncio.timeout(30):
        while not await predicate():  # noqa: ASYNC110 - the state is in Redis
            await asyncio.sleep(0.02)


async def test_a_burst_never_passes_the_cap_across_two_workers_and_no_job_fails(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    async with serve_fake_provider(api_key=API_KEY, limits=ProviderLimits(max_concurrency=4)) as fake:
        one = _limited(redis_url, key_prefix, fake.base_url, "w1", max_concurrency=4)
        two = _limited(redis_url, key_prefix, fake.base_url, "w2", max_concurrency=4)
        async with running_worker(one), running_worker(two), client_for(one) as client:
            rids = [await client.enqueue(_job("synthetic;deltas=4;pace_ms=5")) for _ in range(40)]
            results = [await client.result(rid, timeout=60) for rid in rids]
        assert [r.status for r in results] == ["completed"] * 40
        assert fake.stats.limiter.peak_in_flight <= 4 and fake.stats.responses_429 == 0
        assert fake.stats.limiter.peak_in_flight == 4  # the cap was reached: the test could fail
        rk = Keys(key_prefix).route("claude")
        assert await redis_client.zcard(rk.permits) == 0 and await redis_client.hlen(rk.lease) == 0
        assert await redis_client.hlen(rk.waiting) == 0 and await redis_client.zcard(rk.rpm) == 40


async def test_a_parked_job_says_what_it_waits_on_and_runs_when_the_permit_frees(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    async with serve_fake_provider(api_key=API_KEY) as fake:
        config = _limited(redis_url, key_prefix, fake.base_url, "w1", max_concurrency=1)
        async with running_worker(config), client_for(config) as client:
            first = await client.enqueue(_job("synthetic;deltas=2;hold=g"))
            async with asyncio.timeout(30):
                await fake.stats.wait_until(lambda s: s.limiter.in_flight == 1)
            second = await client.enqueue(_job("synthetic;deltas=2"))
            status = Keys(key_prefix).request(second).status

            async def parked() -> bool:
                return await redis_client.hget(status, "waiting_on") == b"concurrency"

            await _wait_for(parked)
            assert await redis_client.hmget(status, ["state", "waiting_route"]) == [b"queued", b"claude"]
            typed = await client.status(second)
            assert (typed.state, typed.waiting_on, typed.waiting_route) == ("queued", "concurrency", "claude")
            assert typed.waiting_since is not None
            fake.release("g")
            assert (await client.result(first, timeout=30)).status == "completed"
            assert (await client.result(second, timeout=30)).status == "completed"
        assert await redis_client.hget(status, "waiting_on") is None  # the claim deleted it


async def test_one_workers_429_cools_the_route_for_the_other(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    async with serve_fake_provider(api_key=API_KEY) as fake:
        one = _limited(redis_url, key_prefix, fake.base_url, "w1", max_concurrency=4, cooldown_min_ms=2000)
        async with running_worker(one), client_for(one) as client:
            rid = await client.enqueue(_job("synthetic;status=429;retry_after=4;times=1;seed=9"))
            rk = Keys(key_prefix).route("claude")

            async def cooling() -> bool:
                return int(await redis_client.hget(rk.state, "cooldown_until") or 0) > 0

            await _wait_for(cooling)
            until = int(await redis_client.hget(rk.state, "cooldown_until") or 0)
            before = fake.stats.provider_requests
            # Another worker's job waits instead of being sent into the 429.
            two = _limited(redis_url, key_prefix, fake.base_url, "w2", max_concurrency=4, cooldown_min_ms=2000)
            async with running_worker(two):
                other = await client.enqueue(_job("synthetic;deltas=1"))
                status = Keys(key_prefix).request(other).status

                async def parked() -> bool:
                    return await redis_client.hget(status, "waiting_on") == b"cooldown"

                await _wait_for(parked)
                assert fake.stats.provider_requests == before
                assert (await client.result(other, timeout=30)).status == "completed"
                started = int(await redis_client.hget(status, "started_at") or 0)
                assert started >= until
            assert (await client.result(rid, timeout=30)).status == "completed"  # its retry waited too
            assert int(await redis_client.hget(rk.state, "provider_429") or 0) == 1


async def test_interactive_jobs_go_before_a_batch_backlog_and_tenants_alternate(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    async with serve_fake_provider(api_key=API_KEY) as fake:
        config = _limited(redis_url, key_prefix, fake.base_url, "w1", max_concurrency=1)
        async with running_worker(config), client_for(config) as client:
            first = await client.enqueue(_job("synthetic;deltas=1;hold=f"))
            async with asyncio.timeout(30):
                await fake.stats.wait_until(lambda s: s.limiter.in_flight == 1)
            backlog = [("a1", "A", "batch"), ("a2", "A", "batch"), ("a3", "A", "batch")]
            backlog += [("b1", "B", "interactive"), ("b2", "B", "interactive"), ("c1", "C", "batch")]
            for i, (rid, tenant, prio) in enumerate(backlog):
                job = _job(f"synthetic;deltas=1;seed={i}", tenant=tenant, priority=prio, request_id=rid)
                await client.enqueue(job)
            waiting = Keys(key_prefix).route("claude").waiting

            async def all_parked() -> bool:
                return await redis_client.hlen(waiting) == 6

            await _wait_for(all_parked)
            fake.release("f")
            await client.result(first, timeout=30)
            for rid in ("a1", "a2", "a3", "b1", "b2", "c1"):
                assert (await client.result(rid, timeout=30)).status == "completed"
        seen = [r.request_id for r in fake.stats.requests if r.request_id in {"a1", "a2", "a3", "b1", "b2", "c1"}]
        # interactive B first (FIFO), then batch by round robin over A and C
        assert seen == ["b1", "b2", "a1", "c1", "a2", "a3"]


async def test_a_worker_whose_limits_differ_from_a_live_workers_refuses_to_start(
    redis_url: str, key_prefix: str
) -> None:
    from sluice.worker.capacity.admission import LimitsMismatch
    from sluice.worker.pipeline.consumer import Worker

    async with serve_fake_provider(api_key=API_KEY) as fake:
        one = _limited(redis_url, key_prefix, fake.base_url, "w1", max_concurrency=4)
        two = _limited(redis_url, key_prefix, fake.base_url, "w2", max_concurrency=5)
        async with running_worker(one):
            with pytest.raises(LimitsMismatch) as info:
                await Worker(two).run()
        assert info.value.message.startswith('routes.claude: this worker\'s limits {"c":5,')
        assert "live worker w1" in info.value.message and "\n" not in info.value.message


async def test_a_worker_without_the_limits_a_live_worker_enforces_refuses_to_start(
    redis_url: str, key_prefix: str
) -> None:
    from sluice.worker.capacity.admission import LimitsMismatch
    from sluice.worker.pipeline.consumer import Worker

    async with serve_fake_provider(api_key=API_KEY) as fake:
        one = _limited(redis_url, key_prefix, fake.base_url, "w1", max_concurrency=4)
        two = _limited(redis_url, key_prefix, fake.base_url, "w2")
        async with running_worker(one):
            with pytest.raises(LimitsMismatch) as info:
                await Worker(two).run()
        assert info.value.message.startswith("routes.claude: this worker has no limits for it, but live worker w1")
