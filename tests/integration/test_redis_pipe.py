"""The worker's direct append connection (worker/redis/pipe.py) against the real Redis, and through the
fault proxy: order, pipelining, per-call errors, an overdue reply, a cut, the database in the URL, and a
flushed script cache."""

from __future__ import annotations

import asyncio

import hiredis
import msgspec
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.schemas.keys import Keys
from sluice.worker.append.log import PendingBatch, RequestLog
from sluice.worker.redis import scripts
from sluice.worker.redis.pipe import RedisPipe
from sluice.worker.redis.retry import Fenced
from sluice.worker.redis.route import SlotRouter
from tests.faults import TcpProxy

pytestmark = pytest.mark.asyncio
WAIT = 10.0


def _pipe(url: str, socket_timeout: float = 5.0) -> tuple[aioredis.Redis, RedisPipe]:
    r = aioredis.Redis.from_url(url)
    return r, RedisPipe(r, socket_timeout=socket_timeout, connect_timeout=5.0)


async def test_calls_made_together_go_in_one_write_and_keep_their_order(redis_url: str, key_prefix: str) -> None:
    r, pipe = _pipe(redis_url)
    key = f"{key_prefix}:list"
    try:
        assert pipe.send_packed_nowait(hiredis.pack_command(("PING",))) is None  # no connection yet: call()
        assert await pipe.call("PING") == b"PONG"
        writes = pipe.writes
        replies = await asyncio.gather(*(pipe.call("RPUSH", key, i) for i in range(200)))
        assert replies == list(range(1, 201))  # each caller got its own reply, in order
        assert pipe.writes == writes + 1
        assert await r.lrange(key, 0, -1) == [str(i).encode() for i in range(200)]
        fut = pipe.send_packed_nowait(hiredis.pack_command(("LLEN", key)))
        assert fut is not None and await fut == 200
    finally:
        pipe.close()
        await r.delete(key)
        await r.aclose()


async def test_an_error_reply_fails_only_its_own_call(redis_url: str, key_prefix: str) -> None:
    r, pipe = _pipe(redis_url)
    key = f"{key_prefix}:s"
    try:
        results = await asyncio.gather(
            pipe.call("SET", key, "v"), pipe.call("LPUSH", key, "x"), pipe.call("GET", key), return_exceptions=True
        )
        assert results[0] == b"OK" and results[2] == b"v"
        assert isinstance(results[1], ResponseError) and "WRONGTYPE" in str(results[1])
        assert await pipe.call("GET", key) == b"v"  # the connection goes on
    finally:
        pipe.close()
        await r.delete(key)
        await r.aclose()


