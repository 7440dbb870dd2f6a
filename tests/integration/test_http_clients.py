"""Both upstream HTTP clients (wire, the default, and httpx) behave the same behind worker/http/client.py."""

from __future__ import annotations

import socket

import anyio
import pytest

from sluice.schemas.events import BlockDelta, StreamDone, StreamError
from sluice.schemas.invariants import ContractChecker
from sluice.worker.config import HTTP_CLIENTS, Route
from tests.integration.conftest import cleanup, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio
CLIENTS = HTTP_CLIENTS
JOB = {"request": {"messages": [{"role": "user", "content": "hi"}]}}


def _valid(events) -> None:  # type: ignore[no-untyped-def]
    checker = ContractChecker()
    for ev in events:
        checker.process(ev)
    assert checker.terminal


@pytest.mark.parametrize("http_client", CLIENTS)
async def test_stream_reset_and_cancel(http_client, fake, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url, http_client=http_client)
    try:
        async with running_worker(config), client_for(config) as client:
            ok = await client.enqueue({**JOB, "route": "gemini", "model": "synthetic;deltas=30;tools=1;chunk=3"})
            reset = await client.enqueue({**JOB, "route": "anthropic", "model": "synthetic;deltas=20;reset=6"})
            long = await client.enqueue({**JOB, "route": "openai-chat", "model": "synthetic;deltas=500;pace_ms=20"})
            async for ev in client.events(long):
                if isinstance(ev, BlockDelta):
                    break
            await client.cancel(long)
            results = {rid: await client.result(rid, timeout=30) for rid in (ok, reset, long)}
            events = {rid: await client.read_attempt(rid, 1) for rid in (ok, reset, long)}
            with anyio.fail_after(10):
                await fake.stats.wait_until(lambda s: any(r.disconnected for r in s.find(request_id=long)))
        for evs in events.values():
            _valid(evs)
        assert results[ok].status == "completed" and isinstance(events[ok][-1], StreamDone)
        assert [b.kind for b in results[ok].blocks] == ["text", "tool_call"]
        assert results[reset].status == "interrupted" and results[reset].error.category == "transport"  # type: ignore[union-attr]
        assert results[reset].blocks[0].text  # what came before the reset is kept
        assert results[long].error.category == "cancelled"  # type: ignore[union-attr]
    finally:
        await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("http_client", CLIENTS)
async def test_unreachable_provider_is_retried_then_interrupted(
    http_client, fake, redis_url, key_prefix, redis_client
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = make_config(redis_url, key_prefix, fake.base_url, http_client=http_client)
    routes = {**config.routes, "dead": Route(dialect="anthropic", base_url=f"http://127.0.0.1:{port}", model="m")}
    config = make_config(redis_url, key_prefix, fake.base_url, http_client=http_client, routes=routes)
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await client.enqueue({**JOB, "route": "dead"})
            result = await client.result(rid, timeout=30)
            attempts = [await client.read_attempt(rid, n) for n in (1, 2, 3)]
        assert result.status == "interrupted" and result.error is not None
        assert result.error.category == "transport" and "could not connect" in result.error.message
        for evs in attempts:  # three attempts, each its own whole stream
            _valid(evs)
            assert isinstance(evs[-1], StreamError)
    finally:
        await cleanup(redis_client, key_prefix)
