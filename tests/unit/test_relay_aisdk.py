"""The AI SDK UI message stream mapping (pure): exact chunks, ids, held terminals and exact resume.

Events are written as JSON here, not built from the contract's Structs, so fields the contract does not
have yet (``arguments_error`` of a truncated tool call) can be fed as a newer worker would write them.
The same bodies are validated by the ``ai`` package itself in ``tests/integration/test_relay_aisdk.py``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sluice.relay.aisdk import UIMessageStream
from sluice.relay.coalesce import Frame
from sluice.relay.positions import START, Position


class Log:
    """A request's events as frames, attempt by attempt."""

    def __init__(self, rid: str = "req_1") -> None:
        self.rid = rid
        self.frames: list[Frame] = []
        self.attempt = 0
        self.seq = 0

    def add(self, kind: str, **fields: Any) -> Log:
        self.seq += 1
        doc = {
            "type": kind,
            "stream_id": f"{self.rid}:{self.attempt}",
            "request_id": self.rid,
            "seq": self.seq,
            "ts": 1,
            "raw": [],
            **fields,
        }
        self.frames.append(Frame(Position(self.attempt, self.seq), kind, msgspec.json.encode(doc)))
        return self

    def start(self) -> Log:
        self.attempt += 1
        self.seq = 0
        return self.add("stream.start", provider="anthropic", dialect="anthropic", model="m", attempt=self.attempt)

    def block(self, index: int, kind: str, chunks: list[str], **stop: Any) -> Log:
        ref = {"id": f"b_{index}", "index": index, "kind": kind}
        opened = dict(ref)
        if kind == "tool_call":
            opened |= {"name": stop.pop("name", "get_weather"), "call_id": stop.pop("call_id", f"call_{index}")}
        self.add("block.start", block=opened)
        dkind = "json_text" if kind == "tool_call" else "text"
        for c in chunks:
            self.add("block.delta", block=ref, delta={"kind": dkind, "text": c})
        if stop.pop("open", False):
            return self
        return self.add("block.stop", block=ref, **stop)

    def done(self, stop_reason: str = "stop", **fields: Any) -> Log:
        usage = {"input_tokens": 3, "output_tokens": 5}
        return self.add(
            "stream.done", status="completed", stop_reason=stop_reason, provider_stop_reason=None, usage=usage, **fields
        )

    def error(self, category: str = "overloaded", status: str = "failed", **err: Any) -> Log:
        return self.add(
            "stream.error",
            status=status,
            error={"category": category, "retryable": False, "message": "try again", **err},
        )

    @property
    def final(self) -> Position:
        return self.frames[-1].position


def events(body: bytes) -> list[tuple[str, Any]]:
    """(id, chunk) per SSE event of a body; ``[DONE]`` as ``("", "[DONE]")``."""
    out = []
    for raw in body.decode().split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in raw.split("\n"))
        data = fields["data"]
        out.append((fields.get("id", ""), data if data == "[DONE]" else msgspec.json.decode(data)))
    return out


def body_of(log: Log, after: Position = START, part: int | None = None, *, live: bool = False) -> bytes:
    """The whole body; ``live``: the final position becomes known only at the end (as for a live
    request), else it is known from the start (a finished request being caught up on)."""
    stream = UIMessageStream(log.rid, after, part)
    return stream.push(log.frames, None if live else log.final) + stream.close(log.final)


def test_text_and_a_tool_call_chunk_by_chunk() -> None:
    log = Log().start().block(0, "text", ["Hel", "lo"])
    log.block(1, "tool_call", ['{"city": "Pa', 'ris"}'], arguments={"city": "Paris"}).done("tool_use")
    meta_start = {
        "sluice": {"request_id": "req_1", "provider": "anthropic", "model": "m", "dialect": "anthropic", "attempt": 1}
    }
    expected = [
        ("1-1.0", {"type": "start", "messageId": "req_1", "messageMetadata": meta_start}),
        ("1-1", {"type": "start-step"}),
        ("1-2", {"type": "text-start", "id": "1:b_0"}),
        ("1-3", {"type": "text-delta", "id": "1:b_0", "delta": "Hel"}),
        ("1-4", {"type": "text-delta", "id": "1:b_0", "delta": "lo"}),
        ("1-5", {"type": "text-end", "id": "1:b_0"}),
        ("1-6", {"type": "tool-input-start", "toolCallId": "call_1", "toolName": "get_weather"}),
        ("1-7", {"type": "tool-input-delta", "toolCallId": "call_1", "inputTextDelta": '{"city": "Pa'}),
        ("1-8", {"type": "tool-input-delta", "toolCallId": "call_1", "inputTextDelta": 'ris"}'}),
        (
            "1-9",
            {
                "type": "tool-input-available",
                "toolCallId": "call_1",
                "toolName": "get_weather",
                "input": {"city": "Paris"},
            },
        ),
        ("1-10.0", {"type": "finish-step"}),
        (
            "1-10",
            {
                "type": "finish",
                "finishReason": "tool-calls",
                "messageMetadata": {
                    "sluice": {
                        "status": "completed",
                        "stop_reason": "tool_use",
                        "usage": {"input_tokens": 3, "output_tokens": 5},
                        "attempt": 1,
                        "position": "1-10",
                    }
                },
            },
        ),
        ("", "[DONE]"),
    ]
    assert events(body_of(log)) == expected
    # live (the final position learnt only at the end) or caught up: the same bytes
    assert body_of(log, live=True) == body_of(log)


