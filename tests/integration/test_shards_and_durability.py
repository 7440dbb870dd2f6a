"""On one Redis: a sharded layout (job_shards > 1) end to end, a shard count that disagrees with the recorded
one refused, and durability = "replica" with and without a replica to wait for."""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio as aioredis

from sluice.client import LayoutMismatch, SluiceClient
from sluice.harness.embedded_redis import embedded_redis
from sluice.schemas.errors import ConfigError
from sluice.schemas.keys import Keys, shard_index
from sluice.worker.redis.connect import check_layout
from tests.faults.invariants import check_request
from tests.integration.conftest import cleanup, make_config, running_worker

pytestmark = pytest.mark.asyncio


def _job(rid: str, model: str = "synthetic;deltas=4") -> dict[str, object]:
    return {
        "route": "openai-chat",
        "model": model,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }


async def test_two_job_shards_on_one_redis(fake, redis_url, key_prefix, redis_client: aioredis.Redis) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url, job_shards=2)
    keys = Keys(key_prefix, 2)
    rids = [f"r{i}" for i in range(6)]
    assert {shard_index(r, 2) for r in rids} == {0, 1}
    try:
        async with running_worker(config), SluiceClient(redis_url, key_prefix=key_prefix, job_shards=2) as client:
            for rid in rids:
                await client.enqueue(_job(rid))
            for rid in rids:
                assert (await client.result(rid, timeout=30)).status == "completed"
        for rid in rids:
            await check_request(redis_client, keys, rid)
            assert await redis_client.hget(keys.request(rid).status, "job_stream") == keys.shard_for(rid).jobs.encode()
        for shard in keys.shards:
            entries = await redis_client.xrange(shard.jobs)
            assert len(entries) == sum(shard_index(r, 2) == shard.index for r in rids)
        assert not await redis_client.exists(f"{key_prefix}:jobs")  # nothing in the single-instance names
        # a producer or worker told another shard count than the recorded one refuses
        with pytest.raises(LayoutMismatch, match="job_shards = 2"):
            async with SluiceClient(redis_url, key_prefix=key_prefix, job_shards=3) as other:
                await other.enqueue(_job("late"))
        with pytest.raises(ConfigError, match="job_shards = 2"):
            await check_layout(redis_client, Keys(key_prefix, 4))
    finally:
        await cleanup(redis_client, key_prefix)


async def test_durability_replica_without_a_replica_says_unconfirmed(fake, private_redis_url, key_prefix) -> None:
    config = make_config(private_redis_url, key_prefix, fake.base_url, durability="replica", durability_timeout_ms=50)
    r = aioredis.Redis.from_url(private_redis_url)
    try:
        async with running_worker(config), SluiceClient(private_redis_url, key_prefix=key_prefix) as client:
            await client.enqueue(_job("d1"))
            assert (await client.result("d1", timeout=30)).status == "completed"
        keys = Keys(key_prefix)
        await check_request(r, keys, "d1")
        status = await r.hgetall(keys.request("d1").status)
        assert (status[b"durability"], status[b"replicas_acked"]) == (b"unconfirmed", b"0")
        ((_, entry),) = await r.xrange(keys.terminal)
        assert entry[b"durability"] == b"unconfirmed"
    finally:
        await cleanup(r, key_prefix)
        await r.aclose()


@pytest.mark.server  # starts its own server
async def test_durability_replica_waits_for_the_replica(fake, key_prefix) -> None:
    with embedded_redis() as primary, embedded_redis(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]):
        r = aioredis.Redis.from_url(primary.url)
        with anyio.fail_after(30):
            # Online, not only connected: Redis 7 and Valkey sync diskless after a delay (5 s by default), and
            # a WAIT counts only a replica that acknowledges.
            while (await r.info("replication")).get("slave0", {}).get("state") != "online":  # noqa: ASYNC110
                await anyio.sleep(0.05)
        config = make_config(primary.url, key_prefix, fake.base_url, durability="replica")
        try:
            async with running_worker(config), SluiceClient(primary.url, key_prefix=key_prefix) as client:
                for rid in ("p1", "p2", "p3"):
                    await client.enqueue(_job(rid))
                for rid in ("p1", "p2", "p3"):
                    assert (await client.result(rid, timeout=30)).status == "completed"
            keys = Keys(key_prefix)
            for rid in ("p1", "p2", "p3"):
                await check_request(r, keys, rid)
                status = await r.hgetall(keys.request(rid).status)
                assert (status[b"durability"], status[b"replicas_acked"]) == (b"replica", b"1")
        finally:
            await r.aclose()
