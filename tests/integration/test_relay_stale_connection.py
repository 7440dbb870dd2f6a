"""The relay's first read of a request survives a pooled connection Redis closed meanwhile.

Against a redis-server of the test's own (restarted, and its clients killed with ``CLIENT KILL``, which
must never reach a shared Redis): the next client gets its stream (200), not a spurious 503, and the retry
is counted; a Redis that stays down is still a 503, after exactly one retry.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import httpx
import pytest
import redis.asyncio as aioredis

from sluice.harness.embedded_redis import EmbeddedRedis, embedded_redis
from sluice.relay import serve_relay
from tests.integration.test_relay import AUTH, config_for, events_url, read_sse, text_request, write_request

pytestmark = [pytest.mark.asyncio, pytest.mark.server]  # each test starts its own server
PREFIX = "stale"


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with embedded_redis() as s:
        yield s


async def _request(url: str, rid: str) -> list[tuple[str, str, bytes]]:
    r = aioredis.Redis.from_url(url)
    try:
        return await write_request(r, PREFIX, rid, text_request(rid))
    finally:
        await r.aclose()


async def test_a_killed_pooled_connection_is_retried_not_answered_503(server: EmbeddedRedis) -> None:
    want = await _request(server.url, "r1")
    admin = aioredis.Redis.from_url(server.url)
    try:
        async with serve_relay(config_for(server.url, PREFIX)) as relay, httpx.AsyncClient() as http:
            assert (await read_sse(http, events_url(relay.url, "r1"), headers=AUTH)).contract == want
            assert relay.hub.statistics()["first_read_retries"] == 0
            for round_ in (1, 2):  # twice: the retry left no stale connection behind either
                killed = await admin.client_kill_filter(_type="normal", skipme=True)
                assert killed >= 1
                got = await read_sse(http, events_url(relay.url, "r1"), headers=AUTH)
                assert (got.status, got.contract) == (200, want), got.body
                assert relay.hub.statistics()["first_read_retries"] == round_
            metrics = (await http.get(relay.url + "/metrics", headers=AUTH)).text
            assert "\nsluice_relay_first_read_retries_total 2\n" in metrics
    finally:
        await admin.aclose()


async def test_after_a_redis_restart_the_first_client_is_served() -> None:
    first = embedded_redis()
    server = first.__enter__()
    running = True
    try:
        want = await _request(server.url, "r1")
        async with serve_relay(config_for(server.url, PREFIX)) as relay, httpx.AsyncClient() as http:
            assert (await read_sse(http, events_url(relay.url, "r1"), headers=AUTH)).contract == want
            first.__exit__(None, None, None)
            running = False
            # the same port again, an empty server: the request is written anew
            with embedded_redis(port=server.port) as again:
                assert await _request(again.url, "r1") == want
                got = await read_sse(http, events_url(relay.url, "r1"), headers=AUTH)
                assert (got.status, got.contract) == (200, want), got.body
                assert relay.hub.statistics()["first_read_retries"] == 1
    finally:
        if running:
            first.__exit__(None, None, None)


async def test_a_redis_that_stays_down_is_still_a_503() -> None:
    with embedded_redis() as gone:
        await _request(gone.url, "r1")
        url = gone.url
    async with serve_relay(config_for(url, PREFIX)) as relay, httpx.AsyncClient() as http:
        got = await read_sse(http, events_url(relay.url, "r1"), headers=AUTH)
        assert got.status == 503 and b"Redis is unreachable" in got.body
        assert relay.hub.statistics()["first_read_retries"] == 1  # retried once, then answered


async def test_after_redis_closed_idle_connections_the_next_client_is_served() -> None:
    """A relay left idle past Redis's ``timeout`` (here 1 s) finds its pooled connections closed."""
    with embedded_redis(extra_args=["--timeout", "1"]) as server:
        want = await _request(server.url, "r1")
        admin = aioredis.Redis.from_url(server.url)
        try:
            async with serve_relay(config_for(server.url, PREFIX)) as relay, httpx.AsyncClient() as http:
                assert (await read_sse(http, events_url(relay.url, "r1"), headers=AUTH)).contract == want
                me = await admin.client_id()
                with anyio.fail_after(20):  # Redis closes the relay's idle connections (not ours: it polls)
                    while [c for c in await admin.client_list() if int(c["id"]) != me]:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                got = await read_sse(http, events_url(relay.url, "r1"), headers=AUTH)
                assert (got.status, got.contract) == (200, want), got.body
                assert relay.hub.statistics()["first_read_retries"] == 1
        finally:
            await admin.aclose()
