"""The local fake provider over real loopback sockets: endpoints, auth, transport control, faults, stats."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from sluice.harness.fake.provider import DEFAULT_EXAMPLES, OTLP_SINK, FakeProvider, endpoint_path, serve_fake_provider
from sluice.harness.fake.render import render
from sluice.harness.fake.scenarios import build_script, encode_scenario, parse_scenario
from tests.helpers import briefs, run

pytestmark = pytest.mark.asyncio

KEY = "sk-fake-SECRET-0a1b2c3d4e"
DIALECTS = ("openai-chat", "openai-responses", "anthropic", "gemini")
ROOT = Path(__file__).resolve().parents[2]


def auth(dialect: str, key: str | None = KEY) -> dict[str, str]:
    if dialect == "anthropic":
        return {"anthropic-version": "2023-06-01", **({"x-api-key": key} if key is not None else {})}
    if dialect == "gemini":
        return {"x-goog-api-key": key} if key is not None else {}
    return {"authorization": f"Bearer {key}"} if key is not None else {}


def request(fake: FakeProvider, dialect: str, scenario: str, key: str | None = KEY) -> dict[str, object]:
    """httpx arguments for one streaming request of ``dialect`` asking for ``scenario``."""
    if dialect == "gemini":
        body: dict[str, object] = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        return {"url": fake.url(dialect, encode_scenario(scenario)), "json": body, "headers": auth(dialect, key)}
    body = {"model": scenario, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    return {"url": fake.url(dialect), "json": body, "headers": auth(dialect, key)}


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with serve_fake_provider(api_key=KEY) as server:
        yield server


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


async def fetch(client: httpx.AsyncClient, **kw: object) -> tuple[httpx.Response, bytes]:
    async with client.stream("POST", **kw) as resp:  # type: ignore[arg-type]
        return resp, b"".join([chunk async for chunk in resp.aiter_raw()])


def offline(dialect: str, scenario: str) -> list[str]:
    """What the same scenario normalizes to without any server (``created`` never reaches the events)."""
    return briefs(run(dialect, b"".join(render(dialect, build_script(parse_scenario(scenario)))))[1])


async def raw_exchange(fake: FakeProvider, dialect: str, scenario: str) -> tuple[bytes, list[bytes]]:
    """One request over a bare socket: the response head and the HTTP chunks exactly as framed."""
    kw = request(fake, dialect, scenario)
    url = httpx.URL(kw["url"])  # type: ignore[arg-type]
    payload = json.dumps(kw["json"]).encode()
    headers = {
        **kw["headers"],
        "host": f"{url.host}:{url.port}",
        "content-type": "application/json",  # type: ignore[dict-item]
        "content-length": str(len(payload)),
        "connection": "close",
    }
    target = url.raw_path.decode()
    head = f"POST {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(head.encode() + payload)
    data = await reader.read(-1)  # the server closes after "connection: close"
    writer.close()
    response_head, _, rest = data.partition(b"\r\n\r\n")
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return response_head, chunks
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


# -- endpoints ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_each_endpoint_streams(fake: FakeProvider, client: httpx.AsyncClient, dialect: str) -> None:
    scenario = "synthetic;deltas=4;tools=1;reasoning=2;seed=3"
    kw = request(fake, dialect, scenario)
    kw["headers"] = {**kw["headers"], "x-sluice-request-id": f"rid-{dialect}"}  # type: ignore[dict-item]
    resp, body = await fetch(client, **kw)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["transfer-encoding"] == "chunked"
    assert briefs(run(dialect, body)[1]) == offline(dialect, scenario)
    (rec,) = fake.stats.find(request_id=f"rid-{dialect}")
    assert (rec.dialect, rec.scenario, rec.status, rec.outcome, rec.fault) == (
        dialect,
        scenario,
        200,
        "completed",
        False,
    )
    assert rec.bytes_sent == len(body) and rec.events_sent == len(
        render(dialect, build_script(parse_scenario(scenario)))
    )
    assert rec.received_at <= rec.first_byte_at <= rec.ended_at  # type: ignore[operator]
    assert not rec.disconnected


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_transcripts_are_served_byte_for_byte(
    fake: FakeProvider, client: httpx.AsyncClient, dialect: str
) -> None:
    for name in ("hello", "weather"):
        _, body = await fetch(client, **request(fake, dialect, f"transcript:{name}"))
        assert body == (DEFAULT_EXAMPLES / dialect / f"{name}.sse").read_bytes()
        assert run(dialect, body)[2].status == "completed"


async def test_plain_model_name_is_the_default_stream(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    _, body = await fetch(client, **request(fake, "anthropic", "claude-sonnet-4-5"))
    got = briefs(run("anthropic", body)[1])
    assert got[0] == "start claude-sonnet-4-5" and got[-1] == "done stop end_turn"
    assert sum(b.startswith("delta 0 text") for b in got) == 8


async def test_gemini_model_path_may_be_percent_encoded(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    scenario = "synthetic;deltas=2;seed=5"
    url = fake.base_url + endpoint_path("gemini", "synthetic%3Bdeltas%3D2%3Bseed%3D5")
    resp, body = await fetch(client, url=httpx.URL(url), json={}, headers=auth("gemini"))
    assert resp.status_code == 200 and briefs(run("gemini", body)[1]) == offline("gemini", scenario)
    assert [r.scenario for r in fake.stats.requests] == [scenario]


async def test_gemini_key_may_be_a_query_parameter(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    url = fake.base_url + endpoint_path("gemini", "synthetic") + f"&key={KEY}"
    resp, body = await fetch(client, url=url, json={"contents": []})
    assert resp.status_code == 200 and run("gemini", body)[2].status == "completed"


# -- auth and errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dialect", "shape"),
    [
        (
            "openai-chat",
            {"error": {"message": ..., "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
        ),
        (
            "openai-responses",
            {"error": {"message": ..., "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
        ),
        (
            "anthropic",
            {
                "type": "error",
                "error": {"type": "authentication_error", "message": "invalid x-api-key"},
                "request_id": ...,
            },
        ),
        (
            "gemini",
            {
                "error": {
                    "code": 401,
                    "message": "API key not valid. Please pass a valid API key.",
                    "status": "UNAUTHENTICATED",
                }
            },
        ),
    ],
)
async def test_bad_or_missing_key_is_401_in_the_providers_shape(
    fake: FakeProvider, client: httpx.AsyncClient, dialect: str, shape: dict
) -> None:
    for key in ("wrong-key", None, KEY + "x", KEY[:-1]):
        resp, body = await fetch(client, **request(fake, dialect, "synthetic", key=key))
        assert resp.status_code == 401
        assert resp.headers["content-type"].startswith("application/json")
        assert _matches(json.loads(body), shape)
        assert KEY.encode() not in body and KEY not in str(resp.headers)
    assert fake.stats.unauthorized == 4 and fake.stats.completed == 0


def _matches(value: object, shape: object) -> bool:
    if shape is ...:
        return True
    if isinstance(shape, dict):
        return (
            isinstance(value, dict)
            and value.keys() == shape.keys()
            and all(_matches(value[k], shape[k]) for k in shape)
        )
    return value == shape


async def test_auth_uses_each_providers_own_header(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    # A bearer token is not how Anthropic authenticates, and x-api-key is not how OpenAI does.
    kw = request(fake, "anthropic", "synthetic")
    kw["headers"] = {"anthropic-version": "2023-06-01", "authorization": f"Bearer {KEY}"}
    assert (await fetch(client, **kw))[0].status_code == 401
    kw = request(fake, "openai-chat", "synthetic")
    kw["headers"] = {"x-api-key": KEY}
    assert (await fetch(client, **kw))[0].status_code == 401


async def test_anthropic_requires_a_version_header(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    kw = request(fake, "anthropic", "synthetic")
    kw["headers"] = {"x-api-key": KEY}
    resp, body = await fetch(client, **kw)
    assert resp.status_code == 400
    assert json.loads(body)["error"] == {
        "type": "invalid_request_error",
        "message": "anthropic-version: header is required",
    }


async def test_unknown_paths_are_404(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    for method, path in [
        ("POST", "/v1/completions"),
        ("POST", "/v2/messages"),
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1beta/models/x:generateContent"),
    ]:
        resp = await client.request(method, fake.base_url + path, headers=auth("openai-chat"), json={})
        assert resp.status_code == 404 and "error" in resp.json()
    assert fake.stats.not_found == 4


async def test_bad_requests_are_400_in_the_providers_shape(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    resp = await client.post(
        fake.url("openai-chat"), headers=auth("openai-chat"), json={"model": "synthetic;nope=1", "stream": True}
    )
    assert resp.status_code == 400 and "unknown scenario key" in resp.json()["error"]["message"]
    resp = await client.post(fake.url("anthropic"), headers=auth("anthropic"), json={"model": "synthetic"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = await client.post(fake.url("openai-responses"), headers=auth("openai-responses"), content=b"{not json")
    assert resp.status_code == 400
    url = fake.base_url + "/v1beta/models/synthetic:streamGenerateContent"  # without alt=sse
    resp = await client.post(url, headers=auth("gemini"), json={})
    assert resp.status_code == 400 and resp.json()["error"]["status"] == "INVALID_ARGUMENT"
    resp = await client.post(fake.url("gemini", "transcript:nope"), headers=auth("gemini"), json={})
    assert resp.status_code == 404 and resp.json()["error"]["status"] == "NOT_FOUND"


# -- transport control ------------------------------------------------------------------------------------


async def test_chunk_1_writes_one_byte_per_http_chunk(fake: FakeProvider) -> None:
    scenario = "synthetic;deltas=3;tools=1;chunk=1"
    head, chunks = await raw_exchange(fake, "anthropic", scenario)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert {len(c) for c in chunks} == {1}
    assert briefs(run("anthropic", b"".join(chunks))[1]) == offline("anthropic", "synthetic;deltas=3;tools=1")


async def test_chunk_n_and_whole_events(fake: FakeProvider) -> None:
    events = render("gemini", build_script(parse_scenario("synthetic;deltas=2")))
    _, chunks = await raw_exchange(fake, "gemini", "synthetic;deltas=2")
    assert chunks == events  # one HTTP chunk per event by default
    # chunk=N cuts each event into N-byte writes (an event is never held back waiting for the next).
    _, chunks = await raw_exchange(fake, "gemini", "synthetic;deltas=2;chunk=7")
    assert chunks == [e[i : i + 7] for e in events for i in range(0, len(e), 7)]


async def test_pacing_and_send_stamps(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    scenario = "synthetic;deltas=4;pace_ms=40;stamp=1"
    t0 = time.time()
    _, body = await fetch(client, **request(fake, "openai-responses", scenario))
    elapsed = time.time() - t0
    n = len(render("openai-responses", build_script(parse_scenario(scenario))))
    assert elapsed >= (n - 1) * 0.04 * 0.9
    deltas = [b.split("'")[1] for b in briefs(run("openai-responses", body)[1]) if b.startswith("delta 0 text")]
    stamps = [int(m.group(1)) for d in deltas if (m := re.match(r"⏱(\d{16})\|", d))]
    assert len(stamps) == len(deltas) == 4
    assert all(b - a >= 35_000 for a, b in itertools.pairwise(stamps))  # µs, one pace apart
    assert t0 * 1e6 <= stamps[0] <= time.time() * 1e6
    # The summary events repeat the same stamped text the deltas carried.
    assert "".join(deltas).encode() in body.split(b"response.output_text.done", 1)[1]


async def test_first_byte_delay(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    t0 = time.monotonic()
    async with client.stream("POST", **request(fake, "openai-chat", "synthetic;first_byte_ms=300")) as resp:  # type: ignore[arg-type]
        assert resp.status_code == 200
        assert time.monotonic() - t0 >= 0.28
        await resp.aread()


async def test_one_byte_every_n_ms(fake: FakeProvider) -> None:
    scenario = "synthetic;deltas=1;words=1;byte_ms=3"
    t0 = time.monotonic()
    _, chunks = await raw_exchange(fake, "openai-chat", scenario)
    assert {len(c) for c in chunks} == {1}
    assert time.monotonic() - t0 >= (len(chunks) - 1) * 0.003
    assert run("openai-chat", b"".join(chunks))[2].status == "completed"


async def test_keep_alive_reuses_one_connection(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    for dialect in DIALECTS:
        resp, _ = await fetch(client, **request(fake, dialect, "synthetic;deltas=2"))
        assert resp.status_code == 200
    await client.post(fake.url("anthropic"), headers=auth("anthropic", "bad"), json={})  # errors keep it too
    assert fake.stats.max_open_connections == 1 and fake.stats.completed == 4


# -- faults --------------------------------------------------------------------------------------------


async def test_status_429_with_retry_after_then_success(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    scenario = "synthetic;deltas=2;status=429;retry_after=2;times=1;id=retry-1"
    resp, body = await fetch(client, **request(fake, "anthropic", scenario))
    assert resp.status_code == 429 and resp.headers["retry-after"] == "2"
    assert json.loads(body)["error"]["type"] == "rate_limit_error"
    resp, body = await fetch(client, **request(fake, "anthropic", scenario))
    assert resp.status_code == 200 and run("anthropic", body)[2].status == "completed"
    assert [(r.status, r.fault) for r in fake.stats.find(scenario=scenario)] == [(429, True), (200, False)]


@pytest.mark.parametrize(
    ("dialect", "status", "expect"),
    [
        ("anthropic", 529, ("error", "type", "overloaded_error")),
        ("openai-chat", 500, ("error", "type", "server_error")),
        ("openai-responses", 503, ("error", "code", "server_is_overloaded")),
        ("gemini", 429, ("error", "status", "RESOURCE_EXHAUSTED")),
    ],
)
async def test_error_statuses_always_without_times(
    fake: FakeProvider, client: httpx.AsyncClient, dialect: str, status: int, expect: tuple[str, str, str]
) -> None:
    for _ in range(2):
        resp, body = await fetch(client, **request(fake, dialect, f"synthetic;status={status}"))
        assert resp.status_code == status and "retry-after" not in resp.headers
        outer, key, value = expect
        assert json.loads(body)[outer][key] == value


async def test_times_counts_per_exact_scenario_string(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    codes = []
    for scenario in ["synthetic;status=500;times=2;id=a"] * 3 + ["synthetic;status=500;times=2;id=b"]:
        codes.append((await fetch(client, **request(fake, "openai-chat", scenario)))[0].status_code)
    assert codes == [500, 500, 200, 500]


async def test_reset_mid_stream(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    scenario = "synthetic;deltas=10;reset=4"
    received = bytearray()
    with pytest.raises(httpx.ReadError):
        async with client.stream("POST", **request(fake, "anthropic", scenario)) as resp:  # type: ignore[arg-type]
            async for chunk in resp.aiter_raw():
                received += chunk
    expected = b"".join(render("anthropic", build_script(parse_scenario(scenario)))[:4])
    assert bytes(received) == expected
    (rec,) = fake.stats.find(scenario=scenario)
    assert (rec.outcome, rec.events_sent, rec.disconnected) == ("reset", 4, False)


async def test_reset_before_any_event(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    with pytest.raises(httpx.ReadError):
        await fetch(client, **request(fake, "gemini", "synthetic;reset=0"))


async def test_client_disconnect_is_recorded(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    scenario = "synthetic;deltas=200;pace_ms=20"
    kw = request(fake, "openai-chat", scenario)
    kw["headers"] = {**kw["headers"], "x-sluice-request-id": "gone-1"}  # type: ignore[dict-item]
    async with client.stream("POST", **kw) as resp:  # type: ignore[arg-type]
        async for _ in resp.aiter_raw():
            break  # leaving the block closes the connection mid-stream
    async with asyncio.timeout(5):
        await fake.stats.wait_until(lambda s: s.disconnects == 1)
    (rec,) = fake.stats.find(request_id="gone-1")
    assert rec.outcome == "disconnected" and rec.disconnected
    assert rec.disconnected_at is not None and rec.disconnected_at >= rec.first_byte_at  # type: ignore[operator]
    assert 0 < rec.events_sent < 200
    assert fake.stats.active_streams == 0


async def test_stall_after_headers(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    async with client.stream("POST", **request(fake, "anthropic", "synthetic;stall_headers=1")) as resp:  # type: ignore[arg-type]
        assert resp.status_code == 200
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await resp.aread()
    async with asyncio.timeout(5):
        await fake.stats.wait_until(lambda s: s.disconnects == 1)
    (rec,) = fake.stats.find(scenario="synthetic;stall_headers=1")
    assert (rec.events_sent, rec.bytes_sent, rec.outcome) == (0, 0, "disconnected")


async def test_endless_line(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    received = 0
    async with client.stream("POST", **request(fake, "openai-chat", "synthetic;endless_line=1")) as resp:  # type: ignore[arg-type]
        async for chunk in resp.aiter_raw():
            received += len(chunk)
            if received > 2 << 20:
                break
    async with asyncio.timeout(5):
        await fake.stats.wait_until(lambda s: s.disconnects == 1)
    (rec,) = fake.stats.find(scenario="synthetic;endless_line=1")
    assert rec.events_sent == 1 and rec.bytes_sent > 2 << 20


@pytest.mark.parametrize(
    ("scenario", "last"),
    [
        ("synthetic;deltas=3;error_after=3", "failed overloaded overloaded_error retryable=True"),
        ("synthetic;deltas=3;drop_terminal=1", "interrupted transport None retryable=False"),
        ("synthetic;deltas=3;malformed_json=4", "failed protocol None retryable=False"),
        ("synthetic;deltas=3;invalid_utf8=1", "failed protocol None retryable=False"),
        ("synthetic;deltas=1;tools=1;truncate_tool=1", "interrupted transport None retryable=False"),
    ],
)
async def test_body_faults_over_http(fake: FakeProvider, client: httpx.AsyncClient, scenario: str, last: str) -> None:
    resp, body = await fetch(client, **request(fake, "anthropic", scenario))
    assert resp.status_code == 200
    assert briefs(run("anthropic", body)[1])[-1] == last


async def test_fault_applies_to_transcripts(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    _, body = await fetch(client, **request(fake, "openai-chat", "transcript:hello;drop_terminal=1;pace_ms=1"))
    assert body == (DEFAULT_EXAMPLES / "openai-chat" / "hello.sse").read_bytes().removesuffix(b"data: [DONE]\n\n")


# -- stats ----------------------------------------------------------------------------------------------


async def test_stats_endpoint(fake: FakeProvider, client: httpx.AsyncClient) -> None:
    kw = request(fake, "gemini", "synthetic;deltas=2")
    kw["headers"] = {**kw["headers"], "x-sluice-request-id": "stats-1"}  # type: ignore[dict-item]
    await fetch(client, **kw)
    await fetch(client, **request(fake, "gemini", "synthetic", key="nope"))
    resp = await client.get(fake.base_url + "/_fake/stats")  # no auth needed
    assert resp.status_code == 200 and KEY not in resp.text
    stats = resp.json()
    assert stats["counters"]["total_requests"] == 3 and stats["counters"]["unauthorized"] == 1
    first = stats["requests"][0]
    assert (first["request_id"], first["dialect"], first["scenario"], first["outcome"]) == (
        "stats-1",
        "gemini",
        "synthetic;deltas=2",
        "completed",
    )


async def test_many_concurrent_paced_streams(fake: FakeProvider) -> None:
    scenario = "synthetic;deltas=10;pace_ms=20"
    expected = offline("openai-chat", scenario)
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        bodies = await asyncio.gather(*(fetch(client, **request(fake, "openai-chat", scenario)) for _ in range(200)))
    assert all(briefs(run("openai-chat", body)[1]) == expected for _, body in bodies)
    assert fake.stats.completed == 200 and fake.stats.max_active_streams >= 150


async def test_shutdown_ends_open_streams(client: httpx.AsyncClient) -> None:
    async with serve_fake_provider(api_key=KEY) as server:
        async with client.stream("POST", **request(server, "anthropic", "synthetic;stall_headers=1")) as resp:  # type: ignore[arg-type]
            assert resp.status_code == 200
            await server.aclose()
            with pytest.raises(httpx.HTTPError):
                await resp.aread()
        (rec,) = server.stats.requests
        assert rec.outcome == "aborted"


# -- the command line ------------------------------------------------------------------------------------


async def test_cli_serves_until_sigterm(client: httpx.AsyncClient) -> None:
    env = {**os.environ, "SLUICE_FAKE_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sluice.harness.fake.provider",
        "--port",
        "0",
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            base_url = (await proc.stdout.readline()).decode().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", base_url)
        resp = await client.post(
            base_url + "/v1/messages", headers=auth("anthropic"), json={"model": "transcript:hello", "stream": True}
        )
        assert resp.content == (DEFAULT_EXAMPLES / "anthropic" / "hello.sse").read_bytes()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            out, err = await proc.communicate()
        assert proc.returncode == 0
        assert KEY.encode() not in out + err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cli_needs_a_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_FAKE_API_KEY"}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-m", "sluice.harness.fake.provider", "--port", "0"]
    done = await asyncio.to_thread(subprocess.run, argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "SLUICE_FAKE_API_KEY" in done.stderr


async def test_the_otlp_sink_takes_exports_and_is_no_provider_request(
    fake: FakeProvider, client: httpx.AsyncClient
) -> None:
    for signal_path in ("traces", "metrics"):
        resp = await client.post(
            f"{fake.base_url}{OTLP_SINK}/v1/{signal_path}",
            content=b"\x0a\x00",
            headers={"content-type": "application/x-protobuf"},
        )
        assert resp.status_code == 200 and resp.content == b""
    assert fake.stats.otlp_exports == 2 and not fake.stats.requests and fake.stats.total_requests == 0
    stats = (await client.get(f"{fake.base_url}/_fake/stats")).json()
    assert stats["counters"]["otlp_exports"] == 2
