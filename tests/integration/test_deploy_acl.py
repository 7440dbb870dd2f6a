"""The deployment's Redis, for real: ops/deploy/redis.conf and users.acl loaded into a real redis-server 7+,
then the worker, a producer and a reader each connect as their own ACL user and run the whole pipeline.

Not one command may be refused along the way (ACL LOG stays empty), and each role is refused what it
must not do: that is what makes the ACL file a recommendation rather than a guess.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from sluice.client import SluiceClient
from sluice.harness.embedded_redis import EmbeddedRedis, RedisUnavailable, embedded_redis, redis_server_binary
from sluice.schemas.events import BlockDelta, StreamDone
from sluice.schemas.keys import Keys
from sluice.worker.redis.connect import QUIET
from tests.integration.conftest import DIALECTS, make_config, running_worker

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "ops" / "deploy"
# The compose defaults (docker-compose.yml); users.acl holds their SHA-256 hashes.
PASSWORDS = {
    "sluice-worker": "worker-dev-password",
    "sluice-producer": "producer-dev-password",
    "sluice-reader": "reader-dev-password",
    "sluice-admin": "admin-dev-password",
}
PREFIX = "sluice"  # users.acl's key patterns are written for the default prefix


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[EmbeddedRedis]:
    try:
        binary = redis_server_binary(min_version=(7, 0))
    except RedisUnavailable:
        pytest.skip("needs redis-server 7+ (ACL read-only key patterns %R~)")
    args = ["--aclfile", str(DEPLOY / "users.acl")]
    with embedded_redis(binary=binary, config_file=DEPLOY / "redis.conf", extra_args=args) as server:
        yield server


def _url(server: EmbeddedRedis, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@127.0.0.1:{server.port}/0"


@contextlib.contextmanager
def _admin(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(_url(server, "sluice-admin"))
    try:
        yield r
    finally:
        r.close()


def test_redis_conf_turns_aof_on_and_never_evicts(acl_redis: EmbeddedRedis) -> None:
    with _admin(acl_redis) as r:
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert r.info("persistence")["aof_enabled"] == 1


def test_default_user_is_off(acl_redis: EmbeddedRedis) -> None:
    r = redis.Redis(port=acl_redis.port)
    with pytest.raises((AuthenticationError, ResponseError)):
        r.ping()
    r.close()


def test_each_password_in_the_acl_file_is_the_compose_default(acl_redis: EmbeddedRedis) -> None:
    for user in PASSWORDS:
        r = redis.Redis.from_url(_url(acl_redis, user), **QUIET)
        assert r.ping() is True
        r.close()


@pytest.mark.asyncio
async def test_worker_producer_and_reader_run_the_pipeline_with_no_command_refused(acl_redis, fake) -> None:
    with _admin(acl_redis) as admin:
        admin.flushall()
        admin.acl_log_reset()
    keys = Keys(PREFIX)
    # Short claim, heartbeat and trim periods, so XAUTOCLAIM, XCLAIM and the jobs trim run during the test too.
    config = make_config(
        _url(acl_redis, "sluice-worker"),
        PREFIX,
        fake.base_url,
        claim_idle_ms=300,
        heartbeat_ms=100,
        jobs_trim_interval=0.2,
    )
    producer = SluiceClient(_url(acl_redis, "sluice-producer"), key_prefix=PREFIX)
    reader = SluiceClient(_url(acl_redis, "sluice-reader"), key_prefix=PREFIX)
    try:
        async with running_worker(config):
            model = "synthetic;deltas=6;tools=1;pace_ms=20"
            rids = [await producer.enqueue(_job(d, model, f"acl-{d}")) for d in DIALECTS]
            slow = await producer.enqueue(_job("anthropic", "synthetic;deltas=500;pace_ms=20", "acl-cancel"))
            # A job no worker can decode: dead-lettered (XADD to sluice:dlq, XACK).
            await producer.redis.xadd(keys.jobs, {"job": b"not json"})
            for rid in rids:
                # The reader follows the events (XREAD) and the status (HGETALL) of every request.
                with anyio.fail_after(30):  # a refused worker command leaves the request unfinished
                    events = [ev async for ev in reader.events(rid)]
                assert isinstance(events[-1], StreamDone), events[-1]
                assert (await producer.result(rid, timeout=30)).status == "completed"
            # The slow request streams: 15 deltas at 20 ms are three heartbeat periods (XCLAIM JUSTID) under way.
            deltas = 0
            with anyio.fail_after(30):
                async with contextlib.aclosing(reader.events(slow)) as following:
                    async for ev in following:
                        deltas += isinstance(ev, BlockDelta)
                        if deltas == 15:
                            break
            assert await producer.cancel(slow)
            assert (await producer.result(slow, timeout=30)).status == "interrupted"
            # A reader's own consumer group on a request's events stream.
            stream = keys.request(rids[0]).events
            await reader.redis.xgroup_create(stream, "ui", id="0")
            got = await reader.redis.xreadgroup("ui", "c1", {stream: ">"}, count=1000)
            await reader.redis.xack(stream, "ui", *[entry_id for entry_id, _ in got[0][1]])
            # The audit's reads: the raw log and the status record.
            assert await reader.redis.xrange(keys.request(rids[0]).raw)
            assert await reader.redis.hgetall(keys.request(rids[0]).status)
            with anyio.fail_after(10):
                while not _dlq_len(acl_redis):  # noqa: ASYNC110 - polling another connection
                    await anyio.sleep(0.05)
            with anyio.fail_after(10):  # every job settled: the worker's trim empties the jobs stream
                while _jobs_len(acl_redis):  # noqa: ASYNC110 - polling another connection
                    await anyio.sleep(0.05)
        with _admin(acl_redis) as admin:
            assert admin.xlen(keys.dead_letters) == 1
            refused = admin.acl_log()
        assert refused == [], refused
    finally:
        await producer.aclose()
        await reader.aclose()


def _job(route: str, model: str, request_id: str) -> dict[str, object]:
    return {
        "route": route,
        "model": model,
        "request_id": request_id,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }


def _jobs_len(server: EmbeddedRedis) -> int:
    with _admin(server) as admin:
        return int(admin.xlen(Keys(PREFIX).jobs))


def _dlq_len(server: EmbeddedRedis) -> int:
    with _admin(server) as admin:
        return int(admin.xlen(Keys(PREFIX).dead_letters))


@pytest.mark.asyncio
async def test_each_role_is_refused_what_it_must_not_do(acl_redis) -> None:
    keys = Keys(PREFIX)
    rk = keys.request("acl-confined")
    refused = {
        "sluice-reader": [
            ("xadd", (keys.jobs, {"job": "{}"})),  # no enqueueing
            ("hset", (rk.status, "state", "completed")),  # no status edits
            ("xadd", (rk.events, {"type": "x"})),  # no forged events
            ("xreadgroup", ("sluice-workers", "r", {keys.jobs: ">"})),  # no taking jobs
        ],
        "sluice-producer": [
            ("xadd", (rk.events, {"type": "x"})),  # the logs are read-only: no forged events
            ("xadd", (rk.raw, {"kind": "sse"})),
            ("xreadgroup", ("sluice-workers", "p", {keys.jobs: ">"})),  # no taking jobs
            ("get", ("other:key",)),  # nothing outside the prefix
        ],
        "sluice-worker": [
            ("delete", (f"{PREFIX}:x",)),  # only the commands it needs
            ("hset", ("other:{req:x}:status", "state", "x")),  # nothing outside the prefix
            ("flushall", ()),
            ("config_get", ("*",)),
            ("keys", ("*",)),
        ],
    }
    for user, attempts in refused.items():
        r = aioredis.Redis.from_url(_url(acl_redis, user), **QUIET)
        try:
            for method, args in attempts:
                with pytest.raises(NoPermissionError):
                    await getattr(r, method)(*args)
        finally:
            await r.aclose()
