"""Workers holding permits, as real processes (docs/design-capacity.md B.4): SIGKILL -> the permits come back
(after claim_idle_ms, by expiry) and another worker runs the jobs; SIGSTOP past a takeover -> the woken worker's
RENEW reports the lost lease, its attempt is fenced, and the route's counts stay those of the new holder; two
workers of unequal size under one cap -> each is admitted only what it can run, and the makespan is near the
ideal."""

from __future__ import annotations

import json
import math
import signal
import socket
import statistics
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sluice.harness.fake.limits import ProviderLimits
from sluice.harness.fake.provider import serve_fake_provider
from sluice.schemas.keys import Keys, decode_lease
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config
from tests.integration.test_takeover import Workers, _until

pytestmark = pytest.mark.asyncio


def _config_file(path: Path, redis_url: str, prefix: str, base_url: str, cap: int, max_in_flight: int = 64) -> Path:
    lines = [
        f"redis_url = {json.dumps(redis_url)}",
        f"key_prefix = {json.dumps(prefix)}",
        f"max_in_flight = {max_in_flight}",
        "claim_idle_ms = 2000",
        "heartbeat_ms = 200",
        "shutdown_grace = 2.0",
        "[routes.claude]",
        'dialect = "anthropic"',
        f"base_url = {json.dumps(base_url)}",
        f'api_key_env = "{KEY_ENV}"',
        "send_request_id = true",
        f"max_concurrency = {cap}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _job(model: str) -> dict[str, object]:
    return {"route": "claude", "model": model, "request": {"messages": [{"role": "user", "content": "hi"}]}}


async def _holders(redis: aioredis.Redis, keys: Keys) -> set[str]:
    return {decode_lease(v).worker for v in (await redis.hgetall(keys.route("claude").lease)).values()}


async def test_sigkill_of_a_worker_holding_permits_gives_them_back_and_each_job_ends_once(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix)
    rk = keys.route("claude")
    async with serve_fake_provider(api_key=API_KEY, limits=ProviderLimits(max_concurrency=2)) as fake:
        workers = Workers(_config_file(tmp_path / "c.toml", redis_url, key_prefix, fake.base_url, 2), tmp_path)
        config = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with client_for(config) as client:
                a = workers.start("a")
                rids = [await client.enqueue(_job(f"synthetic;deltas=3;hold=k;seed={i}")) for i in range(3)]
                await _until(lambda: fake.stats.limiter.in_flight == 2)  # two permits held at the provider
                assert await redis_client.zcard(rk.permits) == 2
                dead = await _holders(redis_client, keys)
                workers.start("b")
                a.send_signal(signal.SIGKILL)
                with anyio.fail_after(30):  # the dead worker's permits expire; b holds the leases now
                    while (await _holders(redis_client, keys)) & dead or await redis_client.zcard(rk.permits) < 2:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                fake.release("k")
                results = [await client.result(rid, timeout=60) for rid in rids]
            assert [r.status for r in results] == ["completed"] * 3
            assert fake.stats.limiter.peak_in_flight <= 2
            assert await redis_client.zcard(rk.permits) == 0 and await redis_client.hlen(rk.lease) == 0
            assert len(await redis_client.xrange(keys.terminal)) == 3  # each job ended once
            assert int(await redis_client.hget(rk.state, "expired") or 0) == 2
        finally:
            await workers.stop_all()
            await cleanup(redis_client, key_prefix)


async def test_a_sigstopped_worker_woken_after_takeover_is_fenced_and_the_counts_are_unchanged(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix)
    rk = keys.route("claude")
    async with serve_fake_provider(api_key=API_KEY) as fake:
        workers = Workers(_config_file(tmp_path / "c.toml", redis_url, key_prefix, fake.base_url, 1), tmp_path)
        config = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with client_for(config) as client:
                a = workers.start("a")
                rid = await client.enqueue(_job("synthetic;deltas=3;hold=s"))
                await _until(lambda: len(fake.stats.find(request_id=rid)) == 1)
                frozen = await _holders(redis_client, keys)
                a.send_signal(signal.SIGSTOP)
                workers.start("b")
                await _until(lambda: len(fake.stats.find(request_id=rid)) == 2)  # b took the lease, and sent
                assert not (await _holders(redis_client, keys)) & frozen
                a.send_signal(signal.SIGCONT)
                with anyio.fail_after(20):
                    while "lost a lease to another worker" not in workers.log("a"):  # noqa: ASYNC110 - a log file
                        await anyio.sleep(0.1)
                await _until(lambda: fake.stats.find(request_id=rid)[0].disconnected)  # its attempt stopped
                assert await redis_client.zcard(rk.permits) == 1  # b's only: nothing counted twice
                assert await redis_client.zcard(rk.rpm) == 2  # two admissions, two requests sent
                fake.release("s")
                result = await client.result(rid, timeout=60)
            assert result.status == "completed"
            with anyio.fail_after(10):
                while await redis_client.zcard(rk.permits):  # noqa: ASYNC110 - the state is in Redis
                    await anyio.sleep(0.05)
            assert len(await redis_client.xrange(keys.terminal)) == 1
        finally:
            await workers.stop_all()
            await cleanup(redis_client, key_prefix)


@pytest.mark.server  # starts its own server
async def test_a_redis_restart_with_aof_while_jobs_wait_loses_none_and_counts_none_twice(
    tmp_path: Path,
) -> None:
    """A private redis-server (AOF, fsync always), killed and started again while one job holds the route's
    only permit and three wait in its queue: every parked job is admitted after the restart and completes,
    and the RPM window holds one admission per request the provider received."""
    from tests.faults.persistent_redis import PersistentRedis

    server = PersistentRedis()
    server.start()
    prefix = "sluice-cap-aof"
    keys = Keys(prefix)
    rk = keys.route("claude")
    r = aioredis.Redis.from_url(server.url)
    try:
        async with serve_fake_provider(api_key=API_KEY) as fake:
            workers = Workers(_config_file(tmp_path / "c.toml", server.url, prefix, fake.base_url, 1), tmp_path)
            config = make_config(server.url, prefix, fake.base_url)
            try:
                async with client_for(config) as client:
                    workers.start("a")
                    first = await client.enqueue(_job("synthetic;deltas=3;hold=aof"))
                    await _until(lambda: len(fake.stats.find(request_id=first)) == 1)
                    rest = [await client.enqueue(_job(f"synthetic;deltas=2;seed={i}")) for i in range(3)]
                    with anyio.fail_after(30):
                        while await r.hlen(rk.waiting) < 3:  # noqa: ASYNC110 - the state is in Redis
                            await anyio.sleep(0.05)
                await r.aclose()
                server.kill()
                server.start()
                r = aioredis.Redis.from_url(server.url)
                assert await r.hlen(rk.waiting) == 3 and await r.zcard(rk.permits) == 1  # all in the AOF
                fake.release("aof")
                async with client_for(config) as client:  # the old client's connections died with the server
                    results = [await client.result(rid, timeout=60) for rid in [first, *rest]]
                assert [x.status for x in results] == ["completed"] * 4
                with anyio.fail_after(10):
                    while await r.zcard(rk.permits):  # noqa: ASYNC110 - the state is in Redis
                        await anyio.sleep(0.05)
                assert await r.hlen(rk.waiting) == 0 and await r.hlen(rk.lease) == 0
                assert await r.zcard(rk.rpm) == len([x for x in fake.stats.requests if x.request_id])
                assert fake.stats.limiter.peak_in_flight <= 1
            finally:
                await workers.stop_all()
    finally:
        await r.aclose()
        server.kill()


async def test_two_workers_of_unequal_size_are_each_admitted_only_what_they_can_run(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """Worker a (2 run slots) and b (16), one route capped at 50 (never binding), 40 jobs of about 1 s: sampled
    every 20 ms, no worker holds more leases than its slots and the route's permits never pass the fleet's
    slots; the makespan (first ``started_at`` to last ``finished_at``) is within 1.5x of the ideal
    ``ceil(40 / 18)`` waves of the measured median stream."""
    keys = Keys(key_prefix)
    rk = keys.route("claude")
    sizes = {"a": 2, "b": 16}
    async with serve_fake_provider(api_key=API_KEY, limits=ProviderLimits(max_concurrency=50)) as fake:
        procs = {}
        for name, size in sizes.items():
            cfg = _config_file(tmp_path / f"{name}.toml", redis_url, key_prefix, fake.base_url, 50, size)
            procs[name] = Workers(cfg, tmp_path)
        consumers: dict[str, str] = {}
        config = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with client_for(config) as client:
                for name, w in procs.items():
                    consumers[f"{socket.gethostname()}-{w.start(name).pid}"] = name
                with anyio.fail_after(30):  # both joined before the jobs arrive (a late one would find none)
                    while any("worker started" not in w.log(n) for n, w in procs.items()):  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                rids = [await client.enqueue(_job(f"synthetic;deltas=20;pace_ms=50;seed={i}")) for i in range(40)]
                peak = {name: 0 for name in sizes}
                peak_permits = 0
                excess: list[int] = []  # the route's in flight less the streams open at the provider
                with anyio.fail_after(120):
                    while True:
                        held = [decode_lease(v).worker for v in (await redis_client.hgetall(rk.lease)).values()]
                        for name in sizes:
                            n = sum(1 for c in held if consumers.get(c) == name)
                            peak[name] = max(peak[name], n)
                        permits = await redis_client.zcard(rk.permits)
                        peak_permits = max(peak_permits, permits)
                        excess.append(permits - fake.stats.limiter.in_flight)
                        states = [await redis_client.hget(keys.request(r).status, "state") for r in rids]
                        if all(x in (b"completed", b"failed", b"interrupted") for x in states):
                            break
                        await anyio.sleep(0.02)
                statuses = [await redis_client.hgetall(keys.request(r).status) for r in rids]
        finally:
            for w in procs.values():
                await w.stop_all()
            await cleanup(redis_client, key_prefix)
    assert [x[b"state"] for x in statuses] == [b"completed"] * 40
    assert peak["a"] <= sizes["a"] and peak["b"] <= sizes["b"], peak
    assert peak_permits <= sum(sizes.values())
    # In flight is streams: only the transient between an admission and its request reaching the provider, and
    # between a stream's end and its RELEASE (a held admission would show for a whole stream).
    excess.sort()
    assert excess[int(0.9 * len(excess))] <= 3, excess
    by_worker = {consumers.get(x[b"worker"].decode(), "?") for x in statuses}
    assert by_worker == {"a", "b"}  # both ran some
    started = [int(x[b"started_at"]) for x in statuses]
    finished = [int(x[b"finished_at"]) for x in statuses]
    stream_ms = statistics.median(f - s for s, f in zip(started, finished, strict=True))
    ideal_ms = math.ceil(40 / sum(sizes.values())) * stream_ms
    makespan_ms = max(finished) - min(started)
    assert makespan_ms <= 1.5 * ideal_ms, (makespan_ms, ideal_ms, stream_ms)
    assert fake.stats.limiter.peak_in_flight <= 18
