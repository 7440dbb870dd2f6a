"""The usage a provider reports beside an error reaches the failed request's stored status and result.

Each dialect's authored transcript fails after visible text with the usage billed on the failing event
(an OpenAI-compatible router's ``error`` object with ``usage``, ``response.failed``, a proxy's Anthropic
``error`` event, a Gemini error chunk with ``usageMetadata``): served whole by an upstream of the tests'
own, the worker stores ``failed`` (no retry: text was visible) with exactly that usage in the status hash,
the terminal event and the client's result.
"""

from __future__ import annotations

import msgspec
import pytest

from sluice.schemas.events import StreamError, Usage, decode_event
from sluice.schemas.keys import Keys
from tests.faults.upstream import Received, Reply, ScriptedUpstream
from tests.helpers import TRANSCRIPTS, wait_all_acked
from tests.integration.conftest import cleanup, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio

CASES = {
    ("openai-chat", "router_error_with_usage"): Usage(
        input_tokens=21,
        output_tokens=6,
        reasoning_tokens=0,
        cache_read_tokens=0,
        total_tokens=27,
        provider_cost="0.0000183",  # the router's own figure (its usage.cost), kept beside ours
    ),
    ("openai-responses", "failed_with_usage"): Usage(
        input_tokens=52, output_tokens=5, reasoning_tokens=0, cache_read_tokens=32, total_tokens=57
    ),
    ("anthropic", "proxy_error_with_usage"): Usage(
        input_tokens=48, output_tokens=7, cache_read_tokens=1024, cache_write_tokens=0
    ),
    ("gemini", "error_with_usage_metadata"): Usage(
        input_tokens=25, output_tokens=13, reasoning_tokens=8, total_tokens=38
    ),
}


@pytest.mark.parametrize(("dialect", "name"), sorted(CASES))
async def test_a_failed_request_keeps_the_usage_reported_with_its_error(
    redis_url, key_prefix, redis_client, dialect, name
):
    body = (TRANSCRIPTS / dialect / f"{name}.sse").read_bytes()
    want = CASES[(dialect, name)]

    def respond(req: Received, n: int) -> Reply:
        return Reply(200, pieces=[body])

    keys = Keys(key_prefix)
    rid = f"usage-{name}"
    async with ScriptedUpstream(respond) as upstream:
        config = make_config(redis_url, key_prefix, upstream.base_url)
        try:
            async with running_worker(config), client_for(config) as client:
                await client.enqueue(
                    {
                        "route": dialect,
                        "model": "m",
                        "request_id": rid,
                        "request": {"messages": [{"role": "user", "content": "hi"}]},
                    }
                )
                result = await client.result(rid, timeout=30)
                await wait_all_acked(redis_client, keys.jobs, config.group)
            assert len(upstream.received) == 1  # visible text: never retried
            assert result.status == "failed" and result.usage == want
            stored = await redis_client.hget(keys.request(rid).status, "usage")
            assert msgspec.json.decode(stored, type=Usage) == want
            entries = await redis_client.xrange(keys.request(rid).events)
            terminal = decode_event(entries[-1][1][b"event"])
            assert isinstance(terminal, StreamError) and terminal.usage == want
        finally:
            await cleanup(redis_client, key_prefix)
