"""An attempt's append store (``sluice.worker.append.store``) against the real Redis: a cancel that lands
while the store waits for the reply of the batch in flight still stores the batch it was handed (its seqs
are taken: losing it would leave a hole before the terminal)."""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio as aioredis

from sluice.schemas.keys import Keys
from sluice.worker.append.log import PendingBatch, RequestLog
from sluice.worker.append.store import AttemptStore
from sluice.worker.pipeline.context import InFlight
from sluice.worker.redis.route import SlotRouter

pytestmark = pytest.mark.asyncio


def _batch(seqs: range) -> PendingBatch:
    """Raw index i and seq i for each i: one provider event and the delta it became."""
    b = PendingBatch()
    for i in seqs:
        b.add_raw(i, "sse", "message", f"d{i}", "", i * 10, 1)
        b.events.append((i, "block.delta", f'{{"seq":{i}}}', 1))
    return b


async def _ids(r: aioredis.Redis, key: str) -> list[str]:
    return [i.decode() for i, _ in await r.xrange(key)]


async def test_a_cancel_while_waiting_for_a_reply_still_stores_every_batch_handed_over(
    redis_url: str, key_prefix: str
) -> None:
    r = aioredis.Redis.from_url(redis_url)
    router = SlotRouter.for_client(r, socket_timeout=10.0, connect_timeout=10.0)
    rlog = RequestLog(router, Keys(key_prefix).request("r1"))
    rlog.epoch = 5
    await r.hset(rlog.keys.status, mapping={"epoch": "5", "attempt": "0"})
    store = AttemptStore(rlog, 1, InFlight("r1"))
    try:
        pipe = router.pipe_now("append", rlog.slot)
        assert pipe is not None and await pipe.call("PING") == b"PONG"  # connected: sends go at once
        await store.send(_batch(range(1, 3)))  # sent; its reply is not read before the next await
        with anyio.CancelScope() as scope:
            scope.cancel()
            await store.send(_batch(range(3, 5)))  # must settle the one in flight first: cancelled right there
        assert scope.cancelled_caught
        await store.drain()
        want = [f"1-{i}" for i in range(1, 5)]
        assert await _ids(r, rlog.keys.raw) == want and await _ids(r, rlog.keys.events) == want
    finally:
        router.close()
        await r.delete(rlog.keys.raw, rlog.keys.events, rlog.keys.status)
        await r.aclose()
