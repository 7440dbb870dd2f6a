"""The OpenAI Chat adapter: every transcript's exact sequence, block routing (interleaving, parallel calls,
index + id), the compatible-server shapes, and the mapping tables, each written out by hand."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.normalizer.adapters import adapter_class
from sluice.normalizer.adapters.openai_chat import OpenAIChatAdapter
from sluice.schemas.events import RETRYABLE_CATEGORIES, BlockStart, StreamError, StreamWarning
from tests.helpers import TRANSCRIPTS, briefs, check_invariants, run

CHAT = TRANSCRIPTS / "openai-chat"
DONE = b"data: [DONE]\n\n"


def sse(*objs: Any) -> bytes:
    """Frame chunks as OpenAI does: ``data: <json>`` and a blank line; bytes pass through unchanged."""
    out = b""
    for o in objs:
        out += o if isinstance(o, bytes) else b"data: " + json.dumps(o, ensure_ascii=False).encode() + b"\n\n"
    return out


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [choice], **top}


def tc(index: int | None, id: str | None = None, name: str | None = None, args: Any = None) -> dict[str, Any]:
    entry: dict[str, Any] = {} if index is None else {"index": index}
    fn: dict[str, Any] = {}
    if id is not None:
        entry |= {"id": id, "type": "function"}
    if name is not None:
        fn["name"] = name
    if args is not None:
        fn["arguments"] = args
    entry["function"] = fn
    return entry


def tools(*entries: dict[str, Any]) -> dict[str, Any]:
    return chunk({"tool_calls": list(entries)})


def go(*objs: Any) -> tuple[list[str], Any]:
    _, events, result = run("openai-chat", sse(*objs))
    check_invariants(events)
    return briefs(events), result


def test_registered() -> None:
    assert adapter_class("openai-chat") is OpenAIChatAdapter


# -- transcripts, spelled out ---------------------------------------------------------------------

TRANSCRIPT_BRIEFS: dict[str, list[str]] = {
    # Output checks' transcripts (tests/checked_cases.py); the same bytes, unchecked.
    "parallel_weather_time": [
        "start gpt-4.1-2025-04-14",
        "open 0 tool_call get_weather call_W1",
        "open 1 tool_call get_time call_T2",
        "delta 0 json_text '{\"city\":'",
        'delta 1 json_text \'{"tz":"Europe/\'',
        "delta 1 json_text 'Paris\"}'",
        "delta 0 json_text ' \"Paris\"}'",
        'stop 0 {"city":"Paris"}',
        'stop 1 {"tz":"Europe/Paris"}',
        "done tool_use tool_calls",
    ],
    "json_answer": [
        "start gpt-4.1-2025-04-14",
        "open 0 text",
        "delta 0 text '{\"city\": '",
        'delta 0 text \'"Paris", "te\'',
        "delta 0 text 'mp_c\": 21}'",
        "stop 0",
        "done stop stop",
    ],
    "utf8_deltas": [
        "start gpt-4o-2024-08-06",
        "open 0 text",
        *[
            f"delta 0 text {p!r}"
            for p in [
                "При",
                "вет",
                ", ",
                "мир",
                "! ",
                "你",
                "好",
                "，",
                "世界",
                "。",
                " ",
                "👋",
                "🏽",
                " café",
                "\u2028",
                "naïve ",
                "✓",
            ]
        ],
        "stop 0",
        "done stop stop",
    ],
    "text_then_tool_call": [
        "start gpt-4o-2024-08-06",
        "open 0 text",
        "delta 0 text 'Let me '",
        "delta 0 text 'check the weather.'",
        "stop 0",
        "open 1 tool_call get_weather call_Qm8rT2vX9kLp4sNw",
        "delta 1 json_text '{\"'",
        "delta 1 json_text 'city'",
        "delta 1 json_text '\": \"'",
        "delta 1 json_text 'Almaty \\\\'",
        "delta 1 json_text '\"South\\\\'",
        'delta 1 json_text \'"", "\'',
        "delta 1 json_text 'unit\": \"c\\\\u00'",
        'delta 1 json_text \'b0", "note": "line1\\\\\'',
        "delta 1 json_text 'nline2 ✓\"}'",
        'stop 1 {"city":"Almaty \\"South\\"","note":"line1\\nline2 ✓","unit":"c°"}',
        "done tool_use tool_calls",
    ],
    "parallel_tool_calls": [
        "start gpt-4.1-2025-04-14",
        "open 0 tool_call get_weather call_A1b2C3d4E5f6G7h8",
        "open 1 tool_call get_time call_Z9y8X7w6V5u4T3s2",
        "delta 0 json_text '{\"city\":'",
        'delta 1 json_text \'{"tz":"Asia/\'',
        "delta 1 json_text 'Tokyo\"}'",
        "delta 0 json_text ' \"Tokyo\"}'",
        'stop 0 {"city":"Tokyo"}',
        'stop 1 {"tz":"Asia/Tokyo"}',
        "done tool_use tool_calls",
    ],
    "same_index_new_id": [
        "start gpt-4o-mini-2024-07-18",
        "open 0 tool_call lookup call_first000000000001",
        'delta 0 json_text \'{"q": "a"}\'',
        'stop 0 {"q":"a"}',
        "open 1 tool_call lookup call_second00000000002",
        "delta 1 json_text '{\"q\": '",
        "delta 1 json_text '\"b\"}'",
        'stop 1 {"q":"b"}',
        "done tool_use tool_calls",
    ],
    "deepseek_reasoning": [
        "start deepseek-reasoner",
        "open 0 reasoning internal",
        "delta 0 text 'Пользователь'",
        "delta 0 text ' спрашивает 2+2.'",
        "delta 0 text ' Ответ: 4.'",
        "stop 0",
        "open 1 text",
        "delta 1 text '2 + 2'",
        "delta 1 text ' = 4.'",
        "stop 1",
        "done stop stop",
    ],
    "vllm_reasoning": [
        "start Qwen/Qwen3-8B",
        "open 0 reasoning internal",
        "delta 0 text '用户想要'",
        "delta 0 text '一个问候。'",
        "stop 0",
        "open 1 text",
        "delta 1 text '\\n\\n'",
        "delta 1 text '你好！'",
        "stop 1",
        "done stop stop",
    ],
    "openrouter_reasoning": [
        "start google/gemini-2.5-flash",
        "open 0 reasoning internal",
        "delta 0 text 'Think'",
        "delta 0 text 'ing…'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'Done.'",
        "stop 1",
        "done stop stop",
    ],
    "error_after_text": [
        "start gpt-4.1-2025-04-14",
        "open 0 text",
        "delta 0 text 'The'",
        "delta 0 text ' question'",
        "delta 0 text ' \"'",
        "failed server_error server_error retryable=True",
    ],
    "openrouter_error": [
        "start google/gemini-2.5-flash",
        "open 0 text",
        "delta 0 text 'Sure, here'",
        "delta 0 text ' is the plan'",
        "failed server_error server_error retryable=True",
    ],
    "eof_after_finish_reason": [
        "start gpt-4o-2024-08-06",
        "open 0 text",
        "delta 0 text 'All'",
        "delta 0 text ' done.'",
        "interrupted transport None retryable=False",
    ],
    "eof_inside_tool_arguments": [
        "start gpt-4o-2024-08-06",
        "open 0 tool_call write_file call_TrUnC8t3d0000001",
        'delta 0 json_text \'{"path": "notes.md", \'',
        'delta 0 json_text \'"body": "# Ти\'',
        "interrupted transport None retryable=False",
    ],
    "unknown_fields_and_events": [
        "start gpt-4o-audio-preview-2024-12-17",
        "open 0 text",
        "delta 0 text 'Hi'",
        "delta 0 text ' there'",
        "stop 0",
        "warning unknown_events_skipped 2",
        "done stop stop",
    ],
    "length_stop": [
        "start gpt-4o-mini-2024-07-18",
        "open 0 text",
        "delta 0 text 'Once upon'",
        "delta 0 text ' a time,'",
        "stop 0",
        "done length length",
    ],
    "content_filter": [
        "start gpt-4o-2024-08-06",
        "open 0 text",
        "delta 0 text 'Here is how'",
        "stop 0",
        "done content_filter content_filter",
    ],
    "refusal": [
        "start gpt-4o-2024-08-06",
        "open 0 refusal",
        'delta 0 text "I\'m sorry,"',
        'delta 0 text " I can\'t help with that."',
        "stop 0",
        "done refusal stop",
    ],
    "groq_usage": [
        "start llama-3.3-70b-versatile",
        "open 0 text",
        "delta 0 text 'Hello'",
        "delta 0 text ' from Groq.'",
        "stop 0",
        "done stop stop",
    ],
    "azure_prompt_filter": [
        "start gpt-4o-2024-11-20",  # the real model: the empty-model prompt-filter chunk starts nothing
        "open 0 text",
        "delta 0 text 'Bonjour'",
        "delta 0 text ' à tous'",
        "stop 0",
        "done stop stop",
    ],
    "ollama_tool_call": [
        "start qwen2.5-coder:7b-instruct-q8_0",
        "open 0 tool_call run_command call_hk81qg8b",
        'delta 0 json_text \'{"command":"ls -la"}\'',
        'stop 0 {"command":"ls -la"}',
        "done tool_use stop",
    ],
    "invalid_tool_arguments": [
        "start gpt-4o-2024-08-06",
        "open 0 text",
        "delta 0 text 'Calling.'",
        "stop 0",
        "open 1 tool_call get_weather call_BaDjS0n000000001",
        'delta 1 json_text \'{"city": "Paris"\'',
        "failed protocol None retryable=False",
    ],
    "malformed_json": [
        "start gpt-4o-2024-08-06",
        "open 0 text",
        "delta 0 text 'Partial'",
        "failed protocol None retryable=False",
    ],
    # finish_reason length inside the call's arguments: [DONE] closes it, cut, and the stream completes.
    "length_in_tool_arguments": [
        "start gpt-4.1-2025-04-14",
        "open 0 tool_call write_file call_T1",
        """delta 0 json_text '{"path":"notes.txt","lines":["fi'""",
        """delta 0 json_text 'rst line","sec'""",
        "stop 0 null truncated",
        "done length length",
    ],
    # OpenRouter-style: the failing chunk carries the usage billed; it is on the stream.error (golden).
    "router_error_with_usage": [
        "start deepseek/deepseek-chat-v3.1",
        "open 0 text",
        "delta 0 text 'The capital'",
        "delta 0 text ' of Peru is'",
        "failed server_error 502 retryable=True",
    ],
    # Mistral's reasoning model: thinking as typed-part lists, the answer as a text part then strings.
    "mistral_thinking_parts": [
        "start magistral-medium-2509",
        "open 0 reasoning internal",
        "delta 0 text 'The user asks'",
        "delta 0 text ' for 17 × 3.'",
        "delta 0 text ' 17 × 3 = 51.'",
        "delta 0 text ' Answer briefly.'",
        "stop 0",
        "open 1 text",
        "delta 1 text '17 × 3'",
        "delta 1 text ' = 51.'",
        "stop 1",
        "done stop stop",
    ],
}


def test_every_transcript_is_spelled_out() -> None:
    assert {p.stem for p in CHAT.glob("*.sse")} == set(TRANSCRIPT_BRIEFS)


@pytest.mark.parametrize("case", sorted(TRANSCRIPT_BRIEFS))
def test_transcript_sequence(case: str) -> None:
    _, events, _ = run("openai-chat", (CHAT / f"{case}.sse").read_bytes())
    assert briefs(events) == TRANSCRIPT_BRIEFS[case]
    check_invariants(events)


def _result(case: str) -> Any:
    return run("openai-chat", (CHAT / f"{case}.sse").read_bytes())[2]


def test_the_router_error_transcript_keeps_the_billed_usage() -> None:
    r = _result("router_error_with_usage")
    assert r.status == "failed" and r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (21, 6, 27)


def test_a_call_cut_by_length_keeps_its_text_and_no_arguments() -> None:
    r = _result("length_in_tool_arguments")
    assert (r.status, r.stop_reason, r.provider_stop_reason) == ("completed", "length", "length")
    (b,) = r.blocks
    assert (b.arguments, b.arguments_text, b.arguments_error) == (
        None,
        '{"path":"notes.txt","lines":["first line","sec',
        "truncated",
    )
    assert r.tool_calls == []


def test_invalid_arguments_with_a_natural_stop_stay_a_protocol_failure() -> None:
    got, result = go(tools(tc(0, "call_1", "f", '{"a": ')), chunk(finish="tool_calls"), DONE)
    assert got[-1] == "failed protocol None retryable=False"
    assert result.error.block_index == 0


def test_usage_with_details_from_the_include_usage_chunk() -> None:
    u = _result("text_then_tool_call").usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (81, 33, 114)
    assert (u.cache_read_tokens, u.reasoning_tokens, u.cache_write_tokens) == (64, 0, None)


def test_usage_deepseek_groq_vllm_openrouter() -> None:
    ds = _result("deepseek_reasoning").usage
    assert (ds.input_tokens, ds.output_tokens, ds.reasoning_tokens, ds.cache_read_tokens) == (12, 41, 29, 0)
    gq = _result("groq_usage").usage
    assert (gq.input_tokens, gq.output_tokens, gq.total_tokens) == (18, 5, 23)
    vl = _result("vllm_reasoning").usage  # the usage chunk had ``choices: null``
    assert (vl.input_tokens, vl.output_tokens, vl.total_tokens) == (14, 18, 32)
    orr = _result("openrouter_reasoning").usage
    assert (orr.input_tokens, orr.output_tokens, orr.reasoning_tokens) == (10, 25, 21)


def test_results_keep_text_and_withhold_unfinished_arguments() -> None:
    r = _result("error_after_text")
    assert r.status == "failed" and r.blocks[0].text == 'The question "'
    assert r.error.message == "The server had an error while processing your request. Sorry about that!"
    r = _result("eof_inside_tool_arguments")
    assert r.status == "interrupted"
    assert r.blocks[0].arguments is None
    assert r.blocks[0].arguments_text == '{"path": "notes.md", "body": "# Ти'
    r = _result("eof_after_finish_reason")
    assert r.status == "interrupted" and r.stop_reason is None and r.blocks[0].text == "All done."
    r = _result("invalid_tool_arguments")
    assert (r.status, r.error.category, r.error.block_index) == ("failed", "protocol", 1)
    assert r.blocks[1].arguments is None and r.blocks[1].arguments_text == '{"city": "Paris"'
    r = _result("openrouter_error")
    assert r.error.message == "Provider disconnected unexpectedly" and r.blocks[0].text == "Sure, here is the plan"


def test_malformed_json_names_the_raw_event() -> None:
    r = _result("malformed_json")
    assert r.error.category == "protocol" and "raw event 3" in r.error.message


def test_unknown_events_are_named_in_the_warning() -> None:
    _, events, _ = run("openai-chat", (CHAT / "unknown_fields_and_events.sse").read_bytes())
    (warning,) = [e for e in events if isinstance(e, StreamWarning)]
    assert "event:ping" in warning.message and "chat.completion.heartbeat" in warning.message


# -- block routing --------------------------------------------------------------------------------


def test_text_tool_text_are_three_blocks_in_wire_order() -> None:
    got, r = go(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Checking."}),
        tools(tc(0, "call_1", "f", "")),
        tools(tc(0, args='{"a": 1}')),
        chunk({"content": "Meanwhile"}),
        chunk(finish="tool_calls"),
        DONE,
    )
    assert got == [
        "start m",
        "open 0 text",
        "delta 0 text 'Checking.'",
        "stop 0",
        "open 1 tool_call f call_1",
        "delta 1 json_text '{\"a\": 1}'",
        'stop 1 {"a":1}',
        "open 2 text",
        "delta 2 text 'Meanwhile'",
        "stop 2",
        "done tool_use tool_calls",
    ]
    assert [b.kind for b in r.blocks] == ["text", "tool_call", "text"]


def test_reasoning_text_refusal_and_tools_in_one_delta_keep_a_fixed_order() -> None:
    got, _ = go(
        chunk({"reasoning_content": "r", "content": "t", "refusal": "n", "tool_calls": [tc(0, "c", "f", "{}")]}),
        DONE,
    )
    assert got == [
        "start m",
        "open 0 reasoning internal",
        "delta 0 text 'r'",
        "stop 0",
        "open 1 text",
        "delta 1 text 't'",
        "stop 1",
        "open 2 refusal",
        "delta 2 text 'n'",
        "stop 2",
        "open 3 tool_call f c",
        "delta 3 json_text '{}'",
        "stop 3 {}",
        "done other None",
    ]


def test_empty_strings_neither_open_nor_close_blocks() -> None:
    got, _ = go(
        chunk({"role": "assistant", "content": "", "refusal": ""}),
        chunk({"reasoning": "a", "content": ""}),
        chunk({"reasoning": "b", "content": "", "refusal": None}),
        chunk({"content": "", "reasoning": ""}, finish="stop"),
        DONE,
    )
    assert got == [
        "start m",
        "open 0 reasoning internal",
        "delta 0 text 'a'",
        "delta 0 text 'b'",
        "stop 0",
        "done stop stop",
    ]


def test_reasoning_content_wins_over_reasoning_when_a_server_sends_both() -> None:
    got, _ = go(chunk({"reasoning_content": "once", "reasoning": "once"}), DONE)
    assert got[1:3] == ["open 0 reasoning internal", "delta 0 text 'once'"]


def test_a_fragment_for_another_index_never_closes_an_open_call() -> None:
    got, _ = go(
        tools(tc(0, "a", "f", '{"x":')),
        tools(tc(1, "b", "g", '{"y":')),
        tools(tc(0, args="1}")),
        tools(tc(1, args="2}")),
        DONE,
    )
    assert got == [
        "start m",
        "open 0 tool_call f a",
        "delta 0 json_text '{\"x\":'",
        "open 1 tool_call g b",
        "delta 1 json_text '{\"y\":'",
        "delta 0 json_text '1}'",
        "delta 1 json_text '2}'",
        'stop 0 {"x":1}',
        'stop 1 {"y":2}',
        "done other None",
    ]


def test_a_repeated_id_continues_the_same_call() -> None:
    got, _ = go(tools(tc(0, "a", "f", '{"x"')), tools(tc(0, "a", args=": 1}")), DONE)
    assert got == [
        "start m",
        "open 0 tool_call f a",
        "delta 0 json_text '{\"x\"'",
        "delta 0 json_text ': 1}'",
        'stop 0 {"x":1}',
        "done other None",
    ]


def test_a_call_without_an_id_gets_a_synthesized_one() -> None:
    _, events, r = run("openai-chat", sse(tools(tc(0, name="f", args="{}")), DONE))
    (start,) = [e for e in events if isinstance(e, BlockStart)]
    assert start.block.call_id_synthesized and start.block.call_id == "call_req_t:1_0"
    assert r.status == "completed" and r.blocks[0].arguments == {}


def test_id_less_calls_close_on_text_and_on_a_new_id_at_their_index() -> None:
    # A first fragment may come without ``arguments``; an id-less call is still ended by text or a new id.
    got, _ = go(
        tools(tc(0, name="f")),
        tools(tc(0, args="{}")),
        chunk({"content": "t"}),
        tools(tc(0, name="g", args="{}")),
        tools(tc(0, "call_h", "h", "{}")),
        DONE,
    )
    assert got == [
        "start m",
        "open 0 tool_call f call_req_t:1_0",
        "delta 0 json_text '{}'",
        "stop 0 {}",
        "open 1 text",
        "delta 1 text 't'",
        "stop 1",
        "open 2 tool_call g call_req_t:1_2",
        "delta 2 json_text '{}'",
        "stop 2 {}",
        "open 3 tool_call h call_h",
        "delta 3 json_text '{}'",
        "stop 3 {}",
        "done other None",
    ]


def test_an_entry_without_index_falls_back_to_its_position() -> None:
    got, _ = go(tools(tc(None, "a", "f", "{}"), tc(None, "b", "g", "{}")), DONE)
    assert got[1:5] == [
        "open 0 tool_call f a",
        "delta 0 json_text '{}'",
        "open 1 tool_call g b",
        "delta 1 json_text '{}'",
    ]


def test_whole_arguments_object_is_encoded_as_json_text() -> None:
    got, _ = go(tools(tc(0, "a", "f", {"city": "Paris"})), DONE)
    assert got[2:4] == ['delta 0 json_text \'{"city":"Paris"}\'', 'stop 0 {"city":"Paris"}']


def test_a_call_with_no_arguments_means_an_empty_object() -> None:
    got, _ = go(tools(tc(0, "a", "f", "")), chunk(finish="tool_calls"), DONE)
    assert got == ["start m", "open 0 tool_call f a", "stop 0 {}", "done tool_use tool_calls"]


def test_an_empty_fragment_for_an_unknown_index_is_nothing() -> None:
    got, _ = go(chunk({"content": "x"}), tools(tc(3, args="")), chunk({"content": "y"}), DONE)
    assert got == [
        "start m",
        "open 0 text",
        "delta 0 text 'x'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'y'",
        "stop 1",
        "done other None",
    ]


def test_arguments_for_an_index_that_never_started_are_a_protocol_error() -> None:
    got, r = go(chunk({"content": "x"}), tools(tc(0, args='{"a": 1}')), DONE)
    assert got[-1] == "failed protocol None retryable=False"
    assert "index 0" in r.error.message and r.blocks[0].text == "x"


def test_arguments_after_text_closed_the_call_are_a_protocol_error() -> None:
    got, _ = go(tools(tc(0, "a", "f", '{"x":')), chunk({"content": "hm"}), tools(tc(0, args="1}")), DONE)
    # Text after a call closes it; the call's JSON was incomplete, so the close already fails.
    assert got[-1] == "failed protocol None retryable=False"
    got, r = go(tools(tc(0, "a", "f", "{}")), chunk({"content": "hm"}), tools(tc(0, args="1}")), DONE)
    assert got[-1] == "failed protocol None retryable=False" and "index 0" in r.error.message


def test_a_closed_call_id_cannot_come_back() -> None:
    got, r = go(tools(tc(0, "a", "f", "{}")), chunk({"content": "hm"}), tools(tc(0, "a", args="{}")), DONE)
    assert got[-1] == "failed protocol None retryable=False"
    assert "'a' continued after it was closed" in r.error.message


def test_deprecated_function_call_is_a_tool_call() -> None:
    got, r = go(
        chunk({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": ""}}),
        chunk({"function_call": {"arguments": '{"k": "v"}'}}),
        chunk(finish="function_call"),
        DONE,
    )
    assert got[1:4] == ["open 0 tool_call f call_req_t:1_0", 'delta 0 json_text \'{"k": "v"}\'', 'stop 0 {"k":"v"}']
    assert got[-1] == "done tool_use function_call"
    assert r.blocks[0].arguments == {"k": "v"}


def test_non_function_tool_calls_are_skipped_and_counted() -> None:
    custom = {"index": 0, "id": "call_c", "type": "custom", "custom": {"name": "grep", "input": "x"}}
    got, _ = go(chunk({"tool_calls": [custom]}), chunk({"content": "ok"}), DONE)
    assert got == [
        "start m",
        "open 0 text",
        "delta 0 text 'ok'",
        "stop 0",
        "warning unknown_events_skipped 1",
        "done other None",
    ]


def test_content_after_finish_reason_is_kept_and_the_reason_remembered() -> None:
    # Some Ollama versions put finish_reason on a different chunk from the tool calls.
    got, _ = go(chunk(finish="stop"), tools(tc(0, "call_x", "f", "{}")), DONE)
    assert got == ["start m", "open 0 tool_call f call_x", "delta 0 json_text '{}'", "stop 0 {}", "done tool_use stop"]


def test_whole_ollama_call_and_stop_on_separate_chunks() -> None:
    got, _ = go(
        chunk({"role": "assistant", "content": "", "tool_calls": [tc(0, "call_k", "f", '{"a":1}')]}),
        chunk({"role": "assistant", "content": ""}, finish="stop"),
        DONE,
    )
    assert got[-2:] == ['stop 0 {"a":1}', "done tool_use stop"]


# -- choices, starts and terminals ----------------------------------------------------------------


def test_only_choice_zero_is_normalized_other_choices_are_counted() -> None:
    two = {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [
            {"index": 1, "delta": {"content": "B"}, "finish_reason": None},
            {"index": 0, "delta": {"content": "A"}, "finish_reason": None},
        ],
    }
    one = {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 1, "delta": {}, "finish_reason": "length"}],
    }
    got, r = go(two, one, chunk(finish="stop"), DONE)
    assert got == [
        "start m",
        "open 0 text",
        "delta 0 text 'A'",
        "stop 0",
        "warning unknown_events_skipped 2",
        "done stop stop",
    ]
    assert [b.text for b in r.blocks] == ["A"]


def test_a_choice_without_index_is_taken_by_position() -> None:
    c = {"model": "m", "choices": [{"delta": {"content": "A"}}, {"delta": {"content": "B"}}]}
    got, _ = go(c, DONE)
    assert got == [
        "start m",
        "open 0 text",
        "delta 0 text 'A'",
        "stop 0",
        "warning unknown_events_skipped 1",
        "done other None",
    ]


def test_choices_without_delta_and_empty_chunks_carry_nothing() -> None:
    annotation = {"choices": [{"index": 0, "finish_reason": None, "content_filter_results": {}}], "model": ""}
    got, _ = go(annotation, {"choices": [], "model": ""}, chunk({"content": "x"}), annotation, DONE)
    assert got == ["start m", "open 0 text", "delta 0 text 'x'", "stop 0", "done other None"]


def test_done_without_finish_reason_is_completed_other() -> None:
    assert go(chunk({"content": "x"}), DONE)[0][-1] == "done other None"


def test_done_alone_is_an_empty_completed_stream() -> None:
    got, r = go(DONE)
    assert got == ["start None", "done other None"] and r.blocks == []


def test_nothing_after_done_is_normalized() -> None:
    got, _ = go(chunk({"content": "x"}, finish="stop"), DONE, chunk({"content": "late"}))
    assert got == ["start m", "open 0 text", "delta 0 text 'x'", "stop 0", "done stop stop"]


def test_eof_without_anything_is_interrupted() -> None:
    assert go(b": keep-alive\n\n")[0] == ["start None", "interrupted transport None retryable=False"]


def test_empty_data_lines_are_heartbeats() -> None:
    got, _ = go(b"data:\n\n", chunk({"content": "x"}), b"data: \n\n", DONE)
    assert got == ["start m", "open 0 text", "delta 0 text 'x'", "stop 0", "done other None"]


def test_json_that_is_not_an_object_is_a_protocol_error() -> None:
    got, _ = go(chunk({"content": "x"}), b"data: [1, 2]\n\n", DONE)
    assert got[-1] == "failed protocol None retryable=False"


def test_content_that_is_neither_a_string_nor_a_part_list_is_skipped_and_counted() -> None:
    got, _ = go(
        chunk({"content": {"weird": 1}}),
        chunk({"content": [{"type": "text", "text": 7}]}),
        chunk({"content": "x"}),
        DONE,
    )
    assert got == [
        "start m",
        "open 0 text",
        "delta 0 text 'x'",
        "stop 0",
        "warning unknown_events_skipped 2",
        "done other None",
    ]


def think(*texts: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": [{"type": "text", "text": t} for t in texts]}


def test_mistral_thinking_parts_are_reasoning_and_text_parts_text_in_wire_order() -> None:
    got, r = go(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": [think("Two ", "plus")]}),
        chunk({"content": [think(" two.")]}),
        chunk({"content": [think(" Four."), {"type": "text", "text": "It is"}]}),
        chunk({"content": " 4."}),  # after thinking Mistral streams plain strings
        chunk({"content": [{"type": "text", "text": " Check:"}, think("again"), {"type": "text", "text": "4"}]}),
        chunk(finish="stop"),
        DONE,
    )
    assert got == [
        "start m",
        "open 0 reasoning internal",
        "delta 0 text 'Two '",
        "delta 0 text 'plus'",
        "delta 0 text ' two.'",
        "delta 0 text ' Four.'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'It is'",
        "delta 1 text ' 4.'",
        "delta 1 text ' Check:'",
        "stop 1",
        "open 2 reasoning internal",
        "delta 2 text 'again'",
        "stop 2",
        "open 3 text",
        "delta 3 text '4'",
        "stop 3",
        "done stop stop",
    ]
    assert [(b.kind, b.text) for b in r.blocks] == [
        ("reasoning", "Two plus two. Four."),
        ("text", "It is 4. Check:"),
        ("reasoning", "again"),
        ("text", "4"),
    ]


def test_mistral_part_shapes_other_parts_are_counted_and_empty_ones_are_nothing() -> None:
    got, _ = go(
        chunk({"content": [{"type": "thinking", "thinking": "as a string", "closed": False}]}),
        chunk({"content": [{"type": "thinking", "thinking": [{"type": "reference", "reference_ids": [1]}]}]}),
        chunk({"content": [{"type": "thinking", "thinking": []}, {"type": "text", "text": ""}, {"type": "thinking"}]}),
        chunk({"content": [{"type": "image_url", "image_url": "u"}, {"type": "text", "text": "ok"}]}),
        chunk({"content": []}),
        DONE,
    )
    assert got == [
        "start m",
        "open 0 reasoning internal",
        "delta 0 text 'as a string'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'ok'",
        "stop 1",
        "warning unknown_events_skipped 2",
        "done other None",
    ]


def test_usage_later_values_replace_earlier_ones_and_deepseek_cache_hits_count() -> None:
    u1 = {"prompt_tokens": 5, "completion_tokens": 1, "prompt_cache_hit_tokens": 3}
    u2 = {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "prompt_cache_hit_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 1},
    }
    _, _, r = run(
        "openai-chat",
        sse(chunk({"content": "x"}, usage=u1), chunk(finish="stop"), {"choices": [], "model": "m", "usage": u2}, DONE),
    )
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (5, 7, 12)
    assert (u.cache_read_tokens, u.cache_write_tokens) == (4, 1)  # cached_tokens wins over the DeepSeek field
    _, _, r = run("openai-chat", sse(chunk({"content": "x"}, usage=u1), DONE))
    assert r.usage.cache_read_tokens == 3


def test_usage_only_chunk_without_choices_field() -> None:
    _, _, r = run("openai-chat", sse(chunk({"content": "x"}), {"model": "m", "usage": {"prompt_tokens": 2}}, DONE))
    assert r.usage.input_tokens == 2


# -- errors ---------------------------------------------------------------------------------------


def _error_of(*objs: Any) -> Any:
    _, events, r = run("openai-chat", sse(*objs))
    check_invariants(events)
    assert isinstance(events[-1], StreamError) and r.status == "failed"
    return r.error


def test_error_code_wins_over_type_for_provider_code() -> None:
    e = _error_of({"error": {"message": "Slow down", "type": "requests", "code": "rate_limit_exceeded"}})
    assert (e.category, e.provider_code, e.retryable) == ("rate_limit", "rate_limit_exceeded", True)


def test_an_unknown_code_still_takes_its_category_from_a_known_type() -> None:
    e = _error_of({"error": {"message": "m", "type": "server_error", "code": "brand_new_code"}})
    assert (e.category, e.provider_code, e.retryable) == ("server_error", "brand_new_code", True)


def test_unknown_code_and_type_are_unknown_and_not_retryable() -> None:
    e = _error_of({"error": {"message": "m", "type": "weird", "code": None}})
    assert (e.category, e.provider_code, e.retryable) == ("unknown", "weird", False)


def test_numeric_codes_are_strings_in_the_contract() -> None:
    e = _error_of(chunk({"content": ""}, finish="error", error={"code": 502, "message": "Upstream down"}))
    assert (e.category, e.provider_code, e.message) == ("server_error", "502", "Upstream down")


def test_an_error_inside_the_choice_fails_too() -> None:
    c = {
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "partial"},
                "finish_reason": "error",
                "error": {"code": 429, "message": "Rate limited upstream"},
            }
        ],
    }
    _, events, r = run("openai-chat", sse(c))
    assert briefs(events) == [
        "start m",
        "open 0 text",
        "delta 0 text 'partial'",
        "failed rate_limit 429 retryable=True",
    ]
    assert r.blocks[0].text == "partial"


def test_finish_reason_error_without_an_error_object() -> None:
    e = _error_of(chunk({"content": "x"}), chunk(finish="error"))
    assert (e.category, e.provider_code, e.retryable) == ("server_error", "error", True)


def test_deepseek_insufficient_system_resource_is_an_overloaded_failure() -> None:
    e = _error_of(chunk({"content": "x"}), chunk(finish="insufficient_system_resource"), DONE)
    assert (e.category, e.provider_code, e.retryable) == ("overloaded", "insufficient_system_resource", True)


def test_a_bare_string_error() -> None:
    e = _error_of({"error": "upstream exploded"})
    assert (e.category, e.provider_code, e.message) == ("unknown", None, "upstream exploded")


def test_an_error_without_a_message_gets_a_safe_one_and_long_ones_are_cut() -> None:
    assert _error_of({"error": {"code": "server_error"}}).message == "the provider reported an error in the stream"
    assert len(_error_of({"error": {"code": "x", "message": "y" * 1000}}).message) == 300


def test_vllm_error_object_at_top_level() -> None:
    e = _error_of({"object": "error", "message": "bad", "type": "BadRequestError", "param": None, "code": 400})
    assert (e.category, e.provider_code) == ("invalid_request", "400")


def test_named_error_event() -> None:
    data = b'event: error\ndata: {"error": {"type": "server_error", "code": "overloaded", "message": "m"}}\n\n'
    e = _error_of(chunk({"content": "x"}), data)
    assert (e.category, e.provider_code) == ("overloaded", "overloaded")
    e = _error_of(b'event: error\ndata: {"message": "m", "type": "invalid_request_error"}\n\n')
    assert (e.category, e.provider_code) == ("invalid_request", "invalid_request_error")


USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}


@pytest.mark.parametrize(
    "failing",
    [
        pytest.param({"error": {"code": 502, "message": "Upstream down"}, "usage": USAGE}, id="error-object"),
        pytest.param(
            chunk({"content": ""}, finish="error", error={"code": 502, "message": "m"}, usage=USAGE), id="choice-error"
        ),
        pytest.param(chunk(finish="error", usage=USAGE), id="finish-reason-error"),
        pytest.param({"object": "error", "message": "m", "type": "InternalServerError", "usage": USAGE}, id="vllm"),
        pytest.param({"error": {"code": 502}, "x_groq": {"usage": USAGE}}, id="groq"),
    ],
)
def test_usage_beside_an_error_reaches_stream_error(failing: dict[str, Any]) -> None:
    _, events, r = run("openai-chat", sse(chunk({"content": "x"}), failing))
    check_invariants(events)
    assert isinstance(events[-1], StreamError)
    u = events[-1].usage
    assert u is not None and (u.input_tokens, u.output_tokens, u.total_tokens) == (12, 3, 15)
    assert r.status == "failed" and r.usage == u


def test_usage_beside_an_error_merges_with_earlier_usage_and_needs_no_started_stream() -> None:
    early = {"prompt_tokens": 12, "prompt_tokens_details": {"cached_tokens": 8}}
    _, events, _ = run(
        "openai-chat",
        sse(chunk({"content": "x"}, usage=early), {"error": {"code": 502}, "usage": {"completion_tokens": 4}}),
    )
    u = events[-1].usage
    assert u is not None and (u.input_tokens, u.output_tokens, u.cache_read_tokens) == (12, 4, 8)
    _, events, _ = run("openai-chat", sse({"error": {"code": 429}, "usage": USAGE}))
    assert briefs(events) == ["start None", "failed rate_limit 429 retryable=True"]
    assert events[-1].usage is not None and events[-1].usage.total_tokens == 15


def test_an_error_first_still_starts_the_stream() -> None:
    got, _ = go({"error": {"message": "m", "type": "server_error"}})
    assert got == ["start None", "failed server_error server_error retryable=True"]


def test_a_null_error_field_is_no_error() -> None:
    got, _ = go(chunk({"content": "x"}, error=None), DONE)
    assert got[-1] == "done other None"


# -- the mapping tables, as documented ------------------------------------------------------------

DOCUMENTED_STOP_REASONS = {
    "stop": "stop",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "length",
    "model_length": "length",
    "content_filter": "content_filter",
}
DOCUMENTED_FAILURE_FINISH_REASONS = {"error": "server_error", "insufficient_system_resource": "overloaded"}
DOCUMENTED_ERROR_CATEGORIES = {
    **dict.fromkeys(
        [
            "server_error",
            "api_error",
            "internal_error",
            "internal_server_error",
            "timeout",
            "InternalServerError",
            "408",
            "500",
            "502",
            "504",
        ],
        "server_error",
    ),
    **dict.fromkeys(
        ["overloaded", "overloaded_error", "server_is_overloaded", "engine_overloaded", "503", "529"], "overloaded"
    ),
    **dict.fromkeys(
        ["rate_limit_exceeded", "rate_limit_error", "requests", "tokens", "slow_down", "429"], "rate_limit"
    ),
    **dict.fromkeys(["insufficient_quota", "billing_hard_limit_reached", "billing_not_active", "402"], "billing"),
    **dict.fromkeys(
        ["invalid_request_error", "context_length_exceeded", "content_filter", "BadRequestError", "400", "413"],
        "invalid_request",
    ),
    **dict.fromkeys(["invalid_api_key", "invalid_authentication", "authentication_error", "401"], "authentication"),
    **dict.fromkeys(["permission_error", "unsupported_country_region_territory", "403"], "permission"),
    **dict.fromkeys(["model_not_found", "not_found_error", "NotFoundError", "404"], "not_found"),
}


def test_tables_are_as_documented() -> None:
    assert OpenAIChatAdapter.STOP_REASONS == DOCUMENTED_STOP_REASONS
    assert OpenAIChatAdapter.FAILURE_FINISH_REASONS == DOCUMENTED_FAILURE_FINISH_REASONS
    assert OpenAIChatAdapter.ERROR_CATEGORIES == DOCUMENTED_ERROR_CATEGORIES
    assert set(OpenAIChatAdapter.TERMINAL_SIGNALS) >= {"data: [DONE]", "EOF before [DONE]"}


@pytest.mark.parametrize(("reason", "want"), [*DOCUMENTED_STOP_REASONS.items(), ("eos_token", "other")])
def test_finish_reason_maps_end_to_end(reason: str, want: str) -> None:
    got, r = go(chunk({"content": "x"}), chunk(finish=reason), DONE)
    assert got[-1] == f"done {want} {reason}"
    assert (r.status, r.stop_reason, r.provider_stop_reason) == ("completed", want, reason)


@pytest.mark.parametrize(("reason", "category"), sorted(DOCUMENTED_FAILURE_FINISH_REASONS.items()))
def test_failing_finish_reason_maps_end_to_end(reason: str, category: str) -> None:
    e = _error_of(chunk({"content": "x"}), chunk(finish=reason), DONE)
    assert (e.category, e.provider_code, e.retryable) == (category, reason, category in RETRYABLE_CATEGORIES)


@pytest.mark.parametrize(("code", "category"), sorted(DOCUMENTED_ERROR_CATEGORIES.items()))
def test_error_code_maps_end_to_end(code: str, category: str) -> None:
    wire_code: Any = int(code) if code.isdigit() else code
    e = _error_of(chunk({"content": "x"}), {"error": {"message": "m", "type": None, "code": wire_code}})
    assert (e.category, e.provider_code, e.retryable) == (category, code, category in RETRYABLE_CATEGORIES)
    e = _error_of({"error": {"message": "m", "type": code, "code": None}})  # the same word as error.type
    assert (e.category, e.provider_code) == (category, code)


@pytest.mark.parametrize(("cost", "text"), [(6.55e-05, "0.0000655"), (0, "0"), (2, "2"), (0.125, "0.125")])
def test_the_provider_s_own_cost_is_kept_as_a_decimal_string(cost: float, text: str) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "cost": cost}
    body = sse(
        chunk({"content": "hi"}), chunk(finish="stop"), {**chunk(), "choices": [], "usage": usage}, b"data: [DONE]\n\n"
    )
    _, _, result = run("openai-chat", body)
    assert result.usage is not None and result.usage.provider_cost == text


def test_a_later_usage_report_without_a_cost_keeps_the_earlier_one() -> None:
    first = {"prompt_tokens": 3, "completion_tokens": 1, "cost": 0.001}
    later = {"prompt_tokens": 3, "completion_tokens": 2}
    body = sse(
        {**chunk({"content": "hi"}), "usage": first},
        chunk(finish="stop"),
        {**chunk(), "choices": [], "usage": later},
        b"data: [DONE]\n\n",
    )
    _, _, result = run("openai-chat", body)
    assert result.usage is not None
    assert (result.usage.output_tokens, result.usage.provider_cost) == (2, "0.001")
