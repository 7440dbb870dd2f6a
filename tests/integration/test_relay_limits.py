"""What one relay costs and how it refuses: Redis outages (503 with jittered Retry-After, readiness apart
from liveness), a fixed number of Redis connections whatever the number of clients, a client limit,
clients that stop reading (cut by the write timeout, also while catching up), and bad parameters (400).

The relay reaches Redis through a TCP proxy the test controls (``tests/faults/tcp_proxy.py``), so an
outage is a refused connection and the proxy counts the relay's Redis connections exactly.
"""

from __future__ import annotations

import logging
from urllib.parse import quote

import anyio
import httpx
import pytest
import websockets

from sluice.relay import serve_relay
from tests.faults.tcp_proxy import TcpProxy
from tests.integration.conftest import cleanup
from tests.integration.test_relay import (
    AUTH,
    Attempt,
    Received,
    config_for,
    events_url,
    finalize,
    publish,
    read_sse,
    stored,
    wait_until,
    write_request,
)
from tests.integration.test_relay_fanout import _drain, _Records, _stalled_client

pytestmark = pytest.mark.asyncio


async def test_redis_outage_is_503_with_jittered_retry_and_recovers(redis_url, key_prefix, redis_client) -> None:
    log = await write_request(redis_client, key_prefix, "o1", [Attempt("o1", 1).block("text", ["a", "b"]).done()])
    try:
        async with TcpProxy.for_url(redis_url) as proxy:
            proxy.refuse(True)
            config = config_for(proxy.url_for(redis_url), key_prefix, retry_after=2.0, retry_jitter=3.0)
            async with serve_relay(config) as relay, httpx.AsyncClient() as client:
                url = events_url(relay.url, "o1")
                waits, retries = [], []
                for _ in range(12):
                    resp = await client.get(url, headers={**AUTH, "Accept": "text/event-stream"})
                    assert resp.status_code == 503 and resp.headers["content-type"].startswith("text/event-stream")
                    waits.append(int(resp.headers["retry-after"]))
                    head, event = resp.text.split("\n", 1)
                    retries.append(int(head.removeprefix("retry: ")))
                    body = b'event: error\ndata: {"error":"Redis is unreachable; try again later","status":503}\n\n'
                    assert event.encode() == body
                # Retry-After in whole seconds, never early; retry: in ms; both spread over [2, 5] s
                assert all(2 <= w <= 5 for w in waits) and all(2000 <= r <= 5000 for r in retries)
                assert len(set(retries)) > 1  # jittered: clients refused together come back spread out
                plain = await client.get(url, headers=AUTH)  # a client not asking for SSE gets JSON
                assert plain.status_code == 503 and plain.json() == {"error": "Redis is unreachable; try again later"}
                ws_url = relay.url.replace("http", "ws") + "/v1/requests/o1/ws"
                with pytest.raises(websockets.InvalidStatus) as denied:
                    async with websockets.connect(ws_url, additional_headers=AUTH):
                        pass
                assert denied.value.response.status_code == 503
                # readiness says Redis is away; liveness (public, no counters) says the process serves
                ready = await client.get(relay.url + "/readyz")
                assert ready.status_code == 503 and ready.json() == {"ready": False, "error": "Redis is unreachable"}
                assert 2 <= int(ready.headers["retry-after"]) <= 5
                assert (await client.get(relay.url + "/healthz")).json() == {"ok": True}
                stats = relay.hub.statistics()
                assert stats["clients_refused_unavailable"] == 14 and stats["feeds_active"] == 0
                # Redis is back: the same client is served in full
                proxy.refuse(False)
                assert (await client.get(relay.url + "/readyz")).status_code == 200
                got = await read_sse(client, url, headers=AUTH)
                assert got.contract == log and got.ended
    finally:
        await cleanup(redis_client, key_prefix)


