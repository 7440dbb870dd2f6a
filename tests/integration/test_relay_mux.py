"""Many requests over one WebSocket (``/v1/ws``): subscriptions, per-request errors, tokens refreshed
in-band, a relay restart resumed exactly, and a socket that stops reading cut whole."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import anyio
import msgspec
import pytest
import websockets

from sluice.relay import serve_relay, sign_token
from tests.integration.conftest import cleanup
from tests.integration.test_relay import (
    SECRET,
    Attempt,
    config_for,
    finalize,
    publish,
    stored,
    text_request,
    wait_until,
    write_request,
)
from tests.integration.test_relay_fanout import _drain, _Records, _stalled_websocket

pytestmark = pytest.mark.asyncio


class Client:
    """A multiplexed socket's messages, sorted by request as they arrive."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.by_request: dict[str | None, list[dict[str, Any]]] = {}

    async def send(self, **doc: Any) -> None:
        await self.ws.send(msgspec.json.encode(doc).decode())

    async def next(self, request_id: str | None, event: str | None = None) -> dict[str, Any]:
        """The next message about ``request_id`` (None: the socket's own), skipping heartbeats."""
        while True:
            for m in self.by_request.get(request_id, []):
                if event is None or m["event"] == event:
                    self.by_request[request_id].remove(m)
                    return m
            m = msgspec.json.decode(await self.ws.recv())
            if m["event"] != "heartbeat":
                self.by_request.setdefault(m.get("request_id"), []).append(m)

    async def until_end(self, request_id: str) -> list[tuple[str, str, bytes]]:
        """The request's events up to its ``end``, as (id, type, contract JSON)."""
        got = []
        while (m := await self.next(request_id))["event"] != "end":
            assert m["event"] not in ("error",), m
            got.append((m["id"], m["event"], msgspec.json.encode(m["data"])))
        return got


def _as_stored(log: list[tuple[str, str, bytes]]) -> list[tuple[str, str, bytes]]:
    return [(i, t, msgspec.json.encode(msgspec.json.decode(d))) for i, t, d in log]


async def test_many_requests_over_one_socket(redis_url, key_prefix, redis_client) -> None:
    done = _as_stored(await write_request(redis_client, key_prefix, "m1", text_request("m1")))
    live = Attempt("m2", 1).block("text", [f"w{i} " for i in range(20)]).done()
    await publish(redis_client, key_prefix, "m2", 1, live.events[:3])
    for rid in ("m3", "m5"):
        await publish(redis_client, key_prefix, rid, 1, Attempt(rid, 1).events)  # never finish
    now = int(time.time())
    try:
        config = config_for(redis_url, key_prefix, max_streams_per_socket=3)
        async with serve_relay(config) as relay:  # noqa: SIM117
            async with websockets.connect(relay.url.replace("http", "ws") + "/v1/ws") as ws:
                c = Client(ws)
                await c.send(type="auth", token=sign_token(SECRET, "m1", now + 60))
                ack = await c.next(None, "auth")
                assert ack["data"] == {"ok": True, "request_id": "m1", "expires_at": now + 60}
                await c.send(type="subscribe", request_id="m1")
                await c.send(type="subscribe", request_id="m2", token=sign_token(SECRET, "m2", now + 60))
                await c.send(type="subscribe", request_id="nope", token=SECRET)
                assert (await c.next("m1", "subscribed"))["data"] == {"after": "0-0"}
                assert (await c.next("nope"))["data"] == {"status": 404, "error": "no such request"}
                await c.send(type="subscribe", request_id="m2", token=SECRET)
                assert (await c.next("m2", "error"))["data"]["status"] == 409
                await c.next("m2", "subscribed")
                assert await c.until_end("m1") == done
                # per-socket bound: m2, m3 and m5 (all live) fill it; a fourth is refused
                for rid in ("m3", "m5"):
                    await c.send(type="subscribe", request_id=rid, token=SECRET)
                    await c.next(rid, "subscribed")
                await c.send(type="subscribe", request_id="m4", token=SECRET)
                assert (await c.next("m4"))["data"] == {"status": 429, "error": "at most 3 streams per socket"}
                await publish(redis_client, key_prefix, "m2", 1, live.events[3:])
                await finalize(redis_client, key_prefix, "m2")
                assert await c.until_end("m2") == _as_stored(await stored(redis_client, key_prefix, "m2"))
                for rid in ("m3", "m5"):
                    await c.send(type="unsubscribe", request_id=rid)
                    await c.next(rid, "unsubscribed")
                await wait_until(lambda: relay.hub.statistics()["clients_active"] == 0)
                # malformed messages are answered, the socket stays
                for raw, status in (
                    ("{", 400),
                    ('{"type":"dance"}', 400),
                    ("x" * 20_000, 413),
                    ('{"type":"subscribe","request_id":"m1","after":"x"}', 400),
                ):
                    await ws.send(raw)
                    error = await c.next(None, "error") if status != 400 or "m1" not in raw else await c.next("m1")
                    assert error["data"]["status"] == status, raw
                # resume after a position: exactly the rest
                await c.send(type="subscribe", request_id="m1", after=done[4][0], token=SECRET)
                await c.next("m1", "subscribed")
                assert await c.until_end("m1") == done[5:]
    finally:
        await cleanup(redis_client, key_prefix)


