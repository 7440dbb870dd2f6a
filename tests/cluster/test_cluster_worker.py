"""The worker and the client on a real Redis Cluster (3 masters, 3 replicas): sharded jobs end to end in every
dialect, the terminal feed across shards, many concurrent enqueues and readers on a fresh client, and a cancel
reaching the worker wherever the request lives."""

from __future__ import annotations

import itertools
import uuid

import anyio
import pytest

from sluice.client import SluiceClient
from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import StreamDone, StreamError
from sluice.schemas.keys import Keys, key_slot, shard_index
from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import connect
from tests.cluster.harness import Cluster
from tests.faults.invariants import check_request
from tests.integration.conftest import DIALECTS, make_config, raw_log_as_sse, running_worker, without_ts

SHARDS = 3
MODEL = "synthetic;deltas=12;tools=1;reasoning=3;chunk=7"


def _prefix() -> str:
    return f"ct{uuid.uuid4().hex[:10]}"


def _ids(tag: str, count: int, shards: int = SHARDS) -> list[str]:
    """``count`` request ids whose job shards cover every shard."""
    ids: list[str] = []
    by_shard = itertools.cycle(range(shards))
    want = next(by_shard)
    for i in itertools.count():
        rid = f"{tag}-{i}"
        if shard_index(rid, shards) == want:
            ids.append(rid)
            want = next(by_shard)
        if len(ids) == count:
            return ids
    raise AssertionError("unreachable")


def _job(route: str, rid: str, model: str = MODEL) -> dict[str, object]:
    return {
        "route": route,
        "model": model,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "Привет"}]},
    }


def test_the_documented_shard_function_is_cluster_keyslot_mod_n(cluster: Cluster) -> None:
    """What other languages are told to compute: ``CLUSTER KEYSLOT <request id>`` mod N, and the shard tags'
    slots in the i-th of N equal ranges."""
    port = cluster.masters()[0].port
    for rid in ["r1", "req_0123abc", "order-42:retry.1", "Ünïcode"[:1] + "x", *(f"id-{i}" for i in range(20))]:
        slot = cluster.call(port, "CLUSTER", "KEYSLOT", rid)
        assert isinstance(slot, int)
        for n in (2, 3, 7):
            assert shard_index(rid, n) == slot % n
    keys = Keys("p", 6, cluster=True)
    for shard in keys.shards:
        slot = cluster.call(port, "CLUSTER", "KEYSLOT", shard.jobs)
        assert isinstance(slot, int) and shard.index * 16384 // 6 <= slot < (shard.index + 1) * 16384 // 6


async def _cluster_client(cluster: Cluster) -> SluiceCluster:
    rc = connect(cluster.seed_url, cluster=True)
    assert isinstance(rc, SluiceCluster)
    await rc.initialize()
    return rc


@pytest.mark.parametrize("appends", ["pipe", "redis-py"])
@pytest.mark.asyncio
async def test_every_dialect_end_to_end_with_job_shards_on_different_masters(
    cluster: Cluster, fake, appends: str
) -> None:
    prefix = _prefix()
    config = make_config(
        cluster.seed_url, prefix, fake.base_url, redis_cluster=True, job_shards=SHARDS, cluster_appends=appends
    )
    keys = Keys(prefix, SHARDS, cluster=True)
    # the shards' keys hash to slots on different masters (the harness gives masters equal slot ranges)
    assert len({cluster.master_for_key(s.jobs) for s in keys.shards}) == SHARDS
    rids = _ids(prefix, 8)
    rc = await _cluster_client(cluster)
    try:
        async with running_worker(config), SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True) as client:
            for rid, dialect in zip(rids, itertools.cycle(DIALECTS), strict=False):
                assert await client.enqueue(_job(dialect, rid)) == rid
            results = {rid: await client.result(rid, timeout=60) for rid in rids}
            events = {rid: [ev async for ev in client.events(rid)] for rid in rids}
        assert {rid: r.status for rid, r in results.items()} == dict.fromkeys(rids, "completed")
        for rid, dialect in zip(rids, itertools.cycle(DIALECTS), strict=False):
            facts = await check_request(rc, keys, rid)
            assert facts.state == "completed" and list(facts.attempts) == [1]
            raw = await rc.xrange(keys.request(rid).raw)
            info = StreamInfo(f"{rid}:1", rid, "", dialect, 1, MODEL, route=dialect)
            _, offline, offline_result = normalize_bytes([raw_log_as_sse(raw)], dialect, info)
            assert [without_ts(e) for e in events[rid]] == [without_ts(e) for e in offline]
            assert offline_result == results[rid]
            assert isinstance(events[rid][-1], StreamDone)
            status = await rc.hgetall(keys.request(rid).status)
            assert status[b"job_stream"] == keys.shard_for(rid).jobs.encode()
        # each shard's terminal stream holds exactly its own requests
        for shard in keys.shards:
            published = [f[b"request_id"].decode() for _, f in await rc.xrange(shard.terminal)]
            assert sorted(published) == sorted(r for r in rids if shard_index(r, SHARDS) == shard.index)
        assert await rc.hget(keys.layout, "job_shards") == str(SHARDS).encode()
    finally:
        await _cleanup(rc, prefix)
        await rc.aclose()


