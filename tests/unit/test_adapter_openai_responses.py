"""OpenAI Responses adapter: each transcript's exact sequence by hand, the mapping tables, and the edges.

Sequences are written in ``brief`` form (tests/helpers.py); the golden runner checks the same transcripts
event by event and under re-chunking.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.normalizer.adapters import adapter_class, get_adapter
from sluice.normalizer.adapters.openai_responses import OpenAIResponsesAdapter
from sluice.schemas.events import (
    ERROR_CATEGORIES,
    RETRYABLE_CATEGORIES,
    STOP_REASONS,
    StreamError,
    StreamWarning,
    Usage,
)
from tests.helpers import TRANSCRIPTS, briefs, check_invariants, run

D = "openai-responses"
MODEL = "gpt-5-2025-08-07"
DIR = TRANSCRIPTS / D


def sse(*events: dict[str, Any], named: bool = True) -> bytes:
    """Frame events as the API does: ``event: <type>`` then ``data: <json>``, numbered from 0 unless
    an event carries its own ``sequence_number`` (``None`` drops it)."""
    out = []
    for i, ev in enumerate(events):
        body = {"sequence_number": i, **ev}
        if body["sequence_number"] is None:
            del body["sequence_number"]
        head = f"event: {ev['type']}\n" if named and "type" in ev else ""
        out.append(f"{head}data: {json.dumps(body, ensure_ascii=False)}\n\n")
    return "".join(out).encode()


def created(model: str | None = "m") -> dict[str, Any]:
    return {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "model": model}}


def completed(output: list[Any] | None = None, **resp: Any) -> dict[str, Any]:
    return {"type": "response.completed", "response": {"status": "completed", "output": output or [], **resp}}


def incomplete(reason: str | None) -> dict[str, Any]:
    return {
        "type": "response.incomplete",
        "response": {"status": "incomplete", "output": [], "incomplete_details": {"reason": reason}},
    }


def fc_item(fid: str = "fc_1", call_id: str | None = "call_1", name: str = "f", args: str = "") -> dict[str, Any]:
    return {"id": fid, "type": "function_call", "call_id": call_id, "name": name, "arguments": args}


def added(item: dict[str, Any], oi: int = 0) -> dict[str, Any]:
    return {"type": "response.output_item.added", "output_index": oi, "item": item}


def item_done(item: dict[str, Any], oi: int = 0) -> dict[str, Any]:
    return {"type": "response.output_item.done", "output_index": oi, "item": item}


def text_delta(delta: str, item_id: str | None = "msg_1", ci: int = 0, oi: int = 0) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "response.output_text.delta", "output_index": oi, "content_index": ci}
    if item_id is not None:
        ev["item_id"] = item_id
    return {**ev, "delta": delta}


def args_delta(delta: str, fid: str = "fc_1") -> dict[str, Any]:
    return {
        "type": "response.function_call_arguments.delta",
        "item_id": fid,
        "output_index": 0,
        "delta": delta,
    }


def args_done(arguments: str, fid: str = "fc_1") -> dict[str, Any]:
    return {
        "type": "response.function_call_arguments.done",
        "item_id": fid,
        "output_index": 0,
        "arguments": arguments,
    }


def go(*events: dict[str, Any]) -> list[str]:
    _, evs, _ = run(D, sse(*events))
    check_invariants(evs)
    return briefs(evs)


def last_error(*events: dict[str, Any]) -> StreamError:
    _, evs, _ = run(D, sse(*events))
    check_invariants(evs)
    term = evs[-1]
    assert isinstance(term, StreamError)
    return term


# -- transcripts, spelled out ---------------------------------------------------------------------

DONE = "done stop completed"
TRANSCRIPT_BRIEFS: dict[str, list[str]] = {
    # Output checks' transcripts (tests/checked_cases.py); the same bytes, unchecked.
    "json_answer": [
        "start gpt-5-2025-08-07",
        "open 0 text",
        "delta 0 text '{\"city\": '",
        'delta 0 text \'"Paris", "te\'',
        "delta 0 text 'mp_c\": 21}'",
        "stop 0",
        "done stop completed",
    ],
    "utf8_deltas": [
        f"start {MODEL}",
        "open 0 text",
        *(
            f"delta 0 text {t!r}"
            for t in [
                "При",
                "вет",
                ", ",
                "мир",
                "! ",
                "你",
                "好",
                "，",
                "世界",
                "。 ",
                "👩\u200d💻",
                " line\u2028sep",
                " 🇰🇿",
                " ok",
            ]
        ),
        "stop 0",
        DONE,
    ],
    "text_then_function_call": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'Checking '",
        "delta 0 text 'the weather.'",
        "stop 0",
        "open 1 tool_call get_weather call_A1",
        """delta 1 json_text '{"ci'""",
        """delta 1 json_text 'ty": "Alma'""",
        """delta 1 json_text 'ty \\\\"Sou'""",
        """delta 1 json_text 'th\\\\"", "unit": "c\\\\u00b'""",
        """delta 1 json_text '0", "note": "a\\\\\\\\'""",
        """delta 1 json_text 'b\\\\n"}'""",
        """stop 1 {"city":"Almaty \\"South\\"","note":"a\\\\b\\n","unit":"c°"}""",
        "done tool_use completed",
    ],
    "parallel_function_calls": [
        f"start {MODEL}",
        "open 0 tool_call get_weather call_a",
        "open 1 tool_call get_time call_b",
        """delta 0 json_text '{"city":'""",
        """delta 1 json_text '{"tz": "Europe/'""",
        """delta 0 json_text ' "Paris"}'""",
        """delta 1 json_text 'Paris"}'""",
        """stop 1 {"tz":"Europe/Paris"}""",
        """stop 0 {"city":"Paris"}""",
        "done tool_use completed",
    ],
    "reasoning_summary_then_text": [
        f"start {MODEL}",
        "open 0 reasoning public",
        "delta 0 text '**Plan**'",
        "delta 0 text ' compare both'",
        "stop 0",
        "open 1 reasoning public",
        "delta 1 text 'Then '",
        "delta 1 text 'answer briefly.'",
        "stop 1",
        "open 2 reasoning internal",
        "delta 2 signature 'gAAAAB-opaque=='",
        "stop 2",
        "open 3 text",
        "delta 3 text 'B is '",
        "delta 3 text 'larger.'",
        "stop 3",
        DONE,
    ],
    "reasoning_text_then_text": [
        f"start {MODEL}",
        "open 0 reasoning internal",
        "delta 0 text 'Think: '",
        "delta 0 text '2+2=4.'",
        "stop 0",
        "open 1 text",
        "delta 1 text '4'",
        "stop 1",
        DONE,
    ],
    "error_nested_after_text": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'Partial '",
        "delta 0 text 'answer'",
        "failed overloaded server_is_overloaded retryable=True",
    ],
    "error_toplevel_after_text": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'Some '",
        "delta 0 text 'text'",
        "failed rate_limit rate_limit_exceeded retryable=True",
    ],
    "failed_null_code": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'Hel'",
        "delta 0 text 'lo'",
        "failed unknown None retryable=False",
    ],
    "eof_without_terminal": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'All '",
        "delta 0 text 'done, '",
        "delta 0 text 'apparently.'",
        "stop 0",
        "interrupted transport None retryable=False",
    ],
    "eof_inside_tool_arguments": [
        f"start {MODEL}",
        "open 0 tool_call search call_Z",
        """delta 0 json_text '{"query": "str'""",
        """delta 0 json_text 'eaming \\\\"SSE\\\\"'""",
        """delta 0 json_text ' spec", "limit": 1'""",
        "interrupted transport None retryable=False",
    ],
    "unknown_events_and_fields": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'See '",
        "delta 0 text 'the docs.'",
        "stop 0",
        # the web_search_call item's added and done (server-side: skipped, but counted), the future
        # delta and the custom tool call input; the search's progress events are known and not counted
        "warning unknown_events_skipped 4",
        DONE,
    ],
    "length_incomplete": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'The answer '",
        "delta 0 text 'is long and'",
        "stop 0",
        "done length max_output_tokens",
    ],
    "content_filter_incomplete": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'Here is how '",
        "stop 0",
        "done content_filter content_filter",
    ],
    "refusal": [
        f"start {MODEL}",
        "open 0 refusal",
        """delta 0 text "I'm sorry, \"""",
        """delta 0 text "I can't help \"""",
        "delta 0 text 'with that.'",
        "stop 0",
        "done refusal completed",
    ],
    "sequence_gap_and_reorder": [
        f"start {MODEL}",
        "open 0 text",
        "delta 0 text 'one '",
        "warning sequence_gap 1",
        "delta 0 text 'three '",
        "warning sequence_reordered 1",
        "delta 0 text 'two '",
        "stop 0",
        DONE,
    ],
    "invalid_json_arguments": [
        f"start {MODEL}",
        "open 0 tool_call lookup call_bad",
        """delta 0 json_text '{"id": 42,'""",
        """delta 0 json_text ' "name": \\'x\\'}'""",
        "failed protocol None retryable=False",
    ],
    "done_events_only": [
        "start local-model",
        "open 0 text",
        "delta 0 text 'Whole text at once.'",
        "stop 0",
        "open 1 tool_call ping call_1",
        """delta 1 json_text '{"host": "example.org"}'""",
        """stop 1 {"host":"example.org"}""",
        "open 2 tool_call now call_2",
        "stop 2 {}",
        "done tool_use completed",
    ],
    # A server-side tool_search_call (arguments an object, not a string) and its output item are
    # skipped and counted; the client function call and the usage survive.
    "server_side_tool_search": [
        "start gpt-5.4-2026-03-05",
        "open 0 tool_call lookup_order call_Q7a",
        """delta 0 json_text '{"order_id":'""",
        """delta 0 json_text '"A-1042"}'""",
        """stop 0 {"order_id":"A-1042"}""",
        "warning unknown_events_skipped 4",
        "done tool_use completed",
    ],
    # A compatible server (Copilot) names the item anew on every event: output_index is the key.
    "item_id_rotation": [
        "start gpt-5.3-codex",
        "warning item_id_changed 1",
        "open 0 reasoning public",
        "delta 0 text '**Counting letters**'",
        "stop 0",
        "warning item_id_changed 1",
        "open 1 text",
        "delta 1 text 'There are'",
        'delta 1 text " three r\'s."',
        "stop 1",
        "done stop completed",
    ],
    "incomplete_in_function_call": [
        "start gpt-5-2025-08-07",
        "open 0 tool_call write_file call_cut1",
        """delta 0 json_text '{"path":"notes.txt",'""",
        """delta 0 json_text '"lines":["first line","sec'""",
        "stop 0 null truncated",
        "done length max_output_tokens",
    ],
    "reasoning_encrypted_function_call": [
        "start o4-mini-2025-04-16",
        "open 0 reasoning public",
        "delta 0 text '**Looking the order up**'",
        "stop 0",
        "open 1 reasoning public",
        "delta 1 text 'I need the order id.'",
        "stop 1",
        # the encrypted content as it is final, on output_item.done (added carried a partial one)
        "open 2 reasoning internal",
        "delta 2 signature 'gAAAAABpFinalEncrypted=='",
        "stop 2",
        "open 3 tool_call lookup_order call_enc1",
        """delta 3 json_text '{"order_id":"A-1042"}'""",
        """stop 3 {"order_id":"A-1042"}""",
        "done tool_use completed",
    ],
    # A compatible server streams the part as content_index 1 and lists it at 0 when done: one block.
    "content_index_renumbered": [
        "start qwen3-30b-a3b",
        "open 0 text",
        "delta 0 text 'Lima is'",
        "delta 0 text ' the capital of Peru.'",
        "stop 0",
        "done stop completed",
    ],
    # response.failed reports the usage billed: the stream.error carries it (golden).
    "failed_with_usage": [
        "start gpt-4.1-2025-04-14",
        "open 0 text",
        "delta 0 text 'The first'",
        "delta 0 text ' step is'",
        "failed server_error server_error retryable=True",
    ],
}