async def test_tokens_are_refreshed_on_the_socket(redis_url, key_prefix, redis_client) -> None:
    log = _as_stored(
        await write_request(redis_client, key_prefix, "t1", [Attempt("t1", 1).block("text", ["a"]).done()])
    )
    now = int(time.time())
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay:  # noqa: SIM117
            async with websockets.connect(relay.url.replace("http", "ws") + "/v1/ws") as ws:
                c = Client(ws)
                await c.send(type="subscribe", request_id="t1")
                assert (await c.next("t1"))["data"]["status"] == 401
                await c.send(type="auth", token=sign_token(SECRET, "t1", now - 1))
                assert (await c.next(None, "auth"))["data"] == {
                    "ok": False,
                    "status": 403,
                    "error": "the token has expired",
                }
                await c.send(type="subscribe", request_id="t1", token=sign_token(SECRET, "t1", now - 1))
                assert (await c.next("t1"))["data"] == {"status": 403, "error": "the token has expired"}
                # the page fetched a fresh token from its backend: one auth message, then subscribe as usual
                await c.send(type="auth", token=sign_token(SECRET, "t1", now + 60))
                assert (await c.next(None, "auth"))["data"]["ok"] is True
                await c.send(type="subscribe", request_id="t1")
                await c.next("t1", "subscribed")
                assert await c.until_end("t1") == log
                await c.send(type="subscribe", request_id="t2")  # that token is for t1 only
                assert (await c.next("t2"))["data"] == {"status": 403, "error": "the token is for another request"}
    finally:
        await cleanup(redis_client, key_prefix)


async def test_restart_closes_1012_and_resubscribing_resumes_exactly(redis_url, key_prefix, redis_client) -> None:
    a = Attempt("r1", 1).block("text", [f"t{i}" for i in range(10)]).done()
    await publish(redis_client, key_prefix, "r1", 1, a.events[:6])
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay:
            port = relay.port
            ws = await websockets.connect(relay.url.replace("http", "ws") + "/v1/ws")
            c = Client(ws)
            await c.send(type="subscribe", request_id="r1", token=SECRET)
            await c.next("r1", "subscribed")
            first = [await c.next("r1") for _ in range(6)]
            relay.stop()
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await c.next("r1")
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
        await publish(redis_client, key_prefix, "r1", 1, a.events[6:])
        await finalize(redis_client, key_prefix, "r1")
        async with serve_relay(config_for(redis_url, key_prefix), port=port) as relay:  # noqa: SIM117
            async with websockets.connect(relay.url.replace("http", "ws") + "/v1/ws") as ws:
                c = Client(ws)
                await c.send(type="subscribe", request_id="r1", token=SECRET, after=first[-1]["id"])
                await c.next("r1", "subscribed")
                rest = await c.until_end("r1")
        log = _as_stored(await stored(redis_client, key_prefix, "r1"))
        assert [(m["id"], m["event"], msgspec.json.encode(m["data"])) for m in first] + rest == log
    finally:
        await cleanup(redis_client, key_prefix)


def _masked_text_frame(text: str) -> bytes:
    """One client text frame (RFC 6455 5.2: clients mask), short enough for a one-byte length."""
    payload = text.encode()
    assert len(payload) < 126
    mask = os.urandom(4)
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_a_socket_that_stops_reading_is_cut_whole(redis_url, key_prefix, redis_client) -> None:
    """A socket that subscribes to two requests, then reads nothing: when the relay's writes stop
    draining the whole socket is cut (every subscription shares it), logged, and its connection dropped."""
    await write_request(redis_client, key_prefix, "big", [Attempt("big", 1).block("text", ["x" * 32_000] * 384).done()])
    await publish(redis_client, key_prefix, "small", 1, Attempt("small", 1).events)
    records = _Records()
    logging.getLogger("sluice.relay").addHandler(records)
    try:
        async with serve_relay(config_for(redis_url, key_prefix, write_timeout=0.5)) as relay:
            stalled = await anyio.to_thread.run_sync(_stalled_websocket, relay.port, "/v1/ws")
            for rid in ("small", "big"):
                doc = {"type": "subscribe", "request_id": rid, "token": SECRET}
                stalled.sendall(_masked_text_frame(msgspec.json.encode(doc).decode()))
            await wait_until(lambda: relay.hub.statistics()["clients_cut_slow"] == 1, 20)
            await wait_until(lambda: relay.hub.statistics()["clients_active"] == 0)
            received, closed = await anyio.to_thread.run_sync(_drain, stalled, 5.0)
            stalled.close()
        assert closed and received < 1_000_000, received
        (cut,) = [r for r in records.records if r.getMessage().startswith("client cut off")]
        assert cut.reason == "no write completed in 0.5 s"  # type: ignore[attr-defined]
    finally:
        logging.getLogger("sluice.relay").removeHandler(records)
        await cleanup(redis_client, key_prefix)
