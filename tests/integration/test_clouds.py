"""The clouds through the worker against the fake provider (issue 23): Azure OpenAI's paths and its
``api-key`` header, Vertex AI's Gemini and Claude paths with an OAuth2 token google-auth refreshes against
the fake's own token endpoint (a service-account file whose ``token_uri`` points at it). Every recorded and
authored case gives the same result through the Vertex paths as through the provider's own; a credential
(static, refreshed) never reaches Redis or a log, even echoed; a credential that cannot be obtained fails
the attempt ``authentication``, once, naming the route and the source."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from sluice.harness.fake.google_sa import write_service_account
from sluice.harness.fake.provider import TOKEN_PATH, FakeProvider, serve_fake_provider
from sluice.harness.fake.scenarios import encode_scenario
from sluice.schemas.events import StreamStart
from sluice.schemas.keys import Keys
from sluice.schemas.raw import REDACTION_MARKER
from sluice.worker.config import Config, Route
from tests.faults.invariants import assert_no_secret, check_request
from tests.faults.upstream import Received, Reply, ScriptedUpstream
from tests.integration.conftest import API_KEY, KEY_ENV, ROOT, cleanup, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio

SA_ENV = "SLUICE_TEST_SA_FILE"
VERTEX_GEMINI = (
    "/v1/projects/{project}/locations/{location}/publishers/google/models/{model}:streamGenerateContent?alt=sse"
)
AUTHORED = ROOT / "tests" / "fixtures" / "transcripts"
RECORDED = Path(os.environ.get("SLUICE_RECORDED") or ROOT.parent / "shared" / "recorded")


def service_account_file(path: Path, token_uri: str) -> Path:
    return write_service_account(path, token_uri, project="sluice-test")


@pytest.fixture
def sa_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "sa.json"
    monkeypatch.setenv(SA_ENV, str(path))
    yield path


def cloud_routes(base_url: str) -> dict[str, Route]:
    common: dict[str, Any] = {"base_url": base_url, "model": "synthetic", "send_request_id": True}
    google: dict[str, Any] = {**common, "auth": "google", "credentials_file_env": SA_ENV, "project": "sluice-test"}
    return {
        "azure-v1": Route(
            dialect="openai-chat", path="/openai/v1/chat/completions", auth="api-key", api_key_env=KEY_ENV, **common
        ),
        "azure-deployment": Route(
            dialect="openai-chat",
            path="/openai/deployments/{model}/chat/completions?api-version=2024-10-21",
            auth="api-key",
            api_key_env=KEY_ENV,
            **common,
        ),
        "azure-responses": Route(
            dialect="openai-responses", path="/openai/v1/responses", auth="bearer", api_key_env=KEY_ENV, **common
        ),
        "vertex-gemini": Route(dialect="gemini", path=VERTEX_GEMINI, location="global", **google),
        # as docs/configuration.md's example: auth, project and location say Vertex, no switch
        "vertex-claude": Route(dialect="anthropic", location="us-east5", **google),
    }


def with_clouds(config: Config, base_url: str) -> Config:
    return msgspec.structs.replace(config, routes={**config.routes, **cloud_routes(base_url)})


@pytest_asyncio.fixture
async def vertex_fake(sa_file: Path) -> AsyncIterator[FakeProvider]:
    async with serve_fake_provider(api_key=API_KEY) as server:
        service_account_file(sa_file, server.base_url + TOKEN_PATH)
        yield server


def _job(route: str, model: str | None = None) -> dict[str, Any]:
    job: dict[str, Any] = {"route": route, "request": {"messages": [{"role": "user", "content": "hi"}]}}
    if model:
        job["model"] = model
    return job


def _outcome(result: Any, rid: str = "") -> dict[str, Any]:
    """What a result says, without what names the request (a call id sluice made from the stream id)."""
    out = msgspec.to_builtins(result)
    kept = {k: out.get(k) for k in ("status", "stop_reason", "provider_stop_reason", "usage", "blocks", "error")}
    return json.loads(json.dumps(kept).replace(rid, "RID")) if rid else kept


async def test_every_cloud_route_streams_like_its_dialect(redis_url, key_prefix, redis_client, vertex_fake, caplog):
    caplog.set_level(logging.DEBUG, logger="sluice")
    config = with_clouds(make_config(redis_url, key_prefix, vertex_fake.base_url), vertex_fake.base_url)
    same_dialect = {
        "azure-v1": "openai-chat",
        "azure-deployment": "openai-chat",
        "azure-responses": "openai-responses",
        "vertex-gemini": "gemini",
        "vertex-claude": "anthropic",
    }
    try:
        async with running_worker(config), client_for(config) as client:
            rids = {
                r: await client.enqueue(_job(r, "synthetic;tools=1;reasoning=2")) for r in [*same_dialect, *DIALECTS]
            }
            results = {r: await client.result(rid, timeout=30) for r, rid in rids.items()}
        for route, dialect in same_dialect.items():
            assert results[route].status == "completed", (route, results[route].error)
            assert _outcome(results[route], rids[route]) == _outcome(results[dialect], rids[dialect]), route
            await check_request(redis_client, Keys(key_prefix), rids[route])
        paths = {r.path for r in vertex_fake.stats.requests if r.dialect}
        assert {
            "/openai/v1/chat/completions",
            "/openai/deployments/synthetic%3Btools%3D1%3Breasoning%3D2/chat/completions",
            "/openai/v1/responses",
            "/v1/projects/sluice-test/locations/global/publishers/google/models/"
            "synthetic%3Btools%3D1%3Breasoning%3D2:streamGenerateContent",
            "/v1/projects/sluice-test/locations/us-east5/publishers/anthropic/models/"
            "synthetic%3Btools%3D1%3Breasoning%3D2:streamRawPredict",
        } <= paths
        assert vertex_fake.stats.tokens_issued == 1  # one source, one token, shared by both Vertex routes
        secrets = [API_KEY, *vertex_fake.issued_tokens()]
        for secret in secrets:
            await assert_no_secret(redis_client, key_prefix, secret)
            assert not any(secret in r.getMessage() or secret in str(r.__dict__) for r in caplog.records)
    finally:
        await cleanup(redis_client, key_prefix)


DIALECTS = ("anthropic", "openai-chat", "openai-responses", "gemini")


def _cases(root: Path, dialect: str) -> list[str]:
    return sorted(p.stem for p in (root / dialect).glob("*.sse")) if (root / dialect).is_dir() else []


@pytest.mark.parametrize("corpus", ["authored", "recorded"])
async def test_every_case_behaves_the_same_through_vertex(redis_url, key_prefix, redis_client, sa_file, corpus):
    root = AUTHORED if corpus == "authored" else RECORDED
    cases = {d: _cases(root, d) for d in ("gemini", "anthropic")}
    if not any(cases.values()):
        pytest.skip(f"no {corpus} corpus at {root}")
    async with serve_fake_provider(api_key=API_KEY, examples_dir=root) as fake:
        service_account_file(sa_file, fake.base_url + TOKEN_PATH)
        config = with_clouds(make_config(redis_url, key_prefix, fake.base_url), fake.base_url)
        vertex = {"gemini": "vertex-gemini", "anthropic": "vertex-claude"}
        try:
            async with running_worker(config), client_for(config) as client:
                rids = {
                    (d, name, route): await client.enqueue(_job(route, f"transcript:{name}"))
                    for d, names in cases.items()
                    for name in names
                    for route in (d, vertex[d])
                }
                results = {k: await client.result(rid, timeout=60) for k, rid in rids.items()}
            for d, names in cases.items():
                for name in names:
                    on_vertex = _outcome(results[d, name, vertex[d]], rids[d, name, vertex[d]])
                    assert on_vertex == _outcome(results[d, name, d], rids[d, name, d]), (d, name)
        finally:
            await cleanup(redis_client, key_prefix)


async def test_a_token_is_refreshed_before_it_expires_and_never_stored(
    redis_url, key_prefix, redis_client, vertex_fake
):
    # google-auth refreshes from 3 min 45 s before expiry: a 60 s token is stale at once, so every attempt
    # refreshes (no clock to step, no sleep).
    vertex_fake.token_lifetime = 60
    config = with_clouds(make_config(redis_url, key_prefix, vertex_fake.base_url), vertex_fake.base_url)
    try:
        async with running_worker(config), client_for(config) as client:
            for n in range(3):
                rid = await client.enqueue(_job("vertex-gemini"))
                assert (await client.result(rid, timeout=30)).status == "completed"
                assert vertex_fake.stats.tokens_issued == n + 1
        for token in vertex_fake.issued_tokens():
            await assert_no_secret(redis_client, key_prefix, token)
    finally:
        await cleanup(redis_client, key_prefix)


def _echoing(token_response: bytes) -> Any:
    """A Vertex endpoint that echoes the Bearer token in the answer's text, behind a token endpoint."""

    def respond(req: Received, n: int) -> Reply:
        if req.path == "/token":
            return Reply(200, {"content-type": "application/json"}, [token_response])
        token = req.headers["authorization"].removeprefix("Bearer ")
        chunk = {"candidates": [{"content": {"role": "model", "parts": [{"text": f"token {token}!"}]}}]}
        done = {"candidates": [{"content": {"role": "model", "parts": [{"text": "."}]}, "finishReason": "STOP"}]}
        pieces = [b"data: " + msgspec.json.encode(c) + b"\r\n\r\n" for c in (chunk, done)]
        return Reply(200, {"content-type": "text/event-stream"}, pieces)

    return respond


