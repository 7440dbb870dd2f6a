"""The fake provider's pure parts: renderers (checked through sluice's own normalizer and against each
provider's framing), body faults, error shapes, and the scenario language."""

from __future__ import annotations

import json

import pytest

from sluice.harness.fake.render import (
    DIALECTS,
    STAMP_PLACEHOLDER,
    Reasoning,
    Script,
    Text,
    ToolCall,
    error_body,
    inject,
    render,
    render_error,
    render_tagged,
    split_events,
)
from sluice.harness.fake.scenarios import Scenario, ScenarioError, build_script, encode_scenario, parse_scenario
from sluice.normalizer.eventstream import EventStreamDecoder
from sluice.normalizer.sse import SSEDecoder
from tests.helpers import briefs, check_invariants, rechunk, run

SCRIPT = Script(
    model="m-1",
    blocks=(
        Reasoning(("Think", " hard"), signature="SIG"),
        Text(("Hel", "lo ", "wörld")),
        ToolCall("get_weather", "abc", ('{"ci', 'ty": "Pa', 'ris"}')),
        ToolCall("noop", "def", ()),
    ),
    stop="tool_use",
    input_tokens=5,
    output_tokens=7,
    id="ID1",
)
TEXT = ["open 1 text", "delta 1 text 'Hel'", "delta 1 text 'lo '", "delta 1 text 'wörld'", "stop 1"]
THINK = ["open 0 reasoning internal", "delta 0 text 'Think'", "delta 0 text ' hard'"]
ARGS = ["delta {i} json_text '{{\"ci'", "delta {i} json_text 'ty\": \"Pa'", "delta {i} json_text 'ris\"}}'"]

EXPECTED = {
    # Chat has no signature; the calls stay open until finish_reason closes them.
    "openai-chat": [
        "start m-1",
        *THINK,
        "stop 0",
        *TEXT,
        "open 2 tool_call get_weather call_abc",
        *(a.format(i=2) for a in ARGS),
        "open 3 tool_call noop call_def",
        'stop 2 {"city":"Paris"}',
        "stop 3 {}",
        "done tool_use tool_calls",
    ],
    # The summary is public reasoning; encrypted_content is an opaque internal reasoning item.
    "openai-responses": [
        "start m-1",
        "open 0 reasoning public",
        "delta 0 text 'Think'",
        "delta 0 text ' hard'",
        "stop 0",
        "open 1 reasoning internal",
        "delta 1 signature 'SIG'",
        "stop 1",
        *(t.replace(" 1", " 2") for t in TEXT),
        "open 3 tool_call get_weather call_abc",
        *(a.format(i=3) for a in ARGS),
        'stop 3 {"city":"Paris"}',
        "open 4 tool_call noop call_def",
        "stop 4 {}",
        "done tool_use completed",
    ],
    "anthropic": [
        "start m-1",
        *THINK,
        "delta 0 signature 'SIG'",
        "stop 0",
        *TEXT,
        "open 2 tool_call get_weather toolu_abc",
        *(a.format(i=2) for a in ARGS),
        'stop 2 {"city":"Paris"}',
        "open 3 tool_call noop toolu_def",
        "stop 3 {}",
        "done tool_use tool_use",
    ],
    # Whole calls without ids: sluice synthesizes the call id; arguments arrive as one object.
    "gemini": [
        "start m-1",
        *THINK,
        "delta 0 signature 'SIG'",
        "stop 0",
        *TEXT,
        "open 2 tool_call get_weather call_req_t:1_2",
        'delta 2 json_text \'{"city":"Paris"}\'',
        'stop 2 {"city":"Paris"}',
        "open 3 tool_call noop call_req_t:1_3",
        "delta 3 json_text '{}'",
        "stop 3 {}",
        "done tool_use STOP",
    ],
    # ConverseStream names no model; text and reasoning blocks open at their first delta.
    "bedrock-converse": [
        "start None",
        *THINK,
        "delta 0 signature 'SIG'",
        "stop 0",
        *TEXT,
        "open 2 tool_call get_weather tooluse_abc",
        *(a.format(i=2) for a in ARGS),
        'stop 2 {"city":"Paris"}',
        "open 3 tool_call noop tooluse_def",
        "stop 3 {}",
        "done tool_use tool_use",
    ],
}


