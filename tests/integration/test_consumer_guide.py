"""The consumer guide's recipes (docs/consumer-guide.md) as written, by consumers that are not Python.

A worker runs requests of four dialects with the fake provider: one whose first attempt ends with its own
``stream.error`` (retried), one that fails after visible output, the others completed. Then a Node.js
consumer (node-redis and ajv, pinned in tests/aisdk) follows each request with plain XREAD, one with a
consumer group it created before the worker started (MKSTREAM), and the terminal feed with a group, a
small COUNT so it must loop. Every event must validate against the published schema in strict Ajv2020,
every entry must be delivered exactly once and acknowledged, the stop condition must wait for the attempt
the status names, and the result hash computed as the guide states it must equal the stored one. The
guide's redis-cli recipes run too, extracted from the page, where redis-cli is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
import redis.asyncio as aioredis
from anyio.streams.buffered import BufferedByteReceiveStream

from sluice.schemas.jsonschema import SCHEMA_PATH
from sluice.schemas.keys import Keys
from tests.aisdk.harness import HERE, node_harness
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio
__all__ = ["node_harness"]

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "consumer-guide.md"
TERMINAL_FIELDS = {
    "request_id",
    "status",
    "stop_reason",
    "error_category",
    "attempt",
    "raw_count",
    "event_count",
    "result_hash",
    "metadata",
    "usage_reported",  # cost, currency, prices_version too when a price applies (none configured here)
}
JOBS = {  # request id -> (route, model)
    "guide-first": ("anthropic", "synthetic;deltas=7;reasoning=2;tools=1;pace_ms=5"),
    "guide-retry": ("openai-chat", "synthetic;deltas=5;error_after=1;times=1;pace_ms=2"),
    "guide-failed": ("gemini", "synthetic;deltas=8;error_after=4;pace_ms=2"),
    "guide-tools": ("openai-responses", "synthetic;deltas=4;tools=2;text=h%C3%A9llo%20%E2%80%A8%20%F0%9F%91%8B"),
}


def _job(rid: str) -> dict[str, Any]:
    route, model = JOBS[rid]
    return {
        "route": route,
        "model": model,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }


@asynccontextmanager
async def _node(node_dir: Path, redis_url: str, prefix: str, *mode: str) -> AsyncIterator[Any]:
    """consume.mjs started and ready (it printed ``{"ready": true}``); yields a function that waits for
    its summary."""
    node = shutil.which("node")
    assert node is not None
    argv = [
        node,
        str(HERE / "consume.mjs"),
        "--ai-dir",
        str(node_dir),
        "--url",
        redis_url,
        "--prefix",
        prefix,
        "--schema",
        str(SCHEMA_PATH),
        *mode,
    ]
    async with await anyio.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        out = BufferedByteReceiveStream(proc.stdout)
        with anyio.fail_after(30):
            assert json.loads(await out.receive_until(b"\n", 1 << 20)) == {"ready": True}

        async def summary() -> dict[str, Any]:
            with anyio.fail_after(60):
                line = await out.receive_until(b"\n", 64 << 20)
                code = await proc.wait()
            assert code == 0, (await proc.stderr.receive()).decode()
            return dict(json.loads(line))

        try:
            yield summary
        finally:
            if proc.returncode is None:
                proc.kill()


async def _ids(redis: aioredis.Redis, key: str) -> list[str]:
    return [i.decode() for i, _ in await redis.xrange(key)]


async def _pending(redis: aioredis.Redis, key: str, group: str) -> int:
    return int((await redis.xpending(key, group))["pending"])


async def test_a_node_consumer_follows_the_guide(
    node_harness: Path, fake, redis_url, key_prefix, redis_client, monkeypatch
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    keys = Keys(key_prefix)
    config = make_config(redis_url, key_prefix, fake.base_url)
    first = keys.request("guide-first").events
    try:
        # The group reader arrives before the worker: MKSTREAM made the stream, the group waits on it.
        async with _node(node_harness, redis_url, key_prefix, "group", "guide-first", "ui", "ui-1", "2") as grouped:
            assert [g["name"] for g in await redis_client.xinfo_groups(first)] == [b"ui"]
            async with running_worker(config), client_for(config) as sluice:
                for rid in JOBS:
                    await sluice.enqueue(_job(rid))
                results = {rid: await sluice.result(rid, timeout=30) for rid in JOBS}
            in_group = await grouped()
        assert {rid: r.status for rid, r in results.items()} == {
            "guide-first": "completed",
            "guide-retry": "completed",
            "guide-failed": "failed",
            "guide-tools": "completed",
        }
        assert in_group["ids"] == await _ids(redis_client, first) and in_group["reads"] > 1
        assert await _pending(redis_client, first, "ui") == 0
        summaries = {"guide-first": in_group}
        for rid in JOBS:
            async with _node(node_harness, redis_url, key_prefix, "follow", rid) as followed:
                summaries[rid + " (xread)"] = await followed()
        for name, s in summaries.items():
            rid = s["request_id"]
            status = await redis_client.hgetall(keys.request(rid).status)
            assert s["invalid"] == [], name  # strict Ajv2020, the published schema
            assert s["ids"] == await _ids(redis_client, keys.request(rid).events), name
            assert (s["state"], s["attempt"]) == (status[b"state"].decode(), int(status[b"attempt"])), name
            assert s["result_hash"] == s["stored_hash"] == status[b"result_hash"].decode(), (name, s["result"])
        # the retried request: attempt 1 ended with its own stream.error; the reader went on to attempt 2
        assert summaries["guide-retry (xread)"]["terminals"] == {"1": "stream.error", "2": "stream.done"}
        assert summaries["guide-failed (xread)"]["result"]["error"]["category"] == "overloaded"
        tools = summaries["guide-tools (xread)"]["result"]["blocks"]
        assert [b["kind"] for b in tools] == ["text", "tool_call", "tool_call"] and "\u2028" in tools[0]["text"]
        # the terminal feed: COUNT 2 a read, so four entries take several reads; each acknowledged
        async with _node(node_harness, redis_url, key_prefix, "terminals", "billing", "billing-1", "2", "4") as feed:
            fed = await feed()
        entries = {e["fields"]["request_id"]: e["fields"] for e in fed["entries"]}
        assert set(entries) == set(JOBS) and len(fed["entries"]) == 4 and fed["reads"] >= 3
        assert all(set(f) == TERMINAL_FIELDS for f in entries.values())  # no durability: not replica mode
        for rid, f in entries.items():
            rk = keys.request(rid)
            assert f["status"] == results[rid].status and f["result_hash"] == summaries[rid + " (xread)"]["result_hash"]
            assert int(f["event_count"]) == await redis_client.xlen(rk.events)
            assert int(f["raw_count"]) == await redis_client.xlen(rk.raw)
        assert entries["guide-retry"]["attempt"] == "2" and entries["guide-failed"]["error_category"] == "overloaded"
        assert await _pending(redis_client, keys.terminal, "billing") == 0
    finally:
        await cleanup(redis_client, key_prefix)


def guide_recipe(name: str) -> str:
    """The ``sh`` block that follows ``<!-- test: name -->`` in the guide, exactly as published."""
    m = re.search(rf"<!-- test: {re.escape(name)} -->\n```sh\n(.*?)\n```", GUIDE.read_text(), re.S)
    assert m is not None, f"{GUIDE}: no recipe {name}"
    return m.group(1)


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed here")
async def test_the_redis_cli_recipes_as_written(fake, redis_url, key_prefix, redis_client, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    keys = Keys(key_prefix)
    config = make_config(redis_url, key_prefix, fake.base_url)
    env = {**os.environ, "REDIS_URL": redis_url, "PREFIX": key_prefix, "RID": "guide-retry"}
    try:
        async with running_worker(config), client_for(config) as sluice:
            # the request-group reader first (MKSTREAM), then the request: it is read live
            async with await anyio.open_process(
                ["bash", "-c", guide_recipe("redis-cli-request-group")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            ) as proc:
                with anyio.fail_after(10):
                    while not await redis_client.exists(keys.request("guide-retry").events):  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                for rid in ("guide-retry", "guide-first"):
                    await sluice.enqueue(_job(rid))
                assert proc.stdout is not None
                with anyio.fail_after(60):
                    printed = b"".join([chunk async for chunk in proc.stdout]).decode().split()
                    assert await proc.wait() == 0
            await sluice.result("guide-first", timeout=30)
        events = keys.request("guide-retry").events
        assert printed == await _ids(redis_client, events)
        assert {i.split("-")[0] for i in printed} == {"1", "2"}  # past attempt 1's stream.error
        assert await _pending(redis_client, events, "ui") == 0
        feed = await anyio.run_process(["bash", "-c", guide_recipe("redis-cli-terminal-feed")], env=env)
        assert feed.stdout.decode().split() == await _ids(redis_client, keys.terminal)
        assert await _pending(redis_client, keys.terminal, "billing") == 0
    finally:
        await cleanup(redis_client, key_prefix)
