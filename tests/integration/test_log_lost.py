"""A failover can lose appends Redis had acknowledged (replication is asynchronous): the promoted replica's
streams end earlier than the worker believes. Simulated on one Redis: the worker's connections are cut and
refused, the request's streams are cut back by a few events (as the replica had them), then Redis is let
back. The worker must not append after the hole: the attempt ends interrupted / transport right after what
Redis holds, and every invariant holds."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis

from sluice.client import SluiceClient
from sluice.schemas.events import StreamError, decode_event
from sluice.schemas.keys import Keys
from tests.faults import TcpProxy
from tests.faults.invariants import check_request
from tests.integration.conftest import make_config, running_worker

pytestmark = pytest.mark.asyncio


async def _until(check, what: str) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(30):
        while not await check():  # noqa: ASYNC110 - polling Redis
            await anyio.sleep(0.02)


async def test_appends_lost_by_a_failover_end_the_attempt_where_the_log_ends(
    fake, private_redis_url, key_prefix
) -> None:
    r = aioredis.Redis.from_url(private_redis_url, client_name="the-test")
    keys = Keys(key_prefix)
    rid = "lost-1"
    rk = keys.request(rid)
    async with TcpProxy.for_url(private_redis_url) as proxy:
        config = make_config(proxy.url_for(private_redis_url), key_prefix, fake.base_url)
        try:
            mine = aioredis.Redis.from_url(private_redis_url, client_name="the-test")
            async with running_worker(config), SluiceClient(mine, key_prefix=key_prefix) as client:
                await client.enqueue(
                    {
                        "route": "anthropic",
                        "model": "synthetic;deltas=300;pace_ms=10",
                        "request_id": rid,
                        "request": {"messages": [{"role": "user", "content": "x"}]},
                    }
                )

                async def streaming() -> bool:
                    return int(await r.xlen(rk.events)) >= 30

                await _until(streaming, "the stream under way")
                proxy.refuse(True)
                proxy.cut()

                async def only_me() -> bool:  # every proxied connection is gone: nothing more can land
                    return all(c["name"] == "the-test" for c in await r.client_list())

                await _until(only_me, "the worker's connections closed")
                # the "promoted replica" lacks the last events and the raw entries behind them
                events = await r.xrange(rk.events)
                raws = await r.xrange(rk.raw)
                kept = events[:-4]
                refs = [ref for _, f in kept for ref in decode_event(f[b"event"]).raw]
                top_raw = max([0, *refs])
                await r.delete(rk.events, rk.raw)
                for eid, f in kept:
                    await r.xadd(rk.events, f, id=eid)
                for eid, f in raws:
                    if int(eid.split(b"-")[1]) <= top_raw:
                        await r.xadd(rk.raw, f, id=eid)
                proxy.refuse(False)
                result = await client.result(rid, timeout=30)
            facts = await check_request(r, keys, rid)
            assert facts.state == "interrupted" and result.status == "interrupted"
            (attempt,) = facts.attempts.values()
            assert attempt[:-1] == [decode_event(f[b"event"]) for _, f in kept]  # nothing after the hole
            end = attempt[-1]
            assert isinstance(end, StreamError) and end.seq == len(kept) + 1
            assert end.error.category == "transport" and "acknowledged" in (end.error.message or "")
            status = await r.hgetall(rk.status)
            assert msgspec.json.decode(status[b"error"])["category"] == "transport"
            assert int(status[b"event_count"]) == len(kept) + 1
        finally:
            async for key in r.scan_iter(match=f"{key_prefix}:*"):
                await r.delete(key)
            await r.aclose()