def body(dialect: str, script: Script = SCRIPT) -> bytes:
    return b"".join(render(dialect, script))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_rendered_stream_normalizes_to_the_script(dialect: str) -> None:
    _, events, result = run(dialect, body(dialect))
    assert briefs(events) == EXPECTED[dialect]
    check_invariants(events)
    assert result.status == "completed"
    assert result.usage is not None
    assert (result.usage.input_tokens, result.usage.output_tokens) == (5, 7)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_byte_at_a_time_changes_nothing(dialect: str) -> None:
    raw = body(dialect)
    assert briefs(run(dialect, rechunk(raw, range(len(raw))))[1]) == EXPECTED[dialect]


@pytest.mark.parametrize(
    ("dialect", "done"),
    [
        ("openai-chat", "done length length"),
        ("openai-responses", "done length max_output_tokens"),
        ("anthropic", "done length max_tokens"),
        ("gemini", "done length MAX_TOKENS"),
    ],
)
def test_length_stop(dialect: str, done: str) -> None:
    script = Script(model="m", blocks=(Text(("a",)),), stop="length")
    assert briefs(run(dialect, body(dialect, script))[1]) == [
        "start m",
        "open 0 text",
        "delta 0 text 'a'",
        "stop 0",
        done,
    ]


@pytest.mark.parametrize(
    ("dialect", "done"),
    [
        ("openai-chat", "done stop stop"),
        ("openai-responses", "done stop completed"),
        ("anthropic", "done stop end_turn"),
        ("gemini", "done stop STOP"),
    ],
)
def test_text_only_stop(dialect: str, done: str) -> None:
    script = Script(model="m", blocks=(Text(("a", "b")),))
    assert briefs(run(dialect, body(dialect, script))[1])[-1] == done


# -- each provider's framing ------------------------------------------------------------------------------


def _data(event: bytes) -> dict:
    (frame,) = SSEDecoder().feed(event)
    return json.loads(frame.data)


