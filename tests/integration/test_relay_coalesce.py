"""``?coalesce_ms=``: merged text deltas re-expand to exactly the stored text, everything else is the
stored event itself, and positions stay exact."""

from __future__ import annotations

import anyio
import httpx
import msgspec
import pytest

from sluice.relay import serve_relay
from tests.integration.conftest import cleanup
from tests.integration.test_relay import (
    AUTH,
    Attempt,
    Received,
    config_for,
    events_url,
    finalize,
    publish,
    read_sse,
    stored,
    wait_until,
)

pytestmark = pytest.mark.asyncio


def _request() -> Attempt:
    words = ["the ", "quick ", "brown ", "fox ", "jumps ", "over ", "the ", "lazy ", "dog ", "ёжик ", "漢字 ", "🦊 "]
    return (
        Attempt("co", 1)
        .block("reasoning", words * 2, visibility="public")
        .block("text", words * 5)
        .block("tool_call", ['{"q": "', "fox", '"}'], name="search", arguments={"q": "fox"})
        .block("text", ["a", "b", "c"])
        .done()
    )


def _check_reexpansion(got: Received, log: list[tuple[str, str, bytes]]) -> int:
    """Every stored event is covered exactly once, in order; returns the number of merged frames."""
    by_pos = {p: (t, d) for p, t, d in log}
    covered: list[str] = []
    texts: dict[int, str] = {}
    merged = 0
    for pos, kind, data in got.contract:
        doc = msgspec.json.decode(data)
        attempt = pos.split("-")[0]
        if "coalesced" in doc:
            merged += 1
            c = doc.pop("coalesced")
            assert c["count"] == c["last_seq"] - c["first_seq"] + 1 >= 2
            assert pos == f"{attempt}-{c['last_seq']}" and doc["seq"] == c["last_seq"]
            span = [f"{attempt}-{s}" for s in range(c["first_seq"], c["last_seq"] + 1)]
            originals = [msgspec.json.decode(by_pos[p][1]) for p in span]
            assert all(o["type"] == "block.delta" and o["delta"]["kind"] == "text" for o in originals)
            assert all(o["block"] == doc["block"] for o in originals)
            assert doc["delta"]["text"] == "".join(o["delta"]["text"] for o in originals)
            assert doc["raw"] == [r for o in originals for r in o["raw"]]
            covered += span
        else:
            assert (kind, data) == by_pos[pos]  # one to one, byte for byte
            covered.append(pos)
        if doc["type"] == "block.delta":
            texts[doc["block"]["index"]] = texts.get(doc["block"]["index"], "") + doc["delta"]["text"]
    assert covered == [p for p, _, _ in log]
    expected: dict[int, str] = {}
    for _, _, d in log:
        ev = msgspec.json.decode(d)
        if ev["type"] == "block.delta":
            expected[ev["block"]["index"]] = expected.get(ev["block"]["index"], "") + ev["delta"]["text"]
    assert texts == expected
    return merged


async def test_coalesced_output_reexpands_exactly(redis_url, key_prefix, redis_client) -> None:
    a = _request()
    await publish(redis_client, key_prefix, "co", 1, a.events[:1])
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "co")
            results: dict[str, Received] = {}

            async def reader(name: str, **params: str) -> None:
                results[name] = await read_sse(client, url, headers=AUTH, params=params)

            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: reader("live", coalesce_ms="40"))
                tg.start_soon(lambda: reader("plain"))
                await wait_until(lambda: relay.hub.statistics()["clients_active"] == 2)  # both follow live
                for ev in a.events[1:]:  # one event at a time, as a fast model would
                    await publish(redis_client, key_prefix, "co", 1, [ev])
                    await anyio.sleep(0.003)
                await finalize(redis_client, key_prefix, "co")
            log = await stored(redis_client, key_prefix, "co")
            # catching up on a finished stream merges too (the whole backlog is there at once)
            backlog = await read_sse(client, url, headers=AUTH, params={"coalesce_ms": "40"})
            assert results["plain"].contract == log  # without the option: one to one
            live_merges = _check_reexpansion(results["live"], log)
            assert live_merges >= 3 and len(results["live"].contract) < len(log) - 20
            assert _check_reexpansion(backlog, log) >= 3
            # tool-call argument deltas are never merged
            tool = [d for _, t, d in backlog.contract if t == "block.delta" and b"json_text" in d]
            assert len(tool) == 3
            # resuming from a merged frame's id gives exactly the events after the last seq it covers
            merged_frame = next(f for f in backlog.contract if b'"coalesced"' in f[2])
            rest = await read_sse(client, url, headers={**AUTH, "Last-Event-ID": merged_frame[0]})
            start = [p for p, _, _ in log].index(merged_frame[0]) + 1
            assert rest.contract == log[start:]
            assert results["live"].ended and backlog.ended
    finally:
        await cleanup(redis_client, key_prefix)


async def test_coalesce_ms_is_validated(redis_url, key_prefix, redis_client) -> None:
    await publish(redis_client, key_prefix, "cv", 1, Attempt("cv", 1).done().events, state="completed")
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "cv")
            for bad in ("-1", "abc", "999999"):
                got = await read_sse(client, url, headers=AUTH, params={"coalesce_ms": bad})
                assert got.status == 400, bad
    finally:
        await cleanup(redis_client, key_prefix)
