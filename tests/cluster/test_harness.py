"""The cluster harness against a real cluster: topology, key placement, failover, slot migration (MOVED/ASK)
with redis-py's asyncio cluster client."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import MovedError

from tests.cluster.harness import SLOTS, Cluster, key_slot


def _tag() -> str:
    return uuid.uuid4().hex[:10]


@pytest.mark.parametrize(
    "key",
    ["foo", "", "{}", "{user1000}.following", "foo{}{bar}", "foo{{bar}}zap", "foo{bar}{zap}", "a{b", "}{x}"],
)
def test_key_slot_matches_the_server(cluster: Cluster, key: str) -> None:
    assert key_slot(key) == cluster.call(cluster.masters()[0].port, "CLUSTER", "KEYSLOT", key)


@settings(max_examples=60, deadline=None)
@given(key=st.binary(max_size=24) | st.text(alphabet="ab{}", max_size=10))
def test_key_slot_matches_the_server_for_any_key(cluster: Cluster, key: bytes | str) -> None:
    assert key_slot(key) == cluster.call(cluster.masters()[0].port, "CLUSTER", "KEYSLOT", key)


def test_three_masters_each_with_one_replica_cover_every_slot(cluster: Cluster) -> None:
    masters, replicas = cluster.masters(), cluster.replicas()
    assert len(masters) == 3
    assert sorted(r.master_port for r in replicas if r.master_port) == sorted(m.port for m in masters)
    owned = [slot for m in masters for first, last in m.slots for slot in range(first, last + 1)]
    assert sorted(owned) == list(range(SLOTS))
    assert all(n.pid for n in cluster.nodes)


@pytest.mark.asyncio
async def test_a_key_set_through_the_cluster_client_lands_on_the_computed_master(cluster: Cluster) -> None:
    key = f"place:{_tag()}"
    async with RedisCluster.from_url(cluster.seed_url) as rc:
        await rc.set(key, b"v")
    owner = cluster.master_for_key(key)
    for master in cluster.masters():
        direct = aioredis.Redis(port=master.port)
        try:
            if master.port == owner:
                assert await direct.get(key) == b"v"
            else:
                with pytest.raises(MovedError) as moved:
                    await direct.get(key)
                assert (moved.value.slot_id, moved.value.port) == (key_slot(key), owner)
        finally:
            await direct.aclose()


def _asking_calls(cluster: Cluster, port: int) -> int:
    stats = cluster.call(port, "INFO", "commandstats")
    assert isinstance(stats, bytes)
    for line in stats.decode().splitlines():
        if line.startswith("cmdstat_asking:calls="):
            return int(line.split("=")[1].split(",")[0])
    return 0


@pytest.mark.asyncio
async def test_keys_stay_readable_through_a_slot_migration(cluster: Cluster) -> None:
    tag = _tag()
    keys = [f"{{{tag}}}:{i}" for i in range(40)]
    slot = key_slot(keys[0])
    source = cluster.master_for_slot(slot)
    target = next(m.port for m in cluster.masters() if m.port != source)
    async with RedisCluster.from_url(cluster.seed_url) as rc:
        for k in keys:
            await rc.set(k, k)
        asked = _asking_calls(cluster, target)
        # Sequential calls keep one connection per node in this fresh client. That matters: redis-py 8.1 sends
        # ASKING and the redirected command as two pool checkouts, so with two idle connections on the target
        # they land on different ones and the redirect loops until "TTL exhausted".
        with cluster.migrating(slot, target) as migration:
            assert migration.move_keys(keys[:20]) == 20
            assert sorted(migration.keys_on_source()) == sorted(k.encode() for k in keys[20:])
            # moved keys are answered with ASK by the source; redis-py follows it with ASKING to the target
            assert [await rc.get(k) for k in keys] == [k.encode() for k in keys]
            assert _asking_calls(cluster, target) >= asked + 20
            await rc.set(f"{{{tag}}}:new", b"during")  # not on the source: created on the target via ASK
        assert migration.moved == 40
        assert cluster.master_for_slot(slot) == target
        assert [await rc.get(k) for k in keys] == [k.encode() for k in keys]  # after MOVED
        assert await rc.get(f"{{{tag}}}:new") == b"during"
        # and back in one call
        assert cluster.migrate_slot(slot, source) == 41
        assert cluster.master_for_slot(slot) == source
        assert await rc.get(keys[-1]) == keys[-1].encode()


@pytest.mark.asyncio
async def test_a_replicated_write_survives_its_masters_death(cluster: Cluster) -> None:
    key = f"{{{_tag()}}}:durable"
    old = cluster.master_for_key(key)
    replica = next(r.port for r in cluster.replicas() if r.master_port == old)
    direct = aioredis.Redis(port=old)
    try:
        await direct.set(key, b"kept")
        assert await direct.execute_command("WAIT", 1, 5000) == 1  # same connection as the write
    finally:
        await direct.aclose()
    async with RedisCluster.from_url(cluster.seed_url) as rc:
        await rc.initialize()
        cluster.kill(old)
        assert cluster.wait_failover(old) == replica
        assert cluster.master_for_key(key) == replica
        assert await rc.get(key) == b"kept"  # its map still names the dead master: it must recover
    info = cluster.restart(old)
    assert (info.role, info.master_port) == ("replica", replica)
    assert len(cluster.masters()) == 3
    assert len(cluster.replicas()) == 3