@pytest.mark.parametrize(
    ("stop", "reason"),
    [
        ("stop", "stop"),
        ("tool_use", "tool-calls"),
        ("length", "length"),
        ("content_filter", "content-filter"),
        ("refusal", "content-filter"),
        ("pause_turn", "other"),
        ("other", "other"),
        ("something_new", "other"),
    ],
)
def test_finish_reasons(stop: str, reason: str) -> None:
    chunks = [c for _, c in events(body_of(Log().start().block(0, "text", ["x"]).done(stop)))]
    assert chunks[-2]["finishReason"] == reason and chunks[-2]["messageMetadata"]["sluice"]["stop_reason"] == stop


def test_a_retried_attempt_is_no_error_and_the_final_failure_is() -> None:
    log = Log().start().block(0, "text", [], open=True).error("overloaded")  # retried: an empty block left open
    log.start().block(0, "text", ["Partial ans"], open=True)
    log.block(1, "tool_call", ['{"ci'], open=True).error("transport", "interrupted")
    chunks = [c for _, c in events(body_of(log, live=True))][:-1]  # without [DONE]
    types = [c["type"] for c in chunks]
    assert types == [
        "start",
        "start-step",
        "text-start",
        # attempt 2 starts: attempt 1's open part is closed, no error chunk for its (retried) failure
        "text-end",
        "finish-step",
        "start-step",
        "message-metadata",
        "text-start",
        "text-delta",
        "tool-input-start",
        "tool-input-delta",
        # the final failure: the cut tool call is an input error, then the error itself
        "tool-input-error",
        "error",
        "finish-step",
        "finish",
    ]
    assert chunks[11] == {
        "type": "tool-input-error",
        "toolCallId": "call_1",
        "toolName": "get_weather",
        "input": '{"ci',
        "errorText": "the stream interrupted before the arguments were complete",
    }
    assert chunks[12] == {"type": "error", "errorText": "transport: try again"}
    assert chunks[14]["finishReason"] == "error"
    assert chunks[14]["messageMetadata"]["sluice"]["error"] == {"category": "transport", "retryable": False}
    assert chunks[6]["messageMetadata"]["sluice"]["attempt"] == 2
    assert body_of(log) == body_of(log, live=True)


def test_a_protocol_error_naming_a_tool_block_becomes_its_input_error() -> None:
    log = Log().start().block(0, "tool_call", ['{"a": '], open=True).error("protocol", block_index=0)
    chunks = [c for _, c in events(body_of(log))]
    assert chunks[4] == {
        "type": "tool-input-error",
        "toolCallId": "call_0",
        "toolName": "get_weather",
        "input": '{"a": ',
        "errorText": "try again",
    }


def test_truncated_tool_call_and_unknown_fields() -> None:
    """A newer worker's ``arguments: null, arguments_error: "truncated"`` with stop reason ``length``; any
    field this relay does not know is ignored."""
    log = Log().start().block(0, "tool_call", ['{"city": "Os'], arguments=None, arguments_error="truncated")
    log.done("length", something_new={"x": 1})
    chunks = [c for _, c in events(body_of(log))]
    assert chunks[4] == {
        "type": "tool-input-error",
        "toolCallId": "call_0",
        "toolName": "get_weather",
        "input": '{"city": "Os',
        "errorText": "the tool call's arguments are truncated",
    }
    assert chunks[-2]["finishReason"] == "length"


def test_keys_the_sdk_refuses_never_reach_it() -> None:
    log = Log().start().block(0, "tool_call", ['{"__proto__": {}}'], arguments={"__proto__": {}}).done("tool_use")
    log2 = Log().start().block(0, "tool_call", ["{}"], arguments={"a": [{"constructor": {"prototype": 1}}]}).done()
    for lg in (log, log2):
        chunk = [c for _, c in events(body_of(lg))][4]
        assert chunk["type"] == "tool-input-error" and "__proto__" in chunk["errorText"]
    ok = Log().start().block(0, "tool_call", ["{}"], arguments={"note": "__proto__", "constructor": 1}).done()
    assert [c for _, c in events(body_of(ok))][4]["type"] == "tool-input-available"


