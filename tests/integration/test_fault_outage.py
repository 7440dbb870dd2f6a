"""Redis away longer than ``redis_outage_limit`` under worker processes serving a limited route (issue 36, item
1): no worker exits; each loop logs one line when it starts failing and one when it works again; when Redis
is back every request ends with exactly one terminal status, its job acked, the route's store holds nothing
(no permit, lease, reservation or waiting job; every tenant count 0), its RPM window counts each request the
provider received once (plus at most the admissions whose leases expired unsent), and the fleet serves new
jobs.

Against a private redis-server this test starts and kills itself (AOF, ``appendfsync always``: an outage, not
a data loss); the outage lasts until every worker's admission loop has failed past its outage limit.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis

from sluice.schemas.keys import Keys, RouteKeys
from tests.faults.invariants import TERMINAL_STATES, assert_no_secret, check_request
from tests.faults.persistent_redis import PersistentRedis
from tests.integration.conftest import API_KEY, spawn_worker, write_config_file

pytestmark = pytest.mark.asyncio
PREFIX = "sluice-outage"
OUTAGE_LIMIT = 1.0
_WAIT_S = 60.0  # every wait is on state; this only bounds a failing run
Workers = list[tuple[subprocess.Popen[bytes], Path]]


@contextlib.contextmanager
def _private_redis() -> Iterator[PersistentRedis]:
    server = PersistentRedis()
    server.start()
    try:
        yield server
    finally:
        server.close()


async def _until(what: str, predicate: Callable[[], Awaitable[bool] | bool], workers: Workers) -> None:
    """Poll ``predicate`` (the state is in Redis or in the workers' logs) until it holds; a worker that exits
    meanwhile fails the test at once, with its log."""
    try:
        with anyio.fail_after(_WAIT_S):
            while True:
                for proc, log in workers:
                    assert proc.poll() is None, (
                        f"a worker exited ({proc.returncode}) while waiting for {what}: {_tail(log)}"
                    )
                res = predicate()
                if await res if not isinstance(res, bool) else res:
                    return
                await anyio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {_WAIT_S:g} s: {what}") from None


def _records(log: Path) -> list[dict[str, object]]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return [msgspec.json.decode(line) for line in text.splitlines() if line.startswith("{")]


def _lines(log: Path, start: str) -> list[str]:
    return [str(r["msg"]) for r in _records(log) if str(r.get("msg", "")).startswith(start)]


async def _enqueue(r: aioredis.Redis, keys: Keys, rid: str, model: str) -> None:
    job = {
        "route": "anthropic",
        "model": model,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }
    await r.hsetnx(keys.request(rid).status, "state", "queued")
    await r.xadd(keys.jobs, {"job": msgspec.json.encode(job)})


async def _terminal(r: aioredis.Redis, keys: Keys, rids: list[str]) -> bool:
    states = [await r.hget(keys.request(rid).status, "state") for rid in rids]
    return all(s in TERMINAL_STATES for s in states) and not (await r.xpending(keys.jobs, "sluice-workers"))["pending"]


@pytest.mark.server  # starts its own server (a private Redis it stops and starts)
async def test_limited_route_workers_survive_redis_away_past_the_outage_limit(fake: Any, tmp_path: Path) -> None:
    keys = Keys(PREFIX)
    rk = keys.route("anthropic")
    with _private_redis() as server:
        config = write_config_file(
            tmp_path / "c.toml",
            server.url,
            PREFIX,
            fake.base_url,
            claim_idle_ms=1000,
            heartbeat_ms=200,
            redis_socket_timeout=2.0,
            redis_outage_limit=OUTAGE_LIMIT,
            shutdown_grace=1.0,
        )
        config.write_text(
            config.read_text().replace('[routes."anthropic"]\n', '[routes."anthropic"]\nmax_concurrency = 2\n')
        )
        logs = [tmp_path / f"w{i}.log" for i in range(2)]
        workers: list[subprocess.Popen[bytes]] = [spawn_worker(config, log) for log in logs]
        fleet = list(zip(workers, logs, strict=True))
        r = aioredis.Redis.from_url(server.url)
        try:
            await _until("both workers started", lambda: all(_lines(log, "worker started") for log in logs), fleet)
            before = [f"before-{i}" for i in range(6)]
            for rid in before:
                await _enqueue(r, keys, rid, "synthetic;deltas=40;pace_ms=50")
            await _until("two admitted, the rest waiting", lambda: _admitted(r, rk, 2), fleet)

            server.kill()
            # The outage lasts until every worker's admission loop failed past its outage limit (StorageError).
            await _until(
                "each admission loop failed past its limit",
                lambda: all(_lines(log, "admitting failed (StorageError") for log in logs),
                fleet,
            )
            # A worker holding a lease through the outage: its heartbeat's RENEW failed past the limit too.
            await _until(
                "a RENEW failed past its limit",
                lambda: any(_lines(log, "renewing leases failed (StorageError") for log in logs),
                fleet,
            )
            await anyio.to_thread.run_sync(server.start)
            await r.aclose()
            r = aioredis.Redis.from_url(server.url)

            await _until("every request terminal, every job acked", lambda: _terminal(r, keys, before), fleet)
            await _until("the store holds nothing", lambda: _store_empty(r, rk), fleet)
            after = [f"after-{i}" for i in range(3)]
            for rid in after:
                await _enqueue(r, keys, rid, "synthetic;deltas=3")
            await _until("the fleet serves new jobs", lambda: _terminal(r, keys, after), fleet)
            await _until("the store holds nothing again", lambda: _store_empty(r, rk), fleet)

            for w, log in fleet:
                assert w.poll() is None, _tail(log)
            for rid in before + after:
                facts = await check_request(r, keys, rid)
                assert facts.terminal_entries == 1, rid
            for rid in after:
                assert await r.hget(keys.request(rid).status, "state") == b"completed", rid
            # Each loop: one line going down, one coming back (not one per try).
            for log in logs:
                assert len(_lines(log, "admitting failed (StorageError")) == 1, _tail(log)
                assert len(_lines(log, "admitting works again")) == 1, _tail(log)
                assert len(_lines(log, "renewing leases failed (StorageError")) <= 1, _tail(log)
            sent = len([x for x in fake.stats.requests if x.request_id])
            expired = int(await r.hget(rk.state, "expired") or 0)
            rpm = await r.zcard(rk.rpm)
            assert sent <= rpm <= sent + expired, (sent, rpm, expired)
            await assert_no_secret(r, PREFIX, API_KEY)
        finally:
            for w in workers:
                if w.poll() is None:
                    w.send_signal(signal.SIGKILL)
                    w.wait(10)
            await r.aclose()


async def _admitted(r: aioredis.Redis, rk: RouteKeys, n: int) -> bool:
    return int(await r.zcard(rk.permits)) == n and int(await r.hlen(rk.waiting)) > 0


async def _store_empty(r: aioredis.Redis, rk: RouteKeys) -> bool:
    """No permit, lease, reservation or waiting job; every tenant count 0."""
    busy = (
        await r.zcard(rk.permits)
        + await r.hlen(rk.lease)
        + await r.hlen(rk.waiting)
        + await r.zcard(rk.reserved)
        + await r.zcard(rk.held)
    )
    return busy == 0 and all(int(v) == 0 for v in (await r.hgetall(rk.drr)).values())


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""
