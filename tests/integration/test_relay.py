"""The relay against a real server (uvicorn in-process, loopback) and a real Redis.

Streams are written straight into Redis in exactly the worker's layout (``sluice.schemas.keys``: event entry
``<attempt>-<seq>`` with fields ``type`` and ``event``; the status hash's ``attempt`` and ``state``), so
each test controls what is in the log and when. ``test_relay_worker.py`` drives the real worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import httpx
import msgspec
import pytest
import redis.asyncio as aioredis
import websockets

from sluice.normalizer.sse import SSEDecoder, SSEEvent
from sluice.relay import RelayConfig, serve_relay, sign_token
from sluice.schemas.events import (
    Block,
    BlockDelta,
    BlockStart,
    BlockStop,
    Delta,
    ErrorInfo,
    Event,
    OpenBlock,
    StreamDone,
    StreamError,
    StreamStart,
    encode_event,
)
from sluice.schemas.keys import Keys
from tests.integration.conftest import cleanup

pytestmark = pytest.mark.asyncio

SECRET = "relay-test-secret-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {SECRET}"}


# -- writing streams in the worker's layout -----------------------------------------------------------


class Attempt:
    """Contract events of one attempt, built by hand."""

    def __init__(self, rid: str, attempt: int) -> None:
        self.rid, self.attempt = rid, attempt
        self.events: list[Event] = []
        self._blocks = 0
        self.events.append(
            StreamStart(**self._base(), provider="test", dialect="anthropic", model="m", attempt=attempt)
        )

    def _base(self) -> dict[str, object]:
        seq = len(self.events) + 1
        return {
            "stream_id": f"{self.rid}:{self.attempt}",
            "request_id": self.rid,
            "seq": seq,
            "ts": 1000 + seq,
            "raw": [seq],
        }

    def block(
        self,
        kind: str,
        chunks: Sequence[str],
        *,
        name: str | None = None,
        visibility: str | None = None,
        arguments: dict[str, object] | None = None,
    ) -> Attempt:
        index = self._blocks
        self._blocks += 1
        bid = f"blk_{self.attempt}_{index}"
        opened = OpenBlock(
            id=bid,
            index=index,
            kind=kind,
            name=name,
            call_id=f"call_{index}" if kind == "tool_call" else None,
            visibility=visibility or ("internal" if kind == "reasoning" else None),  # type: ignore[arg-type]
        )
        self.events.append(BlockStart(**self._base(), block=opened))
        ref = Block(id=bid, index=index, kind=kind)  # type: ignore[arg-type]
        dkind = "json_text" if kind == "tool_call" else "text"
        for c in chunks:
            self.events.append(BlockDelta(**self._base(), block=ref, delta=Delta(kind=dkind, text=c)))  # type: ignore[arg-type]
        self.events.append(BlockStop(**self._base(), block=ref, arguments=arguments))
        return self

    def done(self) -> Attempt:
        self.events.append(StreamDone(**self._base(), stop_reason="stop", provider_stop_reason="end_turn", usage=None))
        return self

    def error(self, category: str = "overloaded", status: str = "failed") -> Attempt:
        err = ErrorInfo(category=category, retryable=category == "overloaded", message="try again")  # type: ignore[arg-type]
        self.events.append(StreamError(**self._base(), status=status, error=err))  # type: ignore[arg-type]
        return self


def _tag(ev: Event) -> str:
    return type(ev).__struct_config__.tag  # type: ignore[return-value]


async def publish(
    redis: aioredis.Redis, prefix: str, rid: str, attempt: int, events: Sequence[Event], *, state: str = "running"
) -> None:
    """Append ``events`` of ``attempt`` and update the status as the worker's append script does."""
    rk = Keys(prefix).request(rid)
    async with redis.pipeline(transaction=True) as p:
        for ev in events:
            p.xadd(rk.events, {"type": _tag(ev), "event": encode_event(ev)}, id=f"{attempt}-{ev.seq}")
        p.hset(rk.status, mapping={"request_id": rid, "attempt": attempt, "state": state})
        await p.execute()


