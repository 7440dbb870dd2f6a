"""The fake provider's own capacity over real loopback sockets: the cap under many concurrent clients
(streams held open by a gate the test releases), the RPM window's exact retry-after in each dialect's
shape, the counters, and the command-line flags."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import pytest_asyncio

from sluice.harness.fake.provider import FakeStats, ProviderLimits, serve_fake_provider
from tests.helpers import briefs, run
from tests.integration.test_fake_provider import KEY, ROOT, auth, fetch, offline, request

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=30, limits=limits) as c:
        yield c


async def until(stats: FakeStats, predicate: Callable[[FakeStats], bool]) -> None:
    async with asyncio.timeout(20):
        await stats.wait_until(predicate)


async def test_the_cap_holds_under_many_concurrent_clients(client: httpx.AsyncClient) -> None:
    scenario = "synthetic;deltas=3;hold=cap"
    async with serve_fake_provider(api_key=KEY, limits=ProviderLimits(max_concurrency=5)) as fake:
        tasks = [asyncio.create_task(fetch(client, **request(fake, "openai-chat", scenario))) for _ in range(20)]
        st = fake.stats
        await until(st, lambda s: s.limiter.in_flight == 5 and s.limiter.refused_concurrency == 15)
        async with asyncio.timeout(20):  # the refusals are answered at once; the admitted wait at the gate
            while sum(t.done() for t in tasks) < 15:
                await asyncio.wait([t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)
        refused = [t for t in tasks if t.done()]
        assert len(refused) == 15 and st.limiter.in_flight == 5
        for t in refused:
            resp, body = t.result()
            assert (resp.status_code, resp.headers["retry-after"], resp.headers["retry-after-ms"]) == (429, "1", "1000")
            assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        fake.release("cap")
        done = await asyncio.gather(*tasks)
        ok = [body for resp, body in done if resp.status_code == 200]
        assert len(ok) == 5 and all(briefs(run("openai-chat", b)[1]) == offline("openai-chat", scenario) for b in ok)
        assert {
            k: st.counters[k]
            for k in (
                "provider_requests",
                "responses_429",
                "admitted",
                "refused_concurrency",
                "refused_rate",
                "peak_in_flight",
                "in_flight",
                "completed",
            )
        } == {
            "provider_requests": 20,
            "responses_429": 15,
            "admitted": 5,
            "refused_concurrency": 15,
            "refused_rate": 0,
            "peak_in_flight": 5,
            "in_flight": 0,
            "completed": 5,
        }
        assert sorted(r.limited or "" for r in st.requests) == [""] * 5 + ["concurrency"] * 15


async def test_clients_retrying_at_once_never_exceed_the_cap(client: httpx.AsyncClient) -> None:
    limits = ProviderLimits(max_concurrency=4, concurrency_retry_after=0)
    async with serve_fake_provider(api_key=KEY, limits=limits) as fake:

        async def one(i: int) -> int:
            tries = 0
            while True:  # retry-after is 0: come straight back, the harshest client there is
                tries += 1
                resp, body = await fetch(client, **request(fake, "anthropic", f"synthetic;deltas=4;pace_ms=5;id={i}"))
                if resp.status_code == 200:
                    assert run("anthropic", body)[2].status == "completed"
                    return tries
                assert (resp.status_code, resp.headers["retry-after"]) == (429, "0")

        tries = await asyncio.gather(*(one(i) for i in range(30)))
        c = fake.stats.counters
        assert c["peak_in_flight"] <= 4 and c["max_active_streams"] <= 4 and c["admitted"] == c["completed"] == 30
        assert c["provider_requests"] == sum(tries) == 30 + c["responses_429"] == 30 + c["refused_concurrency"]


@pytest.mark.parametrize("dialect", ["openai-chat", "openai-responses", "anthropic", "gemini"])
async def test_the_window_refuses_the_rpm_plus_first_with_the_exact_retry_after(
    client: httpx.AsyncClient, dialect: str
) -> None:
    now = [100.0]
    async with serve_fake_provider(
        api_key=KEY, limits=ProviderLimits(requests_per_minute=3), clock=lambda: now[0]
    ) as fake:
        for t in (100.0, 101.0, 102.5):
            now[0] = t
            resp, body = await fetch(client, **request(fake, dialect, "synthetic;deltas=1"))
            assert resp.status_code == 200 and run(dialect, body)[2].status == "completed"
        now[0] = 112.4  # the oldest admission (100.0) leaves the window at 160.0: 47.6 s from now
        resp, body = await fetch(client, **request(fake, dialect, "synthetic;deltas=1"))
        assert (resp.status_code, resp.headers["retry-after"]) == (429, "48")
        error = json.loads(body)["error"] if dialect != "anthropic" else json.loads(body)
        if dialect.startswith("openai"):
            assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
            assert "(RPM): Limit 3, Used 3, Requested 1. Please try again in 47.6s." in error["message"]
            assert {
                k: resp.headers[k]
                for k in (
                    "retry-after-ms",
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                )
            } == {
                "retry-after-ms": "47600",
                "x-ratelimit-limit-requests": "3",
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": "47.6s",
            }
        elif dialect == "anthropic":
            assert (error["type"], error["error"]["type"]) == ("error", "rate_limit_error")
            assert "3 requests per minute" in error["error"]["message"]
            assert resp.headers["anthropic-ratelimit-requests-limit"] == "3"
            assert resp.headers["anthropic-ratelimit-requests-remaining"] == "0"
            assert resp.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
        else:
            assert (error["code"], error["status"]) == (429, "RESOURCE_EXHAUSTED")
            assert error["details"] == [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [
                        {
                            "quotaMetric": "generativelanguage.googleapis.com/generate_content_requests",
                            "quotaId": "GenerateRequestsPerMinutePerProjectPerModel",
                        }
                    ],
                },
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "47.6s"},
            ]
        now[0] = 159.999
        assert (await fetch(client, **request(fake, dialect, "synthetic;deltas=1")))[0].status_code == 429
        now[0] = 160.0
        assert (await fetch(client, **request(fake, dialect, "synthetic;deltas=1")))[0].status_code == 200
        c = fake.stats.counters
        assert (c["provider_requests"], c["admitted"], c["refused_rate"], c["responses_429"]) == (6, 4, 2, 2)


@pytest.mark.parametrize(
    ("dialect", "status", "path", "value"),
    [
        ("anthropic", 529, ("error", "type"), "overloaded_error"),
        ("gemini", 503, ("error", "status"), "UNAVAILABLE"),
        ("openai-chat", 503, ("error", "code"), "server_is_overloaded"),
    ],
)
async def test_past_the_cap_the_answer_can_be_overloaded(
    client: httpx.AsyncClient, dialect: str, status: int, path: tuple[str, str], value: str
) -> None:
    limits = ProviderLimits(max_concurrency=1, concurrency_status=status, concurrency_retry_after=3)
    async with serve_fake_provider(api_key=KEY, limits=limits) as fake:
        held = asyncio.create_task(fetch(client, **request(fake, dialect, "synthetic;deltas=1;hold=g")))
        await until(fake.stats, lambda s: s.limiter.in_flight == 1)
        resp, body = await fetch(client, **request(fake, dialect, "synthetic;deltas=1"))
        assert (resp.status_code, resp.headers["retry-after"]) == (status, "3")
        assert json.loads(body)[path[0]][path[1]] == value
        fake.release("g")
        assert (await held)[0].status_code == 200
        assert fake.stats.responses_429 == 0 and fake.stats.limiter.refused_concurrency == 1


async def test_a_client_leaving_while_held_frees_its_place(client: httpx.AsyncClient) -> None:
    async with serve_fake_provider(api_key=KEY, limits=ProviderLimits(max_concurrency=1)) as fake:
        held = asyncio.create_task(fetch(client, **request(fake, "gemini", "synthetic;hold=never")))
        await until(fake.stats, lambda s: s.limiter.in_flight == 1)
        held.cancel()  # the response head never comes; cancelling closes the connection
        with pytest.raises(asyncio.CancelledError):
            await held
        await until(fake.stats, lambda s: s.limiter.in_flight == 0)
        assert (await fetch(client, **request(fake, "gemini", "synthetic;deltas=1")))[0].status_code == 200
        assert [r.outcome for r in fake.stats.requests] == ["disconnected", "completed"]


async def test_gates_open_over_http_and_stay_open(client: httpx.AsyncClient) -> None:
    async with serve_fake_provider(api_key=KEY) as fake:
        held = asyncio.create_task(fetch(client, **request(fake, "openai-responses", "synthetic;deltas=1;hold=g.1")))
        await until(fake.stats, lambda s: s.limiter.in_flight == 1)
        assert (await client.post(fake.base_url + "/_fake/release/g.1")).status_code == 200
        assert (await held)[0].status_code == 200
        resp, _ = await fetch(client, **request(fake, "openai-responses", "synthetic;deltas=1;hold=g.1"))
        assert resp.status_code == 200  # an open gate does not hold later requests
        assert (await client.post(fake.base_url + "/_fake/release/-x")).status_code == 400
        resp, body = await fetch(client, **request(fake, "openai-chat", "synthetic;hold=a/b"))
        assert resp.status_code == 400 and b"hold=" in body


async def test_cli_flags_set_the_limits_and_stats_report_them(client: httpx.AsyncClient) -> None:
    env = {**os.environ, "SLUICE_FAKE_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    argv = ["-m", "sluice.harness.fake.provider", "--port", "0", "--max-concurrency", "2", "--requests-per-minute", "2"]
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv, env=env, cwd=ROOT, stdout=pipe, stderr=pipe)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            base_url = (await proc.stdout.readline()).decode().strip()
        body = {"model": "synthetic;deltas=1", "stream": True}
        codes = [(await client.post(base_url + "/v1/messages", headers=auth("anthropic"), json=body)) for _ in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429]
        assert 59 <= int(codes[2].headers["retry-after"]) <= 60
        stats = (await client.get(base_url + "/_fake/stats?requests=0")).json()
        assert "requests" not in stats
        assert stats["limits"] == {
            "max_concurrency": 2,
            "requests_per_minute": 2,
            "window_s": 60.0,
            "concurrency_status": 429,
        }
        c = stats["counters"]
        assert (c["provider_requests"], c["admitted"], c["refused_rate"], c["responses_429"], c["peak_in_flight"]) == (
            3,
            2,
            1,
            1,
            1,
        )
    finally:
        proc.terminate()
        await proc.wait()


async def test_cli_refuses_a_limit_that_cannot_be_meant() -> None:
    env = {**os.environ, "SLUICE_FAKE_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "sluice.harness.fake.provider", "--port", "0", "--max-concurrency", "0"]
    done = await asyncio.to_thread(subprocess.run, argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "sluice fake-provider: max_concurrency=0: expected at least 1 (omit it for no limit)"
    ]
