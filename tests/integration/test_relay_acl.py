"""The relay as the deployment's read-only Redis user (``sluice-reader`` in ``ops/deploy/users.acl``): every
command it sends is one that user has, so ACL LOG stays empty while it serves finished and live requests."""

from __future__ import annotations

import httpx
import pytest
import redis.asyncio as aioredis

from sluice.harness.embedded_redis import EmbeddedRedis
from sluice.relay import serve_relay
from tests.integration.test_deploy_acl import PREFIX, _url, acl_redis
from tests.integration.test_relay import AUTH, Attempt, config_for, events_url, finalize, publish, read_sse, stored

pytestmark = pytest.mark.asyncio
__all__ = ["acl_redis"]  # the module-scoped ACL'd redis-server fixture


async def test_the_relay_runs_as_the_reader_user(acl_redis: EmbeddedRedis) -> None:
    admin = aioredis.Redis.from_url(_url(acl_redis, "sluice-admin"))
    try:
        await admin.execute_command("ACL", "LOG", "RESET")
        done = Attempt("acl1", 1).block("text", ["a", "b"]).done()
        await publish(admin, PREFIX, "acl1", 1, done.events)
        await finalize(admin, PREFIX, "acl1")
        live = Attempt("acl2", 1).block("text", ["c", "d"]).done()
        await publish(admin, PREFIX, "acl2", 1, live.events[:2])
        config = config_for(_url(acl_redis, "sluice-reader"), PREFIX)
        async with serve_relay(config) as relay, httpx.AsyncClient() as client:
            assert (await client.get(relay.url + "/readyz")).status_code == 200
            first = await read_sse(client, events_url(relay.url, "acl1"), headers=AUTH)
            assert (await read_sse(client, events_url(relay.url, "nope"), headers=AUTH)).status == 404
            async with client.stream("GET", events_url(relay.url, "acl2"), headers=AUTH) as resp:
                assert resp.status_code == 200
                await publish(admin, PREFIX, "acl2", 1, live.events[2:])
                await finalize(admin, PREFIX, "acl2")
                body = (await resp.aread()).decode()
        assert first.contract == await stored(admin, PREFIX, "acl1") and first.ended
        assert body.count("\nevent: ") == len(live.events) + 1 and "event: end" in body
        assert await admin.execute_command("ACL", "LOG") == []  # not one command refused
    finally:
        async for key in admin.scan_iter(match=f"{PREFIX}:{{req:acl*", count=1000):
            await admin.delete(key)
        await admin.aclose()