async def finalize(redis: aioredis.Redis, prefix: str, rid: str, state: str = "completed") -> None:
    await redis.hset(Keys(prefix).request(rid).status, "state", state)


async def write_request(
    redis: aioredis.Redis, prefix: str, rid: str, attempts: Sequence[Attempt], state: str = "completed"
) -> list[tuple[str, str, bytes]]:
    """A finished request; returns its log as (position, type, contract JSON)."""
    for a in attempts:
        await publish(redis, prefix, rid, a.attempt, a.events)
    await finalize(redis, prefix, rid, state)
    return await stored(redis, prefix, rid)


async def stored(redis: aioredis.Redis, prefix: str, rid: str) -> list[tuple[str, str, bytes]]:
    rows = await redis.xrange(Keys(prefix).request(rid).events)
    return [(i.decode(), f[b"type"].decode(), f[b"event"]) for i, f in rows]


# -- reading the relay ----------------------------------------------------------------------------------


@dataclass
class Received:
    status: int
    events: list[SSEEvent] = field(default_factory=list)
    comments: int = 0
    body: bytes = b""

    @property
    def contract(self) -> list[tuple[str, str, bytes]]:
        """The contract events received, as (id, type, JSON), without the relay's ``end``."""
        return [(e.id, e.event, e.data.encode()) for e in self.events if e.event != "end"]

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1].event == "end"


def config_for(redis_url: str, prefix: str, **kw: object) -> RelayConfig:
    fields: dict[str, object] = {
        "redis_url": redis_url,
        "secrets": (SECRET,),
        "key_prefix": prefix,
        "heartbeat": 5.0,
        "block_ms": 200,
        "retry_ms": 200,
    }
    fields.update(kw)
    return RelayConfig(**fields)  # type: ignore[arg-type]


async def read_sse(
    client: httpx.AsyncClient,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
    limit: int | None = None,
    into: Received | None = None,
) -> Received:
    """Read one SSE response to its end (or ``limit`` events, then hang up); ``into`` fills as events
    arrive, for a test that waits on a reader's progress."""
    decoder = SSEDecoder(max_event_bytes=64 * 1024 * 1024, max_line_bytes=64 * 1024 * 1024)
    async with client.stream("GET", url, headers=headers, params=params) as resp:
        got = into if into is not None else Received(0)
        got.status = resp.status_code
        if resp.status_code != 200:
            got.body = await resp.aread()
            return got
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for chunk in resp.aiter_raw():
            got.events += decoder.feed(chunk)
            if limit is not None and len(got.events) >= limit:
                break
    got.comments = decoder.comments
    return got


async def wait_until(predicate: Callable[[], bool], limit: float = 10.0) -> None:
    """Poll a condition on the relay's statistics (there is nothing to wait on from outside)."""
    with anyio.fail_after(limit):
        while True:
            if predicate():
                return
            await anyio.sleep(0.01)


def events_url(base: str, rid: str) -> str:
    return f"{base}/v1/requests/{rid}/events"


def text_request(rid: str) -> list[Attempt]:
    """Attempt 1 fails before anything visible (the worker retried); attempt 2 completes."""
    return [
        Attempt(rid, 1).error("overloaded"),
        Attempt(rid, 2)
        .block("text", ["Héllo", ", ", "wörld", " 你好", " 👋🏽", "\n", "line\u2028two"])
        .block("tool_call", ['{"city": "Pa', 'ris"}'], name="weather", arguments={"city": "Paris"})
        .done(),
    ]


# -- tests ----------------------------------------------------------------------------------------------


