"""Faults on a real Redis Cluster with streams in flight: a master SIGKILLed and its replica promoted, and a
slot migrated (MIGRATING / IMPORTING, ASK, then MOVED) under a streaming request. After each, the fault
invariants hold for every request (tests/faults/invariants.py), and what a live reader saw is what is stored."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import anyio
import msgspec
import pytest
from redis.exceptions import RedisError

from sluice.client import SluiceClient
from sluice.schemas.events import BlockDelta, Event, StreamDone, StreamError
from sluice.schemas.keys import Keys, key_slot
from sluice.schemas.result import Result
from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import connect
from tests.cluster.harness import Cluster, SlotMigration
from tests.faults.invariants import check_request
from tests.integration.conftest import DIALECTS, make_config, running_worker

pytestmark = pytest.mark.asyncio

SHARDS = 3
# A lost worker, or Redis gone past the outage limit: what a failover may end a stream with besides completed.
TRANSPORT_CLASS = {"transport", "worker_lost", "timeout"}


def _job(route: str, rid: str, model: str) -> dict[str, object]:
    return {
        "route": route,
        "model": model,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }


async def _until(check: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Wait on state the test's own tasks update (polled; the loop yields between checks)."""
    with anyio.fail_after(limit):
        while not check():  # noqa: ASYNC110 - the state is written by other tasks and by Redis
            await anyio.sleep(0.02)


async def _follow(client: SluiceClient, rid: str, seen: dict[str, list[Event]]) -> None:
    """A reader that rides out Redis errors by resuming after the last event it got (what a UI does)."""
    got = seen.setdefault(rid, [])
    while True:
        after = f"{got[-1].stream_id.rpartition(':')[2]}-{got[-1].seq}" if got else 0
        try:
            async for ev in client.events(rid, after=after):
                got.append(ev)
            return
        except (RedisError, OSError, LookupError):
            await anyio.sleep(0.1)


async def _result(client: SluiceClient, rid: str) -> Result:
    while True:
        try:
            return await client.result(rid, timeout=90)
        except (RedisError, OSError):
            await anyio.sleep(0.1)


async def test_a_master_killed_mid_stream_every_request_ends_once_and_nothing_reported_is_lost(
    cluster: Cluster, fake
) -> None:
    prefix = f"cf{uuid.uuid4().hex[:10]}"
    common = {
        "redis_cluster": True,
        "job_shards": SHARDS,
        "durability": "replica",
        "claim_idle_ms": 8000,
        "heartbeat_ms": 1000,
        "max_in_flight": 64,
    }
    config_a = make_config(cluster.seed_url, prefix, fake.base_url, consumer="w-a", **common)
    config_b = make_config(cluster.seed_url, prefix, fake.base_url, consumer="w-b", **common)
    keys = Keys(prefix, SHARDS, cluster=True)
    victim = cluster.master_for_key(keys.shard(0).jobs)  # a job shard fails over too
    rids = [f"{prefix}-{i}" for i in range(24)]
    on_victim = [r for r in rids if cluster.master_for_key(keys.request(r).status) == victim]
    assert on_victim, "some streams must live on the master that dies"
    later = [f"{prefix}-after-{i}" for i in range(6)]
    seen: dict[str, list[Event]] = {}
    results: dict[str, Result] = {}
    rc = connect(cluster.seed_url, cluster=True)
    assert isinstance(rc, SluiceCluster)
    killed = False
    try:
        async with (
            running_worker(config_a),
            running_worker(config_b),
            SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True) as client,
            anyio.create_task_group() as tg,
        ):
            for i, rid in enumerate(rids):
                await client.enqueue(_job(DIALECTS[i % 4], rid, "synthetic;deltas=80;pace_ms=40"))
                tg.start_soon(_follow, client, rid, seen)
            await _until(
                lambda: sum(any(isinstance(e, BlockDelta) for e in seen.get(r, [])) for r in rids) >= 20,
                "streams in flight",
            )
            await anyio.to_thread.run_sync(cluster.kill, victim)
            killed = True
            promoted = await anyio.to_thread.run_sync(cluster.wait_failover, victim)
            assert promoted != victim
            for i, rid in enumerate(later):  # the workers keep serving new jobs, on every shard
                await client.enqueue(_job(DIALECTS[i % 4], rid, "synthetic;deltas=5"))
                tg.start_soon(_follow, client, rid, seen)
            for rid in [*rids, *later]:
                results[rid] = await _result(client, rid)
            # the replaced master comes back as a replica, so later WAITs find one
            await anyio.to_thread.run_sync(cluster.restart, victim)
            killed = False
        await rc.initialize()
        states: dict[str, tuple[str, str]] = {}
        for rid in [*rids, *later]:
            facts = await check_request(rc, keys, rid)
            status = {k.decode(): v.decode() for k, v in (await rc.hgetall(keys.request(rid).status)).items()}
            category = msgspec.json.decode(status["error"])["category"] if status.get("error") else ""
            states[rid] = (facts.state, category)
            assert status["durability"] in ("replica", "unconfirmed"), status
            stored = facts.last
            if facts.state == "completed":
                assert isinstance(stored[-1], StreamDone)
                # reported completed: the reader saw the whole final attempt, and every event of it is stored
                final = [e for e in seen[rid] if e.stream_id == stored[0].stream_id]
                assert final == stored, rid
                assert results[rid].status == "completed"
            else:
                assert facts.state in ("interrupted", "failed") and category in TRANSPORT_CLASS, (rid, states[rid])
                assert isinstance(stored[-1], StreamError)
        assert all(states[r] == ("completed", "") for r in later), {r: states[r] for r in later}
        # most streams ride the failover out (the appends wait for the promoted replica)
        assert sum(states[r][0] == "completed" for r in rids) >= len(rids) // 2, states
    finally:
        if killed:
            await anyio.to_thread.run_sync(cluster.restart, victim)
        await _cleanup(rc, prefix)
        await rc.aclose()