def test_every_transcript_is_spelled_out() -> None:
    assert {p.stem for p in DIR.glob("*.sse")} == set(TRANSCRIPT_BRIEFS)


@pytest.mark.parametrize("case", sorted(TRANSCRIPT_BRIEFS))
def test_transcript_sequence(case: str) -> None:
    _, events, _ = run(D, (DIR / f"{case}.sse").read_bytes())
    assert briefs(events) == TRANSCRIPT_BRIEFS[case]
    check_invariants(events)


def test_server_side_items_never_fail_the_stream() -> None:
    _, events, result = run(D, (DIR / "server_side_tool_search.sse").read_bytes())
    assert (result.status, result.stop_reason) == ("completed", "tool_use")
    assert result.usage is not None and (result.usage.input_tokens, result.usage.output_tokens) == (310, 41)
    assert [(c.name, c.call_id, c.arguments) for c in result.tool_calls] == [
        ("lookup_order", "call_Q7a", {"order_id": "A-1042"})
    ]
    warning = next(e for e in events if isinstance(e, StreamWarning))
    assert "response.output_item.added:tool_search_call" in warning.message
    assert "response.output_item.done:tool_search_output" in warning.message


def test_a_changed_item_id_is_one_warning_per_item_never_a_new_block() -> None:
    _, events, result = run(D, (DIR / "item_id_rotation.sse").read_bytes())
    assert [(b.kind, b.text) for b in result.blocks] == [
        ("reasoning", "**Counting letters**"),
        ("text", "There are three r's."),
    ]
    warnings = [e.message for e in events if isinstance(e, StreamWarning)]
    assert warnings == [
        "the item at output_index 0 came as 'rot-3', now as 'rot-4'; items are keyed by output_index",
        "the item at output_index 1 came as 'rot-9', now as 'rot-10'; items are keyed by output_index",
    ]