async def test_full_stream_delivered_one_to_one(redis_url, key_prefix, redis_client) -> None:
    log = await write_request(redis_client, key_prefix, "r1", text_request("r1"))
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            got = await read_sse(client, events_url(relay.url, "r1"), headers=AUTH)
        assert got.status == 200
        # every stored event exactly once, in order, across both attempts: id, type and JSON bytes
        assert got.contract == log
        assert [p for p, _, _ in log][:3] == ["1-1", "1-2", "2-1"]
        assert got.ended and msgspec.json.decode(got.events[-1].data) == {"final": log[-1][0]}
        assert got.events[0].retry is not None and 200 <= got.events[0].retry <= 400  # jittered
    finally:
        await cleanup(redis_client, key_prefix)


async def test_resume_after_every_position_gives_exactly_the_tail(redis_url, key_prefix, redis_client) -> None:
    log = await write_request(redis_client, key_prefix, "r2", text_request("r2"))
    try:
        # page=3: catch-up reads span several XRANGE pages
        async with serve_relay(config_for(redis_url, key_prefix, page=3)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "r2")
            positions = ["0-0", *[p for p, _, _ in log]]
            for k, pos in enumerate(positions[:-1]):
                by_header = await read_sse(client, url, headers={**AUTH, "Last-Event-ID": pos})
                by_query = await read_sse(client, url, headers=AUTH, params={"after": pos})
                assert by_header.contract == log[k:], pos
                assert by_query.contract == log[k:], pos
                assert by_header.ended
            # Last-Event-ID wins over ?after= (the browser's reconnect position is the newer one)
            both = await read_sse(client, url, headers={**AUTH, "Last-Event-ID": "2-3"}, params={"after": "0"})
            assert both.contract == log[positions.index("2-3") :]
            # after the final event nothing follows: 204 stops EventSource from reconnecting
            final = await read_sse(client, url, headers={**AUTH, "Last-Event-ID": log[-1][0]})
            assert final.status == 204 and final.events == []
            bad = await read_sse(client, url, headers={**AUTH, "Last-Event-ID": "x-1"})
            assert bad.status == 400
            unknown = await read_sse(client, events_url(relay.url, "nope"), headers=AUTH)
            assert unknown.status == 404
    finally:
        await cleanup(redis_client, key_prefix)


async def test_live_stream_with_joins_and_a_retry(redis_url, key_prefix, redis_client) -> None:
    """Clients joining before, during and after events arrive (and across a retried attempt) all get the
    same complete log, and each live client ends right after the final terminal."""
    a1 = Attempt("r3", 1).error("overloaded")
    a2 = Attempt("r3", 2).block("text", [f"w{i} " for i in range(40)]).done()
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "r3")
            await redis_client.hset(Keys(key_prefix).request("r3").status, mapping={"state": "queued"})
            results: dict[str, Received] = {}

            def reader(name: str, **kw: object) -> None:
                got = results[name] = Received(0)
                tg.start_soon(lambda: read_sse(client, url, headers=AUTH, into=got, **kw))  # type: ignore[arg-type]

            async def until_received(counts: dict[str, int]) -> None:
                await wait_until(lambda: all(len(results[n].contract) == c for n, c in counts.items()))

            async with anyio.create_task_group() as tg:
                reader("early")
                await wait_until(lambda: relay.hub.statistics()["clients_active"] == 1)
                await publish(redis_client, key_prefix, "r3", 1, a1.events)
                # the terminal of attempt 1 is not final: state stays running, the readers stay
                await until_received({"early": len(a1.events)})
                reader("between")
                await until_received({"early": len(a1.events), "between": len(a1.events)})
                sent = len(a1.events)
                for i in range(0, len(a2.events), 7):
                    await publish(redis_client, key_prefix, "r3", 2, a2.events[i : i + 7])
                    sent += len(a2.events[i : i + 7])
                    if i == 14:
                        reader("middle")
                        reader("resumer", params={"after": "2-5"})
                    await until_received({"early": sent, "between": sent})  # each batch arrives live
                resumed = sent - len(a1.events) - 5  # after 2-5
                await until_received({"early": sent, "between": sent, "middle": sent, "resumer": resumed})
                assert not any(r.ended for r in results.values())  # nobody ends before the final state
                await finalize(redis_client, key_prefix, "r3")
            log = await stored(redis_client, key_prefix, "r3")
            for name in ("early", "between", "middle"):
                assert results[name].contract == log, name
                assert results[name].ended
            assert results["resumer"].contract == log[log.index(next(e for e in log if e[0] == "2-5")) + 1 :]
            stats = relay.hub.statistics()
            assert stats["readers_started"] == 1 and stats["feeds_active"] == 0 and stats["clients_active"] == 0
    finally:
        await cleanup(redis_client, key_prefix)


