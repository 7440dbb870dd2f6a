"""The live page in a real browser: headless Chromium (Debian's package) driven by Playwright.

A real request runs through the fake provider and the worker; the page renders it from the relay, the
relay is restarted mid-stream, and the page must resume with Last-Event-ID to exactly the final text.
Skipped with a clear message when no Chromium (or no Playwright) is installed; ``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from sluice.fake.provider import serve_fake_provider
from sluice.relay import serve_relay, sign_token
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config, running_worker
from tests.integration.test_relay import SECRET, config_for

pytestmark = pytest.mark.asyncio

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--no-first-run", "--disable-sync",
]  # fmt: skip
# Text, a tool call and internal reasoning, paced so the stream lasts about two seconds.
SCENARIO = "synthetic;deltas=120;words=1-2;tools=1;reasoning=4;pace_ms=15"
JOB = {"route": "anthropic", "model": SCENARIO, "request": {"messages": [{"role": "user", "content": "hi"}]}}


def _chromium() -> str:
    for candidate in (os.environ.get("SLUICE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("no Chromium found (install Debian's `chromium` package, or set SLUICE_CHROMIUM); .ci/run installs it")


async def _wait(page: object, expression: str, timeout_ms: int = 15_000) -> None:
    await page.wait_for_function(f"() => {expression}", timeout=timeout_ms)  # type: ignore[attr-defined]


async def test_page_renders_and_resumes_after_a_relay_restart(redis_url, key_prefix, monkeypatch) -> None:
    executable = _chromium()
    playwright_api = pytest.importorskip("playwright.async_api", reason="the `playwright` package is not installed")
    monkeypatch.setenv(KEY_ENV, API_KEY)
    redis_client = aioredis.Redis.from_url(redis_url)
    try:
        async with serve_fake_provider(api_key=API_KEY) as fake:
            config = make_config(redis_url, key_prefix, fake.base_url)
            relay_config = config_for(redis_url, key_prefix)
            async with (
                running_worker(config), client_for(config) as sluice, playwright_api.async_playwright() as pw,
            ):  # fmt: skip
                browser = await pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
                try:
                    page = await browser.new_page()
                    async with serve_relay(relay_config) as first:
                        port = first.port
                        rid = await sluice.enqueue(JOB)
                        token = sign_token(SECRET, rid, int(time.time()) + 120)
                        await page.goto(f"{first.url}/view/{rid}?token={token}")
                        await _wait(page, "window.sluiceView && window.sluiceView.positions.length >= 15")
                        assert (await sluice.status(rid)).state == "running"  # still streaming
                    # the first relay is gone: the page notices and keeps reconnecting
                    await _wait(page, "window.sluiceView.reconnects >= 1", 5_000)
                    async with serve_relay(relay_config, port=port) as second:
                        await _wait(page, "window.sluiceView.ended === true")
                        stats = second.hub.statistics()
                    result = await sluice.result(rid, timeout=10)
                    view = await page.evaluate("() => window.sluiceView")
                    rendered = await page.eval_on_selector_all(
                        "section.block",
                        "els => els.map(e => [Number(e.dataset.index), e.dataset.kind,"
                        " e.querySelector('pre.content').textContent])",
                    )
                    status = await page.text_content("#status")
                    await page.screenshot(path=str(Path(os.environ.get("TMPDIR", "/tmp")) / "sluice-live-page.png"))
                finally:
                    await browser.close()
        assert result.status == "completed" and status == "completed"
        # the second relay was reached with the position the page had (Last-Event-ID: the URL has none)
        assert stats["clients_resumed"] >= 1
        # every position exactly once, in order: nothing replayed twice, nothing skipped
        positions = [tuple(map(int, p.split("-"))) for p in view["positions"]]
        assert positions == sorted(set(positions))
        # the rendered blocks are exactly the result's, internal reasoning withheld (the token lacks it)
        expected = [
            [b.index, b.kind, b.arguments_text if b.kind == "tool_call" else b.text]
            for b in result.blocks
            if b.kind != "reasoning"
        ]
        assert any(b.kind == "reasoning" for b in result.blocks)
        assert [r for r in rendered] == expected
        assert sum(len(t) for _, k, t in expected if k == "text") > 200
    finally:
        await cleanup(redis_client, key_prefix)
        await redis_client.aclose()