def test_a_known_item_of_the_wrong_shape_is_a_protocol_failure() -> None:
    bad = {"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}
    err = last_error(created(), added(bad))
    assert err.error.category == "protocol" and "malformed" in err.error.message


def test_any_other_item_is_read_leniently() -> None:
    odd = {"id": "x_1", "type": "brand_new_call", "arguments": {"deep": [1, {"a": None}]}, "name": 7, "content": "s"}
    assert go(created(), added(odd), item_done(odd), completed([odd])) == [
        "start m",
        "warning unknown_events_skipped 2",
        DONE,
    ]


def test_a_call_cut_by_max_output_tokens_keeps_its_text_and_no_arguments() -> None:
    _, _, result = run(D, (DIR / "incomplete_in_function_call.sse").read_bytes())
    assert (result.status, result.stop_reason, result.provider_stop_reason) == (
        "completed",
        "length",
        "max_output_tokens",
    )
    (b,) = result.blocks
    assert (b.arguments, b.arguments_error) == (None, "truncated")
    assert b.arguments_text == '{"path":"notes.txt","lines":["first line","sec'


def test_invalid_arguments_in_a_completed_response_stay_a_protocol_failure() -> None:
    err = last_error(created(), added(fc_item()), args_delta('{"a": '), args_done('{"a": '), completed())
    assert err.error.category == "protocol" and err.error.block_index == 0


def test_the_encrypted_content_is_its_own_encrypted_block() -> None:
    _, _, result = run(D, (DIR / "reasoning_encrypted_function_call.sse").read_bytes())
    assert [(b.kind, b.visibility, b.encrypted, b.text, b.signature) for b in result.blocks[:3]] == [
        ("reasoning", "public", False, "**Looking the order up**", None),
        ("reasoning", "public", False, "I need the order id.", None),
        ("reasoning", "internal", True, "", "gAAAAABpFinalEncrypted=="),
    ]


def test_text_then_call_result() -> None:
    _, _, result = run(D, (DIR / "text_then_function_call.sse").read_bytes())
    assert result.status == "completed"
    assert result.stop_reason == "tool_use"
    text, call = result.blocks
    assert text.text == "Checking the weather."
    assert (call.name, call.call_id) == ("get_weather", "call_A1")
    assert call.arguments == {"city": 'Almaty "South"', "unit": "c°", "note": "a\\b\n"}
    assert result.usage is not None
    assert (result.usage.input_tokens, result.usage.output_tokens, result.usage.total_tokens) == (
        120,
        48,
        168,
    )
    assert (result.usage.cache_read_tokens, result.usage.reasoning_tokens) == (64, 16)
    assert result.usage.cache_write_tokens is None


def test_error_after_text_keeps_text_and_first_terminal_wins() -> None:
    # The capture sends `error` then `response.failed` (code server_error): the error event decides.
    _, events, result = run(D, (DIR / "error_nested_after_text.sse").read_bytes())
    assert result.status == "failed"
    assert result.error is not None
    assert result.error.message == "Our servers are currently overloaded. Please try again later."
    assert [b.text for b in result.blocks] == ["Partial answer"]
    assert sum(isinstance(e, StreamError) for e in events) == 1


def test_failed_keeps_usage() -> None:
    _, _, result = run(D, (DIR / "failed_null_code.sse").read_bytes())
    assert result.usage is not None and result.usage.input_tokens == 120
    assert result.error is not None
    assert result.error.message == "An error occurred while processing your request."


def test_interrupted_tool_call_has_no_arguments() -> None:
    _, _, result = run(D, (DIR / "eof_inside_tool_arguments.sse").read_bytes())
    assert result.status == "interrupted"
    (call,) = result.blocks
    assert call.arguments is None
    assert call.arguments_text == '{"query": "streaming \\"SSE\\" spec", "limit": 1'


def test_encrypted_reasoning_is_a_signature() -> None:
    _, _, result = run(D, (DIR / "reasoning_summary_then_text.sse").read_bytes())
    assert [(b.kind, b.text, b.signature) for b in result.blocks] == [
        ("reasoning", "**Plan** compare both", None),
        ("reasoning", "Then answer briefly.", None),
        ("reasoning", "", "gAAAAB-opaque=="),
        ("text", "B is larger.", None),
    ]


def test_invalid_arguments_fail_at_their_block() -> None:
    _, _, result = run(D, (DIR / "invalid_json_arguments.sse").read_bytes())
    assert result.error is not None
    assert result.error.block_index == 0
    assert result.blocks[0].arguments is None


# -- the mapping tables ---------------------------------------------------------------------------

# As documented in the README and the module: written out again by hand so a table edit is noticed.
DOCUMENTED_STOP_REASONS = {
    "completed": "stop",
    "max_output_tokens": "length",
    "content_filter": "content_filter",
}
DOCUMENTED_ERROR_CATEGORIES = {
    "server_error": "server_error",
    "vector_store_timeout": "server_error",
    "server_is_overloaded": "overloaded",
    "service_unavailable_error": "overloaded",
    "rate_limit_exceeded": "rate_limit",
    "insufficient_quota": "billing",
    "invalid_prompt": "invalid_request",
    "context_length_exceeded": "invalid_request",
    "invalid_request_error": "invalid_request",
    "bio_policy": "invalid_request",
    **dict.fromkeys(
        [
            "invalid_image",
            "invalid_image_format",
            "invalid_base64_image",
            "invalid_image_url",
            "image_too_large",
            "image_too_small",
            "image_parse_error",
            "image_content_policy_violation",
            "invalid_image_mode",
            "image_file_too_large",
            "unsupported_image_media_type",
            "empty_image_file",
            "failed_to_download_image",
            "image_file_not_found",
        ],
        "invalid_request",
    ),
    "invalid_api_key": "authentication",
    "authentication_error": "authentication",
    "data_residency_mismatch": "permission",
    "permission_error": "permission",
    "model_not_found": "not_found",
    "not_found_error": "not_found",
}


def test_tables_are_as_documented() -> None:
    assert OpenAIResponsesAdapter.STOP_REASONS == DOCUMENTED_STOP_REASONS
    assert OpenAIResponsesAdapter.ERROR_CATEGORIES == DOCUMENTED_ERROR_CATEGORIES
    assert set(DOCUMENTED_STOP_REASONS.values()) <= set(STOP_REASONS)
    assert set(DOCUMENTED_ERROR_CATEGORIES.values()) <= set(ERROR_CATEGORIES)
    assert set(OpenAIResponsesAdapter.TERMINAL_SIGNALS) == {
        "response.completed",
        "response.incomplete",
        "response.failed",
        "error",
        "EOF before a terminal (there is no [DONE])",
    }


def test_registry_finds_the_adapter() -> None:
    assert adapter_class(D) is OpenAIResponsesAdapter
    adapter = get_adapter(D)
    assert (adapter.dialect, adapter.provider) == (D, "openai")


@pytest.mark.parametrize(("reason", "stop"), [(r, s) for r, s in DOCUMENTED_STOP_REASONS.items() if r != "completed"])
def test_incomplete_reason_maps(reason: str, stop: str) -> None:
    assert go(created(), incomplete(reason)) == ["start m", f"done {stop} {reason}"]


def test_completed_maps_to_stop() -> None:
    assert go(created(), completed()) == ["start m", "done stop completed"]


@pytest.mark.parametrize(("reason", "provider"), [(None, "incomplete"), ("max_tool_calls", "max_tool_calls")])
def test_other_incomplete_reasons_are_other(reason: str | None, provider: str) -> None:
    assert go(created(), incomplete(reason)) == ["start m", f"done other {provider}"]


@pytest.mark.parametrize(("code", "category"), sorted(DOCUMENTED_ERROR_CATEGORIES.items()))
@pytest.mark.parametrize("form", ["nested", "top-level", "response.failed"])
def test_error_code_maps(code: str, category: str, form: str) -> None:
    if form == "nested":
        ev: dict[str, Any] = {
            "type": "error",
            "error": {"type": "x", "code": code, "message": "m", "param": None},
        }
    elif form == "top-level":
        ev = {"type": "error", "code": code, "message": "m", "param": None}
    else:
        ev = {
            "type": "response.failed",
            "response": {"status": "failed", "error": {"code": code, "message": "m"}},
        }
    err = last_error(created(), ev).error
    assert (err.category, err.provider_code, err.message) == (category, code, "m")
    assert err.retryable is (category in RETRYABLE_CATEGORIES)


# -- errors ---------------------------------------------------------------------------------------


def test_null_code_falls_back_to_the_error_type() -> None:
    err = last_error(created(), {"type": "error", "error": {"type": "invalid_request_error", "code": None}}).error
    assert (err.category, err.provider_code, err.retryable) == (
        "invalid_request",
        "invalid_request_error",
        False,
    )
    assert err.message == "the provider reported an error"


def test_error_without_code_or_type_is_unknown() -> None:
    err = last_error(created(), {"type": "error", "message": "  "}).error
    assert (err.category, err.provider_code, err.message) == (
        "unknown",
        None,
        "the provider reported an error",
    )


def test_nested_error_without_code_reads_the_top_level_code() -> None:
    err = last_error(created(), {"type": "error", "code": 503, "error": {"message": "down"}}).error
    assert (err.provider_code, err.category, err.message) == ("503", "unknown", "down")


def test_error_given_as_a_string() -> None:
    err = last_error(created(), {"type": "error", "error": "upstream exploded"}).error
    assert (err.category, err.message) == ("unknown", "upstream exploded")


def test_failed_without_error_object() -> None:
    err = last_error(created(), {"type": "response.failed", "response": {"status": "failed"}}).error
    assert (err.category, err.provider_code) == ("unknown", None)


def test_long_error_messages_are_cut() -> None:
    err = last_error(created(), {"type": "error", "code": "server_error", "message": "x" * 1000}).error
    assert err.message == "x" * 297 + "..."


def test_error_before_anything_starts_the_stream() -> None:
    ev = {"type": "error", "code": "insufficient_quota", "message": "quota"}
    assert go(ev) == ["start None", "failed billing insufficient_quota retryable=False"]


def test_failed_before_start_keeps_its_usage() -> None:
    ev = {
        "type": "response.failed",
        "response": {"error": {"code": "server_error"}, "usage": {"input_tokens": 1}},
    }
    _, evs, result = run(D, sse(ev))
    assert briefs(evs) == ["start None", "failed server_error server_error retryable=True"]
    assert isinstance(evs[-1], StreamError) and evs[-1].usage == Usage(input_tokens=1)
    assert result.usage == Usage(input_tokens=1)


def test_failed_usage_reaches_stream_error_merged_with_nothing_else() -> None:
    usage = {"input_tokens": 30, "output_tokens": 4, "total_tokens": 34, "input_tokens_details": {"cached_tokens": 16}}
    failed = {
        "type": "response.failed",
        "response": {"status": "failed", "error": {"code": "server_error"}, "usage": usage},
    }
    _, evs, result = run(D, sse(created(), failed))
    want = Usage(input_tokens=30, output_tokens=4, cache_read_tokens=16, total_tokens=34)
    assert isinstance(evs[-1], StreamError) and evs[-1].usage == want and result.usage == want


@pytest.mark.parametrize(
    "error",
    [
        pytest.param({"type": "error", "code": "server_error", "message": "m"}, id="top-level"),
        pytest.param({"type": "error", "error": {"code": "server_error", "message": "m"}}, id="nested"),
        pytest.param({"type": "error", "error": "m", "code": "server_error"}, id="string"),
    ],
)
def test_an_error_event_keeps_the_usage_a_router_reports_beside_it(error: dict[str, Any]) -> None:
    _, evs, result = run(D, sse(created(), {**error, "usage": {"input_tokens": 9, "output_tokens": 2}}))
    assert briefs(evs)[-1] == "failed server_error server_error retryable=True"
    assert isinstance(evs[-1], StreamError) and evs[-1].usage == Usage(input_tokens=9, output_tokens=2)
    assert result.usage == evs[-1].usage


def test_invalid_json_payload_is_a_protocol_failure() -> None:
    raw = sse(created()) + b"event: response.output_text.delta\ndata: {not json\n\n"
    _, evs, _ = run(D, raw)
    assert briefs(evs) == ["start m", "failed protocol None retryable=False"]


# -- blocks ---------------------------------------------------------------------------------------


def test_empty_fragments_open_nothing() -> None:
    part = {"type": "response.content_part.added", "item_id": "msg_1", "output_index": 0, "content_index": 0}
    assert go(
        created(),
        added({"id": "msg_1", "type": "message", "content": []}),
        {**part, "part": {"type": "output_text", "text": ""}},
        text_delta(""),
        {
            "type": "response.output_text.done",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "text": "",
        },
        {**part, "type": "response.content_part.done", "part": {"type": "output_text", "text": ""}},
        {
            "type": "response.refusal.delta",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 1,
            "delta": "",
        },
        item_done({"id": "msg_1", "type": "message", "content": [{"type": "output_text", "text": ""}]}),
        completed(),
    ) == ["start m", "done stop completed"]


def test_closing_is_idempotent_across_done_events() -> None:
    done_text = {
        "type": "response.output_text.done",
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
    }
    part_done = {
        "type": "response.content_part.done",
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
    }
    msg = {"id": "msg_1", "type": "message", "content": [{"type": "output_text", "text": "Hi"}]}
    assert go(
        created(),
        text_delta("Hi"),
        {**done_text, "text": "Hi"},
        {**part_done, "part": {"type": "output_text", "text": "Hi"}},
        item_done(msg),
        completed([msg]),
    ) == ["start m", "open 0 text", "delta 0 text 'Hi'", "stop 0", "done stop completed"]


def test_item_done_closes_parts_left_open() -> None:
    msg = {"id": "msg_1", "type": "message", "content": []}
    assert go(created(), text_delta("a"), text_delta("b", ci=1), item_done(msg), completed()) == [
        "start m",
        "open 0 text",
        "delta 0 text 'a'",
        "open 1 text",
        "delta 1 text 'b'",
        "stop 0",
        "stop 1",
        "done stop completed",
    ]


def _msg(*parts: tuple[str, str]) -> dict[str, Any]:
    content = [{"type": t, "text": x} if t != "refusal" else {"type": t, "refusal": x} for t, x in parts]
    return {"id": "msg_1", "type": "message", "content": content}


def test_a_part_streamed_at_one_index_and_listed_at_another_is_one_block() -> None:
    # Deltas number the part content_index 1; output_item.done and the terminal list it at position 0.
    msg = _msg(("output_text", "Hello"))
    part = {"type": "response.content_part.added", "item_id": "msg_1", "output_index": 0, "content_index": 1}
    for closing in ([item_done(msg), completed([msg])], [completed([msg])]):
        _, evs, result = run(
            D,
            sse(
                created(),
                {**part, "part": {"type": "output_text", "text": ""}},
                text_delta("Hel", ci=1),
                text_delta("lo", ci=1),
                *closing,
            ),
        )
        check_invariants(evs)
        assert briefs(evs) == [
            "start m",
            "open 0 text",
            "delta 0 text 'Hel'",
            "delta 0 text 'lo'",
            "stop 0",
            "done stop completed",
        ]
        assert [b.text for b in result.blocks] == ["Hello"]


def test_renumbered_parts_match_in_order_by_kind_and_a_part_never_streamed_is_still_supplied() -> None:
    # Streamed at 1 (text) and 2 (refusal); the done item lists text, a text never streamed, the refusal.
    refusal_delta = {"type": "response.refusal.delta", "item_id": "msg_1", "output_index": 0, "content_index": 2}
    msg = _msg(("output_text", "ab"), ("output_text", "late"), ("refusal", "no"))
    assert go(created(), text_delta("ab", ci=1), {**refusal_delta, "delta": "no"}, item_done(msg), completed()) == [
        "start m",
        "open 0 text",
        "delta 0 text 'ab'",
        "open 1 refusal",
        "delta 1 text 'no'",
        "stop 0",
        "open 2 text",
        "delta 2 text 'late'",
        "stop 2",
        "stop 1",
        "done refusal completed",
    ]


def test_a_part_streamed_at_its_own_position_keeps_it_and_an_earlier_unstreamed_part_is_supplied() -> None:
    # content_index 1 really is position 1: position 0 was never streamed and comes whole from the item.
    msg = _msg(("output_text", "first"), ("output_text", "second"))
    assert go(created(), text_delta("second", ci=1), item_done(msg), completed()) == [
        "start m",
        "open 0 text",
        "delta 0 text 'second'",
        "open 1 text",
        "delta 1 text 'first'",
        "stop 1",
        "stop 0",
        "done stop completed",
    ]


def test_a_listed_part_whose_text_differs_from_the_stream_is_matched_by_position_then_by_order() -> None:
    for ci in (0, 1):  # at its own position, then renumbered: one block, the streamed text kept
        _, evs, result = run(
            D, sse(created(), text_delta("Hel", ci=ci), item_done(_msg(("output_text", "Hello"))), completed())
        )
        assert briefs(evs) == ["start m", "open 0 text", "delta 0 text 'Hel'", "stop 0", "done stop completed"]
        assert [b.text for b in result.blocks] == ["Hel"]


def test_a_part_never_streamed_whose_position_another_kind_streamed_at_gets_a_block_of_its_own() -> None:
    refusal_delta = {"type": "response.refusal.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0}
    msg = _msg(("output_text", "whole"), ("refusal", "no"))
    assert go(created(), {**refusal_delta, "delta": "no"}, item_done(msg), completed()) == [
        "start m",
        "open 0 refusal",
        "delta 0 text 'no'",
        "open 1 text",
        "delta 1 text 'whole'",
        "stop 1",
        "stop 0",
        "done refusal completed",
    ]


def test_renumbered_reasoning_summary_and_text_parts_are_one_block_each() -> None:
    summary = {
        "type": "response.reasoning_summary_text.delta",
        "item_id": "rs_1",
        "output_index": 0,
        "summary_index": 1,
    }
    raw_text = {"type": "response.reasoning_text.delta", "item_id": "rs_1", "output_index": 0, "content_index": 3}
    item = {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "Plan."}],
        "content": [{"type": "reasoning_text", "text": "think"}],
    }
    assert go(
        created(), {**summary, "delta": "Plan."}, {**raw_text, "delta": "think"}, item_done(item), completed()
    ) == [
        "start m",
        "open 0 reasoning public",
        "delta 0 text 'Plan.'",
        "open 1 reasoning internal",
        "delta 1 text 'think'",
        "stop 0",
        "stop 1",
        "done stop completed",
    ]