async def test_a_slot_migrated_under_a_streaming_request_loses_and_duplicates_nothing(cluster: Cluster, fake) -> None:
    prefix = f"cm{uuid.uuid4().hex[:10]}"
    config = make_config(cluster.seed_url, prefix, fake.base_url, redis_cluster=True, job_shards=SHARDS)
    keys = Keys(prefix, SHARDS, cluster=True)
    rid = f"{prefix}-moving"
    rk = keys.request(rid)
    slot = key_slot(rk.status)
    source = cluster.master_for_slot(slot)
    target = next(m.port for m in cluster.masters() if m.port != source)
    seen: dict[str, list[Event]] = {}
    rc = connect(cluster.seed_url, cluster=True)
    assert isinstance(rc, SluiceCluster)
    try:
        async with (
            running_worker(config) as worker,
            SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True) as client,
            anyio.create_task_group() as tg,
        ):
            await client.enqueue(_job("openai-responses", rid, "synthetic;deltas=150;tools=1;pace_ms=15"))
            tg.start_soon(_follow, client, rid, seen)

            def count() -> int:
                return len(seen.get(rid, []))

            await _until(lambda: count() >= 10, "the stream under way")
            migration = SlotMigration(cluster, slot, source, target)
            await anyio.to_thread.run_sync(migration.begin)  # MIGRATING / IMPORTING: keys still on the source
            mark = count()
            await _until(lambda: count() >= mark + 10, "appends during the open migration")
            moved = await anyio.to_thread.run_sync(lambda: migration.move_keys([rk.status, rk.raw, rk.events]))
            assert moved == 3
            mark = count()  # the source now answers ASK: the appends follow it to the target
            await _until(lambda: count() >= mark + 10, "appends after the keys moved")
            await anyio.to_thread.run_sync(migration.finish)  # the slot is the target's: MOVED from now on
            result = await client.result(rid, timeout=60)
            router = worker.router
            assert router is not None and router.redirects >= 2  # an ASK and a MOVED at least
        assert cluster.master_for_slot(slot) == target
        await rc.initialize()
        facts = await check_request(rc, keys, rid)
        assert facts.state == "completed" and result.status == "completed" and list(facts.attempts) == [1]
        assert seen[rid] == facts.last  # what the reader saw, each event once, is exactly what is stored
        raw_ids = [eid.decode() for eid, _ in await rc.xrange(rk.raw)]
        assert raw_ids == [f"1-{i}" for i in range(len(raw_ids))]
        status = await rc.hgetall(rk.status)
        assert int(status[b"raw_count"]) == len(raw_ids) and int(status[b"event_count"]) == len(facts.last)
    finally:
        await _cleanup(rc, prefix)
        await rc.aclose()


async def _cleanup(rc: SluiceCluster, prefix: str) -> None:
    with anyio.move_on_after(30):
        keys = [key async for key in rc.scan_iter(match=f"{prefix}:*", count=1000)]
        for key in keys:
            await rc.delete(key)
