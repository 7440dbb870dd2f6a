"""The relay's ES module (``/static/sluice.js``) in Chromium: it assembles the contract (blocks, attempts),
resumes exactly across a relay restart, refreshes an expired token, and follows many requests over one
multiplexed WebSocket. Every assembled view is compared with the request's result as sluice assembles it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from sluice.normalizer.assemble import assemble
from sluice.relay import serve_relay, sign_token
from sluice.schemas.events import decode_event
from sluice.schemas.result import Result
from tests.browser.support import browser, wait_for
from tests.integration.conftest import cleanup
from tests.integration.test_relay import (
    SECRET,
    Attempt,
    config_for,
    finalize,
    publish,
    stored,
    text_request,
    wait_until,
    write_request,
)

pytestmark = pytest.mark.asyncio

IMPORT = "window.sluice = await import('/static/sluice.js')"


async def _result(redis_client: Any, prefix: str, rid: str) -> Result:
    log = await stored(redis_client, prefix, rid)
    final_attempt = log[-1][0].split("-")[0]
    return assemble(decode_event(d) for p, _, d in log if p.split("-")[0] == final_attempt)


def _blocks(result: Result) -> list[dict[str, Any]]:
    return [
        {
            "index": b.index,
            "kind": b.kind,
            "text": b.text or "",
            "argumentsText": b.arguments_text or "",
            "arguments": b.arguments,
            "name": b.name,
            "callId": b.call_id,
        }
        for b in result.blocks
    ]


VIEW = """(v) => ({
  attempts: v.attempts.map(a => [a.attempt, a.status, a.stopReason, a.error && a.error.category]),
  blocks: v.blocks.map(b => ({index: b.index, kind: b.kind, text: b.text, argumentsText: b.argumentsText,
                             arguments: b.arguments, name: b.name, callId: b.callId})),
  states: v.blocks.map(b => b.state), positions: v.positions, ended: v.ended, finalId: v.finalId,
})"""


async def test_follow_assembles_attempts_and_resumes_across_a_restart(redis_url, key_prefix, redis_client) -> None:
    await write_request(redis_client, key_prefix, "j1", text_request("j1"))
    live = (
        Attempt("j2", 1)
        .block("text", [f"w{i} " for i in range(40)])
        .block("tool_call", ['{"q": ', '"x"}'], name="search", arguments={"q": "x"})
        .done()
    )
    await publish(redis_client, key_prefix, "j2", 1, live.events[:12])
    now = int(time.time())
    try:
        async with browser() as chromium:
            page = await chromium.new_page()
            async with serve_relay(config_for(redis_url, key_prefix)) as relay:
                port = relay.port
                await page.goto(relay.url + "/healthz")
                await page.evaluate(f"async () => {{ {IMPORT} }}")
                # a finished request with a retried attempt: both attempts, the blocks of the final one
                view = await page.evaluate(
                    f"""async (token) => {{
                      const f = sluice.follow("j1", {{ token }});
                      const outcome = await f.done;
                      return [outcome, ({VIEW})(f.view)];
                    }}""",
                    sign_token(SECRET, "j1", now + 60),
                )
                assert view[0] == {"state": "done", "status": 200}
                assert view[1]["attempts"] == [[1, "failed", None, "overloaded"], [2, "completed", "stop", None]]
                assert view[1]["blocks"] == _blocks(await _result(redis_client, key_prefix, "j1"))
                assert view[1]["states"] == ["complete", "complete"] and view[1]["ended"]
                # a live request, then the relay restarts under it
                await page.evaluate(
                    "(token) => { window.live = sluice.follow('j2', { token }); }", sign_token(SECRET, "j2", now + 60)
                )
                await wait_for(page, "window.live.view.positions.length === 12")
            await publish(redis_client, key_prefix, "j2", 1, live.events[12:])
            await finalize(redis_client, key_prefix, "j2")
            async with serve_relay(config_for(redis_url, key_prefix), port=port) as relay:
                await wait_for(page, "window.live.view.ended")
                resumed = relay.hub.statistics()["clients_resumed"]
            view = await page.evaluate(f"() => ({VIEW})(window.live.view)")
        log = await stored(redis_client, key_prefix, "j2")
        assert view["positions"] == [p for p, _, _ in log] and resumed == 1  # each once, in order
        assert view["blocks"] == _blocks(await _result(redis_client, key_prefix, "j2"))
        assert view["finalId"] == log[-1][0]
    finally:
        await cleanup(redis_client, key_prefix)


async def test_follow_refreshes_an_expired_token(redis_url, key_prefix, redis_client) -> None:
    await write_request(redis_client, key_prefix, "k1", [Attempt("k1", 1).block("text", ["ok"]).done()])
    now = int(time.time())
    try:
        async with browser() as chromium, serve_relay(config_for(redis_url, key_prefix)) as relay:
            page = await chromium.new_page()
            await page.goto(relay.url + "/healthz")
            await page.evaluate(f"async () => {{ {IMPORT} }}")
            expired, fresh = sign_token(SECRET, "k1", now - 1), sign_token(SECRET, "k1", now + 60)
            without = await page.evaluate("async (t) => await sluice.follow('k1', { token: t }).done", expired)
            assert without == {"state": "closed", "status": 403, "reason": "the token has expired"}
            refreshed = await page.evaluate(
                """async ([t, f]) => {
                  let calls = 0;
                  const r = sluice.follow('k1', { token: t, getToken: async () => { calls += 1; return f; } });
                  return [await r.done, calls, r.view.blocks[0].text];
                }""",
                [expired, fresh],
            )
            assert refreshed == [{"state": "done", "status": 200}, 1, "ok"]
    finally:
        await cleanup(redis_client, key_prefix)


async def test_relay_socket_follows_many_requests_on_one_connection(redis_url, key_prefix, redis_client) -> None:
    """Eight live requests on one WebSocket (over HTTP/1.1 a browser holds six streams per origin), one
    of them with an expired token that ``getToken`` refreshes."""
    rids = [f"x{i}" for i in range(8)]
    attempts = {rid: Attempt(rid, 1).block("text", [f"{rid}-{k} " for k in range(15)]).done() for rid in rids}
    for rid, a in attempts.items():
        await publish(redis_client, key_prefix, rid, 1, a.events[:4])
    now = int(time.time())
    tokens = {rid: sign_token(SECRET, rid, now + 60) for rid in rids}
    tokens["x0"] = sign_token(SECRET, "x0", now - 1)  # expired: refreshed through getToken
    try:
        async with browser() as chromium, serve_relay(config_for(redis_url, key_prefix)) as relay:
            page = await chromium.new_page()
            await page.goto(relay.url + "/healthz")
            await page.evaluate(f"async () => {{ {IMPORT} }}")
            await page.evaluate(
                """([url, tokens, fresh]) => {
                  window.refreshes = 0;
                  const socket = window.socket = new sluice.RelaySocket(url, {
                    getToken: async (rid) => { window.refreshes += 1; return fresh; },
                  });
                  window.views = Object.fromEntries(Object.entries(tokens).map(
                    ([rid, token]) => [rid, socket.subscribe(rid, { token }).view]));
                }""",
                [relay.url.replace("http", "ws") + "/v1/ws", tokens, sign_token(SECRET, "x0", now + 60)],
            )
            await wait_until(lambda: relay.hub.statistics()["clients_active"] == 8)
            assert relay.server.relay.mux_sockets == 1  # all eight on one connection
            for rid, a in attempts.items():
                await publish(redis_client, key_prefix, rid, 1, a.events[4:])
                await finalize(redis_client, key_prefix, rid)
            await wait_for(page, "Object.values(window.views).every(v => v.ended)")
            views = await page.evaluate(
                f"() => Object.fromEntries(Object.entries(window.views).map(([k, v]) => [k, ({VIEW})(v)]))"
            )
            refreshes = await page.evaluate("() => window.refreshes")
        assert refreshes == 1
        for rid in rids:
            log = await stored(redis_client, key_prefix, rid)
            assert views[rid]["positions"] == [p for p, _, _ in log], rid
            assert views[rid]["blocks"] == _blocks(await _result(redis_client, key_prefix, rid)), rid
    finally:
        await cleanup(redis_client, key_prefix)
