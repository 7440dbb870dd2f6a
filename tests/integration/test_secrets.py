"""A provider that echoes the route's API key: the key never reaches a Redis value, a log line or an error
message, wherever it comes back (an error body, SSE data, a header, split across reads, an AWS event-stream
message); the raw entries that held it say they were redacted, ``sluice audit`` still explains the stream
from what was stored, and the echo never changes the outcome: the request ends exactly as it does when the
provider sends the marker in the key's place."""

from __future__ import annotations

import logging

import msgspec
import pytest

from sluice.cli.audit import audit_request
from sluice.normalizer.stream import NORMALIZER_VERSION
from sluice.schemas.events import decode_event
from sluice.schemas.keys import Keys
from sluice.schemas.raw import REDACTION_MARKER, RawEntry
from sluice.worker.config import Route
from tests.eventstream_transcripts import START, exc, text
from tests.faults.invariants import assert_no_secret, check_request
from tests.faults.upstream import Received, Reply, ScriptedUpstream
from tests.helpers import briefs
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio


def _key_of(req: Received) -> str:
    return req.headers["authorization"].removeprefix("Bearer ")


def _chunk(content: str) -> bytes:
    doc = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + msgspec.json.encode(doc) + b"\n\n"


def _done() -> bytes:
    doc = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    return b"data: " + msgspec.json.encode(doc) + b"\n\ndata: [DONE]\n\n"


