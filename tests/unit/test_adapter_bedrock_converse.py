"""The bedrock-converse dialect: each authored transcript's exact event sequence, written from the
ConverseStream wire format, and the fixtures' agreement with their readable source."""

from __future__ import annotations

import pytest

from sluice.normalizer.adapters import DIALECTS, adapter_class
from sluice.normalizer.eventstream import encode_frame
from tests.eventstream_transcripts import CASES, DIR, START, body, ev, stop, text
from tests.helpers import briefs, run

D = "bedrock-converse"

EXPECTED: dict[str, list[str]] = {
    "parallel_weather_time": [
        "start None",
        "open 0 tool_call get_weather tooluse_w1",
        """delta 0 json_text '{"city": "Pa'""",
        """delta 0 json_text 'ris"}'""",
        'stop 0 {"city":"Paris"}',
        "open 1 tool_call get_time tooluse_t2",
        """delta 1 json_text '{"tz": "Europe/Paris"}'""",
        'stop 1 {"tz":"Europe/Paris"}',
        "done tool_use tool_use",
    ],
    "json_answer": [
        "start None",
        "open 0 text",
        """delta 0 text '{"city": '""",
        """delta 0 text '"Paris", "te'""",
        """delta 0 text 'mp_c": 21}'""",
        "stop 0",
        "done stop end_turn",
    ],
    "text": [
        "start None",
        "open 0 text",
        "delta 0 text 'Hello'",
        "delta 0 text ', world.'",
        "stop 0",
        "done stop end_turn",
    ],
    "tool_call": [
        "start None",
        "open 0 text",
        "delta 0 text 'Let me check.'",
        "stop 0",
        "open 1 tool_call get_weather tooluse_a1",
        'delta 1 json_text \'{"city": "Pa\'',
        "delta 1 json_text 'ris\"}'",
        'stop 1 {"city":"Paris"}',
        "done tool_use tool_use",
    ],
    "reasoning": [
        "start None",
        "open 0 reasoning internal",
        "delta 0 text 'The user greets; '",
        "delta 0 text 'answer briefly.'",
        "delta 0 signature 'EqoBCkgIARABGAIiQL'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'Hi!'",
        "stop 1",
        "done stop end_turn",
    ],
    "redacted_reasoning": [
        "start None",
        "open 0 reasoning internal",
        "delta 0 signature 'RW5jcnlwdGVkIHRoaW5raW5n'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'Done.'",
        "stop 1",
        "done stop end_turn",
    ],
    "max_tokens": ["start None", "open 0 text", "delta 0 text 'A long ans'", "stop 0", "done length max_tokens"],
    "max_tokens_in_tool_json": [
        "start None",
        "open 0 tool_call search tooluse_b2",
        'delta 0 json_text \'{"q": "long\'',
        "stop 0 null truncated",
        "done length max_tokens",
    ],
    "guardrail_intervened": [
        "start None",
        "open 0 text",
        "delta 0 text 'Sorry.'",
        "stop 0",
        "done content_filter guardrail_intervened",
    ],
    "throttling_exception": [
        "start None",
        "open 0 text",
        "delta 0 text 'Partial'",
        "failed rate_limit throttlingException retryable=True",
    ],
    "service_unavailable_exception": ["start None", "failed overloaded serviceUnavailableException retryable=True"],
    "internal_server_exception": [
        "start None",
        "open 0 text",
        "delta 0 text 'x'",
        "failed server_error internalServerException retryable=True",
    ],
    "validation_exception": ["start None", "failed invalid_request validationException retryable=False"],
    "model_stream_error_exception": [
        "start None",
        "open 0 text",
        "delta 0 text 'Hel'",
        "failed server_error modelStreamErrorException retryable=True",
    ],
    "unmodeled_error": ["start None", "failed server_error InternalFailure retryable=True"],
    "eof_after_message_stop": [
        "start None",
        "open 0 text",
        "delta 0 text 'Hello'",
        "stop 0",
        "interrupted transport None retryable=False",
    ],
    "eof_inside_frame": [
        "start None",
        "open 0 text",
        "delta 0 text 'Hello'",
        "interrupted transport None retryable=False",
    ],
    "crc_mismatch": ["start None", "open 0 text", "delta 0 text 'Hello'", "failed protocol None retryable=False"],
    "unknown_events_skipped": [
        "start None",
        "open 0 text",
        "delta 0 text 'Cited.'",
        "stop 0",
        "warning unknown_events_skipped 2",
        "done stop end_turn",
    ],
}


def test_every_case_is_spelled_out_and_on_disk_as_its_source_writes_it() -> None:
    assert set(EXPECTED) == set(CASES)
    assert {p.stem for p in DIR.glob("*.eventstream")} == set(CASES)
    for case in CASES:
        assert (DIR / f"{case}.eventstream").read_bytes() == body(case), case


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_case_sequence(case: str) -> None:
    _, events, _ = run(D, body(case))
    assert briefs(events) == EXPECTED[case]