async def test_tokens_401_403_and_no_data(redis_url, key_prefix, redis_client) -> None:
    await write_request(redis_client, key_prefix, "r4", text_request("r4"))
    now = int(time.time())
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "r4")
            missing = await read_sse(client, url)
            assert missing.status == 401 and b"Hello" not in missing.body
            cases = {
                "wrong secret": "relay-test-secret-XXXXXXXXXXXXXXXX",
                "other request": sign_token(SECRET, "r5", now + 60),
                "expired": sign_token(SECRET, "r4", now - 1),
                "other key": sign_token("another-deployment-secret-000000", "r4", now + 60),
                "tampered": sign_token(SECRET, "r4", now + 60)[:-2] + "AA",
                "garbage": "sl1.e30.e30",
            }
            for name, token in cases.items():
                by_header = await read_sse(client, url, headers={"Authorization": f"Bearer {token}"})
                by_query = await read_sse(client, url, params={"token": token})
                assert by_header.status == by_query.status == 403, name
                assert not by_header.events and "wörld".encode() not in by_header.body
            ok = await read_sse(client, url, params={"token": sign_token(SECRET, "r4", now + 60)})
            assert ok.status == 200 and ok.ended
            # the WebSocket endpoint refuses the same way, before accepting
            ws_url = relay.url.replace("http", "ws") + "/v1/requests/r4/ws"
            for token, status in ((None, 401), (cases["expired"], 403)):
                with pytest.raises(websockets.InvalidStatus) as info:
                    suffix = f"?token={token}" if token else ""
                    async with websockets.connect(ws_url + suffix):
                        pass
                assert info.value.response.status_code == status
    finally:
        await cleanup(redis_client, key_prefix)


async def test_internal_reasoning_withheld_unless_granted(redis_url, key_prefix, redis_client) -> None:
    a = (
        Attempt("r6", 1)
        .block("reasoning", ["secret ", "thoughts"])
        .block("text", ["Answer"])
        .block("reasoning", ["shown"], visibility="public")
        .block("text", [" more"])
        .done()
    )
    log = await write_request(redis_client, key_prefix, "r6", [a])
    # block.start/delta/stop of the internal block carry its block id; the public block's start says public
    hidden = {p for p, _, data in log if b"blk_1_0" in data}
    assert len(hidden) == 4
    # in place of the hidden block's start: one notice at its position, naming the block, never its content
    notice = (
        "1-2",
        "block.withheld",
        b'{"type":"block.withheld","stream_id":"r6:1","request_id":"r6","seq":2,'
        b'"block":{"id":"blk_1_0","index":0,"kind":"reasoning"},'
        b'"reason":"internal reasoning: the token does not grant it"}',
    )
    visible = [notice if e[0] == "1-2" else e for e in log if e[0] not in hidden - {"1-2"}]
    now = int(time.time())
    try:
        async with serve_relay(config_for(redis_url, key_prefix, page=2)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "r6")
            plain = await read_sse(client, url, params={"token": sign_token(SECRET, "r6", now + 60)})
            assert plain.contract == visible  # positions of later events unchanged
            assert b"secret" not in b"".join(d for _, _, d in plain.contract)
            granted = sign_token(SECRET, "r6", now + 60, allow_internal=True)
            assert (await read_sse(client, url, params={"token": granted})).contract == log
            assert (await read_sse(client, url, headers=AUTH)).contract == log  # a deployment secret
            # resuming inside the internal block (after its block.start) still withholds its deltas
            resumed = await read_sse(
                client, url, params={"token": sign_token(SECRET, "r6", now + 60)}, headers={"Last-Event-ID": "1-3"}
            )
            assert resumed.contract == [e for e in visible if int(e[0].split("-")[1]) > 3]
            assert "block.withheld" not in [t for _, t, _ in resumed.contract]  # its position was passed
            assert resumed.contract[0][1] == "block.start"
    finally:
        await cleanup(redis_client, key_prefix)


