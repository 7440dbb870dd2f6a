"""The live page in a real browser: headless Chromium (Debian's package) driven by Playwright.

A real request runs through the fake provider and the worker; the page trades its URL's token for a
session cookie, renders the request from the relay, the relay is restarted mid-stream, and the page must
resume after the last position it rendered to exactly the final result. Then each state the page can be
in, from hand-written logs: completed with a tool call (name as sent, arguments once, stop reason and
usage), reasoning withheld, a failure that cut a block, refusals that say why (401, 403, 404, 500), and
a Redis outage it waits out. Screenshots of each state go to the test's artifacts folder.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis.asyncio as aioredis

from sluice.harness.fake.provider import serve_fake_provider
from sluice.relay import serve_relay, sign_token
from sluice.schemas.events import StreamDone, Usage
from tests.browser.support import artifacts, browser, wait_for
from tests.faults.tcp_proxy import TcpProxy
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config, running_worker
from tests.integration.test_relay import SECRET, Attempt, config_for, publish, write_request

pytestmark = pytest.mark.asyncio

# Text, a tool call and internal reasoning, paced so the stream lasts about two seconds.
SCENARIO = "synthetic;deltas=120;words=1-2;tools=1;reasoning=4;pace_ms=15"
JOB = {"route": "anthropic", "model": SCENARIO, "request": {"messages": [{"role": "user", "content": "hi"}]}}
RENDERED = (
    "els => els.map(e => [Number(e.dataset.index), e.dataset.kind, e.dataset.state,"
    " e.querySelector('pre.content').textContent])"
)


async def test_page_renders_and_resumes_after_a_relay_restart(redis_url, key_prefix, monkeypatch) -> None:
    shots = artifacts("live-page-restart")
    monkeypatch.setenv(KEY_ENV, API_KEY)
    redis_client = aioredis.Redis.from_url(redis_url)
    try:
        async with serve_fake_provider(api_key=API_KEY) as fake:
            config = make_config(redis_url, key_prefix, fake.base_url)
            relay_config = config_for(redis_url, key_prefix)
            async with running_worker(config), client_for(config) as sluice, browser() as chromium:
                page = await chromium.new_page()
                async with serve_relay(relay_config) as first:
                    port = first.port
                    rid = await sluice.enqueue(JOB)
                    # a short-lived token: the page trades it for a session cookie at once
                    token = sign_token(SECRET, rid, int(time.time()) + 120)
                    await page.goto(f"{first.url}/view/{rid}?token={token}")
                    await wait_for(page, "window.sluiceView && window.sluiceView.positions.length >= 15")
                    assert (await sluice.status(rid)).state == "running"  # still streaming
                    await page.screenshot(path=str(shots / "1-streaming.png"))
                # the first relay is gone: the page notices and keeps reconnecting
                await wait_for(page, "window.sluiceView.reconnects >= 1", 5_000)
                await page.screenshot(path=str(shots / "2-reconnecting.png"))
                async with serve_relay(relay_config, port=port) as second:
                    await wait_for(page, "window.sluiceView.ended === true")
                    stats = second.hub.statistics()
                result = await sluice.result(rid, timeout=10)
                view = await page.evaluate("() => window.sluiceView")
                rendered = await page.eval_on_selector_all("section.block", RENDERED)
                status = await page.text_content("#status")
                summary = await page.text_content("#summary")
                url = page.url
                cookies = await page.context.cookies()
                await page.screenshot(path=str(shots / "3-completed.png"), full_page=True)
        assert result.status == "completed" and status == "completed"
        # the token left the address bar; the session cookie is HttpOnly and scoped to this request
        assert "token=" not in url and view["session"]["request_id"] == rid
        (cookie,) = cookies
        assert cookie["name"] == "sluice_session" and cookie["httpOnly"] and cookie["path"] == f"/v1/requests/{rid}/"
        # the second relay was reached with the position the page had
        assert stats["clients_resumed"] >= 1
        # every position exactly once, in order: nothing replayed twice, nothing skipped
        positions = [tuple(map(int, p.split("-"))) for p in view["positions"]]
        assert positions == sorted(set(positions))
        # the rendered blocks are exactly the result's; internal reasoning is a withheld placeholder
        assert any(b.kind == "reasoning" for b in result.blocks)
        expected = [
            [
                b.index,
                b.kind,
                "withheld" if b.kind == "reasoning" else "complete",
                b.arguments if b.kind == "tool_call" else b.text,
            ]
            for b in result.blocks
        ]
        got = [[i, k, s, json.loads(t) if k == "tool_call" else t] for i, k, s, t in rendered]
        assert [g if g[1] != "reasoning" else [*g[:3], b[3]] for g, b in zip(got, expected, strict=True)] == expected
        assert sum(len(t) for _, k, _, t in got if k == "text") > 200
        assert result.stop_reason is not None and f"stop: {result.stop_reason}" in (summary or "")
    finally:
        await cleanup(redis_client, key_prefix)
        await redis_client.aclose()


def _completed(rid: str) -> Attempt:
    a = Attempt(rid, 1).block("reasoning", ["private ", "thoughts"]).block("text", ["Checking the weather."])
    a.block("tool_call", ['{"city": "Alma', 'ty"}'], name="get_weather", arguments={"city": "Almaty"})
    usage = Usage(input_tokens=42, output_tokens=57)
    a.events.append(StreamDone(**a._base(), stop_reason="tool_use", provider_stop_reason="tool_use", usage=usage))
    return a


async def test_page_states(redis_url, key_prefix) -> None:
    shots = artifacts("live-page-states")
    redis_client = aioredis.Redis.from_url(redis_url)
    now = int(time.time())
    await write_request(redis_client, key_prefix, "done", [_completed("done")])
    cut = Attempt("cut", 1).block("text", ["Half an ans"])
    cut.events.pop()  # no block.stop: the failure cut the block
    cut.error("overloaded")
    await write_request(redis_client, key_prefix, "cut", [cut], state="failed")
    broken = Attempt("broken", 1).block("text", ["x"]).done()
    await publish(redis_client, key_prefix, "broken", 1, broken.events)
    proxy = TcpProxy.for_url(redis_url)
    try:
        async with browser() as chromium, serve_relay(config_for(redis_url, key_prefix)) as relay:
            page = await chromium.new_page()

            async def show(rid: str, token: str | None, done: str, shot: str) -> dict[str, object]:
                query = f"?token={token}" if token else ""
                await page.goto(f"{relay.url}/view/{rid}{query}")
                await wait_for(page, done)
                await page.screenshot(path=str(shots / shot), full_page=True)
                return await page.evaluate("() => window.sluiceView")  # type: ignore[no-any-return]

            await show("done", sign_token(SECRET, "done", now + 60), "window.sluiceView.ended", "completed.png")
            rendered = await page.eval_on_selector_all("section.block", RENDERED)
            assert [r[:3] for r in rendered] == [
                [0, "reasoning", "withheld"],
                [1, "text", "complete"],
                [2, "tool_call", "complete"],
            ]
            assert "withheld" in rendered[0][3] and "private" not in await page.text_content("body")
            # the tool's name exactly as the model sent it (no CSS upper-casing), its arguments once
            name = await page.eval_on_selector(
                "section[data-kind=tool_call] .name", "e => [e.innerText, getComputedStyle(e).textTransform]"
            )
            assert name == ["get_weather", "none"]
            body = await page.inner_text("body")
            assert body.count("Almaty") == 1 and json.loads(rendered[2][3]) == {"city": "Almaty"}
            assert await page.text_content("#summary") == "stop: tool_use · usage 42 in / 57 out"

            view = await show("cut", sign_token(SECRET, "cut", now + 60), "window.sluiceView.ended", "failed.png")
            assert view["state"] == "failed"
            assert await page.eval_on_selector_all("section.block", RENDERED) == [
                [0, "text", "incomplete", "Half an ans"]
            ]
            assert await page.text_content("#notice") == "failed: overloaded: try again"

            # refusals say why: each HTTP status reads differently
            reasons = {}
            cases = {  # a request this browser has no session cookie for
                401: ("nope", None),
                403: ("nope", sign_token(SECRET, "nope", now - 5)),
                404: ("nope", sign_token(SECRET, "nope", now + 60)),
            }
            for status, (rid, token) in cases.items():
                view = await show(rid, token, "window.sluiceView.closed !== null", f"closed-{status}.png")
                assert view["closed"]["status"] == status  # type: ignore[index]
                reasons[status] = await page.text_content("#notice")
            # a 500: a request whose key Redis refuses to read as a stream
            await redis_client.delete(f"{key_prefix}:{{req:broken}}:events")
            await redis_client.set(f"{key_prefix}:{{req:broken}}:events", "not a stream")
            view = await show(
                "broken", sign_token(SECRET, "broken", now + 60), "window.sluiceView.closed !== null", "closed-500.png"
            )
            assert view["closed"]["status"] == 500  # type: ignore[index]
            reasons[500] = await page.text_content("#notice")
            assert reasons == {
                401: "Closed (HTTP 401): a token is required (Authorization: Bearer <token>, ?token= or a session)",
                403: "Closed (HTTP 403): the token has expired",
                404: "Closed (HTTP 404): no such request",
                500: "Closed (HTTP 500): the relay could not read this request",
            }
        # Redis unreachable: the page shows it and keeps trying (jittered), then streams once Redis is back
        async with proxy, browser() as chromium:
            proxy.refuse(True)
            config = config_for(proxy.url_for(redis_url), key_prefix, retry_after=0.2, retry_jitter=0.3)
            async with serve_relay(config) as relay, httpx.AsyncClient() as client:
                page = await chromium.new_page()
                await page.goto(f"{relay.url}/view/done?token={sign_token(SECRET, 'done', now + 60)}")
                await wait_for(page, "window.sluiceView.reconnects >= 2")
                assert await page.text_content("#status") == "reconnecting (503)"
                await page.screenshot(path=str(shots / "redis-unreachable.png"), full_page=True)
                ready = await client.get(relay.url + "/readyz")
                assert ready.status_code == 503 and (await client.get(relay.url + "/healthz")).status_code == 200
                proxy.refuse(False)
                await wait_for(page, "window.sluiceView.ended")
                assert await page.text_content("#status") == "completed"
                await page.screenshot(path=str(shots / "redis-back.png"), full_page=True)
    finally:
        await cleanup(redis_client, key_prefix)
        await redis_client.aclose()
