"""A page on another origin consumes ``?format=ai-sdk`` in Chromium with the ``ai`` package itself.

The page loads the pinned ``ai`` (from ``.venv/node``, through an import map: no bundler) from its own
origin and runs ``useChat``'s code path (``AbstractChat`` + ``DefaultChatTransport``, without React): its
reconnect request goes to the relay, cross-origin with a bearer token (so the relay's CORS is exercised,
preflight included), and it renders the message's parts as they grow. The rendered parts must be the
request's result; a failed request must leave the chat in its error state with sluice's reason.
"""

from __future__ import annotations

import contextlib
import json
import mimetypes
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from sluice.relay import serve_relay, sign_token
from tests.aisdk.harness import ai_sdk, import_map
from tests.browser.support import artifacts, browser, wait_for
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config, running_worker
from tests.integration.test_relay import SECRET, config_for
from tests.integration.test_relay_aisdk import PROMPT, expected_parts

pytestmark = pytest.mark.asyncio
__all__ = ["ai_sdk"]

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>useChat over sluice</title>
<script type="importmap">IMPORTS</script>
<style>body{font-family:system-ui;max-width:50rem;margin:1rem auto} .part{border:1px solid #ccc;border-radius:.3rem;
margin:.4rem 0;padding:.3rem .5rem;white-space:pre-wrap} .part[data-type=reasoning]{background:#f3f0fb}
#status{font-family:monospace}</style></head>
<body><h1>useChat over sluice</h1><div>status: <span id="status">idle</span> <span id="error"></span></div>
<div id="parts"></div>
<script type="module">
import { AbstractChat, DefaultChatTransport } from "ai";
const params = new URLSearchParams(location.search);
const render = (messages) => {
  const message = messages.findLast((m) => m.role === "assistant");
  const parts = document.getElementById("parts");
  parts.replaceChildren(...(message ? message.parts : []).filter((p) => p.type !== "step-start").map((p) => {
    const el = document.createElement("div");
    el.className = "part";
    el.dataset.type = p.type;
    el.dataset.state = p.state ?? "";
    const tool = `${p.type} ${p.toolCallId} ${JSON.stringify(p.input ?? null)}`;
    el.textContent = p.type.startsWith("tool-") ? tool : p.text;
    return el;
  }));
};
const state = {
  status: "ready", error: undefined, messages: [],
  pushMessage(m) { this.messages = this.messages.concat(m); render(this.messages); },
  popMessage() { this.messages = this.messages.slice(0, -1); render(this.messages); },
  replaceMessage(i, m) {
    this.messages = [...this.messages.slice(0, i), m, ...this.messages.slice(i + 1)];
    render(this.messages);
  },
  snapshot: (t) => structuredClone(t),
};
class Chat extends AbstractChat {}
const chat = window.chat = new Chat({
  id: params.get("request"), state,
  transport: new DefaultChatTransport({
    // useChat's resume: a GET that replays the whole message (no position), here on the relay's origin
    prepareReconnectToStreamRequest: () => ({
      api: `${params.get("relay")}/v1/requests/${params.get("request")}/events?format=ai-sdk`,
      headers: { authorization: `Bearer ${params.get("token")}` }, credentials: "omit",
    }),
  }),
  onFinish: ({ finishReason, isError }) => { window.finish = { finishReason: finishReason ?? null, isError }; },
});
await chat.resumeStream();
document.getElementById("status").textContent = chat.status;
document.getElementById("error").textContent = chat.error ? chat.error.message : "";
window.outcome = { status: chat.status, error: chat.error ? chat.error.message : null,
                   parts: chat.messages.findLast((m) => m.role === "assistant")?.parts ?? [] };
</script></body></html>
"""


@contextlib.asynccontextmanager
async def app_origin(node_modules: Path) -> AsyncIterator[str]:
    """The frontend's own origin: the page and ``node_modules`` (served as ES modules)."""
    mimetypes.add_type("text/javascript", ".mjs")
    page = PAGE.replace("IMPORTS", json.dumps({"imports": import_map(node_modules)}))
    app = Starlette(
        routes=[
            Route("/", lambda request: HTMLResponse(page)),
            Mount("/node_modules", StaticFiles(directory=node_modules)),
        ]
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off"))
    sock = server.config.bind_socket()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: server.serve(sockets=[sock]))
        while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to wait on
            await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True


async def test_use_chat_in_chromium_on_another_origin(
    ai_sdk: Path, fake, redis_url, key_prefix, redis_client, monkeypatch
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    shots = artifacts("ai-sdk-page")
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with app_origin(ai_sdk / "node_modules") as origin:
            relay_config = config_for(redis_url, key_prefix, allowed_origins=(origin,))
            async with (
                running_worker(config),
                client_for(config) as sluice,
                serve_relay(relay_config) as relay,
                browser() as chromium,
            ):
                jobs = {
                    "answer": "synthetic;deltas=40;reasoning=4;tools=1;pace_ms=10",
                    "failure": "synthetic;deltas=40;error_after=15;pace_ms=5",
                }
                outcomes: dict[str, Any] = {}
                for name, model in jobs.items():
                    rid = await sluice.enqueue({"route": "anthropic", "model": model, "request": PROMPT})
                    token = sign_token(SECRET, rid, int(time.time()) + 60, allow_internal=True)
                    page = await chromium.new_page()
                    await page.goto(f"{origin}/?request={rid}&token={token}&relay={relay.url}")
                    if name == "answer":
                        await wait_for(page, "document.querySelectorAll('.part').length >= 2")
                        await page.screenshot(path=str(shots / "streaming.png"), full_page=True)
                    await wait_for(page, "window.outcome !== undefined")
                    await page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
                    rendered = await page.eval_on_selector_all(
                        ".part", "els => els.map(e => [e.dataset.type, e.dataset.state, e.textContent])"
                    )
                    outcomes[name] = (rid, await page.evaluate("() => [window.outcome, window.finish]"), rendered)
                results = {name: await sluice.result(rid, timeout=10) for name, (rid, _, _) in outcomes.items()}
        rid, (outcome, finish), rendered = outcomes["answer"]
        want = expected_parts(results["answer"])
        assert outcome["status"] == "ready" and finish == {"finishReason": "tool-calls", "isError": False}
        assert [p["type"] for p in want] == ["reasoning", "text", f"tool-{results['answer'].blocks[2].name}"]
        assert rendered == [
            [
                p["type"],
                p["state"],
                p["text"]
                if "text" in p
                else f"{p['type']} {p['toolCallId']} {json.dumps(p['input'], separators=(',', ':'))}",
            ]
            for p in want
        ]
        rid, (outcome, finish), rendered = outcomes["failure"]
        error = results["failure"].error
        assert error is not None and outcome == {
            **outcome,
            "status": "error",
            "error": f"{error.category}: {error.message}",
        }
        assert finish["isError"] is True
        assert rendered == [["text", "streaming", results["failure"].blocks[0].text]]
    finally:
        await cleanup(redis_client, key_prefix)