async def test_websocket_endpoint(redis_url, key_prefix, redis_client) -> None:
    log = await write_request(redis_client, key_prefix, "r7", text_request("r7"))
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay:
            base = relay.url.replace("http", "ws") + "/v1/requests/r7/ws"
            for after, expected in (("", log), ("2-4", log[6:])):
                got = []
                async with websockets.connect(f"{base}?after={after}", additional_headers=AUTH) as ws:
                    async for message in ws:
                        got.append(msgspec.json.decode(message))
                    assert ws.close_code == 1000
                assert got[-1] == {"event": "end", "data": {"final": log[-1][0]}}
                assert [(m["id"], m["event"], m["data"]) for m in got[:-1]] == [
                    (p, t, msgspec.json.decode(d)) for p, t, d in expected
                ]
    finally:
        await cleanup(redis_client, key_prefix)


async def test_heartbeats_and_disconnect_release_everything(redis_url, key_prefix, redis_client) -> None:
    await publish(redis_client, key_prefix, "r8", 1, Attempt("r8", 1).events)  # started, then nothing
    try:
        config = config_for(redis_url, key_prefix, heartbeat=0.05)
        async with serve_relay(config) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "r8")
            decoder = SSEDecoder()
            async with client.stream("GET", url, headers=AUTH) as resp:
                async for chunk in resp.aiter_raw():
                    decoder.feed(chunk)
                    if decoder.comments >= 4:  # the opening comment and three heartbeats
                        break
                assert relay.hub.statistics()["clients_active"] == 1
            await wait_until(lambda: not relay.hub.statistics()["feeds_active"], 3)
            stats = relay.hub.statistics()
            assert stats["clients_active"] == 0 and stats["readers_active"] == 0
    finally:
        await cleanup(redis_client, key_prefix)


async def test_shutdown_ends_streams_cleanly_and_a_new_relay_resumes(redis_url, key_prefix, redis_client) -> None:
    a = Attempt("r9", 1).block("text", [f"t{i}" for i in range(10)]).done()
    await publish(redis_client, key_prefix, "r9", 1, a.events[:6])
    try:
        async with httpx.AsyncClient() as client:
            async with serve_relay(config_for(redis_url, key_prefix)) as relay:
                port = relay.port
                url = events_url(relay.url, "r9")
                async with anyio.create_task_group() as tg:
                    first: list[Received] = []

                    reading = Received(0)

                    async def read() -> None:
                        first.append(await read_sse(client, url, headers=AUTH, into=reading))

                    tg.start_soon(read)
                    await wait_until(lambda: len(reading.contract) == 6, 3)  # the six events written so far
                    relay.stop()
            # the stream ended cleanly (no `end`: not final) with every event written so far
            assert first[0].contract == (await stored(redis_client, key_prefix, "r9"))
            assert not first[0].ended
            await publish(redis_client, key_prefix, "r9", 1, a.events[6:])
            await finalize(redis_client, key_prefix, "r9")
            async with serve_relay(config_for(redis_url, key_prefix), port=port):
                rest = await read_sse(client, url, headers={**AUTH, "Last-Event-ID": first[0].events[-1].id})
            assert first[0].contract + rest.contract == await stored(redis_client, key_prefix, "r9")
            assert rest.ended
    finally:
        await cleanup(redis_client, key_prefix)


