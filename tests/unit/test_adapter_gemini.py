"""The Gemini adapter: every transcript's exact sequence, the edge cases of parts and signatures, and the
mapping tables (finishReason, blockReason, error status), each written out by hand."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.normalizer.adapters import adapter_class
from sluice.normalizer.adapters.gemini import GeminiAdapter
from sluice.schemas.events import BlockStart, StreamError, Usage
from tests.helpers import TRANSCRIPTS, briefs, check_invariants, run

GEMINI = TRANSCRIPTS / "gemini"


def sse(*objs: Any, eol: bytes = b"\r\n") -> bytes:
    """Frame provider objects as Gemini does: one ``data:`` line each, CRLF, a blank line."""
    return b"".join(b"data: " + json.dumps(o, ensure_ascii=False).encode() + eol + eol for o in objs)


def chunk(*parts: dict[str, Any], finish: str | None = None, **top: Any) -> dict[str, Any]:
    cand: dict[str, Any] = {"content": {"parts": list(parts), "role": "model"}, "index": 0}
    if finish:
        cand["finishReason"] = finish
    return {"candidates": [cand], "modelVersion": "gemini-x", **top}


def text(s: str, **kw: Any) -> dict[str, Any]:
    return {"text": s, **kw}


def call(name: str, args: Any = None, **kw: Any) -> dict[str, Any]:
    fc: dict[str, Any] = {"name": name}
    if args is not None:
        fc["args"] = args
    return {"functionCall": fc, **kw}


def go(*objs: Any) -> tuple[list[str], Any]:
    _, events, result = run("gemini", sse(*objs))
    check_invariants(events)
    return briefs(events), result


# -- transcripts, spelled out ---------------------------------------------------------------------

TRANSCRIPT_BRIEFS: dict[str, list[str]] = {
    # Output checks' transcripts (tests/checked_cases.py); the same bytes, unchecked.
    "parallel_weather_time": [
        "start gemini-2.5-flash",
        "open 0 tool_call get_weather call_req_t:1_0",
        'delta 0 json_text \'{"city":"Paris"}\'',
        "delta 0 signature 'SIGw1'",
        'stop 0 {"city":"Paris"}',
        "open 1 tool_call get_time call_req_t:1_1",
        'delta 1 json_text \'{"tz":"Europe/Paris"}\'',
        'stop 1 {"tz":"Europe/Paris"}',
        "done tool_use STOP",
    ],
    "json_answer": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text '{\"city\": '",
        'delta 0 text \'"Paris", "te\'',
        "delta 0 text 'mp_c\": 21}'",
        "stop 0",
        "done stop STOP",
    ],
    "utf8_deltas": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'При'",
        "delta 0 text 'вет, '",
        "delta 0 text 'ми'",
        "delta 0 text 'р! 你好'",
        "delta 0 text '，世界'",
        "delta 0 text ' 👋🏽'",
        "delta 0 text ' é\\u2028ok'",
        "stop 0",
        "done stop STOP",
    ],
    "text_then_function_call": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Let me check '",
        "delta 0 text 'the weather.'",
        "stop 0",
        "open 1 tool_call get_weather call_req_t:1_1",
        "delta 1 json_text " + repr('{"city":"Zürich \\"HB\\"","path":"C:\\\\tmp\\\\x","units":["c","f"],"days":3}'),
        "delta 1 signature 'CiQBcsjafGSig1=='",
        'stop 1 {"city":"Zürich \\"HB\\"","days":3,"path":"C:\\\\tmp\\\\x","units":["c","f"]}',
        "done tool_use STOP",
    ],
    "parallel_calls_one_chunk": [
        "start gemini-2.5-flash",
        "open 0 tool_call get_weather call_req_t:1_0",
        """delta 0 json_text '{"city":"Paris"}'""",
        "delta 0 signature 'SIGp1'",
        'stop 0 {"city":"Paris"}',
        "open 1 tool_call get_weather call_req_t:1_1",
        """delta 1 json_text '{"city":"Tokyo"}'""",
        'stop 1 {"city":"Tokyo"}',
        "done tool_use STOP",
    ],
    "parallel_calls_spread": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Checking both.'",
        "stop 0",
        "open 1 tool_call get_time call_req_t:1_1",
        """delta 1 json_text '{"tz":"Europe/Paris"}'""",
        'stop 1 {"tz":"Europe/Paris"}',
        "open 2 tool_call list_alarms call_req_t:1_2",
        "stop 2 {}",
        "done tool_use STOP",
    ],
    "function_call_with_id": [
        "start gemini-2.5-flash",
        "open 0 tool_call lookup fc_7a1",
        """delta 0 json_text '{"q":"x"}'""",
        'stop 0 {"q":"x"}',
        "done tool_use STOP",
    ],
    "thought_then_text": [
        "start gemini-2.5-flash",
        "open 0 reasoning internal",
        "delta 0 text '**Plan** add '",
        "delta 0 text 'the numbers.'",
        "delta 0 signature 'THOUGHTsig=='",
        "stop 0",
        "open 1 text",
        "delta 1 text '2 + 2 '",
        "delta 1 text '= 4.'",
        "delta 1 signature 'TEXTsig=='",
        "stop 1",
        "done stop STOP",
    ],
    "error_after_text": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Partial ans'",
        "delta 0 text 'wer'",
        "failed overloaded UNAVAILABLE retryable=True",
    ],
    "eof_without_finish": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Looks complete.'",
        "interrupted transport None retryable=False",
    ],
    "eof_inside_event": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Calling.'",
        "interrupted transport None retryable=False",
    ],
    "unknown_fields_and_parts": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Result: 1'",
        "delta 0 text ' done.'",
        "stop 0",
        "warning unknown_events_skipped 4",
        "done stop STOP",
    ],
    "max_tokens": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'One, two, '",
        "delta 0 text 'three'",
        "stop 0",
        "done length MAX_TOKENS",
    ],
    "safety": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Here is how'",
        "stop 0",
        "done content_filter SAFETY",
    ],
    "prompt_blocked": [
        "start gemini-1.5-flash-002",
        "done content_filter PROHIBITED_CONTENT",
    ],
    # A gateway's error chunk carries the usage billed so far: it is on the stream.error (golden).
    "error_with_usage_metadata": [
        "start gemini-2.5-pro",
        "open 0 reasoning internal",
        "delta 0 text 'Step one: read'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'Read the file'",
        "failed server_error INTERNAL retryable=True",
    ],
    "malformed_function_call": [
        "start gemini-2.5-flash",
        "open 0 text",
        'delta 0 text "I\'ll call it."',
        "failed protocol MALFORMED_FUNCTION_CALL retryable=False",
    ],
    "premature_stop": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'First part.'",
        "delta 0 text ' Second part.'",
        "stop 0",
        "done stop STOP",
    ],
    # A function call arrives whole, so MAX_TOKENS never cuts one: length, with the call's arguments.
    "max_tokens_after_function_call": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Checking the order.'",
        "stop 0",
        "open 1 tool_call lookup_order call_req_t:1_1",
        """delta 1 json_text '{"order_id":"A-1042"}'""",
        "delta 1 signature 'CiQBmaxSig=='",
        """stop 1 {"order_id":"A-1042"}""",
        "done length MAX_TOKENS",
    ],
    # The JSON error body appended without SSE framing fails the stream with its status's category.
    "unframed_error_tail": [
        "start gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'The capital'",
        "delta 0 text ' of France is'",
        "failed overloaded UNAVAILABLE retryable=True",
    ],
    "thought_signatures_function_call": [
        "start gemini-3-pro-preview",
        "open 0 reasoning internal",
        "delta 0 text '**Finding the order**\\nI should look it up.'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'Let me check.'",
        "delta 1 signature 'CiQBtextSig=='",
        "stop 1",
        "open 2 tool_call lookup_order call_req_t:1_2",
        """delta 2 json_text '{"order_id":"A-1042"}'""",
        "delta 2 signature 'CiQBcallSig=='",
        """stop 2 {"order_id":"A-1042"}""",
        "open 3 tool_call lookup_order call_req_t:1_3",  # parallel calls: only the first is signed
        """delta 3 json_text '{"order_id":"B-7"}'""",
        """stop 3 {"order_id":"B-7"}""",
        "done tool_use STOP",
    ],
}


def test_every_transcript_is_spelled_out() -> None:
    assert {p.stem for p in GEMINI.glob("*.sse")} == set(TRANSCRIPT_BRIEFS)


@pytest.mark.parametrize("case", sorted(TRANSCRIPT_BRIEFS))
def test_transcript_sequence(case: str) -> None:
    _, events, _ = run("gemini", (GEMINI / f"{case}.sse").read_bytes())
    assert briefs(events) == TRANSCRIPT_BRIEFS[case]
    check_invariants(events)


@pytest.mark.parametrize("case", sorted(TRANSCRIPT_BRIEFS))
def test_transcripts_are_crlf_framed(case: str) -> None:
    raw = (GEMINI / f"{case}.sse").read_bytes().partition(b"\r\n\r\n{\n")[0]  # an unframed tail is no SSE
    assert raw.count(b"\n") == raw.count(b"\r\n") > 0


def test_utf8_result_and_usage() -> None:
    _, _, r = run("gemini", (GEMINI / "utf8_deltas.sse").read_bytes())
    assert r.status == "completed"
    assert [b.text for b in r.blocks] == ["Привет, мир! 你好，世界 👋🏽 é\u2028ok"]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (9, 14, 23)


def test_function_call_result_keeps_signature_and_arguments() -> None:
    _, _, r = run("gemini", (GEMINI / "text_then_function_call.sse").read_bytes())
    call_block = r.blocks[1]
    assert call_block.kind == "tool_call"
    assert call_block.name == "get_weather"
    assert call_block.signature == "CiQBcsjafGSig1=="
    assert call_block.arguments == {
        "city": 'Zürich "HB"',
        "path": "C:\\tmp\\x",
        "units": ["c", "f"],
        "days": 3,
    }
    # thoughts are generated tokens: output = candidates (22) + thoughts (40)
    assert (r.usage.output_tokens, r.usage.reasoning_tokens, r.usage.total_tokens) == (62, 40, 93)


def test_parallel_calls_without_ids_get_synthesized_flagged_ids() -> None:
    _, events, r = run("gemini", (GEMINI / "parallel_calls_one_chunk.sse").read_bytes())
    starts = [e for e in events if isinstance(e, BlockStart)]
    assert [(s.block.call_id, s.block.call_id_synthesized) for s in starts] == [
        ("call_req_t:1_0", True),
        ("call_req_t:1_1", True),
    ]
    assert [b.signature for b in r.blocks] == ["SIGp1", None]  # only the part that carried it


def test_provider_call_id_is_not_flagged() -> None:
    _, events, _ = run("gemini", (GEMINI / "function_call_with_id.sse").read_bytes())
    start = next(e for e in events if isinstance(e, BlockStart))
    assert (start.block.call_id, start.block.call_id_synthesized) == ("fc_7a1", False)


def test_thought_signatures_stay_with_their_blocks() -> None:
    _, _, r = run("gemini", (GEMINI / "thought_then_text.sse").read_bytes())
    assert [(b.kind, b.text, b.signature) for b in r.blocks] == [
        ("reasoning", "**Plan** add the numbers.", "THOUGHTsig=="),
        ("text", "2 + 2 = 4.", "TEXTsig=="),
    ]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.reasoning_tokens) == (20, 85, 80)
    assert (r.usage.cache_read_tokens, r.usage.total_tokens) == (8, 105)


def test_error_keeps_text_and_message() -> None:
    _, _, r = run("gemini", (GEMINI / "error_after_text.sse").read_bytes())
    assert r.status == "failed"
    assert r.blocks[0].text == "Partial answer"
    assert r.error.message == "The model is overloaded. Please try again later."


def test_interrupted_tool_free_text_is_kept() -> None:
    _, _, r = run("gemini", (GEMINI / "eof_inside_event.sse").read_bytes())
    assert (r.status, r.error.category) == ("interrupted", "transport")
    assert "unfinished event dropped" in r.error.message
    assert [b.text for b in r.blocks] == ["Calling."]


def test_malformed_function_call_result() -> None:
    _, _, r = run("gemini", (GEMINI / "malformed_function_call.sse").read_bytes())
    assert (r.status, r.stop_reason, r.error.category) == ("failed", None, "protocol")
    # finishMessage quotes model output: it is not copied into the safe message
    assert "default_api" not in r.error.message


def test_prompt_block_has_no_blocks() -> None:
    _, _, r = run("gemini", (GEMINI / "prompt_blocked.sse").read_bytes())
    assert (r.status, r.stop_reason, r.blocks, r.usage.input_tokens) == (
        "completed",
        "content_filter",
        [],
        12559,
    )


# -- edge cases, inline ---------------------------------------------------------------------------


def test_lf_framing_works_too() -> None:
    _, events, _ = run("gemini", sse(chunk(text("hi"), finish="STOP"), eol=b"\n"))
    assert briefs(events) == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'hi'",
        "stop 0",
        "done stop STOP",
    ]


def test_text_thought_switches_close_blocks() -> None:
    b, _ = go(
        chunk(text("a")),
        chunk(text("t1", thought=True), text("t2", thought=True)),
        chunk(text("b"), text("c"), finish="STOP"),
    )
    assert b == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'a'",
        "stop 0",
        "open 1 reasoning internal",
        "delta 1 text 't1'",
        "delta 1 text 't2'",
        "stop 1",
        "open 2 text",
        "delta 2 text 'b'",
        "delta 2 text 'c'",
        "stop 2",
        "done stop STOP",
    ]


def test_signature_on_a_text_part_goes_after_its_text() -> None:
    b, r = go(chunk(text("hello", thoughtSignature="S1")), chunk(text(" world"), finish="STOP"))
    assert b == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'hello'",
        "delta 0 signature 'S1'",
        "delta 0 text ' world'",
        "stop 0",
        "done stop STOP",
    ]
    assert r.blocks[0].signature == "S1"


def test_second_signed_part_starts_its_own_block() -> None:
    # Two signatures in one block would be concatenated into one corrupt token.
    b, r = go(chunk(text("a", thoughtSignature="S1"), text("b", thoughtSignature="S2"), finish="STOP"))
    assert b == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'a'",
        "delta 0 signature 'S1'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'b'",
        "delta 1 signature 'S2'",
        "stop 1",
        "done stop STOP",
    ]
    assert [b.signature for b in r.blocks] == ["S1", "S2"]


@pytest.mark.parametrize(
    "objs",
    [
        # nothing open yet
        [chunk(text("", thoughtSignature="S0")), chunk(text("x"), finish="STOP")],
        # the function call closed its own block
        [chunk(call("f", {})), chunk(text("", thoughtSignature="S0"), finish="STOP")],
        # the open block already holds a signature
        [chunk(text("x", thoughtSignature="S1")), chunk(text("", thoughtSignature="S0"), finish="STOP")],
    ],
    ids=["before-any-block", "after-function-call", "block-already-signed"],
)
def test_signature_only_part_never_opens_a_block(objs: list[Any]) -> None:
    b, r = go(*objs)
    assert "warning signature_dropped 1" in b
    assert all(not line.startswith("delta") or "'S0'" not in line for line in b)
    assert r.status == "completed"
    assert all(blk.signature != "S0" for blk in r.blocks)
    assert all(blk.text or blk.kind == "tool_call" for blk in r.blocks)


def test_empty_parts_and_empty_candidates_open_nothing() -> None:
    b, r = go(
        chunk(text("")),
        {"candidates": [{"index": 0}], "modelVersion": "gemini-x"},
        {"usageMetadata": {"promptTokenCount": 3, "totalTokenCount": 3}},
        chunk(text(""), finish="STOP"),
    )
    assert b == ["start gemini-x", "done stop STOP"]
    assert r.blocks == []
    assert r.usage.input_tokens == 3


def test_function_call_closes_open_text_and_stop_becomes_tool_use() -> None:
    b, _ = go(chunk(text("x"), call("f", {"a": [1, {"b": None}]}), text("y"), finish="STOP"))
    assert b == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'x'",
        "stop 0",
        "open 1 tool_call f call_req_t:1_1",
        """delta 1 json_text '{"a":[1,{"b":null}]}'""",
        'stop 1 {"a":[1,{"b":null}]}',
        "open 2 text",
        "delta 2 text 'y'",
        "stop 2",
        "done tool_use STOP",
    ]


def test_function_call_args_that_are_not_an_object_fail_with_the_block() -> None:
    _, events, r = run("gemini", sse(chunk(call("f", [1, 2]), finish="STOP")))
    assert briefs(events)[-1] == "failed protocol None retryable=False"
    assert r.error.block_index == 0


def test_function_call_without_a_name_fails_and_keeps_earlier_parts() -> None:
    b, r = go(chunk(text("kept"), {"functionCall": {"args": {}}}, finish="STOP"))
    assert b == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'kept'",
        "failed protocol None retryable=False",
    ]
    assert r.blocks[0].text == "kept"


def test_only_candidate_zero_is_normalized() -> None:
    obj = {
        "candidates": [
            {"content": {"parts": [text("other")]}, "index": 1, "finishReason": "MAX_TOKENS"},
            {"content": {"parts": [text("main")]}, "finishReason": "STOP"},  # index 0 omitted (proto3)
        ],
        "modelVersion": "gemini-x",
    }
    b, _ = go(obj)
    assert b == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'main'",
        "stop 0",
        "warning unknown_events_skipped 1",
        "done stop STOP",
    ]
    # a chunk holding only another candidate: its finishReason is not the stream's
    other = {"candidates": [{"content": {"parts": [text("o")]}, "index": 1, "finishReason": "STOP"}]}
    b, _ = go(chunk(text("main")), other)
    assert b == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'main'",
        "warning unknown_events_skipped 1",
        "interrupted transport None retryable=False",
    ]


def test_last_terminal_signal_wins() -> None:
    # a later finishReason replaces an earlier one, and a blockReason is replaced by a finishReason
    assert go(chunk(text("a"), finish="MAX_TOKENS"), chunk(text("b"), finish="STOP"))[0][-1] == "done stop STOP"
    assert go(chunk(text("a"), finish="STOP"), chunk(text(""), finish="SAFETY"))[0][-1] == (
        "done content_filter SAFETY"
    )
    blocked = {"promptFeedback": {"blockReason": "SAFETY"}, "modelVersion": "gemini-x"}
    assert go(blocked, chunk(text("a"), finish="STOP"))[0][-1] == "done stop STOP"
    assert go(chunk(text("a"), finish="STOP"), blocked)[0][-1] == "done content_filter SAFETY"


def test_content_after_a_failure_reason_clears_it() -> None:
    b, _ = go(chunk(text("a"), finish="MALFORMED_FUNCTION_CALL"), chunk(text("b"), finish="STOP"))
    assert b[-1] == "done stop STOP"


def test_usage_latest_wins() -> None:
    u1 = {"promptTokenCount": 5, "candidatesTokenCount": 1, "totalTokenCount": 6}
    u2 = {"promptTokenCount": 5, "candidatesTokenCount": 7, "thoughtsTokenCount": 3, "totalTokenCount": 15}
    _, r = go(chunk(text("a"), usageMetadata=u1), chunk(text("b"), finish="STOP", usageMetadata=u2))
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.reasoning_tokens, r.usage.total_tokens) == (
        5,
        10,
        3,
        15,
    )


def test_first_chunk_error_still_starts_the_stream() -> None:
    b, r = go({"error": {"code": 429, "message": "Quota exceeded.", "status": "RESOURCE_EXHAUSTED"}})
    assert b == ["start None", "failed rate_limit RESOURCE_EXHAUSTED retryable=True"]
    assert r.error.message == "Quota exceeded."


def test_error_without_status_maps_its_http_code() -> None:
    b, _ = go(chunk(text("a")), {"error": {"code": 503, "message": ""}})
    assert b[-1] == "failed overloaded 503 retryable=True"
    b, r = go({"error": {"code": "weird"}})
    assert b[-1] == "failed unknown weird retryable=False"
    assert r.error.message == "the provider reported an error"


def test_long_error_message_is_shortened() -> None:
    _, r = go({"error": {"code": 500, "status": "INTERNAL", "message": "x" * 1000}})
    assert len(r.error.message) == 300


# -- the unframed error tail and ErrorInfo reasons ------------------------------------------------

TAIL = b'{\n  "error": {\n    "code": 503,\n    "message": "High demand.",\n    "status": "UNAVAILABLE"\n  }\n}'


@pytest.mark.parametrize("end", [b"\n", b"", b"\r\n", b"\n\n"])
def test_an_unframed_error_tail_fails_the_stream_and_is_kept_as_a_raw_event(end: bytes) -> None:
    raw_events, events, result = run("gemini", sse(chunk(text("Hel"))) + TAIL + end)
    assert briefs(events) == [
        "start gemini-x",
        "open 0 text",
        "delta 0 text 'Hel'",
        "failed overloaded UNAVAILABLE retryable=True",
    ]
    err = result.error
    assert (err.provider_code, err.message, err.retryable) == ("UNAVAILABLE", "High demand.", True)
    tail = raw_events[-1]
    assert (tail.index, tail.unframed, tail.data) == (2, True, TAIL.decode())
    assert events[-1].raw == [2]


def test_an_unframed_tail_split_anywhere_is_the_same() -> None:
    raw = sse(chunk(text("Hel"))) + TAIL + b"\n"
    whole = run("gemini", raw)[1]
    for cut in range(1, len(raw)):
        assert run("gemini", [raw[:cut], raw[cut:]])[1] == whole


def test_an_unframed_one_line_error_with_braces_in_strings() -> None:
    body = b'{"error": {"code": 429, "message": "quota {per minute} \\"x}\\"", "status": "RESOURCE_EXHAUSTED"}}\n'
    b, r = run("gemini", sse(chunk(text("a"))) + body)[1:]
    assert briefs(b)[-1] == "failed rate_limit RESOURCE_EXHAUSTED retryable=True"
    assert r.error.message == 'quota {per minute} "x}"'


def test_an_unframed_tail_cut_short_is_skipped_and_the_eof_interrupts() -> None:
    _, events, _ = run("gemini", sse(chunk(text("a"))) + TAIL[:30])
    assert briefs(events)[-2:] == ["warning unknown_events_skipped 1", "interrupted transport None retryable=False"]


def test_unframed_json_without_an_error_is_skipped() -> None:
    b, _ = go(chunk(text("a"), finish="STOP"))
    _, events, _ = run("gemini", sse(chunk(text("a"), finish="STOP")) + b'{"note": "hi"}\n')
    assert briefs(events) == [*b[:-1], "warning unknown_events_skipped 1", b[-1]]


def test_an_unframed_line_inside_an_event_is_not_json() -> None:
    # A '{' line after a field line belongs to that event (an unknown field), as the SSE spec says.
    _, events, _ = run("gemini", b'data: {"candidates": []}\r\n{"error": {"code": 500}}\r\n\r\n')
    assert briefs(events) == ["start None", "interrupted transport None retryable=False"]


API_KEY_INVALID = {
    "error": {
        "code": 400,
        "message": "API key not valid. Please pass a valid API key.",
        "status": "INVALID_ARGUMENT",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "API_KEY_INVALID",
                "domain": "googleapis.com",
            }
        ],
    }
}


def test_an_error_info_reason_decides_the_category() -> None:
    b, r = go(API_KEY_INVALID)
    assert b == ["start None", "failed authentication API_KEY_INVALID retryable=False"]
    assert r.error.message == "API key not valid. Please pass a valid API key."
    other = {"error": {**API_KEY_INVALID["error"], "details": [{"reason": "SOMETHING_ELSE"}]}}
    assert go(other)[0][-1] == "failed invalid_request INVALID_ARGUMENT retryable=False"


def test_invalid_json_is_a_protocol_failure() -> None:
    _, events, r = run("gemini", b"data: {not json\r\n\r\n")
    assert briefs(events) == ["start None", "failed protocol None retryable=False"]
    assert "not valid JSON" in r.error.message


def test_eof_without_any_event_is_interrupted() -> None:
    _, events, _ = run("gemini", b"")
    assert briefs(events) == ["start None", "interrupted transport None retryable=False"]


def test_registry_finds_the_adapter() -> None:
    assert adapter_class("gemini") is GeminiAdapter


# -- the mapping tables ---------------------------------------------------------------------------

# Written out by hand: what each documented value must become (stop reason, or the failure category).
FINISH_REASONS: dict[str, tuple[str, str]] = {
    "STOP": ("completed", "stop"),
    "MAX_TOKENS": ("completed", "length"),
    "SAFETY": ("completed", "content_filter"),
    "RECITATION": ("completed", "content_filter"),
    "BLOCKLIST": ("completed", "content_filter"),
    "PROHIBITED_CONTENT": ("completed", "content_filter"),
    "SPII": ("completed", "content_filter"),
    "IMAGE_SAFETY": ("completed", "content_filter"),
    "IMAGE_PROHIBITED_CONTENT": ("completed", "content_filter"),
    "IMAGE_RECITATION": ("completed", "content_filter"),
    "MODEL_ARMOR": ("completed", "content_filter"),
    "LANGUAGE": ("completed", "other"),
    "OTHER": ("completed", "other"),
    "FINISH_REASON_UNSPECIFIED": ("completed", "other"),
    "NO_IMAGE": ("completed", "other"),
    "IMAGE_OTHER": ("completed", "other"),
    "SOMETHING_NEW": ("completed", "other"),  # not in the tables: other
    "MALFORMED_FUNCTION_CALL": ("failed", "protocol"),
    "UNEXPECTED_TOOL_CALL": ("failed", "protocol"),
    "TOO_MANY_TOOL_CALLS": ("failed", "protocol"),
    "MISSING_THOUGHT_SIGNATURE": ("failed", "invalid_request"),
}
BLOCK_REASONS = [
    "BLOCKED_REASON_UNSPECIFIED",
    "SAFETY",
    "OTHER",
    "BLOCKLIST",
    "PROHIBITED_CONTENT",
    "IMAGE_SAFETY",
    "MODEL_ARMOR",
    "JAILBREAK",
    "SOMETHING_NEW",
]
ERROR_STATUSES: dict[str, tuple[str, bool]] = {
    "UNAVAILABLE": ("overloaded", True),
    "RESOURCE_EXHAUSTED": ("rate_limit", True),
    "INTERNAL": ("server_error", True),
    "DEADLINE_EXCEEDED": ("server_error", True),
    "INVALID_ARGUMENT": ("invalid_request", False),
    "PERMISSION_DENIED": ("permission", False),
    "UNAUTHENTICATED": ("authentication", False),
    "NOT_FOUND": ("not_found", False),
    "FAILED_PRECONDITION": ("billing", False),
    "ABORTED": ("unknown", False),
}
HTTP_CODES = {
    400: "invalid_request",
    401: "authentication",
    403: "permission",
    404: "not_found",
    429: "rate_limit",
    500: "server_error",
    503: "overloaded",
    504: "server_error",
    418: "unknown",
}


def test_tables_cover_exactly_the_documented_values() -> None:
    documented = set(FINISH_REASONS) - {"SOMETHING_NEW"}
    assert set(GeminiAdapter.STOP_REASONS) | set(GeminiAdapter.FAILURE_REASONS) == documented
    assert not set(GeminiAdapter.STOP_REASONS) & set(GeminiAdapter.FAILURE_REASONS)
    assert set(GeminiAdapter.BLOCK_REASONS) == set(BLOCK_REASONS) - {"SOMETHING_NEW"}
    assert set(GeminiAdapter.ERROR_CATEGORIES) == set(ERROR_STATUSES) - {"ABORTED"}


@pytest.mark.parametrize("reason", sorted(FINISH_REASONS))
def test_finish_reason_maps_as_documented(reason: str) -> None:
    status, value = FINISH_REASONS[reason]
    b, r = go(chunk(text("x")), chunk(finish=reason))
    assert r.status == status
    if status == "completed":
        assert b[-2:] == ["stop 0", f"done {value} {reason}"]
        assert r.provider_stop_reason == reason
    else:
        assert b[-1] == f"failed {value} {reason} retryable=False"
        assert "stop 0" not in b  # a failure closes open blocks only internally


def test_stop_with_a_function_call_is_tool_use() -> None:
    assert go(chunk(call("f", {})), chunk(finish="STOP"))[0][-1] == "done tool_use STOP"
    # other reasons are not upgraded
    assert go(chunk(call("f", {})), chunk(finish="MAX_TOKENS"))[0][-1] == "done length MAX_TOKENS"


@pytest.mark.parametrize("reason", BLOCK_REASONS)
def test_block_reason_is_a_content_filter(reason: str) -> None:
    b, r = go({"promptFeedback": {"blockReason": reason}, "modelVersion": "gemini-x"})
    assert b == ["start gemini-x", f"done content_filter {reason}"]
    assert r.status == "completed"


@pytest.mark.parametrize("status", sorted(ERROR_STATUSES))
def test_error_status_maps_as_documented(status: str) -> None:
    category, retryable = ERROR_STATUSES[status]
    b, r = go(chunk(text("x")), {"error": {"code": 500, "message": "m", "status": status}})
    assert b[-1] == f"failed {category} {status} retryable={retryable}"
    assert r.blocks[0].text == "x"


@pytest.mark.parametrize("code", sorted(HTTP_CODES))
def test_error_code_without_status_maps_as_documented(code: int) -> None:
    b, _ = go({"error": {"code": code, "message": "m"}})
    category = HTTP_CODES[code]
    assert b[-1] == f"failed {category} {code} retryable={category in ('overloaded', 'rate_limit', 'server_error')}"


# -- usage beside an error ------------------------------------------------------------------------

USAGE_METADATA = {"promptTokenCount": 40, "candidatesTokenCount": 6, "thoughtsTokenCount": 10, "totalTokenCount": 56}


def _failed_usage(raw: bytes) -> Any:
    _, events, result = run("gemini", raw)
    check_invariants(events)
    assert isinstance(events[-1], StreamError) and result.status == "failed"
    assert result.usage == events[-1].usage
    return events[-1].usage


def test_an_error_chunk_keeps_the_usage_metadata_beside_it() -> None:
    err = {"error": {"code": 500, "message": "Internal error", "status": "INTERNAL"}, "usageMetadata": USAGE_METADATA}
    want = Usage(input_tokens=40, output_tokens=16, reasoning_tokens=10, total_tokens=56)
    assert _failed_usage(sse(chunk(text("a")), err)) == want
    assert _failed_usage(sse(err)) == want  # the first chunk: no stream yet, the usage is kept all the same


def test_an_unframed_error_tail_keeps_its_usage_metadata() -> None:
    tail = json.dumps(
        {"error": {"code": 503, "status": "UNAVAILABLE", "message": "m"}, "usageMetadata": USAGE_METADATA}
    )
    u = _failed_usage(sse(chunk(text("a"))) + tail.encode())
    assert u is not None and (u.input_tokens, u.total_tokens) == (40, 56)


def test_a_part_that_fails_the_stream_keeps_its_chunks_usage() -> None:
    bad = chunk(text("x"), {"functionCall": {"args": {}}}, usageMetadata=USAGE_METADATA)
    got, _ = go(bad)
    assert got[-1] == "failed protocol None retryable=False"
    assert _failed_usage(sse(bad)) == Usage(input_tokens=40, output_tokens=16, reasoning_tokens=10, total_tokens=56)