def test_the_dialect_is_registered_with_its_framing() -> None:
    assert D in DIALECTS
    assert adapter_class(D).FRAMING == "eventstream"


def test_messages_and_usage() -> None:
    _, events, result = run(D, body("tool_call"))
    assert result.usage is not None
    assert (result.usage.input_tokens, result.usage.output_tokens, result.usage.total_tokens) == (40, 22, 62)
    assert (result.usage.cache_read_tokens, result.usage.cache_write_tokens) == (30, 0)
    _, events, result = run(D, body("model_stream_error_exception"))
    assert result.error is not None and result.error.message == "Model stream error (model status 500)"
    _, events, result = run(D, body("crc_mismatch"))
    assert result.error is not None and "message CRC mismatch" in result.error.message
    assert events[-1].raw == [3]  # the broken frame is a raw event of its own


def test_the_terminal_is_metadata_after_message_stop() -> None:
    # metadata before messageStop only reports usage; nothing after metadata is normalized.
    stream = [START, text(0, "a"), stop(0), ev("metadata", {"usage": {"inputTokens": 1}})]
    assert run(D, b"".join(stream))[2].status == "interrupted"
    stream += [ev("messageStop", {"stopReason": "end_turn"}), ev("metadata", {"usage": {"outputTokens": 2}})]
    raw, events, result = run(D, b"".join([*stream, text(0, "late")]))
    assert briefs(events)[-1] == "done stop end_turn"
    assert result.usage is not None and (result.usage.input_tokens, result.usage.output_tokens) == (1, 2)
    assert len(raw) == 7


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (
            [ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"toolUse": {"input": "{}"}}})],
            "no toolUse start",
        ),
        ([ev("contentBlockDelta", {"delta": {"text": "x"}})], "without a contentBlockIndex"),
        (
            [
                text(0, "a"),
                ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": "b"}}}),
            ],
            "a reasoning delta in block 0, which is a text block",
        ),
        (
            [encode_frame({":message-type": "event", ":event-type": "contentBlockDelta"}, b"{not json")],
            "not valid JSON",
        ),
        ([encode_frame({":message-type": "event", ":event-type": "messageStart"}, b'{"role": 5}')], "not valid JSON"),
    ],
)
def test_malformed_payloads_fail_protocol(frames: list[bytes], message: str) -> None:
    _, _, result = run(D, b"".join([START, *frames]))
    assert result.status == "failed" and result.error is not None
    assert result.error.category == "protocol" and message in result.error.message


@pytest.mark.parametrize(
    "payload",
    [b"a,b,c\n1,2,3\n", b"<Stats><BytesScanned>9</BytesScanned></Stats>", b"[1]", b""],
    ids=["csv", "xml", "json-array", "empty"],
)
def test_an_unknown_event_is_skipped_unread_whatever_its_payload(payload: bytes) -> None:
    """The header names the event: an unknown one (S3 Select's ``Records`` with CSV, ``Stats`` with XML, as in
    the AWS SDKs' event-stream fixtures) is kept raw, counted and skipped, never a protocol error. (Invalid
    UTF-8 follows ``limits.invalid_utf8`` as in any event.)"""
    unknown = [
        encode_frame({":message-type": "event", ":event-type": "Records"}, payload),
        encode_frame({":message-type": "event", ":event-type": "Stats"}, payload),
    ]
    stream = [START, text(0, "Hi"), *unknown, stop(0), ev("messageStop", {"stopReason": "end_turn"})]
    raw, events, result = run(D, b"".join([*stream, ev("metadata", {"usage": {"outputTokens": 1}})]))
    assert briefs(events) == [
        "start None",
        "open 0 text",
        "delta 0 text 'Hi'",
        "stop 0",
        "warning unknown_events_skipped 2",
        "done stop end_turn",
    ]
    assert result.status == "completed"
    assert [(r.event, r.data) for r in raw[2:4]] == [("Records", payload.decode()), ("Stats", payload.decode())]


def test_raw_rows_keep_each_frame_and_flag_a_redacted_one() -> None:
    from sluice.schemas.raw import REDACTION_MARKER
    from sluice.worker.append.log import PendingBatch

    redacted = text(0, f"key {REDACTION_MARKER}")  # as if the redactor had rewritten an echoed key
    raw, events, _ = run(D, START + redacted)
    batch = PendingBatch.normalized(raw, events, ts=5)
    assert [row[:7] for row in batch.raw] == [
        (1, "frame", "messageStart", raw[0].data, "event", 0, 5),
        (2, "frame", "contentBlockDelta", raw[1].data, "event", len(START), 5),
    ]
    assert batch.raw[0][7:] == ("frame", 1) and batch.blobs[0] == START
    assert batch.raw[1][7:] == ("redacted", "1", "frame", 2) and batch.blobs[1] == redacted