async def test_an_overdue_reply_breaks_the_connection_and_the_next_call_reconnects(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    key = f"{key_prefix}:k"
    async with TcpProxy.for_url(redis_url) as proxy:
        r, pipe = _pipe(proxy.url_for(redis_url), socket_timeout=0.3)
        try:
            assert await pipe.call("SET", key, "v") == b"OK"
            proxy.stall(True)
            with pytest.raises(RedisTimeoutError):
                async with asyncio.timeout(WAIT):
                    await pipe.call("GET", key)
            proxy.stall(False)
            assert await pipe.call("GET", key) == b"v"  # a new connection
            assert proxy.statistics().accepted == 2
        finally:
            pipe.close()
            await r.aclose()
            await redis_client.delete(key)


async def test_a_cut_fails_the_calls_in_flight_and_the_next_call_reconnects(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    key = f"{key_prefix}:k"
    async with TcpProxy.for_url(redis_url) as proxy:
        r, pipe = _pipe(proxy.url_for(redis_url))
        try:
            assert await pipe.call("SET", key, "v") == b"OK"
            proxy.stall(True)
            pending = asyncio.ensure_future(pipe.call("GET", key))
            async with asyncio.timeout(WAIT):  # the GET is in flight: the stalled proxy holds its bytes
                await proxy.wait_until(lambda s: s.held_bytes > 0)
            assert proxy.cut() == 1
            with pytest.raises(RedisConnectionError):
                async with asyncio.timeout(WAIT):
                    await pending
            proxy.stall(False)
            assert await pipe.call("GET", key) == b"v"
        finally:
            pipe.close()
            await r.aclose()
            await redis_client.delete(key)


async def test_the_database_in_the_url_is_selected(redis_url: str, key_prefix: str) -> None:
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
    r, pipe = _pipe(f"{base}/5")
    key = f"{key_prefix}:db"
    try:
        await pipe.call("SET", key, "in-5")
        assert await r.get(key) == b"in-5"  # r is on db 5 too
        other = aioredis.Redis.from_url(f"{base}/0")
        assert await other.get(key) is None
        await other.aclose()
    finally:
        pipe.close()
        await r.delete(key)
        await r.aclose()


def _router(r: aioredis.Redis) -> SlotRouter:
    return SlotRouter.for_client(r, socket_timeout=10.0, connect_timeout=10.0)


async def test_the_routed_connections_reload_a_flushed_script(private_redis_url: str, key_prefix: str) -> None:
    r = aioredis.Redis.from_url(private_redis_url)  # SCRIPT FLUSH: never on a Redis the tests did not start
    router = _router(r)
    assert not router.cluster and len(router.masters()) == 1  # a single instance: a cluster of one master
    st, raw, ev = f"{key_prefix}:st", f"{key_prefix}:raw", f"{key_prefix}:ev"
    append_sha = scripts.sha(scripts.APPEND)
    try:
        await r.hset(st, mapping={"epoch": "1", "attempt": "1"})
        pack = msgspec.msgpack.Encoder().encode
        batch = [[0, "http", "http.response", "{}", "", 0, 1], [1, "sse", "message", "{}", "", 0, 1]]
        events = [[1, "stream.start", "{}", 0]]
        await r.script_flush()
        res, _ = await router.evalsha(
            "append", 0, append_sha, scripts.APPEND, [st, raw, ev], [1, 1, 0, pack(batch), pack(events)]
        )
        assert res == b"ok"
        assert await r.xlen(raw) == 2 and await r.xlen(ev) == 1
        assert (await r.script_exists(append_sha)) == [True]
        # Finalize runs on the control connection (not behind appends); its SHA is computed once per process.
        fin_sha = scripts.sha(scripts.FINALIZE)
        assert scripts.sha(scripts.FINALIZE) is fin_sha
        addr = router.master(0)
        assert addr is not None
        control = router.pipe_at("control", addr)
        assert control is not router.pipe_at("append", addr)
        calls = control.calls

        async def fin(args: list[object]) -> object:
            res, _ = await router.evalsha("control", 0, fin_sha, scripts.FINALIZE, [st, raw, ev], args)
            return res

        assert await fin([2, 60, "state", "completed"]) == b"fenced"  # stale epoch
        assert await fin([1, 60, "state", "completed"]) == b"ok"
        assert control.calls == calls + 4  # the flush above: NOSCRIPT, SCRIPT LOAD, EVALSHA, then one EVALSHA
        assert await r.hget(st, "state") == b"completed" and 0 < await r.ttl(raw) <= 60
        # Counted off the entry ids: attempt 1's last raw index is 1 (two entries), its last seq 1.
        assert await r.hmget(st, ["raw_count", "event_count"]) == [b"2", b"1"]
    finally:
        router.close()
        await r.delete(st, raw, ev)
        await r.aclose()


async def test_the_append_script_is_idempotent_fenced_and_keeps_only_what_it_must(
    redis_url: str, key_prefix: str
) -> None:
    """A batch sent again (its reply was lost) adds nothing; one that overlaps adds only its new entries;
    an older attempt or epoch is fenced; the status hash changes only when an attempt starts or first
    shows a delta; an error other than "already stored" is not swallowed."""
    r = aioredis.Redis.from_url(redis_url)
    st, raw, ev = f"{key_prefix}:st", f"{key_prefix}:raw", f"{key_prefix}:ev"
    script = r.register_script(scripts.APPEND)
    pack = msgspec.msgpack.Encoder().encode

    def rows(attempt_raw: range, seqs: range, delta_from: int = 99) -> tuple[bytes, bytes]:
        raws = [[i, "sse", "message", f"d{i}", "", i * 10, 1] for i in attempt_raw]
        evs = [[s, "block.delta" if s >= delta_from else "stream.start", f"e{s}", int(s >= delta_from)] for s in seqs]
        return pack(raws), pack(evs)

    async def append(epoch: int, attempt: int, packed: tuple[bytes, bytes], maxlen: int = 0) -> object:
        return await script(keys=[st, raw, ev], args=[epoch, attempt, maxlen, *packed])

    try:
        await r.hset(st, mapping={"epoch": "3", "attempt": "0"})
        assert await append(3, 1, rows(range(0, 2), range(1, 2))) == b"ok"
        assert await r.hmget(st, ["attempt", "visible"]) == [b"1", b"0"]
        first = rows(range(2, 4), range(2, 4), delta_from=3)
        assert await append(3, 1, first) == b"ok"
        assert await append(3, 1, first) == b"ok"  # sent again: nothing more
        assert await append(3, 1, rows(range(3, 6), range(3, 6), delta_from=3)) == b"ok"  # overlaps by one
        assert [i for i, _ in await r.xrange(raw)] == [f"1-{i}".encode() for i in range(6)]
        assert [f[b"event"] for _, f in await r.xrange(ev)] == [f"e{s}".encode() for s in range(1, 6)]
        assert await r.hget(st, "visible") == b"1"
        assert await append(2, 1, rows(range(6, 7), range(6, 7))) == b"fenced"  # a stale epoch
        await r.hset(st, "attempt", "2")
        assert await append(3, 1, rows(range(6, 7), range(6, 7))) == b"fenced"  # an attempt already left
        assert await append(3, 3, rows(range(0, 1), range(1, 2))) == b"ok"  # a new attempt starts invisible
        assert await r.hmget(st, ["attempt", "visible"]) == [b"3", b"0"]
        assert (await r.xrevrange(ev, count=1))[0][0] == b"3-1"
        await r.delete(ev)
        await r.set(ev, "not a stream")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await append(3, 3, rows(range(1, 2), range(2, 3)))
    finally:
        await r.delete(st, raw, ev)
        await r.aclose()


async def test_a_sent_append_is_packed_as_the_whole_command_would_be(redis_url: str, key_prefix: str) -> None:
    """The append's fixed head is packed once per attempt; head plus batch must be the very RESP that
    packing the whole command gives, or Redis would read garbage."""
    r = aioredis.Redis.from_url(redis_url)
    router = _router(r)
    rlog = RequestLog(router, Keys(key_prefix).request("r1"))
    try:
        rlog.epoch, attempt = 7, 2
        keys, fixed = [rlog.keys.status, rlog.keys.raw, rlog.keys.events], [7, 2, 0]
        batch = PendingBatch()
        batch.add_raw(0, "sse", "message", "ü" * 70, "", 0, 1)
        raw, events = batch.packed()
        addr = router.master(rlog.slot)
        assert addr is not None and await router.pipe_at("append", addr).call("PING") == b"PONG"
        sent: list[bytes] = []
        pipe = router.pipe_now("append", rlog.slot)
        assert pipe is not None
        pipe.send_packed_nowait = lambda packed: sent.append(packed)  # type: ignore[method-assign,assignment,return-value]
        rlog.send_append(attempt, batch)
        want = hiredis.pack_command(("EVALSHA", scripts.sha(scripts.APPEND), 3, *keys, *fixed, raw, events))
        assert sent == [want]
        rlog.send_append(attempt, batch)  # the head is cached for the attempt: the same bytes again
        assert sent == [want, want]
    finally:
        router.close()
        await r.aclose()


async def test_the_finalize_and_its_status_read_go_in_one_write(redis_url: str, key_prefix: str) -> None:
    """One round trip for both: the read follows the script on the same connection, so it sees its write;
    a stale epoch is still ``Fenced`` (and the read's answer is not used)."""
    r = aioredis.Redis.from_url(redis_url)
    router = _router(r)
    rlog = RequestLog(router, Keys(key_prefix).request("r1"))
    try:
        await r.hset(rlog.keys.status, mapping={"epoch": "3", "attempt": "1", "state": "running"})
        addr = router.master(rlog.slot)
        assert addr is not None
        control = router.pipe_at("control", addr)
        await router.evalsha(  # connected, and the script known, before counting
            "control",
            rlog.slot,
            scripts.sha(scripts.FINALIZE),
            scripts.FINALIZE,
            [rlog.keys.status, rlog.keys.raw, rlog.keys.events],
            [0, 60, "state", "failed"],
        )
        writes, calls = control.writes, control.calls
        rlog.epoch = 3
        vals = await rlog.finalize_and_read(60, {"state": "completed", "stop_reason": "end"}, ["state", "stop_reason"])
        assert vals == [b"completed", b"end"]
        assert (control.writes, control.calls) == (writes + 1, calls + 2)
        rlog.epoch = 2
        with pytest.raises(Fenced):
            await rlog.finalize_and_read(60, {"state": "failed"}, ["state"])
        assert await r.hget(rlog.keys.status, "state") == b"completed"
    finally:
        router.close()
        await r.delete(rlog.keys.status, rlog.keys.raw, rlog.keys.events)
        await r.aclose()