def test_done_text_is_not_appended_twice() -> None:
    done = {"type": "response.output_text.done", "item_id": "msg_1", "output_index": 0, "content_index": 0}
    assert go(created(), text_delta("Hel"), {**done, "text": "Hello"}, completed()) == [
        "start m",
        "open 0 text",
        "delta 0 text 'Hel'",
        "stop 0",
        "done stop completed",
    ]


def test_delta_after_close_is_a_protocol_failure() -> None:
    done = {"type": "response.output_text.done", "item_id": "msg_1", "output_index": 0, "content_index": 0}
    assert go(created(), text_delta("a"), {**done, "text": "a"}, text_delta("late")) == [
        "start m",
        "open 0 text",
        "delta 0 text 'a'",
        "stop 0",
        "failed protocol None retryable=False",
    ]


def test_arguments_after_close_are_a_protocol_failure() -> None:
    assert go(created(), added(fc_item()), args_done("{}"), args_delta("{")) == [
        "start m",
        "open 0 tool_call f call_1",
        "delta 0 json_text '{}'",
        "stop 0 {}",
        "failed protocol None retryable=False",
    ]


def test_unannounced_function_call_fragments_fail() -> None:
    assert go(created(), args_delta('{"a":1}')) == ["start m", "failed protocol None retryable=False"]
    assert go(created(), args_done('{"a":1}')) == ["start m", "failed protocol None retryable=False"]