def test_openai_chat_framing() -> None:
    events = render("openai-chat", SCRIPT)
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") and b"\r" not in e for e in events)
    assert events[-1] == b"data: [DONE]\n\n"
    usage = _data(events[-2])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 12
    chunks = [_data(e) for e in events[:-2]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and all(c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    # The first fragment of each call names it; the rest carry only index and an argument fragment.
    assert calls[0] == {
        "index": 0,
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert calls[1] == {"index": 0, "function": {"arguments": '{"ci'}}
    assert calls[4]["index"] == 1 and calls[4]["id"] == "call_def"


def test_openai_responses_framing() -> None:
    events = render("openai-responses", SCRIPT)
    datas = [_data(e) for e in events]
    assert [d["sequence_number"] for d in datas] == list(range(len(events)))
    for event, data in zip(events, datas, strict=True):
        assert event.startswith(b"event: " + data["type"].encode() + b"\ndata: ")
    assert [d["type"] for d in datas[:2]] == ["response.created", "response.in_progress"]
    assert datas[-1]["type"] == "response.completed"
    final = datas[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 12
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][0]["encrypted_content"] == "SIG"
    done = [d for d in datas if d["type"] == "response.function_call_arguments.done"]
    assert [(d["item_id"], d["arguments"]) for d in done] == [("fc_ID102", '{"city": "Paris"}'), ("fc_ID103", "")]
    assert b"[DONE]" not in b"".join(events)


def test_anthropic_framing() -> None:
    datas = [_data(e) for e in render("anthropic", SCRIPT)]
    types = [d["type"] for d in datas]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert "ping" in types
    assert datas[0]["message"]["usage"]["input_tokens"] == 5
    assert datas[-2]["delta"]["stop_reason"] == "tool_use" and datas[-2]["usage"] == {"output_tokens": 7}
    starts = [d["content_block"] for d in datas if d["type"] == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert starts[2] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}


def test_gemini_framing() -> None:
    events = render("gemini", SCRIPT)
    # CRLF framing, data lines only, no end marker: the last chunk carries finishReason, then EOF.
    assert all(e.startswith(b"data: ") and e.endswith(b"\r\n\r\n") and e.count(b"\n") == 2 for e in events)
    datas = [_data(e) for e in events]
    assert [d["candidates"][0].get("finishReason") for d in datas] == [None] * (len(datas) - 1) + ["STOP"]
    parts = [p for d in datas for p in d["candidates"][0]["content"]["parts"]]
    assert {"text": " hard", "thought": True, "thoughtSignature": "SIG"} in parts
    assert {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}} in parts
    assert datas[-1]["usageMetadata"] == {"promptTokenCount": 5, "candidatesTokenCount": 7, "totalTokenCount": 12}
    assert b'"modelVersion": "m-1"' in events[0]  # Google's ": " separators


def test_unknown_dialect() -> None:
    with pytest.raises(ValueError, match="unknown dialect"):
        render("cohere", SCRIPT)


# -- body faults ----------------------------------------------------------------------------------------------


def faulty(dialect: str, script: Script = SCRIPT, **kw: object) -> tuple[list[str], object]:
    events = inject(dialect, script, render_tagged(dialect, script), **kw)  # type: ignore[arg-type]
    _, normalized, result = run(dialect, b"".join(data for _, data in events))
    check_invariants(normalized)
    return briefs(normalized), result


@pytest.mark.parametrize("dialect", DIALECTS)
def test_drop_terminal_is_interrupted(dialect: str) -> None:
    got, result = faulty(dialect, drop_terminal=True)
    assert got[-1] == "interrupted transport None retryable=False"
    assert not any(b.startswith("done") for b in got)
    assert result.status == "interrupted"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("dialect", "kind", "last"),
    [
        ("openai-chat", "overloaded", "failed overloaded server_is_overloaded retryable=True"),
        ("openai-chat", "rate_limit", "failed rate_limit rate_limit_exceeded retryable=True"),
        ("openai-responses", "overloaded", "failed overloaded server_is_overloaded retryable=True"),
        ("openai-responses", "server_error", "failed server_error server_error retryable=True"),
        ("anthropic", "overloaded", "failed overloaded overloaded_error retryable=True"),
        ("anthropic", "server_error", "failed server_error api_error retryable=True"),
        ("gemini", "overloaded", "failed overloaded UNAVAILABLE retryable=True"),
        ("gemini", "rate_limit", "failed rate_limit RESOURCE_EXHAUSTED retryable=True"),
    ],
)
def test_error_after_keeps_what_came_before(dialect: str, kind: str, last: str) -> None:
    n = len(render(dialect, SCRIPT)) - 3
    got, _ = faulty(dialect, error_after=n, error_kind=kind)
    assert got[-1] == last
    assert "delta 1 text 'Hel'" in got or "delta 2 text 'Hel'" in got


@pytest.mark.parametrize("dialect", DIALECTS)
def test_error_before_anything(dialect: str) -> None:
    got, _ = faulty(dialect, error_after=0)
    assert got == ["start None", got[-1]] and got[-1].startswith("failed overloaded")


def test_responses_error_is_error_then_failed() -> None:
    (error, failed) = (_data(e) for e in render_error("openai-responses", SCRIPT, "overloaded", seq=7))
    assert error == {
        "type": "error",
        "sequence_number": 7,
        "code": "server_is_overloaded",
        "message": error["message"],
        "param": None,
    }
    assert failed["type"] == "response.failed" and failed["sequence_number"] == 8
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == "server_is_overloaded"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_malformed_json_is_a_protocol_failure(dialect: str) -> None:
    got, _ = faulty(dialect, malformed_json=2)
    assert got[-1] == "failed protocol None retryable=False"


def test_malformed_done_marker() -> None:
    events = inject("openai-chat", SCRIPT, render_tagged("openai-chat", SCRIPT), malformed_json=14)
    assert events[-1][1] == b"data: {\n\n"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_invalid_utf8_goes_into_a_text_delta(dialect: str) -> None:
    tagged = render_tagged(dialect, SCRIPT)
    first_text = next(i for i, (tag, _) in enumerate(tagged) if tag == "text")
    events = inject(dialect, SCRIPT, tagged, invalid_utf8=first_text + 1)
    assert [i for i, (a, b) in enumerate(zip(tagged, events, strict=True)) if a != b] == [first_text]
    assert b'"\xffHel"' in events[first_text][1]
    got, _ = faulty(dialect, invalid_utf8=first_text + 1)
    assert got[-1] == "failed protocol None retryable=False"  # the default limit: invalid UTF-8 fails


@pytest.mark.parametrize("dialect", ["openai-chat", "openai-responses", "anthropic"])
def test_truncate_tool_ends_inside_the_arguments(dialect: str) -> None:
    got, result = faulty(dialect, truncate_tool=True)
    assert got[-2:] == [got[-2], "interrupted transport None retryable=False"]
    assert got[-2].endswith("json_text '{\"ci'")
    call = [b for b in result.blocks if b.kind == "tool_call"]  # type: ignore[attr-defined]
    assert [(c.arguments, c.arguments_text) for c in call] == [(None, '{"ci')]


def test_truncate_tool_gemini_cuts_the_whole_call_event() -> None:
    events = inject("gemini", SCRIPT, render_tagged("gemini", SCRIPT), truncate_tool=True)
    assert b"functionCall" in events[-1][1] and not events[-1][1].endswith(b"\r\n\r\n")
    got, result = faulty("gemini", truncate_tool=True)
    assert got[-1] == "interrupted transport None retryable=False"
    assert not [b for b in result.blocks if b.kind == "tool_call"]  # type: ignore[attr-defined]


BAD = Script(model="m", blocks=(Text(("Hi",)), ToolCall("f", "x", ('{"a": ', "1,"))), stop="tool_use")


@pytest.mark.parametrize("dialect", ["openai-chat", "openai-responses", "anthropic"])
def test_bad_tool_json_is_well_terminated(dialect: str) -> None:
    raw = body(dialect, BAD)
    assert raw.endswith((b"data: [DONE]\n\n", b'"type":"message_stop"}\n\n')) or b"response.completed" in raw
    got, result = faulty(dialect, BAD)
    assert got[-1] == "failed protocol None retryable=False"  # sluice refuses unparseable arguments
    assert [(b.arguments, b.arguments_text) for b in result.blocks if b.kind == "tool_call"] == [(None, '{"a": 1,')]  # type: ignore[attr-defined]


def test_bad_tool_json_gemini_is_malformed_function_call() -> None:
    events = render("gemini", BAD)
    assert b"functionCall" not in b"".join(events)
    assert _data(events[-1])["candidates"][0]["finishReason"] == "MALFORMED_FUNCTION_CALL"
    got, _ = faulty("gemini", BAD)
    assert got[-1] == "failed protocol MALFORMED_FUNCTION_CALL retryable=False"


# -- HTTP error bodies -------------------------------------------------------------------------------------


def test_error_bodies_have_each_providers_shape() -> None:
    assert json.loads(error_body("anthropic", 529, "Overloaded", request_id="req_1")) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
        "request_id": "req_1",
    }
    assert json.loads(error_body("openai-chat", 429, "slow down")) == {
        "error": {"message": "slow down", "type": "requests", "param": None, "code": "rate_limit_exceeded"}
    }
    assert json.loads(error_body("openai-responses", 401, "no")) == {
        "error": {"message": "no", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    }
    assert json.loads(error_body("gemini", 503, "busy")) == {
        "error": {"code": 503, "message": "busy", "status": "UNAVAILABLE"}
    }
    assert json.loads(error_body("anthropic", 401, "invalid x-api-key"))["error"]["type"] == "authentication_error"
    assert json.loads(error_body("gemini", 418, "?"))["error"]["status"] == "INVALID_ARGUMENT"
    assert json.loads(error_body("anthropic", 599, "?"))["error"]["type"] == "api_error"


def test_render_error_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown error kind"):
        render_error("anthropic", SCRIPT, "meltdown")


# -- transcripts split byte for byte ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "pieces"),
    [
        (b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n", [b"data: a\r\ndata: b\r\n\r\n", b"data: c\r\n\r\n"]),
        (b"data: a\n\n: keep\n\ndata: b\n\ntail", [b"data: a\n\n", b": keep\n\n", b"data: b\n\n", b"tail"]),
        (b"data: a\r\rdata: b\n\r\n", [b"data: a\r\r", b"data: b\n\r\n"]),
        (b"", []),
    ],
)
def test_split_events(raw: bytes, pieces: list[bytes]) -> None:
    assert split_events(raw) == pieces
    assert b"".join(split_events(raw)) == raw


@pytest.mark.parametrize("dialect", [d for d in DIALECTS if d != "bedrock-converse"])  # SSE bodies only
def test_split_events_finds_the_rendered_events(dialect: str) -> None:
    assert split_events(body(dialect)) == render(dialect, SCRIPT)


def test_rendered_frames_decode_one_message_each() -> None:
    pieces = render("bedrock-converse", SCRIPT)
    decoder = EventStreamDecoder()
    assert [m.frame for m in decoder.feed(b"".join(pieces))] == pieces
    assert decoder.close() == 0


# -- the scenario language ------------------------------------------------------------------------------


def test_parse_synthetic_keys() -> None:
    sc = parse_scenario(
        "synthetic;deltas=3;words=2-4;tools=2;reasoning=1;pace_ms=2.5;chunk=1;stamp=1;seed=9;id=x;reset=4;"
        "status=429;retry_after=1.5;times=2;error_after=0;error=rate_limit;text=a%20b%3Bc"
    )
    assert (sc.kind, sc.deltas, sc.words, sc.tools, sc.reasoning, sc.pace_ms, sc.chunk) == (
        "synthetic",
        3,
        (2, 4),
        2,
        1,
        2.5,
        1,
    )
    assert (sc.stamp, sc.seed, sc.reset, sc.status, sc.retry_after, sc.times) == (True, 9, 4, 429, "1.5", 2)
    assert (sc.error_after, sc.error, sc.text) == (0, "rate_limit", "a b;c")
    assert sc.faulty
    plain = sc.without_faults()
    assert not plain.faulty and (plain.reset, plain.status, plain.error_after, plain.deltas) == (None, 0, None, 3)


def test_hold_is_transport_not_a_fault() -> None:
    sc = parse_scenario("transcript:hello;hold=g-1.a;status=503;times=1")
    assert sc.hold == "g-1.a" and sc.without_faults().hold == "g-1.a"  # times=K never drops the gate


def test_gemini_error_bodies_carry_retry_info_and_the_quota() -> None:
    body = json.loads(error_body("gemini", 429, "busy", retry_delay_s=47.6, quota_id="PerMinute"))
    assert body["error"]["details"] == [
        {
            "@type": "type.googleapis.com/google.rpc.QuotaFailure",
            "violations": [
                {"quotaMetric": "generativelanguage.googleapis.com/generate_content_requests", "quotaId": "PerMinute"}
            ],
        },
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "47.6s"},
    ]
    assert json.loads(error_body("gemini", 503, "x", retry_delay_s=2))["error"]["details"][0]["retryDelay"] == "2s"
    # The other dialects carry the hint in headers only: their bodies do not change.
    for dialect in ("anthropic", "openai-chat"):
        assert error_body(dialect, 429, "m", retry_delay_s=3, quota_id="q") == error_body(dialect, 429, "m")


