"""The jobs stream is trimmed by the workers, safely (issue 36, item 10): what goes is exactly the prefix every
consumer group on the stream delivered and acknowledged; an entry pending in any group, or not yet delivered
to any group, stays, and so does everything after it.

Through a worker process (``jobs_trim_interval`` short) serving the stream's own group beside a second group
the test drives by hand, and, for the cases a worker does not make on its own (an entry pending behind acked
ones, two groups at different places), the worker's trim script on streams built by hand.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis

from sluice.schemas.keys import Keys
from sluice.worker.redis.scripts import TRIM_JOBS
from tests.integration.conftest import cleanup, spawn_worker, write_config_file

pytestmark = pytest.mark.asyncio
GROUP = "sluice-workers"
_WAIT_S = 30.0  # bounds a failing run; every wait is on state


async def _until(what: str, predicate: Callable[[], Awaitable[bool]], worker: subprocess.Popen[bytes]) -> None:
    try:
        with anyio.fail_after(_WAIT_S):
            while not await predicate():
                assert worker.poll() is None, f"the worker exited ({worker.returncode})"
                await anyio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {_WAIT_S:g} s: {what}") from None


def _job(rid: str, model: str) -> bytes:
    return msgspec.json.encode(
        {
            "route": "anthropic",
            "model": model,
            "request_id": rid,
            "request": {"messages": [{"role": "user", "content": "hi"}]},
        }
    )


async def _ids(r: aioredis.Redis, stream: str) -> list[str]:
    return [i.decode() for i, _ in await r.xrange(stream)]


async def test_a_worker_trims_exactly_what_every_group_settled(
    fake: Any, redis_url: str, key_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    r = redis_client
    keys = Keys(key_prefix)
    config = write_config_file(
        tmp_path / "c.toml", redis_url, key_prefix, fake.base_url, jobs_trim_interval=0.1, heartbeat_ms=200
    )
    # A second group on the stream (an audit tap, another fleet) from its start, driven by the test.
    await r.xgroup_create(keys.jobs, "tap", id="0", mkstream=True)
    rids = [f"t{i}" for i in range(7)]
    for rid in rids[:6]:
        await r.xadd(keys.jobs, {"job": _job(rid, "synthetic;deltas=2")})
    await r.xadd(keys.jobs, {"job": _job("t6", "synthetic;deltas=2;hold=t6")})  # runs until released
    ids = await _ids(r, keys.jobs)
    worker = spawn_worker(config, tmp_path / "w.log")
    try:

        async def workers_settled(n: int) -> bool:
            states = [await r.hget(keys.request(rid).status, "state") for rid in rids[:n]]
            if not all(s == b"completed" for s in states):
                return False
            return int((await r.xpending(keys.jobs, GROUP))["pending"]) == 1  # t6 held, running

        await _until("t0..t5 completed, t6 running", lambda: workers_settled(6), worker)
        # The tap read t0..t2 and acked t0, t1: t2 pending there, t3.. undelivered. The workers' group holds
        # t6 pending (running). The oldest unsettled entry of any group is t2.
        await r.xreadgroup("tap", "c", {keys.jobs: ">"}, count=3)
        await r.xack(keys.jobs, "tap", ids[0], ids[1])

        async def trimmed_to(expected: list[str]) -> bool:
            return await _ids(r, keys.jobs) == expected

        await _until("exactly t0, t1 gone", lambda: trimmed_to(ids[2:]), worker)
        # The tap settles t2..t5 and reads up to them: t6 is undelivered there and pending in the workers' group.
        await r.xreadgroup("tap", "c", {keys.jobs: ">"}, count=3)
        await r.xack(keys.jobs, "tap", *ids[2:6])
        await _until("exactly t2..t5 gone, t6 kept", lambda: trimmed_to(ids[6:]), worker)
        # t6 finishes in the workers' group; the tap reads it but has not acked it yet: still kept.
        fake.release("t6")
        await _until("t6 completed and acked by the workers", lambda: _acked(r, keys.jobs), worker)
        await r.xreadgroup("tap", "c", {keys.jobs: ">"}, count=1)
        before = await _xtrim_calls(r)
        await _until("a trim ran since", lambda: _more_xtrim_calls(r, before), worker)
        assert await _ids(r, keys.jobs) == ids[6:]  # pending in the tap: kept
        await r.xack(keys.jobs, "tap", ids[6])
        await _until("every entry settled in every group: the stream is empty", lambda: trimmed_to([]), worker)
        # Lag stays exact for both groups (KEDA and /metrics read it): nothing left to deliver.
        groups = {g["name"]: g for g in await r.xinfo_groups(keys.jobs)}
        assert groups[b"tap"]["lag"] == 0 and groups[GROUP.encode()]["lag"] == 0
        assert (await r.xinfo_stream(keys.jobs))["entries-added"] == 7
        # New jobs still run on the trimmed stream.
        await r.xadd(keys.jobs, {"job": _job("t7", "synthetic;deltas=2")})

        async def t7_done() -> bool:
            return await r.hget(keys.request("t7").status, "state") == b"completed"

        await _until("a new job runs", t7_done, worker)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(15)
        await cleanup(r, key_prefix)


async def _acked(r: aioredis.Redis, stream: str) -> bool:
    return int((await r.xpending(stream, GROUP))["pending"]) == 0


async def _xtrim_calls(r: aioredis.Redis) -> int:
    """XTRIM calls so far (scripts' own included). A script is atomic: a count above one read before means a
    whole trim ran after that read. Nothing else in sluice sends XTRIM."""
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_xtrim", {}).get("calls", 0))


async def _more_xtrim_calls(r: aioredis.Redis, before: int) -> bool:
    return await _xtrim_calls(r) > before


async def _trim(r: aioredis.Redis, stream: str, limit: int = 10_000) -> int:
    return int(await r.register_script(TRIM_JOBS)(keys=[stream], args=[limit]))


async def test_the_trim_keeps_everything_from_the_oldest_entry_any_group_has_not_settled(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    r = redis_client
    stream = f"{key_prefix}:jobs"
    try:
        assert await _trim(r, stream) == 0  # no stream
        ids = [(await r.xadd(stream, {"n": str(i)})).decode() for i in range(8)]
        assert await _trim(r, stream) == 0  # no group: nobody said what is settled
        await r.xgroup_create(stream, "a", id="0")
        await r.xgroup_create(stream, "b", id="0")
        # a: delivered 0..4, acked 0, 1, 3 (2 and 4 pending: 3 is acked behind a pending one); 5.. undelivered.
        await r.xreadgroup("a", "c", {stream: ">"}, count=5)
        await r.xack(stream, "a", ids[0], ids[1], ids[3])
        # b: delivered and acked 0..5; 6, 7 undelivered.
        await r.xreadgroup("b", "c", {stream: ">"}, count=6)
        await r.xack(stream, "b", *ids[:6])
        assert await _trim(r, stream) == 2 and await _ids(r, stream) == ids[2:]  # a's pending 2 holds the rest
        assert await _trim(r, stream) == 0  # sent again (a lost reply): nothing more
        await r.xack(stream, "a", ids[2], ids[4])  # a: 0..4 settled, 5 undelivered
        assert await _trim(r, stream) == 3 and await _ids(r, stream) == ids[5:]
        await r.xreadgroup("a", "c", {stream: ">"}, count=10)
        await r.xack(stream, "a", *ids[5:])  # a: all settled; b: 6, 7 undelivered
        assert await _trim(r, stream) == 1 and await _ids(r, stream) == ids[6:]
        await r.xreadgroup("b", "c", {stream: ">"}, count=10)
        await r.xack(stream, "b", *ids[6:])
        assert await _trim(r, stream) == 2 and await _ids(r, stream) == []
        for g in await r.xinfo_groups(stream):
            assert (g["lag"], g["pending"], g["entries-read"]) == (0, 0, 8), g
        # A group created later ("$": from the end) has nothing unsettled: new entries are what it waits for.
        await r.xgroup_create(stream, "late", id="$")
        new = (await r.xadd(stream, {"n": "8"})).decode()
        assert await _trim(r, stream) == 0 and await _ids(r, stream) == [new]
    finally:
        await r.delete(stream)


async def test_a_long_untrimmed_stream_is_caught_up_in_bounded_steps(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    r = redis_client
    stream = f"{key_prefix}:jobs"
    try:
        async with r.pipeline(transaction=False) as p:
            for i in range(3_000):
                p.xadd(stream, {"n": str(i)})
            await p.execute()
        await r.xgroup_create(stream, "a", id="0")
        await r.xreadgroup("a", "c", {stream: ">"}, count=2_500)
        ids = [i for i, _ in await r.xrange(stream)]
        await r.xack(stream, "a", *ids[:2_400])  # 2,400 settled, 100 pending, 500 undelivered
        removed = [await _trim(r, stream, limit=1_000) for _ in range(4)]
        assert all(n <= 1_000 for n in removed), removed
        assert sum(removed) == 2_400 and removed[-1] == 0, removed
        assert [i for i, _ in await r.xrange(stream)] == ids[2_400:]
    finally:
        await r.delete(stream)