async def test_live_page_health_and_metrics(redis_url, key_prefix, redis_client) -> None:
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            for path in ("/", "/view/req_x"):
                page = await client.get(relay.url + path)
                assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
                assert 'from "/static/sluice.js"' in page.text
                assert page.headers["referrer-policy"] == "no-referrer"  # the token is in the page's URL
                assert "script-src 'self' 'sha256-" in page.headers["content-security-policy"]
            module = await client.get(relay.url + "/static/sluice.js")
            assert module.status_code == 200 and module.headers["content-type"].startswith("text/javascript")
            assert "export function follow(" in module.text
            # liveness is public and says nothing about traffic; the counters need a deployment secret
            health = await client.get(relay.url + "/healthz")
            assert health.status_code == 200 and health.json() == {"ok": True}
            assert (await client.get(relay.url + "/readyz")).json() == {"ready": True}
            assert (await client.get(relay.url + "/metrics")).status_code == 401
            token = sign_token(SECRET, "req_x", int(time.time()) + 60)
            denied = await client.get(relay.url + "/metrics", headers={"Authorization": f"Bearer {token}"})
            assert denied.status_code == 403
            metrics = await client.get(relay.url + "/metrics", headers=AUTH)
            assert metrics.status_code == 200
            lines = dict(line.rsplit(" ", 1) for line in metrics.text.splitlines() if not line.startswith("#"))
            assert lines["sluice_relay_clients_active"] == "0"
            assert lines["sluice_relay_clients_total"] == "0"
            assert int(lines["sluice_relay_open_fds"]) > 0 and int(lines["sluice_relay_fd_soft_limit"]) > 0
    finally:
        await cleanup(redis_client, key_prefix)


async def test_bad_entries_and_broken_keys_stay_contained(redis_url, key_prefix, redis_client) -> None:
    a = Attempt("rb", 1).block("text", ["x", "y"]).done()
    rk = Keys(key_prefix).request("rb")
    await publish(redis_client, key_prefix, "rb", 1, a.events[:3])
    # another request whose events key is not a stream: its reader fails, nobody else notices
    await redis_client.hset(Keys(key_prefix).request("broken").status, mapping={"state": "running", "attempt": 1})
    await redis_client.set(Keys(key_prefix).request("broken").events, "oops")
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            broken = await read_sse(client, events_url(relay.url, "broken"), headers=AUTH)
            assert broken.status == 500 and msgspec.json.decode(broken.body) == {
                "error": "the relay could not read this request"
            }
            got: list[Received] = []
            async with anyio.create_task_group() as tg:
                reading = Received(0)

                async def live() -> None:
                    got.append(await read_sse(client, events_url(relay.url, "rb"), headers=AUTH, into=reading))

                tg.start_soon(live)
                await wait_until(lambda: len(reading.contract) == 3)  # caught up: the rest arrives live
                # an off-contract entry arrives live: logged and skipped, the reader moves past it
                read_before = relay.hub.statistics()["events_read"]
                await redis_client.xadd(rk.events, {"type": "block.delta", "event": b"{not json"}, id="1-4")
                await wait_until(lambda: relay.hub.statistics()["events_read"] > read_before)
                await publish(redis_client, key_prefix, "rb", 1, [e for e in a.events if e.seq > 4])
                await finalize(redis_client, key_prefix, "rb")
            log = await stored(redis_client, key_prefix, "rb")
            assert got[0].contract == [e for e in log if e[0] != "1-4"] and got[0].ended
            # and the same from the catch-up read of a late client
            late = await read_sse(client, events_url(relay.url, "rb"), headers=AUTH)
            assert late.contract == got[0].contract
            assert relay.hub.statistics()["feeds_active"] == 0
    finally:
        await cleanup(redis_client, key_prefix)
