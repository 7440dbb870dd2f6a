"""The numbers KEDA's redis-streams scaler reads (pkg/scalers/redis_streams_scaler.go), from a real
Redis with the worker's own group, under a backlog and as jobs are read and acked:

- the ``lagCount`` trigger: ``XINFO GROUPS <stream>``, the ``lag`` of the group (``XLEN`` while the
  group does not exist yet, 0 while the stream does not);
- the ``pendingEntriesCount`` trigger: ``XPENDING <stream> <group>``'s count;
- either is active when its number is above ``activationLagCount`` (0 here).

Lag counts the entries no consumer has read, pending those read and not acked: a read moves k from lag
to pending, an ack takes k off pending and leaves lag alone, and a running worker brings both to 0. Then
the ``sluice-keda`` ACL user of ops/deploy/users.acl runs exactly those commands (and go-redis's
connection handshake) on a private redis-server, refused nothing, and is refused everything else.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from sluice.client import SluiceClient
from sluice.harness.embedded_redis import EmbeddedRedis
from sluice.schemas.keys import Keys
from sluice.worker.redis.connect import QUIET, ensure_group
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, make_config, running_worker
from tests.integration.test_deploy_acl import acl_redis

__all__ = ["acl_redis"]

GROUP = "sluice-workers"
KEDA_PASSWORD = "keda-dev-password"  # secrets.example.yaml's; users.acl holds its SHA-256


async def keda_reads(r: aioredis.Redis, stream: str, group: str) -> tuple[int, int]:
    """(lag, pending) as the scaler computes them."""
    try:
        groups = await r.xinfo_groups(stream)
    except ResponseError as exc:
        if "no such key" not in str(exc):
            raise
        return 0, 0  # the scaler: no stream yet, lag 0 (XPENDING would answer NOGROUP: no metric)
    mine = [g for g in groups if g["name"].decode() == group]
    if not mine:
        return int(await r.xlen(stream)), 0  # the scaler's fallback before the group exists
    pending = await r.xpending(stream, group)
    return int(mine[0]["lag"]), int(pending["pending"])


def _job(i: int) -> dict[str, Any]:
    return {
        "route": "anthropic",
        "model": "synthetic;deltas=2",
        "request_id": f"keda-{i}",
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }


@pytest.mark.asyncio
async def test_lag_and_pending_move_as_documented(redis_url, key_prefix, redis_client, fake, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    stream = Keys(key_prefix).shard(0).jobs
    client = SluiceClient(redis_url, key_prefix=key_prefix)
    try:
        assert await keda_reads(redis_client, stream, GROUP) == (0, 0)  # nothing enqueued, no stream
        for i in range(10):
            await client.enqueue(_job(i))
        assert await keda_reads(redis_client, stream, GROUP) == (10, 0)  # no group yet: XLEN
        await ensure_group(redis_client, stream, GROUP)  # what a worker does first (from id 0)
        seen = [await keda_reads(redis_client, stream, GROUP)]
        # Read as the worker reads (XREADGROUP ... >), then ack as it does when a job is finished.
        got = await redis_client.xreadgroup(GROUP, "w1", {stream: ">"}, count=3)
        ids = [entry_id for _, entries in got for entry_id, _ in entries]
        seen.append(await keda_reads(redis_client, stream, GROUP))
        await redis_client.xreadgroup(GROUP, "w2", {stream: ">"}, count=4)
        seen.append(await keda_reads(redis_client, stream, GROUP))
        await redis_client.xack(stream, GROUP, *ids[:2])
        seen.append(await keda_reads(redis_client, stream, GROUP))
        await client.enqueue(_job(10))
        seen.append(await keda_reads(redis_client, stream, GROUP))
        assert seen == [(10, 0), (7, 3), (3, 7), (3, 5), (4, 5)]
        # A worker of the group takes the rest; the entries read by w1 and w2 (consumers that went
        # away) stay pending until the worker's reclaim takes them over after their idle time.
        await redis_client.xack(stream, GROUP, *ids[2:])
        leftover = await redis_client.xpending_range(stream, GROUP, "-", "+", 10)
        await redis_client.xack(stream, GROUP, *[p["message_id"] for p in leftover])
        assert await keda_reads(redis_client, stream, GROUP) == (4, 0)
        config = make_config(redis_url, key_prefix, fake.base_url)
        async with running_worker(config):
            with anyio.fail_after(30):
                while await keda_reads(redis_client, stream, GROUP) != (0, 0):  # noqa: ASYNC110 - Redis state
                    await anyio.sleep(0.05)
        states = [await client.status(f"keda-{i}") for i in range(7, 11)]
        assert [s.state for s in states] == ["completed"] * 4
    finally:
        await client.aclose()
        await cleanup(redis_client, key_prefix)


def test_the_keda_user_runs_what_the_scaler_sends_and_nothing_else(acl_redis: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(f"redis://sluice-admin:admin-dev-password@127.0.0.1:{acl_redis.port}/0")
    # KEDA's go-redis sends no CLIENT SETINFO (nor does sluice): neither does this stand-in.
    keda = redis.Redis.from_url(f"redis://sluice-keda:{KEDA_PASSWORD}@127.0.0.1:{acl_redis.port}/0", **QUIET)
    try:
        admin.flushall()
        admin.acl_log_reset()
        sharded = Keys("sluice", job_shards=4).shard(2).jobs
        for stream in ("sluice:jobs", sharded):
            admin.xadd(stream, {"job": json.dumps(_job(0))})
            admin.xgroup_create(stream, GROUP, id="0")
        # go-redis (KEDA's client) opens with HELLO 3 AUTH, then PING; the lag trigger checks INFO's
        # redis_version, then XINFO GROUPS (XLEN when the group is missing); the pending one XPENDING.
        assert keda.execute_command("HELLO", "3", "AUTH", "sluice-keda", KEDA_PASSWORD)
        assert keda.ping() is True
        assert int(str(keda.info("server")["redis_version"]).split(".")[0]) >= 7
        for stream in ("sluice:jobs", sharded):
            (group,) = keda.xinfo_groups(stream)
            assert (group["lag"], keda.xpending(stream, GROUP)["pending"], keda.xlen(stream)) == (1, 0, 1)
        assert admin.acl_log() == []  # not one command refused
        refused = [
            lambda: keda.xreadgroup(GROUP, "k", {"sluice:jobs": ">"}),
            lambda: keda.xadd("sluice:jobs", {"job": "{}"}),
            lambda: keda.xrange("sluice:jobs"),
            lambda: keda.xinfo_groups("sluice:terminal"),
            lambda: keda.xpending("sluice:{req:x}:events", GROUP),
            lambda: keda.xack("sluice:jobs", GROUP, "0-1"),
            lambda: keda.keys("*"),
        ]
        for call in refused:
            with pytest.raises(NoPermissionError):
                call()
    finally:
        keda.close()
        admin.close()
