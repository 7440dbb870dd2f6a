"""One transcript per dialect, its every contract event written out by hand from the wire bytes: seq, raw
references (the 1-based index of the SSE event each came from), usage and all. The goldens beside the
transcripts are regenerated from the implementation's own output; these are not, so a change that shifts
a reference or a count fails here even when every golden was rewritten.

How each reference was counted is noted beside the events; ``ts`` is 0 and the request is ``req_t``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from sluice.schemas.events import encode_event
from tests.helpers import TRANSCRIPTS, check_invariants, run

COMMON = {"stream_id": "req_t:1", "request_id": "req_t", "ts": 0}


def ev(type_: str, seq: int, raw: list[int], **fields: Any) -> dict[str, Any]:
    return {"type": type_, **COMMON, "seq": seq, "raw": raw, **fields}


def block(index: int, kind: str) -> dict[str, Any]:
    return {"id": f"b_{index}", "index": index, "kind": kind}


def usage(**counts: int | None) -> dict[str, int | None]:
    names = ("input_tokens", "output_tokens", "reasoning_tokens", "cache_read_tokens", "cache_write_tokens")
    return {**dict.fromkeys(names), "total_tokens": None, **counts}


# anthropic/max_tokens_in_tool_json.sse, raw events: 1 message_start, 2 content_block_start (text ""),
# 3 text_delta, 4 content_block_stop, 5 content_block_start (tool_use), 6 input_json_delta "",
# 7 and 8 input_json_delta, 9 content_block_stop, 10 message_delta (max_tokens, 64), 11 message_stop.
ANTHROPIC = [
    ev("stream.start", 1, [1], provider="anthropic", dialect="anthropic", model="claude-sonnet-4-5", attempt=1),
    ev("block.start", 2, [3], block=block(0, "text")),  # "" at 2 is not content: the text opens at 3
    ev("block.delta", 3, [3], block=block(0, "text"), delta={"kind": "text", "text": "I'll write the file."}),
    ev("block.stop", 4, [4], block=block(0, "text"), arguments=None),
    ev("block.start", 5, [5], block={**block(1, "tool_call"), "name": "write_file", "call_id": "toolu_01T"}),
    # 6 is an empty fragment: no event
    ev(
        "block.delta",
        6,
        [7],
        block=block(1, "tool_call"),
        delta={"kind": "json_text", "text": '{"path": "notes.txt", "lines": ["first'},
    ),
    ev("block.delta", 7, [8], block=block(1, "tool_call"), delta={"kind": "json_text", "text": ' line", "sec'}),
    # closed at 9 with JSON that does not parse; message_stop (11), after max_tokens (10), says it was cut
    ev("block.stop", 8, [9, 11], block=block(1, "tool_call"), arguments=None, arguments_error="truncated"),
    ev(
        "stream.done",
        9,
        [11],
        status="completed",
        stop_reason="length",
        provider_stop_reason="max_tokens",
        usage=usage(input_tokens=120, output_tokens=64, cache_read_tokens=0, cache_write_tokens=0),
    ),
]

# openai-chat/length_in_tool_arguments.sse: 1 the call's first fragment (id, name, ""), 2 and 3 argument
# fragments, 4 finish_reason length, 5 the usage chunk, 6 [DONE].
OPENAI_CHAT = [
    ev("stream.start", 1, [1], provider="openai", dialect="openai-chat", model="gpt-4.1-2025-04-14", attempt=1),
    ev("block.start", 2, [1], block={**block(0, "tool_call"), "name": "write_file", "call_id": "call_T1"}),
    ev(
        "block.delta",
        3,
        [2],
        block=block(0, "tool_call"),
        delta={"kind": "json_text", "text": '{"path":"notes.txt","lines":["fi'},
    ),
    ev("block.delta", 4, [3], block=block(0, "tool_call"), delta={"kind": "json_text", "text": 'rst line","sec'}),
    # [DONE] closes the call and finishes with the last finish_reason: both at 6
    ev("block.stop", 5, [6], block=block(0, "tool_call"), arguments=None, arguments_error="truncated"),
    ev(
        "stream.done",
        6,
        [6],
        status="completed",
        stop_reason="length",
        provider_stop_reason="length",
        usage=usage(input_tokens=80, output_tokens=16, reasoning_tokens=0, cache_read_tokens=0, total_tokens=96),
    ),
]

# openai-responses/server_side_tool_search.sse: 1 created, 2 in_progress, 3/4 tool_search_call added/done,
# 5/6 tool_search_output added/done, 7 function_call added, 8 and 9 argument deltas, 10 arguments.done,
# 11 output_item.done, 12 response.completed.
OPENAI_RESPONSES = [
    ev("stream.start", 1, [1], provider="openai", dialect="openai-responses", model="gpt-5.4-2026-03-05", attempt=1),
    ev("block.start", 2, [7], block={**block(0, "tool_call"), "name": "lookup_order", "call_id": "call_Q7a"}),
    ev("block.delta", 3, [8], block=block(0, "tool_call"), delta={"kind": "json_text", "text": '{"order_id":'}),
    ev("block.delta", 4, [9], block=block(0, "tool_call"), delta={"kind": "json_text", "text": '"A-1042"}'}),
    ev("block.stop", 5, [10], block=block(0, "tool_call"), arguments={"order_id": "A-1042"}),
    ev(
        "stream.warning",
        6,
        [12],
        code="unknown_events_skipped",
        count=4,
        message="skipped 4 unknown provider event(s): response.output_item.added:tool_search_call, "
        "response.output_item.added:tool_search_output, response.output_item.done:tool_search_call, "
        "response.output_item.done:tool_search_output",
    ),
    ev(
        "stream.done",
        7,
        [12],
        status="completed",
        stop_reason="tool_use",
        provider_stop_reason="completed",
        usage=usage(input_tokens=310, output_tokens=41, reasoning_tokens=0, cache_read_tokens=0, total_tokens=351),
    ),
]

# gemini/unframed_error_tail.sse: 1 and 2 data chunks (CRLF), 3 the JSON error body with no SSE framing.
GEMINI = [
    ev("stream.start", 1, [1], provider="gemini", dialect="gemini", model="gemini-2.5-flash", attempt=1),
    ev("block.start", 2, [1], block=block(0, "text")),
    ev("block.delta", 3, [1], block=block(0, "text"), delta={"kind": "text", "text": "The capital"}),
    ev("block.delta", 4, [2], block=block(0, "text"), delta={"kind": "text", "text": " of France is"}),
    # no block.stop: the text is not whole
    ev(
        "stream.error",
        5,
        [3],
        status="failed",
        error={
            "category": "overloaded",
            "retryable": True,
            "provider_code": "UNAVAILABLE",
            "message": "The model is overloaded. Please try again later.",
            "block_index": None,
        },
        usage=usage(input_tokens=6, output_tokens=5, total_tokens=11),
    ),
]

CASES = {
    "anthropic/max_tokens_in_tool_json": ANTHROPIC,
    "openai-chat/length_in_tool_arguments": OPENAI_CHAT,
    "openai-responses/server_side_tool_search": OPENAI_RESPONSES,
    "gemini/unframed_error_tail": GEMINI,
}


@pytest.mark.parametrize("case", list(CASES))
def test_events_are_exactly_the_handwritten_ones(case: str) -> None:
    dialect = case.partition("/")[0]
    _, events, _ = run(dialect, (TRANSCRIPTS / f"{case}.sse").read_bytes())
    assert [json.loads(encode_event(e)) for e in events] == CASES[case]
    check_invariants(events)


@pytest.mark.parametrize("case", list(CASES))
def test_the_golden_agrees_with_the_handwritten_events(case: str) -> None:
    lines = (TRANSCRIPTS / f"{case}.jsonl").read_bytes().splitlines()
    assert [json.loads(line) for line in lines if line.strip()] == CASES[case]


def test_one_transcript_per_dialect() -> None:
    assert {c.partition("/")[0] for c in CASES} == {"anthropic", "openai-chat", "openai-responses", "gemini"}


def test_the_cut_call_in_the_assembled_result() -> None:
    _, _, result = run("anthropic", (TRANSCRIPTS / "anthropic/max_tokens_in_tool_json.sse").read_bytes())
    assert msgspec.to_builtins(result)["blocks"][1] == {
        "index": 1,
        "kind": "tool_call",
        "text": None,
        "signature": None,
        "name": "write_file",
        "call_id": "toolu_01T",
        "arguments": None,
        "arguments_text": '{"path": "notes.txt", "lines": ["first line", "sec',
        "arguments_error": "truncated",
        "visibility": None,
        "encrypted": False,
        "verdict": None,  # (1.3) nothing declared, nothing checked
    }