def test_parse_transcript_and_plain_names() -> None:
    sc = parse_scenario("transcript:weather;pace_ms=5;drop_terminal=1")
    assert (sc.kind, sc.transcript, sc.pace_ms, sc.drop_terminal) == ("transcript", "weather", 5.0, True)
    plain = parse_scenario("claude-sonnet-4-5")
    assert (plain.kind, plain.model, plain.faulty) == ("synthetic", "claude-sonnet-4-5", False)
    assert parse_scenario("synthetic").model is None


def test_encoded_scenario_fits_a_gemini_model_name() -> None:
    raw = "synthetic;deltas=2;text=h%C3%A9;status=529;times=1"
    encoded = encode_scenario(raw)
    assert encoded.startswith("scenario-") and all(c.isalnum() or c in "-_" for c in encoded)
    assert parse_scenario(encoded) == parse_scenario(raw)
    with pytest.raises(ScenarioError, match="base64url"):
        parse_scenario("scenario-!!!")


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("synthetic;nope=1", "unknown scenario key"),
        ("synthetic;deltas=x", "expected an integer"),
        ("synthetic;deltas", "expected key=value"),
        ("synthetic;words=5-2", "expected 5..1000"),
        ("synthetic;chunk=0", "expected 1.."),
        ("synthetic;status=200", "expected 400..599"),
        ("synthetic;pace_ms=-1", "expected 0..3600000"),
        ("synthetic;stamp=yes", "expected 0 or 1"),
        ("synthetic;retry_after=soon", "retry_after"),
        ("synthetic;stop=pause", "expected stop or length"),
        ("synthetic;error=meltdown", "expected one of"),
        ("transcript:../etc/passwd", "transcript name"),
        ("transcript:hello;deltas=3", "only to synthetic"),
        ("synthetic;hold=a/b", "a gate name"),
        ("synthetic;hold=", "a gate name"),
    ],
)
def test_bad_scenarios(model: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(model)


def test_build_script_is_seeded() -> None:
    sc = parse_scenario("synthetic;deltas=5;words=1-1;tools=2;reasoning=3;seed=7")
    script = build_script(sc)
    assert script == build_script(sc) != build_script(parse_scenario("synthetic;deltas=5;tools=2;seed=8"))
    kinds = [type(b).__name__ for b in script.blocks]
    assert kinds == ["Reasoning", "Text", "ToolCall", "ToolCall"]
    reasoning, text, *calls = script.blocks
    assert len(reasoning.deltas) == 3 and reasoning.signature  # type: ignore[union-attr]
    assert len(text.deltas) == 5 and all(len(d.split()) == 1 for d in text.deltas)  # type: ignore[union-attr]
    assert [json.loads(c.arguments)["call"] for c in calls] == [0, 1]  # type: ignore[union-attr]
    assert all(len(c.fragments) >= 2 for c in calls)  # type: ignore[union-attr]
    assert script.stop == "tool_use" and script.model == "fake-model"


def test_build_script_text_literal_and_stamps() -> None:
    script = build_script(parse_scenario("synthetic;text=one%20two%20three%20four;words=2"))
    assert script.blocks == (Text(("one two ", "three four")),)
    split = build_script(parse_scenario("synthetic;text=abcdef;deltas=3;stamp=1")).blocks[0]
    assert split == Text(tuple(STAMP_PLACEHOLDER + p for p in ("ab", "cd", "ef")))
    assert build_script(parse_scenario("synthetic;deltas=0")).blocks == ()


def test_build_script_bad_tool_json() -> None:
    (call,) = build_script(parse_scenario("synthetic;deltas=0;tools=1;bad_tool_json=1")).blocks
    with pytest.raises(ValueError):
        json.loads(call.arguments)  # type: ignore[union-attr]


def test_scenario_is_immutable() -> None:
    sc = Scenario(raw="synthetic", kind="synthetic")
    with pytest.raises(AttributeError):
        sc.deltas = 3  # type: ignore[misc]
