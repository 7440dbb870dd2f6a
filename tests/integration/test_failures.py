"""Issue 5: every fault ends in exactly one correct terminal status; what was received is kept; retries
happen only before anything was visible, each attempt its own stream."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import msgspec
import pytest

from sluice.normalizer.limits import Limits
from sluice.schemas.events import BlockDelta, Event, StreamDone, StreamError
from sluice.schemas.invariants import ContractChecker
from sluice.schemas.keys import Keys
from tests.helpers import wait_all_acked
from tests.integration.conftest import cleanup, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio

FAST = {"connect": 2.0, "first_byte": 1.0, "idle": 1.0, "total": 20.0}


def _attempts(events: Sequence[Event]) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {}
    for ev in events:
        out.setdefault(int(ev.stream_id.rsplit(":", 1)[1]), []).append(ev)
    for evs in out.values():  # every attempt is a whole, valid stream of its own
        checker = ContractChecker()
        for ev in evs:
            checker.process(ev)
        assert checker.terminal
    return out


def _text(events: Sequence[Event]) -> str:
    return "".join(e.delta.text for e in events if isinstance(e, BlockDelta) and e.block.kind == "text")


async def _run(fake, redis_url, key_prefix, redis_client, route: str, model: str, *, timeouts=None, **cfg):  # type: ignore[no-untyped-def]
    config = make_config(redis_url, key_prefix, fake.base_url, **cfg)
    job = {
        "route": route,
        "model": model,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
        "timeouts": timeouts or FAST,
    }
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await client.enqueue(job)
            result = await client.result(rid, timeout=60)
            events = [ev async for ev in client.events(rid)]
            status = await client.status(rid)
        assert len(await redis_client.xrange(Keys(key_prefix).terminal)) == 1
        await wait_all_acked(redis_client, Keys(key_prefix).jobs, config.group)
        return rid, result, _attempts(events), status
    finally:
        await cleanup(redis_client, key_prefix)


def _error(evs: Sequence[Event]) -> tuple[str, str]:
    last = evs[-1]
    assert isinstance(last, StreamError), last
    return last.status, last.error.category


@pytest.mark.parametrize("route", ["anthropic", "openai-chat"])
async def test_reset_mid_stream_is_interrupted_and_keeps_text(fake, redis_url, key_prefix, redis_client, route):
    _, result, attempts, status = await _run(
        fake, redis_url, key_prefix, redis_client, route, "synthetic;deltas=20;reset=6"
    )
    assert list(attempts) == [1]  # text was visible: no automatic retry
    assert _error(attempts[1]) == ("interrupted", "transport")
    assert result.status == "interrupted" and _text(attempts[1]) != ""
    assert status.state == "interrupted"


async def test_reset_before_anything_visible_is_retried(fake, redis_url, key_prefix, redis_client):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "anthropic", "synthetic;deltas=5;reset=1;times=1;id=r0"
    )
    assert list(attempts) == [1, 2]
    assert _error(attempts[1]) == ("interrupted", "transport")
    assert isinstance(attempts[2][-1], StreamDone) and result.status == "completed"


async def test_stall_after_headers_trips_first_byte(fake, redis_url, key_prefix, redis_client):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "openai-chat", "synthetic;deltas=5;stall_headers=1"
    )
    assert list(attempts) == [1]
    assert _error(attempts[1]) == ("interrupted", "timeout")
    assert "first_byte timeout" in result.error.message  # type: ignore[union-attr]


async def test_slow_first_byte_trips_first_byte(fake, redis_url, key_prefix, redis_client):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "gemini", "synthetic;deltas=5;first_byte_ms=3000"
    )
    assert _error(attempts[1]) == ("interrupted", "timeout")
    assert "first_byte timeout" in result.error.message  # type: ignore[union-attr]


async def test_one_byte_at_a_time_still_trips_idle(fake, redis_url, key_prefix, redis_client):
    # Bytes keep arriving, but no content event completes within the idle window.
    timeouts = {"connect": 2.0, "first_byte": 30.0, "idle": 0.8, "total": 60.0}
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "anthropic", "synthetic;deltas=5;byte_ms=15", timeouts=timeouts
    )
    assert _error(attempts[1]) == ("interrupted", "timeout")
    assert "idle timeout" in result.error.message  # type: ignore[union-attr]


async def test_total_deadline(fake, redis_url, key_prefix, redis_client):
    timeouts = {"connect": 2.0, "first_byte": 5.0, "idle": 5.0, "total": 1.0}
    _, result, attempts, _ = await _run(
        fake,
        redis_url,
        key_prefix,
        redis_client,
        "openai-responses",
        "synthetic;deltas=100;pace_ms=50",
        timeouts=timeouts,
    )
    assert _error(attempts[1]) == ("interrupted", "timeout")
    assert "total timeout" in result.error.message and _text(attempts[1])  # type: ignore[union-attr]


@pytest.mark.parametrize(("status", "category"), [(429, "rate_limit"), (500, "server_error"), (529, "overloaded")])
async def test_retryable_http_errors_retry_then_complete(fake, redis_url, key_prefix, redis_client, status, category):
    extra = ";retry_after=1" if status == 429 else ""
    _, result, attempts, status_rec = await _run(
        fake, redis_url, key_prefix, redis_client, "anthropic", f"synthetic;deltas=4;status={status};times=1{extra}"
    )
    assert list(attempts) == [1, 2]
    assert _error(attempts[1]) == ("failed", category)
    assert isinstance(attempts[2][-1], StreamDone)
    assert result.status == "completed" and status_rec.attempt == 2


async def test_persistent_5xx_gives_up_after_max_attempts(fake, redis_url, key_prefix, redis_client):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "openai-chat", "synthetic;deltas=4;status=500"
    )
    assert list(attempts) == [1, 2, 3]
    assert all(_error(a) == ("failed", "server_error") for a in attempts.values())
    assert result.status == "failed"


@pytest.mark.parametrize(
    ("status", "category"), [(400, "invalid_request"), (401, "authentication"), (403, "permission"), (404, "not_found")]
)
async def test_client_errors_never_retry(fake, redis_url, key_prefix, redis_client, status, category):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "gemini", f"synthetic;deltas=4;status={status}"
    )
    assert list(attempts) == [1]
    assert _error(attempts[1]) == ("failed", category)
    assert result.error is not None and not result.error.retryable


async def test_error_event_after_visible_text_is_failed_without_retry(fake, redis_url, key_prefix, redis_client):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "anthropic", "synthetic;deltas=8;error_after=4"
    )
    assert list(attempts) == [1]
    assert _error(attempts[1]) == ("failed", "overloaded")
    assert result.status == "failed" and result.blocks and result.blocks[0].text


async def test_error_event_before_anything_visible_is_retried(fake, redis_url, key_prefix, redis_client):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "anthropic", "synthetic;deltas=3;error_after=1;times=1;id=e1"
    )
    assert list(attempts) == [1, 2]
    assert _error(attempts[1]) == ("failed", "overloaded")
    assert result.status == "completed"


@pytest.mark.parametrize(
    ("model", "category"),
    [
        ("synthetic;deltas=6;malformed_json=4", "protocol"),
        ("synthetic;deltas=6;invalid_utf8=4", "protocol"),
        ("synthetic;deltas=4;tools=1;bad_tool_json=1", "protocol"),
    ],
)
async def test_protocol_faults_fail_and_keep_what_came_before(
    fake, redis_url, key_prefix, redis_client, model, category
):
    _, result, attempts, _ = await _run(fake, redis_url, key_prefix, redis_client, "openai-chat", model)
    assert list(attempts) == [1]
    assert _error(attempts[1]) == ("failed", category)
    assert _text(attempts[1]) != "" and result.status == "failed"


async def test_truncated_tool_json_is_interrupted_without_arguments(fake, redis_url, key_prefix, redis_client):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "anthropic", "synthetic;deltas=3;tools=1;truncate_tool=1"
    )
    assert _error(attempts[1]) == ("interrupted", "transport")
    tool = [b for b in result.blocks if b.kind == "tool_call"]
    assert tool and tool[0].arguments is None and tool[0].arguments_text


async def test_dropped_terminal_is_interrupted(fake, redis_url, key_prefix, redis_client):
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "openai-chat", "synthetic;deltas=6;drop_terminal=1"
    )
    assert _error(attempts[1]) == ("interrupted", "transport")
    assert result.blocks[0].text  # the text looks complete; the status says it is not


async def test_endless_line_hits_the_line_limit(fake, redis_url, key_prefix, redis_client):
    limits = Limits(max_line_bytes=64 * 1024)
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "anthropic", "synthetic;deltas=3;endless_line=1", limits=limits
    )
    assert _error(attempts[1]) == ("failed", "limit_exceeded")
    assert "SSE line" in result.error.message  # type: ignore[union-attr]


async def test_total_bytes_limit(fake, redis_url, key_prefix, redis_client):
    limits = Limits(max_total_bytes=2000)
    _, result, attempts, _ = await _run(
        fake, redis_url, key_prefix, redis_client, "openai-chat", "synthetic;deltas=200", limits=limits
    )
    assert _error(attempts[1]) == ("failed", "limit_exceeded")
    assert _text(attempts[1]) != "" and "response body" in result.error.message  # type: ignore[union-attr]


async def test_cancel_mid_stream_closes_upstream(fake, redis_url, key_prefix, redis_client):
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await client.enqueue(
                {
                    "route": "anthropic",
                    "model": "synthetic;deltas=400;pace_ms=20",
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                }
            )
            async for ev in client.events(rid):
                if isinstance(ev, BlockDelta):
                    break
            assert await client.cancel(rid)
            result = await client.result(rid, timeout=30)
            with anyio.fail_after(10):
                await fake.stats.wait_until(lambda s: any(r.disconnected for r in s.find(request_id=rid)))
        assert result.status == "interrupted" and result.error is not None
        assert result.error.category == "cancelled"
        [served] = fake.stats.find(request_id=rid)
        assert served.disconnected and served.outcome != "completed"
    finally:
        await cleanup(redis_client, key_prefix)


async def test_cancel_before_pickup_is_never_sent(fake, redis_url, key_prefix, redis_client):
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with client_for(config) as client:
            rid = await client.enqueue(
                {
                    "route": "anthropic",
                    "model": "synthetic;deltas=4",
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                }
            )
            assert await client.cancel(rid)
            assert not await client.cancel("no-such-request")
            async with running_worker(config):
                result = await client.result(rid, timeout=30)
        assert result.status == "interrupted" and result.error is not None
        assert result.error.category == "cancelled"
        assert fake.stats.find(request_id=rid) == []
    finally:
        await cleanup(redis_client, key_prefix)


async def test_poison_job_is_dead_lettered_with_a_terminal_status(fake, redis_url, key_prefix, redis_client):
    """A job delivered more than max_deliveries times goes to the dead-letter stream and its request ends."""
    config = make_config(redis_url, key_prefix, fake.base_url, max_deliveries=2, claim_idle_ms=200)
    keys = Keys(key_prefix)
    try:
        async with client_for(config) as client:
            await redis_client.xgroup_create(keys.jobs, config.group, id="0", mkstream=True)
            rid = await client.enqueue(
                {
                    "route": "anthropic",
                    "model": "synthetic;deltas=3",
                    "request_id": "poison-1",
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                }
            )
            # Three workers took it and died (read or claimed, never acked): it was delivered three times.
            got = await redis_client.xreadgroup(config.group, "dead-1", {keys.jobs: ">"})
            entry_id = got[0][1][0][0]
            for name in ("dead-2", "dead-3"):
                await redis_client.xclaim(keys.jobs, config.group, name, 0, [entry_id])
            async with running_worker(config):
                result = await client.result(rid, timeout=30)
        assert result.status == "failed" and result.error is not None
        assert result.error.category == "worker_lost" and "delivered" in result.error.message
        dlq = await redis_client.xrange(keys.dead_letters)
        assert [f[b"request_id"] for _, f in dlq] == [b"poison-1"]
        assert fake.stats.find(request_id=rid) == []
        await wait_all_acked(redis_client, keys.jobs, config.group)
    finally:
        await cleanup(redis_client, key_prefix)


async def test_an_oversized_job_added_by_a_plain_xadd_still_ends_its_request(fake, redis_url, key_prefix, redis_client):
    """What another language's producer does: the status first, then a 2 MiB job with a plain XADD. The
    worker refuses the job before decoding it, yet reads its request id with a bounded parse: the request
    ends failed / limit_exceeded instead of staying queued, and the job is dead-lettered once."""
    config = make_config(redis_url, key_prefix, fake.base_url)
    keys = Keys(key_prefix)
    job = {
        "route": "anthropic",
        "request": {"messages": [{"role": "user", "content": "x" * (2 << 20)}]},
        "request_id": "bigX",
    }
    try:
        await redis_client.hset(keys.request("bigX").status, "state", "queued")
        await redis_client.xadd(keys.jobs, {"job": msgspec.json.encode(job)})
        async with running_worker(config), client_for(config) as client:
            result = await client.result("bigX", timeout=30)
            await wait_all_acked(redis_client, keys.jobs, config.group)
        assert result.status == "failed" and result.error is not None
        assert result.error.category == "limit_exceeded" and "over the limit" in result.error.message
        dlq = await redis_client.xrange(keys.dead_letters)
        assert [f[b"request_id"] for _, f in dlq] == [b"bigX"]
        terminal = await redis_client.xrange(keys.terminal)
        assert [(f[b"request_id"], f[b"status"]) for _, f in terminal] == [(b"bigX", b"failed")]
        assert len(fake.stats.requests) == 0
    finally:
        await cleanup(redis_client, key_prefix)


async def test_capped_streams_state_their_cap_and_a_reader_can_tell_the_gap(fake, redis_url, key_prefix, redis_client):
    config = make_config(redis_url, key_prefix, fake.base_url, stream_maxlen=100)
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await client.enqueue(
                {
                    "route": "openai-chat",
                    "model": "synthetic;deltas=600",
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                }
            )
            result = await client.result(rid, timeout=60)
            status = await client.status(rid)
            kept = await client.read_attempt(rid, 1)
        assert result.status == "completed"
        assert status.maxlen == 100
        assert (status.event_count or 0) > len(kept)  # trimmed: fewer stored than appended
        assert kept[0].seq > 1  # the reader sees the log does not start at seq 1 and the status says why
        assert [e.seq for e in kept] == list(range(kept[0].seq, kept[0].seq + len(kept)))  # the tail is whole
        assert isinstance(kept[-1], StreamDone)
    finally:
        await cleanup(redis_client, key_prefix)