def test_function_call_announced_twice_fails() -> None:
    assert go(created(), added(fc_item()), added(fc_item())) == [
        "start m",
        "open 0 tool_call f call_1",
        "failed protocol None retryable=False",
    ]


def test_item_without_output_index() -> None:
    msg = {"id": "msg_1", "type": "message", "content": [{"type": "output_text", "text": "x"}]}
    assert go(created(), {"type": "response.output_item.done", "item": msg}, completed()) == [
        "start m",
        "open 0 text",
        "delta 0 text 'x'",
        "stop 0",
        "done stop completed",
    ]


def test_function_call_arguments_sent_with_the_item() -> None:
    assert go(created(), added(fc_item(args='{"x": 1}')), args_done('{"x": 1}'), completed()) == [
        "start m",
        "open 0 tool_call f call_1",
        """delta 0 json_text '{"x": 1}'""",
        'stop 0 {"x":1}',
        "done tool_use completed",
    ]


def test_empty_argument_deltas_are_skipped() -> None:
    assert go(created(), added(fc_item()), args_delta(""), args_delta("{}"), args_done("{}"), completed()) == [
        "start m",
        "open 0 tool_call f call_1",
        "delta 0 json_text '{}'",
        "stop 0 {}",
        "done tool_use completed",
    ]


