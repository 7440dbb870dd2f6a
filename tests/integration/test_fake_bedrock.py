"""The fake provider's Bedrock ConverseStream endpoint: event-stream framing for every scenario kind, a
SigV4 signature recomputed (botocore's signer, the fake's test key pair) and a Bedrock API key as Bearer;
requests signed by the worker's own ``aws-sigv4`` credential."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping

import httpx
import pytest
import pytest_asyncio

from sluice.harness.fake.provider import DEFAULT_EXAMPLES, FakeProvider, serve_fake_provider
from sluice.harness.fake.render import inject, render_tagged
from sluice.harness.fake.scenarios import build_script, parse_scenario
from sluice.harness.fake.sigv4 import FAKE_AWS_ACCESS_KEY_ID, FAKE_AWS_SECRET_ACCESS_KEY
from sluice.worker.credentials.aws import AwsChain, SigV4
from sluice.worker.credentials.base import OutgoingRequest
from tests.helpers import briefs, run

KEY = "bedrock-api-key-for-the-fake-0001"
D = "bedrock-converse"
pytestmark = pytest.mark.asyncio
BODY = json.dumps({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}).encode()


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    # The standard chain, resolved from the environment only (no shared files, no metadata endpoint).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_AWS_ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_AWS_SECRET_ACCESS_KEY)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with serve_fake_provider(api_key=KEY) as server:
        yield server


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


async def signed(url: str, body: bytes = BODY, region: str = "us-east-1") -> dict[str, str]:
    headers = {"content-type": "application/json"}
    cred = SigV4("bedrock", region, AwsChain(None))
    added = await cred.apply(OutgoingRequest("POST", url, headers, body))
    assert FAKE_AWS_SECRET_ACCESS_KEY in cred.current_secrets()
    assert added["authorization"].rpartition("Signature=")[2] in cred.current_secrets()
    return {**headers, **added}


async def post(client: httpx.AsyncClient, url: str, headers: Mapping[str, str], body: bytes = BODY) -> httpx.Response:
    async with client.stream("POST", url, content=body, headers=dict(headers)) as resp:
        await resp.aread()
        return resp


def offline(scenario: str) -> list[str]:
    """The scenario rendered and its body faults applied without any server, as the fake plans it."""
    sc = parse_scenario(scenario)
    script = build_script(sc)
    events = inject(
        D,
        script,
        render_tagged(D, script),
        malformed_json=sc.malformed_json,
        truncate_tool=sc.truncate_tool,
        drop_terminal=sc.drop_terminal,
        error_after=sc.error_after,
        error_kind=sc.error,
    )
    return briefs(run(D, b"".join(data for _, data in events))[1])


@pytest.mark.parametrize(
    ("scenario", "last"),
    [
        ("synthetic;deltas=4", "done stop end_turn"),
        ("synthetic;tools=2", "done tool_use tool_use"),
        ("synthetic;reasoning=3", "done stop end_turn"),
        ("synthetic;error_after=3;error=rate_limit", "failed rate_limit throttlingException retryable=True"),
        ("synthetic;error_after=2;error=overloaded", "failed overloaded serviceUnavailableException retryable=True"),
        ("synthetic;error_after=2;error=server_error", "failed server_error internalServerException retryable=True"),
        ("synthetic;tools=1;truncate_tool=1", "interrupted transport None retryable=False"),
        ("synthetic;drop_terminal=1", "interrupted transport None retryable=False"),
        ("synthetic;malformed_json=3", "failed protocol None retryable=False"),
    ],
)
async def test_scenarios_stream_in_event_stream_framing_signed_with_sigv4(
    fake: FakeProvider, client: httpx.AsyncClient, scenario: str, last: str
) -> None:
    url = fake.url(D, scenario)
    resp = await post(client, url, await signed(url))
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/vnd.amazon.eventstream"
    got = briefs(run(D, resp.content)[1])
    assert got == offline(scenario)
    assert got[-1] == last


async def test_malformed_json_is_a_json_error_not_a_crc_error(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    url = fake.url(D, "synthetic;malformed_json=3")
    resp = await post(client, url, await signed(url))
    result = run(D, resp.content)[2]
    assert result.error is not None and "not valid JSON" in result.error.message


async def test_transcripts_are_served_byte_for_byte(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    for name in ("hello", "weather"):
        url = fake.url(D, f"transcript:{name}")
        resp = await post(client, url, await signed(url))
        assert resp.content == (DEFAULT_EXAMPLES / D / f"{name}.eventstream").read_bytes()
        assert run(D, resp.content)[2].status == "completed"


async def test_a_bedrock_api_key_as_bearer(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    url = fake.url(D, "synthetic;deltas=2")
    assert (await post(client, url, {"authorization": f"Bearer {KEY}"})).status_code == 200
    assert (await post(client, url, {"authorization": "Bearer wrong"})).status_code == 401
    assert (await post(client, url, {})).status_code == 401


async def test_a_signature_that_does_not_hold_is_refused(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    url = fake.url(D, "synthetic;deltas=2")
    good = await signed(url)
    resp = await post(client, url, good, body=BODY.replace(b"hi", b"ho"))  # the body changed after signing
    assert resp.status_code == 403 and b"signature we calculated does not match" in resp.content
    other = fake.url(D, "synthetic;deltas=3")
    assert (await post(client, other, good)).status_code == 403  # signed for another path
    resp = await post(client, url, {**good, "x-amz-date": "20200101T000000Z"})
    assert resp.status_code == 403
    wrong_key = good["authorization"].replace(FAKE_AWS_ACCESS_KEY_ID, "AKIAOTHERKEY00000000")
    assert (await post(client, url, {**good, "authorization": wrong_key})).status_code == 403
    assert (await post(client, url, good)).status_code == 200
    assert fake.stats.unauthorized == 4
