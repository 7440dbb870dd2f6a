"""A request's appends after its append connection was replaced (``sluice.worker.append.log``): the
connection that acknowledged the last append broke while nothing was in flight, and the next append goes on
a new one, which may reach a promoted replica lacking what was acknowledged. Simulated on one Redis: the
connection is killed (``CLIENT KILL ID``, only ours), the acknowledged entries are deleted as a failover
would have lost them, then the next append is sent: it must raise ``LogLost``, never append after the hole,
whether the pipe reconnects for it (the waiting path) or another request reconnected it first (the
no-wait path sees a live connection with another id). With nothing lost, the append goes on."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from sluice.schemas.keys import Keys
from sluice.worker.append.log import PendingBatch, RequestLog
from sluice.worker.append.store import AttemptStore
from sluice.worker.pipeline.context import InFlight
from sluice.worker.redis.retry import LogLost
from sluice.worker.redis.route import SlotRouter

pytestmark = pytest.mark.asyncio


def _batch(seqs: range) -> PendingBatch:
    b = PendingBatch()
    for i in seqs:
        b.add_raw(i, "sse", "message", f"d{i}", "", i * 10, 1)
        b.events.append((i, "block.delta", f'{{"seq":{i}}}', 1))
    return b


async def _ids(r: aioredis.Redis, key: str) -> list[str]:
    return [i.decode() for i, _ in await r.xrange(key)]


@pytest_asyncio.fixture
async def setup(redis_url: str, key_prefix: str) -> AsyncIterator[tuple[aioredis.Redis, SlotRouter, Keys]]:
    r = aioredis.Redis.from_url(redis_url)
    router = SlotRouter.for_client(r, socket_timeout=10.0, connect_timeout=10.0)
    try:
        yield r, router, Keys(key_prefix)
    finally:
        router.close()
        async for key in r.scan_iter(match=f"{key_prefix}:*"):
            await r.delete(key)
        await r.aclose()


async def _log(r: aioredis.Redis, router: SlotRouter, keys: Keys, rid: str) -> RequestLog:
    rlog = RequestLog(router, keys.request(rid), outage_limit=5.0)
    rlog.epoch = 3
    await r.hset(rlog.keys.status, mapping={"epoch": "3", "attempt": "0"})
    return rlog


async def _kill_append_connection(r: aioredis.Redis, router: SlotRouter, rlog: RequestLog) -> None:
    pipe = router.pipe_now("append", rlog.slot)
    assert pipe is not None
    client_id = await pipe.call("CLIENT", "ID")
    await r.client_kill_filter(_id=client_id)
    with anyio.fail_after(10):
        while pipe.connection_id is not None:  # noqa: ASYNC110 - the pipe notices the close on its own
            await anyio.sleep(0.005)


async def _lose(r: aioredis.Redis, rlog: RequestLog, ids: list[str]) -> None:
    await r.xdel(rlog.keys.events, *ids)
    await r.xdel(rlog.keys.raw, *ids)


@pytest.mark.parametrize("path", ["waiting", "no-wait"])
async def test_an_append_on_a_new_connection_after_lost_entries_raises_log_lost(setup, path: str) -> None:  # type: ignore[no-untyped-def]
    r, router, keys = setup
    rlog = await _log(r, router, keys, "rc-1")
    await rlog.append(1, _batch(range(1, 4)))
    await _kill_append_connection(r, router, rlog)
    await _lose(r, rlog, ["1-2", "1-3"])  # the "promoted replica" holds seq 1 only
    with pytest.raises(LogLost):
        if path == "waiting":
            await rlog.append(1, _batch(range(4, 6)))
        else:
            store = AttemptStore(rlog, 1, InFlight("rc-1"))
            await store.send(_batch(range(4, 6)))
            await store.drain()
    assert await _ids(r, rlog.keys.events) == ["1-1"]  # nothing after the hole


async def test_a_connection_reopened_by_another_request_still_makes_the_next_append_check(setup) -> None:  # type: ignore[no-untyped-def]
    r, router, keys = setup
    rlog = await _log(r, router, keys, "rc-2")
    other = await _log(r, router, keys, "rc-3")
    await rlog.append(1, _batch(range(1, 4)))
    await _kill_append_connection(r, router, rlog)
    await other.append(1, _batch(range(1, 2)))  # reconnects the shared pipe: a live connection, a new id
    pipe = router.pipe_now("append", rlog.slot)
    assert pipe is not None and pipe.connection_id is not None
    await _lose(r, rlog, ["1-3"])
    store = AttemptStore(rlog, 1, InFlight("rc-2"))
    with pytest.raises(LogLost):
        await store.send(_batch(range(4, 6)))
        await store.drain()
    assert await _ids(r, rlog.keys.events) == ["1-1", "1-2"]


async def test_a_new_connection_with_nothing_lost_appends_after_the_check(setup) -> None:  # type: ignore[no-untyped-def]
    r, router, keys = setup
    rlog = await _log(r, router, keys, "rc-4")
    store = AttemptStore(rlog, 1, InFlight("rc-4"))
    await store.send(_batch(range(1, 4)))
    await store.drain()
    await _kill_append_connection(r, router, rlog)
    await store.send(_batch(range(4, 6)))
    await store.send(_batch(range(6, 7)))  # on the connection that acknowledged the check: no check again
    await store.drain()
    want = [f"1-{i}" for i in range(1, 7)]
    assert await _ids(r, rlog.keys.events) == want and await _ids(r, rlog.keys.raw) == want