def test_whole_function_call_in_item_done_only() -> None:
    assert go(created(), item_done(fc_item("fc_9", "call_9", "g", '{"k": "v"}')), completed()) == [
        "start m",
        "open 0 tool_call g call_9",
        """delta 0 json_text '{"k": "v"}'""",
        'stop 0 {"k":"v"}',
        "done tool_use completed",
    ]


def test_announced_call_keeps_its_call_id_when_item_done_omits_it() -> None:
    assert go(created(), added(fc_item()), item_done(fc_item(call_id=None, args="{}")), completed()) == [
        "start m",
        "open 0 tool_call f call_1",
        "delta 0 json_text '{}'",
        "stop 0 {}",
        "done tool_use completed",
    ]


def test_call_without_call_id_gets_a_synthesized_one() -> None:
    assert go(created(), added(fc_item(call_id=None)), args_done(""), completed()) == [
        "start m",
        "open 0 tool_call f call_req_t:1_0",
        "stop 0 {}",
        "done tool_use completed",
    ]


def test_arguments_that_are_not_an_object_fail() -> None:
    assert go(created(), added(fc_item()), args_delta("[1, 2]"), args_done("[1, 2]")) == [
        "start m",
        "open 0 tool_call f call_1",
        "delta 0 json_text '[1, 2]'",
        "failed protocol None retryable=False",
    ]


