"""Bedrock through the worker against the fake provider: a route with ``auth = "aws-sigv4"`` (every request
signed from the standard AWS chain, the fake recomputing the signature) and one with a Bedrock API key as
Bearer. The streams complete like the other dialects' (text, tool call, reasoning), an in-stream exception
fails the request with its category, ``sluice audit`` replays the event-stream frames byte for byte, and no
key, session token or signature reaches Redis or a log."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from sluice.cli.audit import audit_request
from sluice.harness.fake.provider import FakeProvider, serve_fake_provider
from sluice.harness.fake.sigv4 import FAKE_AWS_ACCESS_KEY_ID, FAKE_AWS_SECRET_ACCESS_KEY
from sluice.schemas.keys import Keys
from sluice.worker.config import Config, RetryPolicy, Route
from tests.faults.invariants import assert_no_secret, check_request
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio

SESSION_TOKEN = "FwoGZXIvYXdzEXAMPLE-session-token-for-the-fake-0001"


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_AWS_ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_AWS_SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)  # temporary credentials: x-amz-security-token
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with serve_fake_provider(api_key=API_KEY) as server:
        yield server


def bedrock_config(redis_url: str, prefix: str, base_url: str) -> Config:
    config = make_config(redis_url, prefix, base_url)
    common: dict[str, Any] = {"dialect": "bedrock-converse", "base_url": base_url, "send_request_id": True}
    routes = {
        "bedrock-sigv4": Route(auth="aws-sigv4", region="us-east-1", model="synthetic", **common),
        "bedrock-key": Route(api_key_env=KEY_ENV, model="synthetic", **common),
    }
    no_retry = RetryPolicy(max_attempts=1)
    return msgspec.structs.replace(config, routes={**config.routes, **routes}, retry=no_retry)


def job(route: str, model: str) -> dict[str, Any]:
    return {"route": route, "model": model, "request": {"messages": [{"role": "user", "content": "hi"}]}}


async def test_bedrock_routes_stream_audit_and_keep_every_credential_out(
    redis_url: str, key_prefix: str, redis_client: Any, fake: FakeProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="sluice")
    config = bedrock_config(redis_url, key_prefix, fake.base_url)
    keys = Keys(key_prefix)
    cases = {
        ("bedrock-sigv4", "synthetic;tools=1;reasoning=2"): ("completed", None),
        ("bedrock-key", "synthetic;tools=1;reasoning=2"): ("completed", None),
        ("bedrock-sigv4", "synthetic;error_after=3;error=rate_limit"): ("failed", "rate_limit"),
        ("bedrock-sigv4", "synthetic;error_after=2;error=server_error"): ("failed", "server_error"),
        ("bedrock-sigv4", "synthetic;drop_terminal=1"): ("interrupted", "transport"),
    }
    try:
        async with running_worker(config), client_for(config) as client:
            rids = {case: await client.enqueue(job(*case)) for case in cases}
            results = {case: await client.result(rid, timeout=30) for case, rid in rids.items()}
        for case, (status, category) in cases.items():
            result = results[case]
            assert result.status == status, (case, result.error)
            assert (result.error.category if result.error else None) == category, case
            await check_request(redis_client, keys, rids[case])
            audit = await audit_request(redis_client, keys, rids[case])
            assert audit.ok, (case, audit.problems, [(a.problem, a.divergence) for a in audit.attempts])
        sigv4 = results[("bedrock-sigv4", "synthetic;tools=1;reasoning=2")]
        assert [b.kind for b in sigv4.blocks] == ["reasoning", "text", "tool_call"]
        assert sigv4.stop_reason == "tool_use" and sigv4.blocks[2].arguments is not None
        keyed = results[("bedrock-key", "synthetic;tools=1;reasoning=2")]
        assert [b.text for b in keyed.blocks] == [b.text for b in sigv4.blocks]
        assert fake.stats.unauthorized == 0
        assert {r.path for r in fake.stats.requests if r.dialect} >= {
            "/model/synthetic%3Btools%3D1%3Breasoning%3D2/converse-stream"
        }
        # Raw rows of kind "frame" hold each message's exact bytes.
        raw = await redis_client.xrange(keys.request(rids[("bedrock-key", "synthetic;tools=1;reasoning=2")]).raw)
        frames = [f for _, f in raw if f.get(b"kind") == b"frame"]
        assert frames and all(f[b"frame"][:4] == len(f[b"frame"]).to_bytes(4, "big") for f in frames)
        for secret in (FAKE_AWS_SECRET_ACCESS_KEY, SESSION_TOKEN, FAKE_AWS_ACCESS_KEY_ID, API_KEY, "AWS4-HMAC-SHA256"):
            await assert_no_secret(redis_client, key_prefix, secret)
            assert not any(secret in r.getMessage() or secret in str(r.__dict__) for r in caplog.records), secret
        signature = re.compile(rb"Signature=[0-9a-f]{64}")
        async for key in redis_client.scan_iter(match=f"{key_prefix}:*"):
            if await redis_client.type(key) == b"stream":
                for _, fields in await redis_client.xrange(key):
                    assert not any(signature.search(v) for v in fields.values()), key
    finally:
        await cleanup(redis_client, key_prefix)