async def test_a_blip_under_a_live_stream_loses_nothing(redis_url, key_prefix, redis_client) -> None:
    """Redis cut and refused while clients follow a live request: they keep their streams (heartbeats),
    and once Redis is back every event arrives once, in order."""
    a = Attempt("o2", 1).block("text", [f"w{i} " for i in range(30)]).done()
    await publish(redis_client, key_prefix, "o2", 1, a.events[:10])
    try:
        async with TcpProxy.for_url(redis_url) as proxy:
            config = config_for(proxy.url_for(redis_url), key_prefix, heartbeat=0.2)
            async with serve_relay(config) as relay, httpx.AsyncClient() as client:
                results: list[Received] = []

                async def follow() -> None:
                    results.append(await read_sse(client, events_url(relay.url, "o2"), headers=AUTH))

                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(follow)
                    await wait_until(lambda: relay.hub.statistics()["clients_active"] == 3)
                    proxy.refuse(True)
                    proxy.cut()
                    await publish(redis_client, key_prefix, "o2", 1, a.events[10:20])  # written while the relay is cut
                    await wait_until(lambda: relay.hub.statistics()["redis_errors"] >= 1)
                    proxy.refuse(False)
                    await publish(redis_client, key_prefix, "o2", 1, a.events[20:])
                    await finalize(redis_client, key_prefix, "o2")
        log = await stored(redis_client, key_prefix, "o2")
        assert [r.contract == log and r.ended for r in results] == [True, True, True]
    finally:
        await cleanup(redis_client, key_prefix)


async def test_redis_connections_stay_bounded_whatever_the_clients(redis_url, key_prefix, redis_client) -> None:
    """300 clients on one request and 40 on as many others: one first round trip per request, and the
    relay's Redis connections (counted by the proxy they go through) never pass pool + 2 per lane."""
    crowd = Attempt("crowd", 1).block("text", [f"t{i}" for i in range(20)]).done()
    await publish(redis_client, key_prefix, "crowd", 1, crowd.events[:8])
    others = {f"o{i}": Attempt(f"o{i}", 1).done() for i in range(40)}
    for rid, a in others.items():
        await publish(redis_client, key_prefix, rid, 1, a.events[:1])  # live: started, nothing more yet
    pool, lanes = 4, 2
    try:
        async with TcpProxy.for_url(redis_url) as proxy:
            config = config_for(proxy.url_for(redis_url), key_prefix, redis_pool_size=pool, reader_lanes=lanes)
            limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
            async with serve_relay(config) as relay, httpx.AsyncClient(limits=limits, timeout=30) as client:
                results: dict[str, list[Received]] = {rid: [] for rid in ["crowd", *others]}
                peak = 0

                async def follow(rid: str) -> None:
                    results[rid].append(await read_sse(client, events_url(relay.url, rid), headers=AUTH))

                async with anyio.create_task_group() as tg:
                    for k in range(300):
                        tg.start_soon(follow, "crowd")
                        if k < len(others):
                            tg.start_soon(follow, f"o{k}")
                    while relay.hub.statistics()["clients_active"] < 340:
                        peak = max(peak, proxy.statistics().open)
                        await anyio.sleep(0.005)
                    stats = relay.hub.statistics()
                    await publish(redis_client, key_prefix, "crowd", 1, crowd.events[8:])
                    for rid, a in others.items():
                        await publish(redis_client, key_prefix, rid, 1, a.events[1:])
                    for rid in results:
                        await finalize(redis_client, key_prefix, rid)
                    while relay.hub.statistics()["clients_active"]:
                        peak = max(peak, proxy.statistics().open)
                        await anyio.sleep(0.005)
                assert peak <= pool + 2 * lanes, peak
                assert relay.redis.open_connections() <= pool + 2 * lanes
        for rid, got in results.items():
            log = await stored(redis_client, key_prefix, rid)
            assert len(got) == (300 if rid == "crowd" else 1) and all(r.contract == log and r.ended for r in got), rid
        # one first round trip per request, however many clients joined it
        assert stats["readers_started"] == 41 and stats["clients_total"] == 340
    finally:
        await cleanup(redis_client, key_prefix)


async def test_max_clients_is_503_not_a_crash(redis_url, key_prefix, redis_client) -> None:
    await publish(redis_client, key_prefix, "m1", 1, Attempt("m1", 1).events)
    try:
        config = config_for(redis_url, key_prefix, max_clients=3, retry_after=1.0, retry_jitter=1.0)
        async with serve_relay(config) as relay, httpx.AsyncClient() as client:
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(lambda: read_sse(client, events_url(relay.url, "m1"), headers=AUTH))
                await wait_until(lambda: relay.hub.statistics()["clients_active"] == 3)
                refused = await client.get(events_url(relay.url, "m1"), headers=AUTH)
                assert refused.status_code == 503 and 1 <= int(refused.headers["retry-after"]) <= 2
                assert refused.json() == {"error": "the relay serves its maximum of 3 clients"}
                assert relay.hub.statistics()["clients_refused_full"] == 1
                await publish(redis_client, key_prefix, "m1", 1, [Attempt("m1", 1).done().events[-1]])
                await finalize(redis_client, key_prefix, "m1")
            # the slots are free again
            assert (await read_sse(client, events_url(relay.url, "m1"), headers=AUTH)).ended
    finally:
        await cleanup(redis_client, key_prefix)