TOKEN = "ya29.echoed-" + "t" * 40


async def test_an_echoed_token_is_redacted_from_redis_and_logs(redis_url, key_prefix, redis_client, sa_file, caplog):
    caplog.set_level(logging.DEBUG, logger="sluice")
    body = json.dumps({"access_token": TOKEN, "expires_in": 3600, "token_type": "Bearer"}).encode()
    async with ScriptedUpstream(_echoing(body)) as upstream:
        service_account_file(sa_file, upstream.base_url + "/token")
        config = with_clouds(make_config(redis_url, key_prefix, upstream.base_url), upstream.base_url)
        try:
            async with running_worker(config), client_for(config) as client:
                rid = await client.enqueue(_job("vertex-gemini", "gemini-2.5-flash"))
                result = await client.result(rid, timeout=30)
            assert upstream.received[1].headers["authorization"] == f"Bearer {TOKEN}"  # it was sent, and echoed
            assert result.status == "completed" and result.text == f"token {REDACTION_MARKER}!."
            await assert_no_secret(redis_client, key_prefix, TOKEN)
            assert not any(TOKEN in r.getMessage() or TOKEN in str(r.__dict__) for r in caplog.records)
        finally:
            await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("failure", ["unset", "refused", "unreadable"])
async def test_a_credential_that_cannot_be_obtained_fails_authentication_once(
    redis_url, key_prefix, redis_client, sa_file, monkeypatch, failure
):
    async with serve_fake_provider(api_key=API_KEY) as fake:
        if failure == "unset":
            monkeypatch.delenv(SA_ENV)
        elif failure == "refused":  # a token endpoint that is not one: google-auth's refresh fails
            service_account_file(sa_file, fake.base_url + "/_fake/no-such-endpoint")
        else:
            sa_file.write_text("{not json")
        config = with_clouds(make_config(redis_url, key_prefix, fake.base_url), fake.base_url)
        try:
            async with running_worker(config), client_for(config) as client:
                rid = await client.enqueue(_job("vertex-claude"))
                result = await client.result(rid, timeout=30)
                starts = [ev.stream_id async for ev in client.events(rid) if isinstance(ev, StreamStart)]
            assert starts == [f"{rid}:1"]  # one attempt: not retried
            assert result.status == "failed" and result.error is not None
            assert result.error.category == "authentication" and not result.error.retryable
            msg = result.error.message
            assert msg.startswith(
                f"route 'vertex-claude': no credential from the service-account file named by {SA_ENV}: "
            )
            assert "BEGIN PRIVATE KEY" not in msg
            assert fake.stats.provider_requests == 0  # nothing was sent, and no retry
        finally:
            await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("dummy", ["x", "EMPTY", "none"])