def test_missing_item_id_falls_back_to_the_output_index() -> None:
    msg = {"id": "msg_7", "type": "message", "content": [{"type": "output_text", "text": "ab"}]}
    assert go(
        created(),
        added({"id": "msg_7", "type": "message", "content": []}, oi=3),
        text_delta("a", item_id=None, oi=3),
        text_delta("b", item_id="msg_7", oi=3),
        item_done(msg, oi=3),
        completed(),
    ) == ["start m", "open 0 text", "delta 0 text 'a'", "delta 0 text 'b'", "stop 0", "done stop completed"]


def test_items_without_ids_are_keyed_by_output_index() -> None:
    assert go(
        created(),
        added({"type": "message", "content": []}, oi=0),
        text_delta("a", item_id=None, oi=0),
        item_done({"type": "message", "content": [{"type": "output_text", "text": "a"}]}, oi=0),
        {"type": "response.output_text.delta", "content_index": 0, "delta": "?"},
        completed(),
    ) == [
        "start m",
        "open 0 text",
        "delta 0 text 'a'",
        "stop 0",
        "open 1 text",
        "delta 1 text '?'",
        "stop 1",
        "done stop completed",
    ]


def test_message_item_added_with_its_content() -> None:
    msg = {
        "id": "msg_1",
        "type": "message",
        "content": [{"type": "output_text", "text": "Hi"}, {"type": "x"}],
    }
    assert go(created(), added(msg), item_done(msg), completed()) == [
        "start m",
        "open 0 text",
        "delta 0 text 'Hi'",
        "stop 0",
        "done stop completed",
    ]


def test_refusal_and_summary_parts_added_with_text() -> None:
    base = {"item_id": "i", "output_index": 0}
    assert go(
        created(),
        {
            "type": "response.content_part.added",
            **base,
            "content_index": 0,
            "part": {"type": "refusal", "refusal": "No."},
        },
        {
            "type": "response.content_part.done",
            **base,
            "content_index": 0,
            "part": {"type": "refusal", "refusal": "No."},
        },
        {
            "type": "response.reasoning_summary_part.added",
            **base,
            "summary_index": 0,
            "part": {"type": "summary_text", "text": "S"},
        },
        {
            "type": "response.reasoning_summary_part.done",
            **base,
            "summary_index": 0,
            "part": {"type": "summary_text", "text": "S"},
        },
        completed(),
    ) == [
        "start m",
        "open 0 refusal",
        "delta 0 text 'No.'",
        "stop 0",
        "open 1 reasoning public",
        "delta 1 text 'S'",
        "stop 1",
        "done refusal completed",
    ]


def test_reasoning_item_with_only_done_values() -> None:
    rs = {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "Sum"}],
        "content": [{"type": "reasoning_text", "text": "Raw"}, {"type": "other"}],
    }
    assert go(created(), added({"id": "rs_1", "type": "reasoning", "summary": []}), item_done(rs), completed()) == [
        "start m",
        "open 0 reasoning public",
        "delta 0 text 'Sum'",
        "stop 0",
        "open 1 reasoning internal",
        "delta 1 text 'Raw'",
        "stop 1",
        "done stop completed",
    ]


def test_terminal_supplies_output_never_streamed_and_closes_open_blocks() -> None:
    msg = {"id": "msg_2", "type": "message", "content": [{"type": "output_text", "text": "From the end."}]}
    ws = {"id": "ws_1", "type": "web_search_call"}
    streamed = {"id": "msg_1", "type": "message", "content": [{"type": "output_text", "text": "open"}]}
    assert go(created(), text_delta("open", oi=1), completed([ws, streamed, msg, fc_item()])) == [
        "start m",
        "open 0 text",
        "delta 0 text 'open'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'From the end.'",
        "stop 1",
        "open 2 tool_call f call_1",
        "stop 2 {}",
        "done tool_use completed",
    ]


def test_terminal_closes_a_block_its_output_does_not_mention() -> None:
    assert go(created(), text_delta("open"), completed([])) == [
        "start m",
        "open 0 text",
        "delta 0 text 'open'",
        "stop 0",
        DONE,
    ]


def test_terminal_alone_starts_the_stream() -> None:
    msg = {"id": "msg_1", "type": "message", "content": [{"type": "output_text", "text": "All at once."}]}
    assert go(completed([msg], model="solo", usage={"input_tokens": 3})) == [
        "start solo",
        "open 0 text",
        "delta 0 text 'All at once.'",
        "stop 0",
        "done stop completed",
    ]


def test_terminal_without_a_response_object() -> None:
    assert go(created(), {"type": "response.completed"}) == ["start m", "done stop completed"]


def test_usage_without_details() -> None:
    _, _, result = run(D, sse(created(), completed(usage={"input_tokens": 5, "output_tokens": 2})))
    assert result.usage is not None
    assert (result.usage.input_tokens, result.usage.output_tokens) == (5, 2)
    assert (result.usage.cache_read_tokens, result.usage.reasoning_tokens, result.usage.total_tokens) == (None,) * 3


# -- skipped events -------------------------------------------------------------------------------


