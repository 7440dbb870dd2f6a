"""Route limits on a real Redis Cluster: two limited routes whose capacity stores (one hash tag each) live on
different masters, and a worker serving both: every job completes under its route's cap, and each store ends
empty with its RPM window holding one admission per job of that route."""

from __future__ import annotations

import itertools
import uuid

import pytest

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
