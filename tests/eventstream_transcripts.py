"""The authored bedrock-converse transcripts, as readable frames: ``python -m tests.eventstream_transcripts``
writes each case's binary body to ``tests/fixtures/transcripts/bedrock-converse/<case>.eventstream``.

Rule: the binary files are the fixtures (the conformance tests read them like every dialect's ``.sse``); this
module is their source, and ``tests/unit/test_adapter_bedrock_converse.py`` checks that the files on disk are
exactly what it writes, so neither drifts. Each frame is laid out as ConverseStream sends it (the three
headers, a JSON payload with Bedrock's ``p`` padding field); a case may end in raw bytes (a cut frame) or a
frame with a flipped bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sluice.normalizer.eventstream import encode_frame

__all__ = ["CASES", "DIR", "body", "main"]

DIR = Path(__file__).parent / "fixtures" / "transcripts" / "bedrock-converse"


def ev(event_type: str, payload: dict[str, Any], pad: str = "abcdefgh") -> bytes:
    headers = {":event-type": event_type, ":content-type": "application/json", ":message-type": "event"}
    return encode_frame(headers, json.dumps({**payload, "p": pad}, separators=(",", ":")).encode())


def exc(exception_type: str, payload: dict[str, Any]) -> bytes:
    headers = {":exception-type": exception_type, ":content-type": "application/json", ":message-type": "exception"}
    return encode_frame(headers, json.dumps(payload, separators=(",", ":")).encode())


def text(i: int, t: str) -> bytes:
    return ev("contentBlockDelta", {"contentBlockIndex": i, "delta": {"text": t}})


def stop(i: int) -> bytes:
    return ev("contentBlockStop", {"contentBlockIndex": i})


START = ev("messageStart", {"role": "assistant"})


def end(reason: str, usage: dict[str, int] | None = None) -> list[bytes]:
    u = usage or {"inputTokens": 12, "outputTokens": 7, "totalTokens": 19}
    return [ev("messageStop", {"stopReason": reason}), ev("metadata", {"usage": u, "metrics": {"latencyMs": 321}})]


def flip(frame: bytes, at: int) -> bytes:
    b = bytearray(frame)
    b[at] ^= 0x20
    return bytes(b)


CASES: dict[str, list[bytes]] = {
    "text": [START, text(0, "Hello"), text(0, ", world."), stop(0), *end("end_turn")],
    "tool_call": [
        START,
        text(0, "Let me check."),
        stop(0),
        ev(
            "contentBlockStart",
            {"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "tooluse_a1", "name": "get_weather"}}},
        ),
        ev("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": ""}}}),
        ev("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": '{"city": "Pa'}}}),
        ev("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": 'ris"}'}}}),
        stop(1),
        *end(
            "tool_use",
            {
                "inputTokens": 40,
                "outputTokens": 22,
                "totalTokens": 62,
                "cacheReadInputTokens": 30,
                "cacheWriteInputTokens": 0,
            },
        ),
    ],
    "reasoning": [
        START,
        ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": "The user greets; "}}}),
        ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": "answer briefly."}}}),
        ev(
            "contentBlockDelta",
            {"contentBlockIndex": 0, "delta": {"reasoningContent": {"signature": "EqoBCkgIARABGAIiQL"}}},
        ),
        stop(0),
        text(1, "Hi!"),
        stop(1),
        *end("end_turn"),
    ],
    "redacted_reasoning": [
        START,
        ev(
            "contentBlockDelta",
            {"contentBlockIndex": 0, "delta": {"reasoningContent": {"redactedContent": "RW5jcnlwdGVkIHRoaW5raW5n"}}},
        ),
        stop(0),
        text(1, "Done."),
        stop(1),
        *end("end_turn"),
    ],
    "max_tokens": [START, text(0, "A long ans"), stop(0), *end("max_tokens")],
    "max_tokens_in_tool_json": [
        START,
        ev(
            "contentBlockStart",
            {"contentBlockIndex": 0, "start": {"toolUse": {"toolUseId": "tooluse_b2", "name": "search"}}},
        ),
        ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"toolUse": {"input": '{"q": "long'}}}),
        stop(0),
        *end("max_tokens"),
    ],
    "guardrail_intervened": [START, text(0, "Sorry."), stop(0), *end("guardrail_intervened")],
    "throttling_exception": [
        START,
        text(0, "Partial"),
        exc("throttlingException", {"message": "Too many requests, please wait before trying again."}),
    ],
    "service_unavailable_exception": [
        START,
        exc("serviceUnavailableException", {"message": "Bedrock is unable to process your request."}),
    ],
    "internal_server_exception": [
        START,
        text(0, "x"),
        exc("internalServerException", {"message": "The server encountered an error processing your request."}),
    ],
    "validation_exception": [
        START,
        exc(
            "validationException", {"message": "The model returned the following errors: max_tokens: must be positive"}
        ),
    ],
    "model_stream_error_exception": [
        START,
        text(0, "Hel"),
        exc(
            "modelStreamErrorException",
            {"message": "Model stream error", "originalStatusCode": 500, "originalMessage": "upstream failed"},
        ),
    ],
    "unmodeled_error": [
        START,
        encode_frame(
            {
                ":message-type": "error",
                ":error-code": "InternalFailure",
                ":error-message": "An internal error occurred.",
            },
            b"",
        ),
    ],
    "eof_after_message_stop": [START, text(0, "Hello"), stop(0), ev("messageStop", {"stopReason": "end_turn"})],
    "eof_inside_frame": [START, text(0, "Hello"), text(0, " again")[:30]],
    "crc_mismatch": [START, text(0, "Hello"), flip(text(0, " world"), 40), stop(0), *end("end_turn")],
    "unknown_events_skipped": [
        START,
        ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"citation": {"title": "doc"}}}),
        stop(0),
        text(1, "Cited."),
        stop(1),
        ev("futureEvent", {"x": 1}),
        *end("end_turn"),
    ],
    # Output checks (contract 1.3): two calls in one turn, and a JSON-schema answer in text deltas.
    "parallel_weather_time": [
        START,
        ev(
            "contentBlockStart",
            {"contentBlockIndex": 0, "start": {"toolUse": {"toolUseId": "tooluse_w1", "name": "get_weather"}}},
        ),
        ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"toolUse": {"input": '{"city": "Pa'}}}),
        ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"toolUse": {"input": 'ris"}'}}}),
        stop(0),
        ev(
            "contentBlockStart",
            {"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "tooluse_t2", "name": "get_time"}}},
        ),
        ev("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": '{"tz": "Europe/Paris"}'}}}),
        stop(1),
        *end("tool_use", {"inputTokens": 50, "outputTokens": 30, "totalTokens": 80}),
    ],
    "json_answer": [
        START,
        text(0, '{"city": '),
        text(0, '"Paris", "te'),
        text(0, 'mp_c": 21}'),
        stop(0),
        *end("end_turn"),
    ],
}


def body(case: str) -> bytes:
    return b"".join(CASES[case])


def main() -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        (DIR / f"{case}.eventstream").write_bytes(body(case))
        print(f"wrote bedrock-converse/{case}.eventstream")


if __name__ == "__main__":
    main()
