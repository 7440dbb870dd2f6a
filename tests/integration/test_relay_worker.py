"""The relay in front of the real worker: fake provider -> worker -> Redis -> relay -> clients."""

from __future__ import annotations

import time

import anyio
import httpx
import msgspec
import pytest
import websockets

from sluice.normalizer.assemble import assemble
from sluice.relay import serve_relay, sign_token
from sluice.schemas.events import BlockStart, decode_event
from tests.integration.conftest import cleanup, client_for, make_config, running_worker
from tests.integration.test_relay import AUTH, SECRET, Received, config_for, events_url, read_sse, stored
from tests.integration.test_relay_coalesce import _check_reexpansion

pytestmark = pytest.mark.asyncio

SCENARIO = "synthetic;deltas=40;tools=1;reasoning=5;pace_ms=4"


async def test_live_request_from_the_worker(fake, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with (
            running_worker(config),
            client_for(config) as sluice,
            serve_relay(config_for(redis_url, key_prefix)) as relay,
            httpx.AsyncClient() as http,
        ):
            rid = await sluice.enqueue(
                {"route": "anthropic", "model": SCENARIO, "request": {"messages": [{"role": "user", "content": "hi"}]}}
            )
            url = events_url(relay.url, rid)
            browser_token = sign_token(SECRET, rid, int(time.time()) + 60)
            got: dict[str, Received] = {}
            ws_messages: list[dict[str, object]] = []

            async def sse(name: str, **kw: object) -> None:
                got[name] = await read_sse(http, url, **kw)  # type: ignore[arg-type]

            async def ws() -> None:
                ws_url = relay.url.replace("http", "ws") + f"/v1/requests/{rid}/ws?token={browser_token}"
                async with websockets.connect(ws_url) as conn:
                    ws_messages.extend([msgspec.json.decode(m) async for m in conn])

            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: sse("backend", headers=AUTH))
                tg.start_soon(lambda: sse("browser", params={"token": browser_token}))
                tg.start_soon(lambda: sse("coalesced", headers=AUTH, params={"coalesce_ms": "30"}))
                tg.start_soon(ws)
            result = await sluice.result(rid, timeout=10)
            log = await stored(redis_client, key_prefix, rid)
        assert result.status == "completed"
        assert got["backend"].contract == log and got["backend"].ended
        events = [decode_event(d) for _, _, d in log]
        assert assemble(events) == result
        # the browser's token does not allow internal reasoning: that block is withheld, nothing else
        internal = {e.block.index for e in events if isinstance(e, BlockStart) and e.block.visibility == "internal"}
        assert internal and any(b.kind == "reasoning" and b.text for b in result.blocks)
        hidden = {
            p
            for (p, _, _), e in zip(log, events, strict=True)
            if getattr(getattr(e, "block", None), "index", None) in internal
        }
        # a withheld block's start becomes one block.withheld notice at its position; nothing else of it shows
        starts = {p for p, t, _ in log if p in hidden and t == "block.start"}
        expected = [(p, "block.withheld" if p in starts else t) for p, t, _ in log if p not in hidden - starts]
        assert [(p, t) for p, t, _ in got["browser"].contract] == expected
        assert [e for e in got["browser"].contract if e[0] not in starts] == [e for e in log if e[0] not in hidden]
        assert [(m["id"], m["event"]) for m in ws_messages[:-1]] == expected
        assert ws_messages[-1]["event"] == "end"
        assert _check_reexpansion(got["coalesced"], log) >= 1
    finally:
        await cleanup(redis_client, key_prefix)