@pytest.mark.asyncio
async def test_the_terminal_feed_across_shards_with_consumer_group_semantics(cluster: Cluster, fake) -> None:
    prefix = _prefix()
    config = make_config(cluster.seed_url, prefix, fake.base_url, redis_cluster=True, job_shards=SHARDS)
    rids = _ids(prefix, 6)
    rc = await _cluster_client(cluster)
    try:
        async with running_worker(config), SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True) as client:
            for rid in rids:
                await client.enqueue(_job("anthropic", rid, "synthetic;deltas=3"))
            for rid in rids:
                await client.result(rid, timeout=30)
            # a consumer that takes four entries and dies without acking them
            async with client.terminals("billing", "b-1") as feed:
                first = [t async for t in _take(feed, 4)]
            pending = [await rc.xpending_range(s.terminal, "billing", "-", "+", 100) for s in client.keys.shards]
            left = {p["message_id"].decode() for ps in pending for p in ps}
            assert {t.entry_id for t in first} <= left
            # started again, it gets them again (its pending list first), then the rest; acked, never again
            async with client.terminals("billing", "b-1") as feed:
                again = [t async for t in _take(feed, len(rids))]
                for t in again:
                    await feed.ack(t)
            assert sorted(t.request_id for t in again) == sorted(rids)
            assert {t.entry_id for t in first} <= {t.entry_id for t in again}
            assert {t.status for t in again} == {"completed"}
            pending = [await rc.xpending(s.terminal, "billing") for s in client.keys.shards]
            assert sum(int(p["pending"]) for p in pending) == 0
            # another group reads the whole feed on its own; a consumer that died holding entries has them
            # claimed by a live one once they are idle long enough
            async with client.terminals("audit", "dead") as feed:
                assert len([t async for t in _take(feed, 2)]) == 2
            async with client.terminals("audit", "live", claim_idle_ms=1) as feed:
                audited = [t async for t in _take(feed, len(rids))]
                for t in audited:
                    await feed.ack(t)
            assert sorted(t.request_id for t in audited) == sorted(rids)
            pending = [await rc.xpending(s.terminal, "audit") for s in client.keys.shards]
            assert sum(int(p["pending"]) for p in pending) == 0
    finally:
        await _cleanup(rc, prefix)
        await rc.aclose()


async def _take(feed, n: int):  # type: ignore[no-untyped-def]
    got = 0
    async for t in feed:
        yield t
        got += 1
        if got == n:
            return


@pytest.mark.asyncio
async def test_many_concurrent_enqueues_and_readers_on_a_fresh_client(cluster: Cluster, fake) -> None:
    """Before the fix, a fresh redis-py cluster client sent this burst to random masters and its MOVED storm
    closed connections under other tasks: lost replies, AttributeErrors, entries stuck in a pending list."""
    prefix = _prefix()
    config = make_config(
        cluster.seed_url, prefix, fake.base_url, redis_cluster=True, job_shards=SHARDS, max_in_flight=64
    )
    rids = [f"{prefix}-{i}" for i in range(60)]
    rc = await _cluster_client(cluster)
    try:
        async with running_worker(config):
            client = SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True)  # fresh: no slot map yet
            try:
                finals: dict[str, object] = {}

                async def one(rid: str) -> None:
                    await client.enqueue(_job("openai-chat", rid, "synthetic;deltas=5;pace_ms=5"))
                    evs = [ev async for ev in client.events(rid)]
                    finals[rid] = evs[-1]

                async with anyio.create_task_group() as tg:
                    for rid in rids:
                        tg.start_soon(one, rid)
            finally:
                await client.aclose()
        assert all(isinstance(ev, StreamDone) for ev in finals.values()) and len(finals) == len(rids)
        keys = Keys(prefix, SHARDS, cluster=True)
        for rid in rids:
            assert (await check_request(rc, keys, rid)).state == "completed"
    finally:
        await _cleanup(rc, prefix)
        await rc.aclose()


@pytest.mark.asyncio
async def test_a_cancel_reaches_the_owning_worker_on_any_shard(cluster: Cluster, fake) -> None:
    prefix = _prefix()
    config = make_config(cluster.seed_url, prefix, fake.base_url, redis_cluster=True, job_shards=SHARDS)
    rids = _ids(prefix, SHARDS)
    rc = await _cluster_client(cluster)
    try:
        async with running_worker(config), SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True) as client:
            for rid in rids:
                await client.enqueue(_job("gemini", rid, "synthetic;deltas=2000;pace_ms=20"))
            for rid in rids:  # wait until each streams, then cancel it
                async for ev in client.events(rid):
                    if type(ev).__name__ == "BlockDelta":
                        break
                assert await client.cancel(rid)
            ends = {rid: [ev async for ev in client.events(rid)][-1] for rid in rids}
        keys = Keys(prefix, SHARDS, cluster=True)
        for rid, end in ends.items():
            assert isinstance(end, StreamError) and (end.status, end.error.category) == ("interrupted", "cancelled")
            assert (await check_request(rc, keys, rid)).state == "interrupted"
        assert {key_slot(keys.shard_for(r).jobs) for r in rids} != {key_slot(keys.control)}
    finally:
        await _cleanup(rc, prefix)
        await rc.aclose()


async def _cleanup(rc: SluiceCluster, prefix: str) -> None:
    keys = [key async for key in rc.scan_iter(match=f"{prefix}:*", count=1000)]  # every primary
    for key in keys:
        await rc.delete(key)
