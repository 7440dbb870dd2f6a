"""``?format=ai-sdk`` judged by the ``ai`` package itself (Node): its parser and chunk schema, its message
assembler, and ``useChat``'s code path, each compared with the request's assembled result.

Requests run for real (fake provider -> worker -> Redis -> relay); the Node checks read the relay over HTTP
while the requests stream. Skipped with a message when ``node``/``npm`` are missing (``tests/aisdk``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from sluice.relay import serve_relay, sign_token
from sluice.schemas.result import Result
from tests.aisdk.harness import HERE, ai_sdk, check_body, check_url, parts_of, run_node
from tests.integration.conftest import cleanup, client_for, make_config, running_worker
from tests.integration.test_relay import SECRET, config_for
from tests.unit.test_relay_aisdk import Log, body_of

pytestmark = pytest.mark.asyncio
__all__ = ["ai_sdk"]  # the session fixture, used by the tests below

PROMPT = {"messages": [{"role": "user", "content": "hi"}]}
CASES = {
    "text": ("anthropic", "synthetic;deltas=30;pace_ms=2"),
    "reasoning+text": ("anthropic", "synthetic;deltas=12;reasoning=6;pace_ms=2"),
    "tool call": ("openai-responses", "synthetic;deltas=4;tools=1;pace_ms=2"),
    "parallel tool calls": ("gemini", "synthetic;deltas=3;tools=2;pace_ms=2"),
    "failure mid-stream": ("anthropic", "synthetic;deltas=30;error_after=12;pace_ms=2"),
}


def expected_parts(result: Result, *, reasoning: bool = True) -> list[dict[str, Any]]:
    """The UI message parts a result must assemble to: a failure leaves its last block streaming."""
    out: list[dict[str, Any]] = []
    for k, b in enumerate(result.blocks):
        cut = result.status != "completed" and k == len(result.blocks) - 1
        if b.kind == "tool_call":
            state = "input-available" if b.arguments is not None else "input-streaming"
            out.append({"type": f"tool-{b.name}", "toolCallId": b.call_id, "state": state, "input": b.arguments})
        elif b.kind != "reasoning" or reasoning:
            kind = "reasoning" if b.kind == "reasoning" else "text"
            out.append({"type": kind, "text": b.text, "state": "streaming" if cut else "done"})
    return out


async def test_the_harness_can_fail(ai_sdk: Path) -> None:
    """The judge is not vacuous: the SDK's own samples pass, a chunk missing a field and a delta without
    its start are violations."""
    samples = HERE / "samples"
    code, out = check_body(ai_sdk, (samples / "text.sse").read_bytes(), "--strict")
    assert code == 0 and out["aiVersion"] == "6.0.326" and parts_of(out["message"])[0]["text"] == "Hello, world."
    code, out = check_body(ai_sdk, (samples / "invalid_chunk.sse").read_bytes())
    assert code == 1 and out["errors"][0]["stage"] == "parse" and out["errors"][0]["kind"] == "schema"
    code, out = check_body(ai_sdk, (samples / "delta_without_start.sse").read_bytes())
    assert code == 1 and out["errors"][0]["stage"] == "assemble"


async def test_edge_bodies_are_valid_for_the_sdk(ai_sdk: Path) -> None:
    """The mapping's edge cases (built as in the unit tests) are valid streams for the SDK, and assemble
    to what they say: a retried attempt leaves nothing behind, a truncated call is an input error, a
    final failure reaches useChat as its error."""
    retried = Log().start().block(0, "text", [], open=True).error("overloaded")
    retried.start().block(0, "text", ["fine"]).done()
    truncated = Log().start().block(0, "tool_call", ['{"city": "Os'], arguments=None, arguments_error="truncated")
    truncated.done("length")
    refused_key = Log().start().block(0, "tool_call", ['{"__proto__": 1}'], arguments={"__proto__": 1}).done()
    failed = Log().start().block(0, "text", ["Half"], open=True).block(1, "tool_call", ['{"a'], open=True)
    failed.error("protocol", block_index=1)
    results = {}
    for name, log in {"retried": retried, "truncated": truncated, "refused_key": refused_key, "failed": failed}.items():
        code, out = check_body(ai_sdk, body_of(log), "--strict")
        assert code == 0, (name, out["errors"])
        results[name] = out
    assert parts_of(results["retried"]["message"]) == [
        {"type": "text", "text": "", "state": "done"},
        {"type": "text", "text": "fine", "state": "done"},
    ]
    tool = parts_of(results["truncated"]["message"])[0]
    assert tool["state"] == "output-error" and tool["errorText"] == "the tool call's arguments are truncated"
    assert results["truncated"]["chat"]["onFinish"]["finishReason"] == "length"
    assert parts_of(results["refused_key"]["message"])[0]["state"] == "output-error"
    assert results["failed"]["chat"]["status"] == "error" and results["failed"]["errorChunks"] == [
        "protocol: try again"
    ]
    assert [p["state"] for p in parts_of(results["failed"]["message"])] == ["streaming", "output-error"]


async def test_invalid_tool_calls_are_input_errors_for_the_sdk(ai_sdk: Path) -> None:
    """A call whose verdict is invalid (contract 1.3) reaches ``useChat`` as the SDK's own input error, its
    errorText saying why; a valid one beside it stays an available input."""
    bad = {"pointer": "/city", "keyword": "maxLength", "message": '"Paris" is longer than 3 characters'}
    log = Log().start()
    log.block(0, "tool_call", ['{"city": "Paris"}'], arguments={"city": "Paris"}, verdict={"valid": True})
    log.block(
        1,
        "tool_call",
        ['{"city": ', '"Paris"}'],
        arguments={"city": "Paris"},
        verdict={"valid": False, "reason": "schema", "errors": [bad]},
        call_id="call_bad",
    )
    log.done("tool_use", answer={"valid": True})
    code, out = check_body(ai_sdk, body_of(log), "--strict")
    assert code == 0, out["errors"]
    parts = parts_of(out["message"])
    assert [(p["toolCallId"], p["state"]) for p in parts] == [
        ("call_0", "input-available"),
        ("call_bad", "output-error"),
    ]
    assert parts[1]["errorText"] == 'invalid tool call (schema): /city: "Paris" is longer than 3 characters'
    assert out["chat"]["onFinish"]["finishReason"] == "tool-calls"


async def test_requests_through_the_ai_package(ai_sdk: Path, fake, redis_url, key_prefix, redis_client) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with (
            running_worker(config),
            client_for(config) as sluice,
            serve_relay(config_for(redis_url, key_prefix)) as relay,
            httpx.AsyncClient() as http,
        ):
            rids = {
                name: await sluice.enqueue({"route": route, "model": model, "request": PROMPT})
                for name, (route, model) in CASES.items()
            }
            browser = sign_token(SECRET, rids["reasoning+text"], int(time.time()) + 60)  # without internal reasoning
            urls = {
                name: f"{relay.url}/v1/requests/{rid}/events?format=ai-sdk&token={SECRET}" for name, rid in rids.items()
            }
            urls["browser"] = f"{relay.url}/v1/requests/{rids['reasoning+text']}/events?format=ai-sdk&token={browser}"
            checked: dict[str, tuple[int, Any]] = {}

            async def check(name: str) -> None:
                checked[name] = await anyio.to_thread.run_sync(lambda: check_url(ai_sdk, urls[name], "--strict"))

            async with anyio.create_task_group() as tg:  # while the requests stream
                for name in urls:
                    tg.start_soon(check, name)
            results = {name: await sluice.result(rid, timeout=20) for name, rid in rids.items()}
            # after the final event there is nothing to resume: 204 (useChat: no active stream)
            ((last, _),) = await redis_client.xrevrange(f"{key_prefix}:{{req:{rids['text']}}}:events", count=1)
            gone = await http.get(urls["text"], headers={"Last-Event-ID": last.decode()})
            assert gone.status_code == 204
        for name, (code, out) in checked.items():
            result = results["reasoning+text" if name == "browser" else name]
            assert code == 0, (name, out["errors"])
            assert out["http"]["headers"]["x-vercel-ai-ui-message-stream"] == "v1"
            want = expected_parts(result, reasoning=name != "browser")
            # the SDK's assembler and useChat's own code path both build exactly the result's blocks
            assert parts_of(out["message"]) == want, name
            (message,) = out["chat"]["assistantMessages"]
            assert message["id"] == result_id(out) and parts_of(message) == want, name
            # sluice's facts in the message metadata (useChat stops reading at an error chunk: the assembler
            # reads on to the finish that carries them)
            meta = out["message"]["metadata"]["sluice"]
            assert meta["status"] == result.status and meta.get("usage") == _usage(result)
            if result.status == "completed":
                assert out["chat"]["status"] == "ready" and not out["errorChunks"]
                assert (
                    out["chat"]["onFinish"]["finishReason"]
                    == {"stop": "stop", "tool_use": "tool-calls"}[result.stop_reason or ""]
                )
            else:
                assert result.error is not None
                assert out["errorChunks"] == [f"{result.error.category}: {result.error.message}"]
                assert out["chat"]["status"] == "error" and out["chat"]["onFinish"]["isError"]
        assert any(p["type"] == "reasoning" for p in parts_of(checked["reasoning+text"][1]["message"]))
        assert len(expected_parts(results["parallel tool calls"])) == 3  # a text and two calls
    finally:
        await cleanup(redis_client, key_prefix)


def result_id(out: dict[str, Any]) -> str:
    return str(out["message"]["id"])


def _usage(result: Result) -> Any:
    return msgspec.to_builtins(result.usage)


async def test_resume_after_a_disconnect(ai_sdk: Path, fake, redis_url, key_prefix, redis_client) -> None:
    """useChat's code path cut mid-event and resumed with the last id it saw (``resumeStreamIsReplay:
    false``): the message it continues is exactly the result; and useChat's default resume (a full
    replay, no position) rebuilds the same message."""
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with (
            running_worker(config),
            client_for(config) as sluice,
            serve_relay(config_for(redis_url, key_prefix)) as relay,
        ):
            rid = await sluice.enqueue(
                {"route": "anthropic", "model": "synthetic;deltas=60;reasoning=4;tools=1;pace_ms=5", "request": PROMPT}
            )
            url = f"{relay.url}/v1/requests/{rid}/events?format=ai-sdk&token={SECRET}"
            cuts = (3, 17, 40)
            continued = {}

            async def resume(cut: int) -> None:
                continued[cut] = await anyio.to_thread.run_sync(
                    lambda: run_node(ai_sdk, "continue.mjs", "--url", url, "--cut", str(cut))[1]
                )

            async with anyio.create_task_group() as tg:  # cut while the request streams
                for cut in cuts:
                    tg.start_soon(resume, cut)
            result = await sluice.result(rid, timeout=20)
            code, replay = await anyio.to_thread.run_sync(lambda: check_url(ai_sdk, url, "--resume", "--strict"))
        want = expected_parts(result)
        assert result.status == "completed" and len(want) == 3
        for cut, out in continued.items():
            assert out["afterCut"]["status"] == "error"  # the disconnect, as useChat saw it
            assert out["requests"][1]["url"].endswith(f"&after={out['lastId']}"), cut
            assert out["status"] == "ready" and out["onFinish"]["finishReason"] == "tool-calls", cut
            (message,) = out["assistantMessages"]
            assert message["id"] == rid and parts_of(message) == want, cut
        assert code == 0 and replay["chat"]["mode"] == "resumeStream"
        (message,) = replay["chat"]["assistantMessages"]
        assert parts_of(message) == want
    finally:
        await cleanup(redis_client, key_prefix)