async def test_a_dummy_key_never_changes_what_the_model_said(redis_url, key_prefix, redis_client, dummy, monkeypatch):
    """A keyless local server's dummy key: every dialect's stream (and Azure's) completes with the text it
    has with a real key, the dummy word inside it left alone."""
    text = f"none%20of%20EMPTY%20x%20{dummy}"
    results: dict[str, dict[str, Any]] = {}
    for key in (dummy, API_KEY):
        monkeypatch.setenv(KEY_ENV, key)
        async with serve_fake_provider(api_key=key) as fake:
            config = make_config(redis_url, key_prefix, fake.base_url)
            config = msgspec.structs.replace(
                config, routes={**config.routes, "azure-v1": cloud_routes(fake.base_url)["azure-v1"]}
            )
            try:
                async with running_worker(config), client_for(config) as client:
                    for route in (*DIALECTS, "azure-v1"):
                        rid = await client.enqueue(_job(route, encode_scenario(f"synthetic;text={text};tools=1")))
                        result = await client.result(rid, timeout=30)
                        assert result.status == "completed", (key, route, result.error)
                        assert REDACTION_MARKER not in json.dumps(msgspec.to_builtins(result))
                        results.setdefault(route, {})[key] = _outcome(result, rid)
            finally:
                await cleanup(redis_client, key_prefix)
    for route, by_key in results.items():
        assert by_key[dummy] == by_key[API_KEY], route
        assert f"none of EMPTY x {dummy}" in json.dumps(by_key[dummy]), route