def _respond(req: Received, n: int) -> Reply:
    key = _key_of(req)
    model = msgspec.json.decode(req.body)["model"]
    if model == "echo-401":
        body = msgspec.json.encode(
            {
                "error": {
                    "message": f"Incorrect API key provided: {key}.",
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            }
        )
        return Reply(401, {"content-type": "application/json", "x-request-id": key}, [body])
    if model == "echo-midstream":
        err = b"data: " + msgspec.json.encode({"error": {"message": f"key {key} was revoked", "code": "401"}})
        return Reply(200, pieces=[_chunk("Hello"), err + b"\n\n"])
    if model == "echo-split":
        # The key in a text delta, cut in three across reads: no read holds it whole.
        line = _chunk(f"your key is {key}!")
        a, b = line.index(key.encode()) + 3, line.index(key.encode()) + 11
        return Reply(200, pieces=[line[:a], line[a:b], line[b:], _done()], pace=0.05)
    raise AssertionError(model)


@pytest.mark.parametrize(
    ("model", "state", "category"),
    [("echo-401", "failed", "authentication"), ("echo-midstream", "failed", None), ("echo-split", "completed", None)],
)
async def test_an_echoed_api_key_is_never_stored_or_logged(
    redis_url, key_prefix, redis_client, caplog, model, state, category
):
    caplog.set_level(logging.DEBUG, logger="sluice")
    keys = Keys(key_prefix)
    async with ScriptedUpstream(_respond) as upstream:
        config = make_config(redis_url, key_prefix, upstream.base_url)
        try:
            async with running_worker(config), client_for(config) as client:
                rid = await client.enqueue(
                    {
                        "route": "openai-chat",
                        "model": model,
                        "request": {"messages": [{"role": "user", "content": "hi"}]},
                    }
                )
                result = await client.result(rid, timeout=30)
            assert _key_of(upstream.received[0]) == API_KEY  # the provider did get the key, and echoed it
            assert result.status == state
            if category:
                assert result.error is not None and result.error.category == category
            if result.error:
                assert REDACTION_MARKER in result.error.message and API_KEY not in result.error.message
            await check_request(redis_client, keys, rid)
            await assert_no_secret(redis_client, key_prefix, API_KEY)
            raw = [RawEntry.from_redis(i, f) for i, f in await redis_client.xrange(keys.request(rid).raw)]
            redacted = [e for e in raw if e.redacted]
            if model == "echo-401":
                assert raw[0].kind == "http" and raw[0].body is not None and REDACTION_MARKER.encode() in raw[0].body
                assert REDACTION_MARKER in raw[0].data  # the echoing header
            else:
                assert len(redacted) == 1 and REDACTION_MARKER in redacted[0].data
                assert not any(REDACTION_MARKER in e.data for e in raw if not e.redacted)
            if model == "echo-split":
                assert result.blocks[0].text == f"your key is {REDACTION_MARKER}!"
            audit = await audit_request(redis_client, keys, rid, current_version=NORMALIZER_VERSION)
            assert audit.ok, audit
            for record in caplog.records:
                assert API_KEY not in record.getMessage()
                assert not any(API_KEY in str(v) for v in record.__dict__.values())
        finally:
            await cleanup(redis_client, key_prefix)


async def test_the_request_id_goes_upstream_only_when_the_route_asks(redis_url, key_prefix, redis_client):
    def respond(req: Received, n: int) -> Reply:
        return Reply(200, pieces=[_chunk("ok"), _done()])

    async with ScriptedUpstream(respond) as upstream:
        config = make_config(redis_url, key_prefix, upstream.base_url)
        on = msgspec.structs.replace(config.routes["openai-chat"], send_request_id=True)
        off = msgspec.structs.replace(on, send_request_id=False)  # the default of a route
        assert Route(dialect="openai-chat", base_url="http://x").send_request_id is False
        config = msgspec.structs.replace(config, routes={"on": on, "off": off})
        try:
            async with running_worker(config), client_for(config) as client:
                for route in ("on", "off"):
                    job = {
                        "route": route,
                        "request_id": f"rid-{route}",
                        "request": {"messages": [{"role": "user", "content": "hi"}]},
                    }
                    rid = await client.enqueue(job)
                    assert (await client.result(rid, timeout=30)).status == "completed"
            sent = [r.headers.get("x-sluice-request-id") for r in upstream.received]
            assert sent == ["rid-on", None]
        finally:
            await cleanup(redis_client, key_prefix)


def _bedrock(req: Received, n: int) -> Reply:
    """A ConverseStream answer that echoes the key twice (a text delta, then a ``validationException``), or,
    for the model ``plain``, says the marker in its place; the key is cut across reads."""
    key = _key_of(req)
    word = REDACTION_MARKER if "/model/plain/" in req.path else key
    body = b"".join(
        [START, text(0, f"key {word}."), exc("validationException", {"message": f"The token {word} is invalid."})]
    )
    at = body.index(word.encode()) + 5
    return Reply(200, {"content-type": "application/vnd.amazon.eventstream"}, [body[:at], body[at:]], pace=0.05)


async def test_a_bedrock_exception_that_echoes_the_key_ends_as_without_the_echo(
    redis_url, key_prefix, redis_client, caplog
):
    """AWS event-stream: the key inside a length-prefixed, CRC-checked message is redacted after the message
    is decoded, so the exception still fails the request ``invalid_request``, event for event as the same
    stream with the marker, and the stored frames replay."""
    caplog.set_level(logging.DEBUG, logger="sluice")
    keys = Keys(key_prefix)
    async with ScriptedUpstream(_bedrock) as upstream:
        config = make_config(redis_url, key_prefix, upstream.base_url)
        route = Route(dialect="bedrock-converse", base_url=upstream.base_url, api_key_env=KEY_ENV)
        config = msgspec.structs.replace(config, routes={"bedrock": route})
        try:
            async with running_worker(config), client_for(config) as client:
                rids = {
                    model: await client.enqueue(
                        {
                            "route": "bedrock",
                            "model": model,
                            "request": {"messages": [{"role": "user", "content": "hi"}]},
                        }
                    )
                    for model in ("echo", "plain")
                }
                results = {model: await client.result(rid, timeout=30) for model, rid in rids.items()}
            assert [_key_of(r) for r in upstream.received] == [API_KEY, API_KEY]
            events = {
                model: [decode_event(f[b"event"]) for _, f in await redis_client.xrange(keys.request(rid).events)]
                for model, rid in rids.items()
            }
            assert briefs(events["echo"]) == [
                "start echo",
                "open 0 text",
                f"delta 0 text 'key {REDACTION_MARKER}.'",
                "failed invalid_request validationException retryable=False",
            ]
            for model in ("echo", "plain"):
                result = results[model]
                assert result.status == "failed" and result.error is not None
                assert result.error.category == "invalid_request"
                assert result.error.message == f"The token {REDACTION_MARKER} is invalid."
                assert result.blocks[0].text == f"key {REDACTION_MARKER}."

            # Event for event the same, past the stream.start that names the model requested (ids and times aside).
            def bare(model: str) -> list[object]:
                return [msgspec.structs.replace(e, ts=0, stream_id="", request_id="") for e in events[model][1:]]

            assert bare("echo") == bare("plain")
            raw = [RawEntry.from_redis(i, f) for i, f in await redis_client.xrange(keys.request(rids["echo"]).raw)]
            assert [(e.kind, e.event, e.redacted) for e in raw] == [
                ("http", "http.response", False),
                ("frame", "messageStart", False),
                ("frame", "contentBlockDelta", True),
                ("frame", "validationException", True),
            ]
            plain_raw = await redis_client.xrange(keys.request(rids["plain"]).raw)
            assert [e.frame for e in raw[1:]] == [RawEntry.from_redis(i, f).frame for i, f in plain_raw[1:]]
            for rid in rids.values():
                await check_request(redis_client, keys, rid)
                audit = await audit_request(redis_client, keys, rid, current_version=NORMALIZER_VERSION)
                assert audit.ok, audit
            await assert_no_secret(redis_client, key_prefix, API_KEY)
            for record in caplog.records:
                assert API_KEY not in record.getMessage()
                assert not any(API_KEY in str(v) for v in record.__dict__.values())
        finally:
            await cleanup(redis_client, key_prefix)