def test_lifecycle_events_start_once() -> None:
    _, evs, _ = run(D, sse({"type": "response.queued", "response": {"model": "q"}}, created("c"), completed()))
    assert briefs(evs) == ["start q", "done stop completed"]


def test_lifecycle_without_response_object() -> None:
    assert go({"type": "response.in_progress"}, completed()) == ["start None", "done stop completed"]


def test_server_side_items_are_counted_and_their_progress_events_are_not() -> None:
    ws = {"id": "ws_1", "type": "web_search_call"}
    assert go(
        created(),
        {"type": "response.in_progress", "response": {}},
        added(ws),
        {"type": "response.web_search_call.searching", "item_id": "ws_1", "output_index": 0},
        {
            "type": "response.code_interpreter_call_code.delta",
            "item_id": "ci",
            "output_index": 0,
            "delta": "x",
        },
        {"type": "response.mcp_call_arguments.delta", "item_id": "mcp", "output_index": 0, "delta": "x"},
        item_done(ws),
        {
            "type": "response.output_text.annotation.added",
            "item_id": "m",
            "output_index": 0,
            "annotation": {},
        },
        {"type": "response.output_item.added", "output_index": 1},
        {"type": "response.output_item.done", "output_index": 1},
        completed(),
    ) == ["start m", "warning unknown_events_skipped 2", "done stop completed"]


def test_unknown_events_and_items_are_counted() -> None:
    custom = {"id": "ct_1", "type": "custom_tool_call", "call_id": "c", "name": "sh", "input": ""}
    part = {"type": "response.content_part.added", "item_id": "m", "output_index": 0, "content_index": 0}
    _, evs, _ = run(
        D,
        sse(
            created(),
            added(custom),
            item_done(custom),
            {**part, "part": {"type": "audio"}},
            {"type": "response.brand_new", "x": 1},
            {"type": ""},
            completed(),
        ),
    )
    assert briefs(evs) == ["start m", "warning unknown_events_skipped 5", "done stop completed"]
    # The count names events and item types, never the items' contents.
    assert "response.output_item.added:custom_tool_call" in evs[1].message and "sh" not in evs[1].message
    assert "response.brand_new" in evs[1].message


def test_untyped_event_uses_the_sse_event_name() -> None:
    raw = sse(created()) + b'event: response.completed\ndata: {"response": {"status": "completed"}}\n\n'
    assert briefs(run(D, raw)[1]) == ["start m", "done stop completed"]


def test_cancelled_is_skipped_and_eof_interrupts() -> None:
    # response.cancelled is a webhook, not a streaming event: if a server sends one, EOF follows.
    assert go(created(), text_delta("a"), {"type": "response.cancelled", "response": {"status": "cancelled"}}) == [
        "start m",
        "open 0 text",
        "delta 0 text 'a'",
        "interrupted transport None retryable=False",
    ]


def test_events_after_the_terminal_are_ignored() -> None:
    assert go(created(), completed(), text_delta("late"), {"type": "error", "code": "server_error"}) == [
        "start m",
        "done stop completed",
    ]


def test_content_before_start_is_a_protocol_failure() -> None:
    assert go(text_delta("early")) == ["start None", "failed protocol None retryable=False"]


# -- sequence numbers -----------------------------------------------------------------------------


def seqd(ev: dict[str, Any], n: int | None) -> dict[str, Any]:
    return {**ev, "sequence_number": n}


def test_a_resumed_stream_may_start_after_zero() -> None:
    assert go(seqd(created(), 41), seqd(completed(), 42)) == ["start m", "done stop completed"]


def test_one_warning_per_gap_however_wide() -> None:
    assert go(seqd(created(), 0), seqd(text_delta("a"), 1), seqd(text_delta("b"), 500), seqd(completed(), 501)) == [
        "start m",
        "open 0 text",
        "delta 0 text 'a'",
        "warning sequence_gap 1",
        "delta 0 text 'b'",
        "stop 0",
        "done stop completed",
    ]


def test_repeated_number_is_reported_as_reordered() -> None:
    assert go(seqd(created(), 0), seqd(text_delta("a"), 1), seqd(text_delta("b"), 1), seqd(completed(), 2)) == [
        "start m",
        "open 0 text",
        "delta 0 text 'a'",
        "warning sequence_reordered 1",
        "delta 0 text 'b'",
        "stop 0",
        "done stop completed",
    ]


def test_gap_at_the_first_event_that_starts_the_stream() -> None:
    # The warning cannot precede stream.start: it follows it.
    unknown = seqd({"type": "response.brand_new"}, 0)
    assert go(unknown, seqd(created(), 3), seqd(completed(), 4)) == [
        "start m",
        "warning sequence_gap 1",
        "warning unknown_events_skipped 1",
        "done stop completed",
    ]


def test_gap_before_the_stream_started_is_not_reported() -> None:
    unknown = seqd({"type": "response.brand_new"}, 0)
    error = seqd({"type": "error", "code": "server_error"}, 5)
    assert go(unknown, error) == [
        "start None",
        "warning unknown_events_skipped 1",
        "failed server_error server_error retryable=True",
    ]


def test_gap_on_a_terminal_precedes_it() -> None:
    assert go(seqd(created(), 0), seqd(completed(), 2)) == [
        "start m",
        "warning sequence_gap 1",
        "done stop completed",
    ]


def test_events_without_sequence_numbers_are_not_checked() -> None:
    assert go(seqd(created(), None), seqd(text_delta("a"), None), seqd(completed(), None)) == [
        "start m",
        "open 0 text",
        "delta 0 text 'a'",
        "stop 0",
        "done stop completed",
    ]


def test_warning_messages_say_what_happened() -> None:
    _, evs, _ = run(D, sse(seqd(created(), 0), seqd(text_delta("a"), 4), seqd(text_delta("b"), 2)))
    warnings = [e.message for e in evs if type(e).__name__ == "StreamWarning"]
    assert warnings == [
        "sequence_number jumped from 0 to 4: 3 event(s) missing",
        "sequence_number 2 arrived after 4 (reordered or repeated)",
    ]