def test_refusal_blocks_are_marked_and_reasoning_is_its_own_part() -> None:
    log = Log().start().block(0, "reasoning", ["hmm"]).block(1, "refusal", ["No."]).done("refusal")
    chunks = [c for _, c in events(body_of(log))]
    assert chunks[2] == {"type": "reasoning-start", "id": "1:b_0"}
    assert chunks[5] == {"type": "text-start", "id": "1:b_1", "providerMetadata": {"sluice": {"kind": "refusal"}}}


def test_signatures_warnings_and_withheld_notices_add_nothing() -> None:
    log = Log().start()
    log.add("block.withheld", block={"id": "b_0", "index": 0, "kind": "reasoning"})
    log.block(1, "text", ["a"])
    log.add("block.delta", block={"id": "b_1", "index": 1, "kind": "text"}, delta={"kind": "signature", "text": "s"})
    log.add("stream.warning", code="unknown_events", message="2 skipped", count=2).done()
    ids = [i for i, _ in events(body_of(log))]
    assert ids == ["1-1.0", "1-1", "1-3", "1-4", "1-5", "1-8.0", "1-8", ""]


def test_resume_after_every_chunk_id_is_exactly_the_rest() -> None:
    log = Log().start().block(0, "text", [], open=True).error("overloaded")
    log.start().block(0, "reasoning", ["a", "b"]).block(1, "text", ["c"]).block(2, "tool_call", ["{}"], arguments={})
    log.error("server_error")
    full = events(body_of(log))
    for k, (cid, _) in enumerate(full[:-1]):
        pos, _, part = cid.partition(".")
        after = Position.from_entry_id(pos)
        for live in (False, True):
            rest = events(body_of(log, after, int(part) if part else None, live=live))
            assert rest == full[k + 1 :], cid
    # the start of the stream is sent once, only to a client without a position
    assert [c["type"] for _, c in events(body_of(log, Position(1, 1)))[:-1]].count("start") == 0


def test_coalesced_deltas_map_to_one_text_delta() -> None:
    """``?coalesce_ms=`` merges text deltas before the mapping: one text-delta with the joined text, at the
    last merged delta's position (so resuming after it is exact)."""
    from sluice.relay.coalesce import Coalescer
    from sluice.relay.positions import Entry
    from sluice.schemas.events import decode_event

    log = Log().start().block(0, "text", ["Hel", "lo", "!"]).done()
    coalescer = Coalescer(1.0)
    entries = [Entry(f.position, f.type, f.data, decode_event(f.data)) for f in log.frames]
    frames = [f for e in entries for f in coalescer.push(e, 0.0)] + coalescer.flush()
    stream = UIMessageStream("req_1")
    got = events(stream.push(frames, log.final) + stream.close(log.final))
    assert [(i, c["type"]) for i, c in got[2:5]] == [("1-2", "text-start"), ("1-5", "text-delta"), ("1-6", "text-end")]
    assert got[3][1]["delta"] == "Hello!"


BAD_CITY = {"pointer": "/city", "keyword": "maxLength", "message": '"Paris" is longer than 3 characters'}


def test_an_invalid_verdict_is_a_tool_input_error_and_the_answer_rides_the_finish() -> None:
    log = Log().start()
    log.block(0, "tool_call", ['{"city": "Paris"}'], arguments={"city": "Paris"}, verdict={"valid": True})
    invalid = {"valid": False, "reason": "schema", "errors": [BAD_CITY]}
    log.block(1, "tool_call", ['{"city": "Paris"}'], arguments={"city": "Paris"}, verdict=invalid, call_id="c2")
    undeclared = {
        "valid": False,
        "reason": "undeclared_tool",
        "errors": [{"pointer": "", "keyword": "", "message": "'x' is not among the job's tools"}],
    }
    log.block(2, "tool_call", ["{}"], arguments={}, verdict=undeclared, name="x", call_id="c3")
    log.done("tool_use", answer={"valid": True})
    chunks = [c for _, c in events(body_of(log))]
    stops = [c for c in chunks if isinstance(c, dict) and c["type"] in ("tool-input-available", "tool-input-error")]
    assert stops == [
        {"type": "tool-input-available", "toolCallId": "call_0", "toolName": "get_weather", "input": {"city": "Paris"}},
        {
            "type": "tool-input-error",
            "toolCallId": "c2",
            "toolName": "get_weather",
            "input": '{"city": "Paris"}',
            "errorText": 'invalid tool call (schema): /city: "Paris" is longer than 3 characters',
        },
        {
            "type": "tool-input-error",
            "toolCallId": "c3",
            "toolName": "x",
            "input": "{}",
            "errorText": "invalid tool call (undeclared_tool): 'x' is not among the job's tools",
        },
    ]
    assert chunks[-2]["messageMetadata"]["sluice"]["answer"] == {"valid": True}