async def test_a_stalled_client_catching_up_is_cut_by_the_write_timeout(redis_url, key_prefix, redis_client) -> None:
    """A finished 12 MB request: the client never reads. No live buffer fills (it is all catch-up), so
    only the write timeout notices; it is cut, logged, and its connection dropped."""
    big = Attempt("big", 1).block("text", ["x" * 32_000] * 384).done()
    await write_request(redis_client, key_prefix, "big", [big])
    records = _Records()
    logger = logging.getLogger("sluice.relay")
    logger.addHandler(records)
    try:
        config = config_for(redis_url, key_prefix, write_timeout=0.5)
        async with serve_relay(config) as relay:
            stalled = _stalled_client(relay.port, "/v1/requests/big/events")
            await wait_until(lambda: relay.hub.statistics()["clients_cut_slow"] == 1, 20)
            received, closed = await anyio.to_thread.run_sync(_drain, stalled, 5.0)
            stalled.close()
            stats = relay.hub.statistics()
        assert closed and received < 1_000_000, received
        assert stats["clients_active"] == 0
        (cut,) = [r for r in records.records if r.getMessage().startswith("client cut off")]
        assert cut.request_id == "big" and cut.reason == "no write completed in 0.5 s"  # type: ignore[attr-defined]
    finally:
        logger.removeHandler(records)
        await cleanup(redis_client, key_prefix)


BAD_QUERIES = {
    "coalesce_ms=%C2%B2": "coalesce_ms must be an integer 0..5000",  # '²': isdigit() says yes, int() says no
    "coalesce_ms=-1": "coalesce_ms must be an integer 0..5000",
    "coalesce_ms=5001": "coalesce_ms must be an integer 0..5000",
    "coalesce_ms=1e3": "coalesce_ms must be an integer 0..5000",
    "after=%D9%A1-%D9%A2": "not a position <attempt>-<seq>: '١-٢'",  # Arabic-Indic digits
    "after=1-2.0": "not a position <attempt>-<seq>: '1-2.0'",  # chunk ids are for format=ai-sdk only
    "after=x": "not a position <attempt>-<seq>: 'x'",
    "format=xml": "format must be one of sse, ai-sdk",
    "coalesce=50": "unknown parameter 'coalesce' (accepted: after, coalesce_ms, format, token)",
    "after=1&after=2": "parameter 'after' given more than once",
    "token=a%20b": "token must be 1..4096 printable ASCII characters",
    f"token={'t' * 4097}": "token must be 1..4096 printable ASCII characters",
}


async def test_every_parameter_is_validated(redis_url, key_prefix, redis_client) -> None:
    await write_request(redis_client, key_prefix, "p1", [Attempt("p1", 1).done()])
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            base = events_url(relay.url, "p1")
            for query, message in BAD_QUERIES.items():
                resp = await client.get(f"{base}?{query}", headers=AUTH)
                assert (resp.status_code, resp.json()) == (400, {"error": message}), query
            bad_header = await client.get(base, headers={**AUTH, "Last-Event-ID": "1-²".encode()})
            assert bad_header.status_code == 400
            rule = {"error": "the request id must be 1-128 ASCII letters, digits and - _ . :"}
            for bad in ("r" * 129, "r\u0435q-1"):  # too long; a Cyrillic "е", which the worker refuses too
                refused = await client.get(events_url(relay.url, quote(bad)), headers=AUTH)
                assert (refused.status_code, refused.json()) == (400, rule), bad
            ws = relay.url.replace("http", "ws") + "/v1/requests/p1/ws?coalesce_ms=%C2%B2"
            with pytest.raises(websockets.InvalidStatus) as denied:
                async with websockets.connect(ws, additional_headers=AUTH):
                    pass
            assert denied.value.response.status_code == 400
            # and what is valid still works: a chunk id with format=ai-sdk
            ok = await client.get(f"{base}?format=ai-sdk&after=1-1.0", headers=AUTH)
            assert ok.status_code == 200 and ok.headers["x-vercel-ai-ui-message-stream"] == "v1"
            assert relay.hub.statistics()["readers_started"] == 1  # nothing invalid reached Redis
    finally:
        await cleanup(redis_client, key_prefix)
