"""Route limits on a real Redis Cluster: two limited routes whose capacity stores (one hash tag each) live on
different masters, and a worker serving both: every job completes under its route's cap, and each store ends
empty with its RPM window holding one admission per job of that route; and a failover of a route's master
while jobs wait."""

from __future__ import annotations

import itertools
import uuid

import anyio
import pytest
from redis.exceptions import RedisError

from sluice.client import SluiceClient
from sluice.harness.fake.limits import ProviderLimits
from sluice.harness.fake.provider import serve_fake_provider
from sluice.schemas.keys import Keys
from sluice.worker.config import Route
from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import connect
from tests.cluster.harness import Cluster
from tests.integration.conftest import API_KEY, KEY_ENV, make_config, running_worker


def _two_routes_on_two_masters(cluster: Cluster, keys: Keys) -> tuple[str, str]:
    first = f"r{0}"
    home = cluster.master_for_key(keys.route(first).state)
    for i in itertools.count(1):
        if cluster.master_for_key(keys.route(f"r{i}").state) != home:
            return first, f"r{i}"
    raise AssertionError("unreachable")


@pytest.mark.asyncio
async def test_two_limited_routes_on_different_masters(cluster: Cluster) -> None:
    prefix = f"ct{uuid.uuid4().hex[:10]}"
    keys = Keys(prefix, 3, cluster=True)
    a, b = _two_routes_on_two_masters(cluster, keys)
    async with serve_fake_provider(api_key=API_KEY, limits=ProviderLimits(max_concurrency=4)) as fake:
        routes = {
            name: Route(
                dialect="anthropic",
                base_url=fake.base_url,
                model="synthetic",
                api_key_env=KEY_ENV,
                send_request_id=True,
                max_concurrency=2,
            )
            for name in (a, b)
        }
        config = make_config(cluster.seed_url, prefix, fake.base_url, redis_cluster=True, job_shards=3, routes=routes)
        rc = connect(cluster.seed_url, cluster=True)
        assert isinstance(rc, SluiceCluster)
        await rc.initialize()
        try:
            async with running_worker(config), SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True) as c:
                rids = {
                    await c.enqueue(
                        {
                            "route": route,
                            "model": "synthetic;deltas=3;pace_ms=5",
                            "tenant": f"t{i % 3}",
                            "priority": "batch" if i % 2 else "interactive",
                            "request": {"messages": [{"role": "user", "content": "hi"}]},
                        }
                    ): route
                    for i, route in zip(range(24), itertools.cycle((a, b)), strict=False)
                }
                results = {rid: await c.result(rid, timeout=60) for rid in rids}
            assert {r.status for r in results.values()} == {"completed"}
            assert fake.stats.responses_429 == 0 and fake.stats.limiter.peak_in_flight <= 4
            for route in (a, b):
                rk = keys.route(route)
                assert await rc.zcard(rk.permits) == 0 and await rc.hlen(rk.lease) == 0
                assert await rc.zcard(rk.rpm) == 12
        finally:
            async for key in rc.scan_iter(match=f"{prefix}:*"):
                await rc.delete(key)
            await rc.aclose()


@pytest.mark.asyncio
async def test_a_failover_of_the_routes_master_while_jobs_wait(cluster: Cluster) -> None:
    """The master holding a route's store is killed while one job holds the only permit and four wait: after
    the replica takes over, every job completes once and the store ends empty (what the replica had received
    is what survives: the jobs were parked well before the kill)."""
    prefix = f"ct{uuid.uuid4().hex[:10]}"
    keys = Keys(prefix, 3, cluster=True)
    rk = keys.route("fo")
    victim = cluster.master_for_key(rk.state)
    async with serve_fake_provider(api_key=API_KEY) as fake:
        route = Route(
            dialect="anthropic",
            base_url=fake.base_url,
            model="synthetic",
            api_key_env=KEY_ENV,
            send_request_id=True,
            max_concurrency=1,
        )
        config = make_config(
            cluster.seed_url,
            prefix,
            fake.base_url,
            redis_cluster=True,
            job_shards=3,
            routes={"fo": route},
            claim_idle_ms=15_000,
            heartbeat_ms=1_000,
            redis_outage_limit=60.0,
        )
        rc = connect(cluster.seed_url, cluster=True)
        assert isinstance(rc, SluiceCluster)
        await rc.initialize()
        killed = False

        def job(model: str) -> dict[str, object]:
            return {"route": "fo", "model": model, "request": {"messages": [{"role": "user", "content": "hi"}]}}

        try:
            async with running_worker(config), SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True) as c:
                first = await c.enqueue(job("synthetic;deltas=2;hold=fo"))
                with anyio.fail_after(30):
                    await fake.stats.wait_until(lambda s: s.limiter.in_flight == 1)
                rest = [await c.enqueue(job(f"synthetic;deltas=2;seed={i}")) for i in range(4)]
                with anyio.fail_after(30):
                    while await rc.hlen(rk.waiting) < 4:  # noqa: ASYNC110 - the state is in Redis
                        await anyio.sleep(0.05)
                await anyio.to_thread.run_sync(cluster.kill, victim)
                killed = True
                assert await anyio.to_thread.run_sync(cluster.wait_failover, victim) != victim
                fake.release("fo")
                statuses = []
                for rid in [first, *rest]:
                    while True:
                        try:
                            statuses.append((await c.result(rid, timeout=90)).status)
                            break
                        except (RedisError, OSError):
                            await anyio.sleep(0.1)
            assert statuses == ["completed"] * 5
            await rc.initialize()
            with anyio.fail_after(30):
                while await rc.zcard(rk.permits):  # noqa: ASYNC110 - the state is in Redis
                    await anyio.sleep(0.05)
            assert await rc.hlen(rk.waiting) == 0 and await rc.hlen(rk.lease) == 0
            assert fake.stats.limiter.peak_in_flight <= 1
            await anyio.to_thread.run_sync(cluster.restart, victim)
            killed = False
        finally:
            if killed:
                await anyio.to_thread.run_sync(cluster.restart, victim)
            async for key in rc.scan_iter(match=f"{prefix}:*"):
                await rc.delete(key)
            await rc.aclose()
