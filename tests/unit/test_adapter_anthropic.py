"""The Anthropic Messages adapter: every transcript's full sequence and result, written out by hand, plus
the mapping tables and the edge cases of the content-block lifecycle.

Rule: expectations come from the wire format (docs/wire_formats.md §4, Anthropic's streaming docs), not
from the adapter's output; the goldens beside each transcript must agree with what is spelled out here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.normalizer.adapters import get_adapter
from sluice.normalizer.adapters.anthropic import AnthropicAdapter
from sluice.normalizer.sse import SSEEvent
from sluice.schemas.events import BlockStart, StreamError, Usage
from sluice.schemas.result import Result
from tests.helpers import TRANSCRIPTS, briefs, check_invariants, run

ANTHROPIC = TRANSCRIPTS / "anthropic"
MODEL = "claude-sonnet-4-5"


def d(index: int, kind: str, text: str) -> str:
    return f"delta {index} {kind} {text!r}"


def texts(index: int, *parts: str) -> list[str]:
    return [d(index, "text", p) for p in parts]


def stop_args(index: int, args: dict[str, Any]) -> str:
    return f"stop {index} {json.dumps(args, sort_keys=True, separators=(',', ':'), ensure_ascii=False)}"


def usage(inp: int, out: int, cache_read: int | None = 0, cache_write: int | None = 0) -> Usage:
    return Usage(input_tokens=inp, output_tokens=out, cache_read_tokens=cache_read, cache_write_tokens=cache_write)


def sse(*events: dict[str, Any]) -> bytes:
    """Frame payloads as Anthropic does: ``event: <type>``, one ``data:`` line, a blank line."""
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n".encode() for e in events)


def go(raw: bytes) -> tuple[list[str], Result]:
    _, events, result = run("anthropic", raw)
    check_invariants(events)
    return briefs(events), result


def message_start(inp: int = 5) -> dict[str, Any]:
    return {
        "type": "message_start",
        "message": {
            "id": "msg_x",
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": inp, "output_tokens": 1},
        },
    }


def block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def delta(index: int, **body: Any) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": body}


def block_stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


def message_delta(reason: str | None, out: int = 3, **u: Any) -> dict[str, Any]:
    return {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": None},
        "usage": {"output_tokens": out, **u},
    }


MESSAGE_STOP = {"type": "message_stop"}
TEXT = {"type": "text", "text": ""}


# -- transcripts, spelled out ---------------------------------------------------------------------

UTF8_PARTS = [
    "Прив",
    "ет",
    ", ",
    "мир",
    "! ",
    "你好",
    "，",
    "世",
    "界",
    "。",
    " 😀",
    "👍🏽",
    " 👩\u200d👩\u200d👧",
    " ё",
    "\u2028",
    "x\u0085y",
    " 🚀é",  # the last one arrives as JSON escapes, a surrogate pair among them
]

TRANSCRIPT_BRIEFS: dict[str, list[str]] = {
    # Output checks' transcripts (tests/checked_cases.py); the same bytes, unchecked.
    "parallel_weather_time": [
        "start claude-sonnet-4-5",
        "open 0 tool_call get_weather toolu_01W",
        'delta 0 json_text \'{"city": "Pa\'',
        "delta 0 json_text 'ris\"}'",
        'stop 0 {"city":"Paris"}',
        "open 1 tool_call get_time toolu_02T",
        'delta 1 json_text \'{"tz": "Europe/\'',
        "delta 1 json_text 'Paris\"}'",
        'stop 1 {"tz":"Europe/Paris"}',
        "done tool_use tool_use",
    ],
    "json_answer": [
        "start claude-sonnet-4-5",
        "open 0 text",
        "delta 0 text '{\"city\": '",
        'delta 0 text \'"Paris", "te\'',
        "delta 0 text 'mp_c\": 21}'",
        "stop 0",
        "done stop end_turn",
    ],
    "text_tool_use": [
        f"start {MODEL}",
        "open 0 text",
        *texts(0, "Проверяю ", "погоду."),
        "stop 0",
        "open 1 tool_call get_weather toolu_01A",
        # The empty first fragment emits nothing; the others are split inside a string and an escape.
        d(1, "json_text", '{"city": "Alma'),
        d(1, "json_text", r"ty \"Sou"),
        d(1, "json_text", r'th\"", "unit": "c\u00b'),
        d(1, "json_text", '0"}'),
        stop_args(1, {"city": 'Almaty "South"', "unit": "c°"}),
        "done tool_use tool_use",
    ],
    "utf8_many_deltas": [f"start {MODEL}", "open 0 text", *texts(0, *UTF8_PARTS), "stop 0", "done stop end_turn"],
    "two_tool_use": [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "Checking both."),
        "stop 0",
        "open 1 tool_call get_weather toolu_01W",
        d(1, "json_text", '{"city"'),
        d(1, "json_text", ': "Par'),
        d(1, "json_text", 'is", "days": [1, '),
        d(1, "json_text", "2]}"),
        stop_args(1, {"city": "Paris", "days": [1, 2]}),
        "open 2 tool_call get_time toolu_02T",
        "stop 2 {}",  # a tool without arguments streams "" : that is {}
        "done tool_use tool_use",
    ],
    "thinking_then_text": [
        f"start {MODEL}",
        "open 0 reasoning internal",
        *texts(0, "The user asks 2+2.", "\nThat is 4."),
        d(0, "signature", "EqQBCkYIBxgCKkBsig=="),
        "stop 0",
        "open 1 text",
        *texts(1, "2 + 2 = ", "4."),
        "stop 1",
        "done stop end_turn",
    ],
    "redacted_thinking": [
        f"start {MODEL}",
        "open 0 reasoning internal",
        d(0, "signature", "EmwKAhgBEgy3vaRED=="),  # opaque: no text, only the token to pass back
        "stop 0",
        "open 1 reasoning internal",
        d(1, "text", "Continuing."),
        d(1, "signature", "EqSIG2=="),
        "stop 1",
        "open 2 text",
        d(2, "text", "Done."),
        "stop 2",
        "done stop end_turn",
    ],
    # A proxy reports the usage billed beside the error event: it is on the stream.error (golden).
    "proxy_error_with_usage": [
        "start claude-sonnet-4-5-20250929",
        "open 0 text",
        *texts(0, "Here are the", " three steps"),
        "failed server_error api_error retryable=True",
    ],
    "overloaded_after_text": [
        f"start {MODEL}",
        "open 0 text",
        *texts(0, "Partial ans", "wer"),
        "failed overloaded overloaded_error retryable=True",  # no block.stop: the text is not whole
    ],
    "eof_without_message_stop": [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "Looks complete."),
        "stop 0",
        "interrupted transport None retryable=False",  # message_delta said end_turn; still no terminal
    ],
    "eof_message_stop_unterminated": [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "Almost."),
        "stop 0",
        "interrupted transport None retryable=False",  # message_stop never got its blank line
    ],
    "eof_inside_tool_json": [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "Searching."),
        "stop 0",
        "open 1 tool_call search toolu_01S",
        d(1, "json_text", '{"query": "weather in'),
        d(1, "json_text", " Par"),
        "interrupted transport None retryable=False",
    ],
    "unknown_events_ping": [
        f"start {MODEL}",
        "open 0 text",
        *texts(0, "Hello", " world"),
        "stop 0",
        # content_block_annotation, future_delta, citations_delta, content_block:container_upload; pings
        # are known and not counted.
        "warning unknown_events_skipped 4",
        "done stop end_turn",
    ],
    "max_tokens": [
        f"start {MODEL}",
        "open 0 text",
        *texts(0, "Once upon a time, there", " was a"),
        "stop 0",
        "done length max_tokens",
    ],
    "refusal": [
        f"start {MODEL}",
        "open 0 text",
        *texts(0, "Here is how to st", "art: first"),
        "stop 0",
        "done refusal refusal",  # the partial text stays; no refusal message is added
    ],
    "server_tool_web_search": [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "Let me search."),
        "stop 0",
        # server_tool_use (provider index 1) and web_search_tool_result (2) run at Anthropic: skipped,
        # never a tool_call to execute. Provider index 3 is our block 1.
        "open 1 text",
        *texts(1, "Sluice is ", "a normalizer."),
        "stop 1",
        "warning unknown_events_skipped 3",  # the two server blocks and the citations_delta
        "done stop end_turn",
    ],
    "invalid_tool_json": [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "Calling."),
        "stop 0",
        "open 1 tool_call get_weather toolu_01B",
        d(1, "json_text", '{"city": "Paris"'),
        d(1, "json_text", ",}"),
        "failed protocol None retryable=False",  # never repaired, never {}
    ],
    "framing_variants": [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "a\u2028b"),  # data split over two lines, raw U+2028 inside the JSON string
        d(0, "text", "\u00a0c"),  # a CR-only framed event
        "stop 0",
        "done stop end_turn",
    ],
    # An empty text block (start and stop, no delta) before a refusal opens nothing.
    "empty_text_then_refusal": [f"start {MODEL}", "done refusal refusal"],
    # max_tokens inside the tool call's JSON: Anthropic closes the block, then says max_tokens.
    "max_tokens_in_tool_json": [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "I'll write the file."),
        "stop 0",
        "open 1 tool_call write_file toolu_01T",
        d(1, "json_text", '{"path": "notes.txt", "lines": ["first'),
        d(1, "json_text", ' line", "sec'),
        "stop 1 null truncated",  # held from content_block_stop until message_stop confirms the cut
        "done length max_tokens",
    ],
    "thinking_tool_use": [
        f"start {MODEL}",
        "open 0 reasoning internal",
        d(0, "text", "The user wants the order status."),
        d(0, "signature", "EpUBCkYIBRgCKkDthink1=="),
        "stop 0",
        "open 1 reasoning internal",  # redacted_thinking: encrypted, its data is the signature
        d(1, "signature", "EmwKAhgBEgyRedacted2=="),
        "stop 1",
        "open 2 tool_call lookup_order toolu_01K",
        d(2, "json_text", '{"order_id": "A-1042"}'),
        stop_args(2, {"order_id": "A-1042"}),
        "done tool_use tool_use",
    ],
}

# (kind, text, signature, name, call_id, arguments, arguments_text) per block
Blocks = list[tuple[str, str | None, str | None, str | None, str | None, dict[str, Any] | None, str | None]]


def tb(text: str, signature: str | None = None, kind: str = "text") -> tuple[Any, ...]:
    return (kind, text, signature, None, None, None, None)


def tool(name: str, call_id: str, arguments: dict[str, Any] | None, arguments_text: str) -> tuple[Any, ...]:
    return ("tool_call", None, None, name, call_id, arguments, arguments_text)


TRANSCRIPT_RESULTS: dict[str, tuple[str, str | None, str | None, Usage | None, Blocks]] = {
    "parallel_weather_time": (
        "completed",
        "tool_use",
        "tool_use",
        usage(300, 61),
        [
            tool("get_weather", "toolu_01W", {"city": "Paris"}, '{"city": "Paris"}'),
            tool("get_time", "toolu_02T", {"tz": "Europe/Paris"}, '{"tz": "Europe/Paris"}'),
        ],
    ),
    "json_answer": ("completed", "stop", "end_turn", usage(300, 14), [tb('{"city": "Paris", "temp_c": 21}')]),
    "text_tool_use": (
        "completed",
        "tool_use",
        "tool_use",
        usage(42, 57, 10, 0),
        [
            tb("Проверяю погоду."),
            tool(
                "get_weather",
                "toolu_01A",
                {"city": 'Almaty "South"', "unit": "c°"},
                r'{"city": "Almaty \"South\"", "unit": "c\u00b0"}',
            ),
        ],
    ),
    "utf8_many_deltas": ("completed", "stop", "end_turn", usage(12, 25), [tb("".join(UTF8_PARTS))]),
    "two_tool_use": (
        "completed",
        "tool_use",
        "tool_use",
        usage(310, 88, 200, 0),
        [
            tb("Checking both."),
            tool("get_weather", "toolu_01W", {"city": "Paris", "days": [1, 2]}, '{"city": "Paris", "days": [1, 2]}'),
            tool("get_time", "toolu_02T", {}, ""),
        ],
    ),
    "thinking_then_text": (
        "completed",
        "stop",
        "end_turn",
        usage(40, 60),
        [tb("The user asks 2+2.\nThat is 4.", "EqQBCkYIBxgCKkBsig==", "reasoning"), tb("2 + 2 = 4.")],
    ),
    "redacted_thinking": (
        "completed",
        "stop",
        "end_turn",
        usage(40, 30),
        [
            tb("", "EmwKAhgBEgy3vaRED==", "reasoning"),
            tb("Continuing.", "EqSIG2==", "reasoning"),
            tb("Done."),
        ],
    ),
    "overloaded_after_text": ("failed", None, None, usage(21, 1), [tb("Partial answer")]),
    "proxy_error_with_usage": (
        "failed",
        None,
        None,
        usage(48, 7, cache_read=1024),
        [tb("Here are the three steps")],
    ),
    "eof_without_message_stop": ("interrupted", None, None, usage(9, 5), [tb("Looks complete.")]),
    "eof_message_stop_unterminated": ("interrupted", None, None, usage(9, 4), [tb("Almost.")]),
    "eof_inside_tool_json": (
        "interrupted",
        None,
        None,
        usage(50, 1),
        [tb("Searching."), tool("search", "toolu_01S", None, '{"query": "weather in Par')],
    ),
    "unknown_events_ping": ("completed", "stop", "end_turn", usage(15, 7), [tb("Hello world")]),
    "max_tokens": ("completed", "length", "max_tokens", usage(8, 16), [tb("Once upon a time, there was a")]),
    "refusal": ("completed", "refusal", "refusal", usage(30, 12), [tb("Here is how to start: first")]),
    "server_tool_web_search": (
        "completed",
        "stop",
        "end_turn",
        usage(120, 90),
        [tb("Let me search."), tb("Sluice is a normalizer.")],
    ),
    "invalid_tool_json": (
        "failed",
        None,
        None,
        usage(33, 20),  # the failure waits for the terminal: its usage is the last
        [tb("Calling."), tool("get_weather", "toolu_01B", None, '{"city": "Paris",}')],
    ),
    "framing_variants": ("completed", "stop", "end_turn", usage(3, 4), [tb("a\u2028b\u00a0c")]),
    "empty_text_then_refusal": ("completed", "refusal", "refusal", usage(21, 2), []),
    "max_tokens_in_tool_json": (
        "completed",
        "length",
        "max_tokens",
        usage(120, 64),
        [
            tb("I'll write the file."),
            tool("write_file", "toolu_01T", None, '{"path": "notes.txt", "lines": ["first line", "sec'),
        ],
    ),
    "thinking_tool_use": (
        "completed",
        "tool_use",
        "tool_use",
        usage(410, 96),
        [
            tb("The user wants the order status.", "EpUBCkYIBRgCKkDthink1==", "reasoning"),
            tb("", "EmwKAhgBEgyRedacted2==", "reasoning"),
            tool("lookup_order", "toolu_01K", {"order_id": "A-1042"}, '{"order_id": "A-1042"}'),
        ],
    ),
}

# (category, provider_code, retryable, block_index) of each failed or interrupted case
TRANSCRIPT_ERRORS: dict[str, tuple[str, str | None, bool, int | None]] = {
    "overloaded_after_text": ("overloaded", "overloaded_error", True, None),
    "proxy_error_with_usage": ("server_error", "api_error", True, None),
    "eof_without_message_stop": ("transport", None, False, None),
    "eof_message_stop_unterminated": ("transport", None, False, None),
    "eof_inside_tool_json": ("transport", None, False, None),
    "invalid_tool_json": ("protocol", None, False, 1),
}


def test_every_transcript_is_spelled_out() -> None:
    on_disk = {p.stem for p in ANTHROPIC.glob("*.sse")}
    assert on_disk == set(TRANSCRIPT_BRIEFS) == set(TRANSCRIPT_RESULTS)
    assert set(TRANSCRIPT_ERRORS) <= on_disk


@pytest.mark.parametrize("case", sorted(TRANSCRIPT_BRIEFS))
def test_transcript_sequence(case: str) -> None:
    got, _ = go((ANTHROPIC / f"{case}.sse").read_bytes())
    assert got == TRANSCRIPT_BRIEFS[case]


@pytest.mark.parametrize("case", sorted(TRANSCRIPT_RESULTS))
def test_transcript_result(case: str) -> None:
    _, result = go((ANTHROPIC / f"{case}.sse").read_bytes())
    status, stop, provider_stop, use, blocks = TRANSCRIPT_RESULTS[case]
    assert (result.status, result.stop_reason, result.provider_stop_reason) == (status, stop, provider_stop)
    assert result.usage == use
    assert [
        (b.kind, b.text, b.signature, b.name, b.call_id, b.arguments, b.arguments_text) for b in result.blocks
    ] == blocks
    assert [b.index for b in result.blocks] == list(range(len(blocks)))
    if case in TRANSCRIPT_ERRORS:
        e = result.error
        assert e is not None
        assert (e.category, e.provider_code, e.retryable, e.block_index) == TRANSCRIPT_ERRORS[case]
    else:
        assert result.error is None


def test_a_call_cut_by_max_tokens_is_never_offered_for_execution() -> None:
    _, result = go((ANTHROPIC / "max_tokens_in_tool_json.sse").read_bytes())
    assert [b.arguments_error for b in result.blocks] == [None, "truncated"]
    assert result.tool_calls == [] and result.text == "I'll write the file."


def test_redacted_thinking_is_an_encrypted_reasoning_block() -> None:
    _, events, result = run("anthropic", (ANTHROPIC / "thinking_tool_use.sse").read_bytes())
    starts = [e.block for e in events if isinstance(e, BlockStart)]
    assert [(b.kind, b.encrypted) for b in starts] == [("reasoning", False), ("reasoning", True), ("tool_call", False)]
    assert [(b.encrypted, b.visibility) for b in result.blocks] == [
        (False, "internal"),
        (True, "internal"),
        (False, None),
    ]


def test_error_messages_are_the_providers_or_say_what_happened() -> None:
    _, result = go((ANTHROPIC / "overloaded_after_text.sse").read_bytes())
    assert result.error is not None and result.error.message == "Overloaded"
    _, result = go((ANTHROPIC / "invalid_tool_json.sse").read_bytes())
    assert result.error is not None and "block 1" in result.error.message
    raw = (ANTHROPIC / "eof_message_stop_unterminated.sse").read_bytes()
    tail = raw[raw.rindex(b"\n\n") + 2 :]
    assert tail == b'event: message_stop\ndata: {"type":"message_stop"}\n'
    _, result = go(raw)
    assert result.error is not None
    assert f"({len(tail)} bytes of an unfinished event dropped)" in result.error.message


def test_raw_references_point_at_the_provider_events() -> None:
    raw_events, events, _ = run("anthropic", (ANTHROPIC / "text_tool_use.sse").read_bytes())
    by_index = {e.index: e for e in raw_events}
    for ev in events:
        assert len(ev.raw) == 1
        src = by_index[ev.raw[0]]
        if isinstance(ev, BlockStart):
            # A tool call opens at its content_block_start; text at its first non-empty delta.
            assert src.event == ("content_block_start" if ev.block.kind == "tool_call" else "content_block_delta")
    assert events[-1].raw == [14] and by_index[14].event == "message_stop"


def test_a_tool_use_is_never_a_server_tool() -> None:
    _, events, _ = run("anthropic", (ANTHROPIC / "server_tool_web_search.sse").read_bytes())
    assert all(e.block.kind != "tool_call" for e in events if isinstance(e, BlockStart))


# -- mapping tables -------------------------------------------------------------------------------

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_use",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "refusal",
    "pause_turn": "pause_turn",
}


def test_stop_reason_table_is_as_documented() -> None:
    assert AnthropicAdapter.STOP_REASONS == STOP_REASONS
    assert set(AnthropicAdapter.TERMINAL_SIGNALS) >= {"message_stop", "event: error"}


@pytest.mark.parametrize(("provider", "want"), [*STOP_REASONS.items(), ("a_future_reason", "other")])
def test_stop_reasons(provider: str, want: str) -> None:
    got, result = go(sse(message_start(), message_delta(provider), MESSAGE_STOP))
    assert got == [f"start {MODEL}", f"done {want} {provider}"]
    assert (result.stop_reason, result.provider_stop_reason) == (want, provider)


def test_message_stop_without_a_stop_reason() -> None:
    got, _ = go(sse(message_start(), MESSAGE_STOP))
    assert got == [f"start {MODEL}", "done other None"]


ERRORS = {
    "overloaded_error": ("overloaded", True),
    "rate_limit_error": ("rate_limit", True),
    "api_error": ("server_error", True),
    "timeout_error": ("server_error", True),  # HTTP 504 from Anthropic's side: a server failure
    "invalid_request_error": ("invalid_request", False),
    "request_too_large": ("invalid_request", False),
    "authentication_error": ("authentication", False),
    "permission_error": ("permission", False),
    "not_found_error": ("not_found", False),
    "billing_error": ("billing", False),
    "a_future_error": ("unknown", False),
}


def test_error_table_is_as_documented() -> None:
    assert {k: v for k, (v, _) in ERRORS.items() if k != "a_future_error"} == AnthropicAdapter.ERROR_CATEGORIES


@pytest.mark.parametrize(("code", "want"), list(ERRORS.items()))
def test_error_events(code: str, want: tuple[str, bool]) -> None:
    err = {"type": "error", "error": {"type": code, "message": f"{code} happened"}, "request_id": "req_1"}
    got, result = go(sse(message_start(), block_start(0, TEXT), delta(0, type="text_delta", text="hi"), err))
    category, retryable = want
    assert got == [
        f"start {MODEL}",
        "open 0 text",
        d(0, "text", "hi"),
        f"failed {category} {code} retryable={retryable}",
    ]
    assert result.error is not None and result.error.message == f"{code} happened"


def test_error_before_message_start_still_starts_the_stream() -> None:
    err = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert go(sse(err))[0] == ["start None", "failed overloaded overloaded_error retryable=True"]


def test_error_without_details() -> None:
    got, result = go(sse(message_start(), {"type": "error"}))
    assert got == [f"start {MODEL}", "failed unknown None retryable=False"]
    assert result.error is not None and result.error.message == "the provider reported an error"


def test_long_error_messages_are_cut() -> None:
    err = {"type": "error", "error": {"type": "api_error", "message": "x" * 1000}}
    _, result = go(sse(message_start(), err))
    assert result.error is not None and len(result.error.message) == 300 and result.error.message.endswith("...")


# -- content-block edge cases ---------------------------------------------------------------------


def test_usage_is_merged_not_summed() -> None:
    start = message_start(inp=100)
    start["message"]["usage"].update(cache_read_input_tokens=7, cache_creation_input_tokens=3)
    # Newer servers repeat input_tokens in message_delta; counts there are cumulative.
    raw = sse(start, message_delta(None, out=10), message_delta("end_turn", out=25, input_tokens=100), MESSAGE_STOP)
    got, result = go(raw)
    assert got == [f"start {MODEL}", "done stop end_turn"]
    assert result.usage == usage(100, 25, 7, 3)


def test_whole_input_at_block_start_is_honoured() -> None:
    # A proxy may send the whole input up front instead of the {} placeholder and deltas.
    raw = sse(
        message_start(),
        block_start(0, {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": [1, "é"]}}),
        block_stop(0),
        message_delta("tool_use"),
        MESSAGE_STOP,
    )
    got, result = go(raw)
    assert got == [
        f"start {MODEL}",
        "open 0 tool_call f toolu_1",
        d(0, "json_text", '{"a":[1,"é"]}'),
        'stop 0 {"a":[1,"é"]}',
        "done tool_use tool_use",
    ]
    assert result.blocks[0].arguments == {"a": [1, "é"]}


def test_text_and_thinking_present_at_block_start() -> None:
    raw = sse(
        message_start(),
        block_start(0, {"type": "thinking", "thinking": "pre", "signature": ""}),
        block_stop(0),
        block_start(1, {"type": "text", "text": "Hi"}),
        delta(1, type="text_delta", text="!"),
        block_stop(1),
        message_delta("end_turn"),
        MESSAGE_STOP,
    )
    assert go(raw)[0] == [
        f"start {MODEL}",
        "open 0 reasoning internal",
        d(0, "text", "pre"),
        "stop 0",
        "open 1 text",
        *texts(1, "Hi", "!"),
        "stop 1",
        "done stop end_turn",
    ]


def test_a_block_without_content_never_opens() -> None:
    # content_block_start's "" placeholder is not content: a text or thinking block that never gets any
    # (Anthropic frames one before a refusal) opens nothing, as an empty string never does in any dialect.
    thinking = {"type": "thinking", "thinking": "", "signature": ""}
    got, result = go(
        sse(
            message_start(),
            block_start(0, TEXT),
            block_stop(0),
            block_start(1, thinking),
            delta(1, type="thinking_delta", thinking=""),
            block_stop(1),
            message_delta("refusal"),
            MESSAGE_STOP,
        )
    )
    assert got == [f"start {MODEL}", "done refusal refusal"]
    assert result.blocks == []


def test_a_signature_alone_opens_a_thinking_block() -> None:
    thinking = {"type": "thinking", "thinking": "", "signature": ""}
    got, result = go(
        sse(
            message_start(),
            block_start(0, thinking),
            delta(0, type="signature_delta", signature="EqSIG=="),
            block_stop(0),
            message_delta("end_turn"),
            MESSAGE_STOP,
        )
    )
    assert got == [
        f"start {MODEL}",
        "open 0 reasoning internal",
        d(0, "signature", "EqSIG=="),
        "stop 0",
        "done stop end_turn",
    ]
    assert (result.blocks[0].text, result.blocks[0].signature, result.blocks[0].encrypted) == ("", "EqSIG==", False)


def test_the_sse_event_name_is_used_when_data_has_no_type() -> None:
    raw = sse(message_start()) + b"event: message_stop\ndata: {}\n\n"
    assert go(raw)[0] == [f"start {MODEL}", "done other None"]


def test_events_after_message_stop_are_not_normalized() -> None:
    raw = sse(message_start(), message_delta("end_turn"), MESSAGE_STOP, {"type": "ping"}, block_start(0, TEXT))
    raw_events, events, _ = run("anthropic", raw)
    assert briefs(events) == [f"start {MODEL}", "done stop end_turn"]
    assert len(raw_events) == 5  # still framed for the raw log


def test_ping_before_message_start_is_harmless() -> None:
    got, _ = go(sse({"type": "ping"}, message_start(), message_delta("end_turn"), MESSAGE_STOP))
    assert got == [f"start {MODEL}", "done stop end_turn"]


def test_pause_turn_after_a_server_tool() -> None:
    raw = sse(
        message_start(),
        block_start(0, {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}),
        delta(0, type="input_json_delta", partial_json='{"query": "x"}'),
        block_stop(0),
        message_delta("pause_turn"),
        MESSAGE_STOP,
    )
    got, result = go(raw)
    assert got == [f"start {MODEL}", "warning unknown_events_skipped 1", "done pause_turn pause_turn"]
    assert result.blocks == []


@pytest.mark.parametrize(
    ("events", "want_tail"),
    [
        # malformed JSON data
        ([b"event: content_block_delta\ndata: {not json}\n\n"], "failed protocol None retryable=False"),
        # a delta for a block that never started
        ([delta(3, type="text_delta", text="x")], "failed protocol None retryable=False"),
        # a second message_start
        ([message_start()], "failed protocol None retryable=False"),
        # a stop for a block that never started
        ([block_stop(4)], "failed protocol None retryable=False"),
        # a block started twice
        ([block_start(0, TEXT), block_start(0, TEXT)], "failed protocol None retryable=False"),
        # the wrong delta for the block
        (
            [block_start(0, TEXT), delta(0, type="input_json_delta", partial_json="{}")],
            "failed protocol None retryable=False",
        ),
        # message_stop with a block still open
        ([block_start(0, TEXT), message_delta("end_turn"), MESSAGE_STOP], "failed protocol None retryable=False"),
    ],
    ids=["bad-json", "unknown-block", "second-start", "stop-unknown", "double-start", "wrong-delta", "open-at-stop"],
)
def test_provider_protocol_errors(events: list[Any], want_tail: str) -> None:
    body = b"".join(e if isinstance(e, bytes) else sse(e) for e in events)
    raw = sse(message_start()) + body + sse(message_delta("end_turn"), MESSAGE_STOP)
    _, evs, result = run("anthropic", raw)
    check_invariants(evs)
    assert briefs(evs)[-1] == want_tail
    assert result.status == "failed"
    err = evs[-1]
    assert isinstance(err, StreamError) and err.error.category == "protocol"


def test_open_block_at_message_stop_names_the_block() -> None:
    raw = sse(
        message_start(),
        block_start(0, TEXT),
        delta(0, type="text_delta", text="a"),
        block_stop(0),
        block_start(1, TEXT),
        delta(1, type="text_delta", text="b"),
        MESSAGE_STOP,
    )
    _, result = go(raw)
    assert result.error is not None and result.error.block_index == 1


def test_a_provider_block_left_open_without_content_is_still_a_protocol_error() -> None:
    _, result = go(sse(message_start(), block_start(0, TEXT), MESSAGE_STOP))
    assert result.error is not None and result.error.category == "protocol"
    assert result.error.block_index is None and "provider block 0" in result.error.message


def test_unknown_delta_inside_a_skipped_block_is_not_counted_twice() -> None:
    raw = sse(
        message_start(),
        block_start(0, {"type": "code_execution_tool_result", "tool_use_id": "srvtoolu_1", "content": {}}),
        delta(0, type="some_new_delta"),
        block_stop(0),
        message_delta("end_turn"),
        MESSAGE_STOP,
    )
    assert go(raw)[0] == [f"start {MODEL}", "warning unknown_events_skipped 1", "done stop end_turn"]


def test_the_adapter_is_registered_and_pure() -> None:
    a = get_adapter("anthropic")
    assert isinstance(a, AnthropicAdapter) and (a.dialect, a.provider) == ("anthropic", "anthropic")
    assert a.end() == []  # EOF is never a success: the machine reports the interruption
    ev = SSEEvent(event="ping", data='{"type":"ping"}', id="", retry=None, index=1, offset=0)
    assert [type(x).__name__ for x in a.feed(ev)] == ["Ignore"]


def test_block_start_without_an_index_is_a_protocol_error() -> None:
    raw = sse(message_start(), {"type": "content_block_start", "content_block": TEXT}, MESSAGE_STOP)
    got, result = go(raw)
    assert got == [f"start {MODEL}", "failed protocol None retryable=False"]
    assert result.error is not None and "without an index" in result.error.message


def test_usage_only_from_message_delta_and_an_empty_message_delta() -> None:
    start = message_start()
    del start["message"]["usage"]
    bare = {"type": "message_delta", "delta": {}}
    got, result = go(sse(start, bare, message_delta("end_turn", out=4), bare, MESSAGE_STOP))
    assert got == [f"start {MODEL}", "done stop end_turn"]  # a later bare delta keeps the stop reason
    assert result.usage == Usage(output_tokens=4)


def test_the_usage_reported_before_an_error_reaches_stream_error_merged() -> None:
    raw = sse(
        message_start(inp=30),
        block_start(0, {"type": "text", "text": ""}),
        delta(0, type="text_delta", text="Half"),
        message_delta(None, out=12),
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
    )
    _, events, result = run("anthropic", raw)
    assert isinstance(events[-1], StreamError)
    assert events[-1].usage == result.usage == usage(30, 12, None, None)


def test_a_usage_a_proxy_puts_beside_an_error_is_kept() -> None:
    err = {"type": "error", "error": {"type": "api_error", "message": "m"}, "usage": {"output_tokens": 9}}
    _, events, result = run("anthropic", sse(message_start(inp=30), err))
    assert isinstance(events[-1], StreamError) and events[-1].usage == result.usage == usage(30, 9, None, None)
    _, events, _ = run("anthropic", sse({**err, "usage": {"input_tokens": 4, "output_tokens": 0}}))
    assert briefs(events) == ["start None", "failed server_error api_error retryable=True"]
    assert isinstance(events[-1], StreamError) and events[-1].usage == Usage(input_tokens=4, output_tokens=0)
