"""End to end over real sockets and a real Redis: enqueue -> worker -> fake provider -> Redis logs."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis

from sluice.client import InvalidJob
from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import BlockDelta, StreamDone, StreamError, StreamWarning, decode_event
from sluice.schemas.keys import Keys
from tests.helpers import wait_all_acked, wait_all_handled
from tests.integration.conftest import (
    API_KEY,
    DIALECTS,
    cleanup,
    client_for,
    make_config,
    raw_log_as_sse,
    running_worker,
    without_ts,
)

pytestmark = pytest.mark.asyncio


async def _enqueue_text(client, route: str, model: str, request_id: str | None = None) -> str:  # type: ignore[no-untyped-def]
    job: dict[str, object] = {
        "route": route,
        "model": model,
        "request": {"messages": [{"role": "user", "content": "Привет"}]},
    }
    if request_id:
        job["request_id"] = request_id
    return await client.enqueue(job)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_end_to_end_per_dialect(dialect, fake, redis_url, key_prefix, redis_client: aioredis.Redis) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    keys = Keys(key_prefix)
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await _enqueue_text(client, dialect, "synthetic;deltas=12;tools=1;reasoning=3;chunk=7")
            result = await client.result(rid, timeout=30)
            events = [ev async for ev in client.events(rid)]
        assert result.status == "completed", result
        assert isinstance(events[-1], StreamDone)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert any(isinstance(e, BlockDelta) for e in events)
        rk = keys.request(rid)
        raw = await redis_client.xrange(rk.raw)
        # index 0 is the HTTP response record, then every provider event in order
        assert raw[0][0] == b"1-0" and raw[0][1][b"kind"] == b"http"
        assert [e[0] for e in raw[1:]] == [f"1-{i}".encode() for i in range(1, len(raw))]
        # the normalized log equals an offline normalization of exactly the bytes the raw log holds
        info = StreamInfo(
            f"{rid}:1", rid, "", dialect, 1, "synthetic;deltas=12;tools=1;reasoning=3;chunk=7", route=dialect
        )
        _, offline, offline_result = normalize_bytes([raw_log_as_sse(raw)], dialect, info)
        assert [without_ts(e) for e in events] == [without_ts(e) for e in offline]
        assert offline_result == result
        # cross-links both ways: every raw ref names an entry of the raw stream, in the same attempt
        raw_ids = {e[0].decode() for e in raw}
        for ev in events:
            for ref in ev.raw:
                assert f"1-{ref}" in raw_ids
        stored = await redis_client.xrange(rk.events)
        assert [e[0].decode() for e in stored] == [f"1-{e.seq}" for e in events]
        assert [decode_event(e[1][b"event"]) for e in stored] == events
        status = {k.decode(): v.decode() for k, v in (await redis_client.hgetall(rk.status)).items()}
        assert status["state"] == "completed"
        assert status["raw_stream"] == rk.raw and status["events_stream"] == rk.events
        assert int(status["raw_count"]) == len(raw) and int(status["event_count"]) == len(events)
        assert status["result_hash"].startswith("sha256:")
        terminal = await redis_client.xrange(keys.terminal)
        assert [t[1][b"request_id"].decode() for t in terminal] == [rid]
        await wait_all_acked(redis_client, keys.jobs, config.group)
        for key in (rk.raw, rk.events, rk.status):
            ttl = await redis_client.ttl(key)
            assert 0 < ttl <= config.retention_seconds
    finally:
        await cleanup(redis_client, key_prefix)


async def test_duplicate_request_id_runs_once(fake, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with running_worker(config), client_for(config) as client:
            a = await _enqueue_text(client, "anthropic", "synthetic;deltas=3;id=dup", request_id="dup-1")
            b = await _enqueue_text(client, "anthropic", "synthetic;deltas=3;id=dup", request_id="dup-1")
            assert a == b == "dup-1"
            # also a raw second entry on the jobs stream, as a producer without the client might add
            await redis_client.xadd(
                Keys(key_prefix).jobs,
                {
                    "job": msgspec.json.encode(
                        {
                            "route": "anthropic",
                            "request_id": "dup-1",
                            "request": {"messages": [{"role": "user", "content": "x"}]},
                        }
                    )
                },
            )
            result = await client.result("dup-1", timeout=30)
            # both entries delivered and acked: the duplicate was seen and refused, not merely not reached
            await wait_all_handled(redis_client, Keys(key_prefix).jobs, config.group)
            assert len(await redis_client.xrange(Keys(key_prefix).jobs)) == 2
        assert result.status == "completed"
        assert len(await redis_client.xrange(Keys(key_prefix).terminal)) == 1
        served = [r for r in fake.stats.requests if r.request_id == "dup-1"]
        assert len(served) == 1
    finally:
        await cleanup(redis_client, key_prefix)


async def test_resume_and_two_consumer_groups(fake, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await _enqueue_text(client, "openai-chat", "synthetic;deltas=8")
            await client.result(rid, timeout=30)
            events = [ev async for ev in client.events(rid)]
            for k in range(len(events)):
                tail = [ev async for ev in client.events(rid, after=k)]
                assert [e.seq for e in tail] == [e.seq for e in events[k:]]
        stream = Keys(key_prefix).request(rid).events
        for group in ("ui", "persist"):
            await redis_client.xgroup_create(stream, group, id="0")
            got = await redis_client.xreadgroup(group, "c1", {stream: ">"}, count=1000)
            assert [decode_event(f[b"event"]) for _, f in got[0][1]] == events
    finally:
        await cleanup(redis_client, key_prefix)


async def test_api_key_never_stored(fake, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with running_worker(config), client_for(config) as client:
            ok = await _enqueue_text(client, "gemini", "synthetic;deltas=4")
            bad = await _enqueue_text(client, "anthropic", "synthetic;status=401")
            await client.result(ok, timeout=30)
            failed = await client.result(bad, timeout=30)
        assert failed.status == "failed" and failed.error is not None
        assert API_KEY not in failed.error.message
        async for key in redis_client.scan_iter(match=f"{key_prefix}:*"):
            dump = await redis_client.dump(key)
            assert API_KEY.encode() not in dump, key
            assert API_KEY.encode() not in key
    finally:
        await cleanup(redis_client, key_prefix)


async def test_bad_jobs_are_dead_lettered_and_never_sent(fake, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url, max_job_bytes=2000)
    keys = Keys(key_prefix)
    try:
        async with running_worker(config), client_for(config) as client:
            await redis_client.xadd(keys.jobs, {"job": b"{not json"})
            await redis_client.xadd(
                keys.jobs,
                {
                    "job": msgspec.json.encode(
                        {
                            "route": "anthropic",
                            "request_id": "big-1",
                            "request": {"messages": [{"role": "user", "content": "x" * 5000}]},
                        }
                    )
                },
            )
            await redis_client.xadd(
                keys.jobs,
                {
                    "job": msgspec.json.encode(
                        {
                            "route": "nowhere",
                            "request_id": "route-1",
                            "request": {"messages": [{"role": "user", "content": "x"}]},
                        }
                    )
                },
            )
            await redis_client.xadd(
                keys.jobs,
                {
                    "job": msgspec.json.encode(
                        {
                            "route": "anthropic",
                            "request_id": "url-1",
                            "base_url": "http://evil.example",
                            "request": {"messages": [{"role": "user", "content": "x"}]},
                        }
                    )
                },
            )
            await redis_client.xadd(keys.jobs, {"other": b"x"})
            homoglyph = "r\u0435q-1"  # a Cyrillic "е": not the request "req-1", and no request at all
            await redis_client.xadd(
                keys.jobs,
                {
                    "job": msgspec.json.encode(
                        {
                            "route": "anthropic",
                            "request_id": homoglyph,
                            "request": {"messages": [{"role": "user", "content": "x"}]},
                        }
                    )
                },
            )
            for name, value in (("total", -5), ("idle", 0)):  # a timeout that cannot work: refused, not dropped
                job = {
                    "route": "anthropic",
                    "request_id": f"neg-{name}",
                    "timeouts": {name: value},
                    "request": {"messages": [{"role": "user", "content": "x"}]},
                }
                await redis_client.xadd(keys.jobs, {"job": msgspec.json.encode(job)})
                with pytest.raises(InvalidJob) as refused:
                    await client.enqueue({**job, "request_id": f"neg-{name}-client"})
                said = f"invalid job: timeouts.{name} must be above 0 seconds, not {float(value)!r}"
                assert str(refused.value) == said
                r = await client.result(f"neg-{name}", timeout=30)
                assert r.status == "failed" and r.error is not None
                assert (r.error.category, r.error.message) == ("invalid_request", said)
            for rid in ("route-1", "url-1"):
                r = await client.result(rid, timeout=30)
                assert r.status == "failed" and r.error is not None and r.error.category == "invalid_request"
            with anyio.fail_after(10):
                while await redis_client.xlen(keys.dead_letters) < 8:  # noqa: ASYNC110 - polling Redis
                    await anyio.sleep(0.05)
        dlq = await redis_client.xrange(keys.dead_letters)
        reasons = [f[b"reason"].decode() for _, f in dlq]
        assert any("not valid JSON" in r for r in reasons)
        assert any("over the limit" in r for r in reasons)
        assert any("unknown route 'nowhere'" in r for r in reasons)
        assert any("base_url" in r for r in reasons)
        assert any("no 'job' field" in r for r in reasons)
        assert "invalid job: request_id must be 1-128 ASCII letters, digits and - _ . :" in reasons
        assert await client_status(redis_client, keys, homoglyph) == {}
        assert fake.stats.total_requests == 0
        big = await client_status(redis_client, keys, "big-1")
        assert big == {} or big.get("state") == "failed"
        await wait_all_acked(redis_client, keys.jobs, config.group)
    finally:
        await cleanup(redis_client, key_prefix)


async def client_status(redis_client, keys: Keys, rid: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    raw = await redis_client.hgetall(keys.request(rid).status)
    return {k.decode(): v.decode() for k, v in raw.items()}


async def test_retry_before_anything_visible_uses_new_attempt(fake, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await _enqueue_text(client, "anthropic", "synthetic;deltas=3;status=529;times=1;id=r1")
            result = await client.result(rid, timeout=30)
            events = [ev async for ev in client.events(rid)]
        assert result.status == "completed"
        first = [e for e in events if e.stream_id == f"{rid}:1"]
        second = [e for e in events if e.stream_id == f"{rid}:2"]
        assert isinstance(first[-1], StreamError) and first[-1].error.category == "overloaded"
        assert isinstance(second[-1], StreamDone)
        assert [e.seq for e in second] == list(range(1, len(second) + 1))
    finally:
        await cleanup(redis_client, key_prefix)


async def test_reasoning_from_another_dialect_is_left_out_and_said_in_the_stream(
    fake, redis_url, key_prefix, redis_client
) -> None:
    """A conversation moved from Gemini to Anthropic: Gemini's thought signature is never sent to Anthropic,
    and the stream says so in a stream.warning just before its terminal."""
    config = make_config(redis_url, key_prefix, fake.base_url)
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "reasoning", "dialect": "gemini", "text": "thinking", "signature": "c2lnbmF0dXJl"},
                {"type": "text", "text": "hello"},
            ],
        },
        {"role": "user", "content": "and then?"},
    ]
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await client.enqueue(
                {"route": "anthropic", "model": "synthetic;deltas=2", "request": {"messages": messages}}
            )
            result = await client.result(rid, timeout=30)
            events = await client.read_attempt(rid, 1)
        assert result.status == "completed"
        warning = events[-2]
        assert isinstance(warning, StreamWarning) and warning.code == "request_adapted", events[-2]
        assert "gemini" in warning.message
        sent = fake.stats.find(request_id=rid)
        assert len(sent) == 1
    finally:
        await cleanup(redis_client, key_prefix)
