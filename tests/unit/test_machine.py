"""The stream state machine: every invariant broken on purpose, the result it assembles, and properties.

Rule: each illegal move gets the typed error the docstring promises (``ProviderProtocolError`` for the
provider's sequencing, ``LimitExceeded`` for a cap, ``ContractViolation`` for our own bugs) and leaves
the machine able to ``fail``; the transition table is total (h2); and random action sequences driven the
way ``normalizer/stream.py`` drives the machine never produce an event sequence the independent
``ContractChecker`` rejects.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.normalizer.actions import Action, Append, Close, Fail, Finish, Ignore, Open, SetUsage, Start, Warn
from sluice.normalizer.machine import TRANSITIONS, State, StreamInfo, StreamMachine
from sluice.schemas.errors import ContractViolation, LimitExceeded, ProviderProtocolError, WorkerError
from sluice.schemas.events import (
    BLOCK_KINDS,
    ERROR_CATEGORIES,
    STOP_REASONS,
    BlockDelta,
    BlockStart,
    BlockStop,
    Event,
    StreamDone,
    StreamError,
    Usage,
    decode_event,
    encode_event,
)
from sluice.schemas.invariants import ContractChecker
from tests.helpers import briefs

INFO = StreamInfo(stream_id="s:1", request_id="r", provider="prov", dialect="dia", model="requested")
ACTION_TYPES: tuple[type, ...] = (Start, Open, Append, Close, SetUsage, Finish, Fail, Warn, Ignore)


def machine(**kw: int) -> StreamMachine:
    return StreamMachine(INFO, **kw)


def run(m: StreamMachine, actions: Iterable[Action]) -> list[Event]:
    out: list[Event] = []
    for a in actions:
        out += m.process(a, ts=7, raw=[1])
    return out


def started(*actions: Action, **kw: int) -> StreamMachine:
    m = machine(**kw)
    run(m, [Start("model-x"), *actions])
    return m


def check(events: Sequence[Event]) -> None:
    checker = ContractChecker()
    for ev in events:
        checker.process(ev)
    assert checker.terminal


# -- the happy path and the assembled result ------------------------------------------------------


def test_full_turn_events_and_result() -> None:
    m = machine()
    events = run(
        m,
        [
            Start("claude-x"),
            SetUsage(Usage(input_tokens=10, output_tokens=1, cache_read_tokens=3)),
            Open("r", "reasoning"),
            Append("r", "text", "hmm"),
            Append("r", "signature", "SIG1"),
            Append("r", "signature", "SIG2"),
            Close("r"),
            Open("t", "text"),
            Append("t", "text", "Hi "),
            Append("t", "text", ""),  # empty deltas emit nothing
            Append("t", "text", "there"),
            Close("t"),
            Open("c", "tool_call", name="get", call_id="call_1"),
            Append("c", "json_text", '{"a": '),
            Append("c", "json_text", '"\\u00e9"}'),
            Close("c"),
            SetUsage(Usage(output_tokens=57)),
            Finish("stop", "end_turn", usage=Usage(total_tokens=70)),
        ],
    )
    assert briefs(events) == [
        "start claude-x",
        "open 0 reasoning internal",
        "delta 0 text 'hmm'",
        "delta 0 signature 'SIG1'",
        "delta 0 signature 'SIG2'",
        "stop 0",
        "open 1 text",
        "delta 1 text 'Hi '",
        "delta 1 text 'there'",
        "stop 1",
        "open 2 tool_call get call_1",
        "delta 2 json_text '{\"a\": '",
        "delta 2 json_text '\"\\\\u00e9\"}'",
        'stop 2 {"a":"é"}',
        "done tool_use end_turn",  # a natural stop with a tool call is tool_use
    ]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert {(e.stream_id, e.request_id, e.ts, tuple(e.raw)) for e in events} == {("s:1", "r", 7, (1,))}
    assert [e.block.id for e in events if isinstance(e, BlockStart)] == ["b_0", "b_1", "b_2"]
    usage = Usage(input_tokens=10, output_tokens=57, cache_read_tokens=3, total_tokens=70)
    done = events[-1]
    assert isinstance(done, StreamDone) and done.usage == usage
    check(events)
    r = m.result()
    assert (r.status, r.stop_reason, r.provider_stop_reason, r.error, r.usage) == (
        "completed",
        "tool_use",
        "end_turn",
        None,
        usage,
    )
    assert [
        (b.index, b.kind, b.text, b.signature, b.name, b.call_id, b.arguments, b.arguments_text) for b in r.blocks
    ] == [
        (0, "reasoning", "hmm", "SIG1SIG2", None, None, None, None),
        (1, "text", "Hi there", None, None, None, None, None),
        (2, "tool_call", None, None, "get", "call_1", {"a": "é"}, '{"a": "\\u00e9"}'),
    ]
    assert m.statistics() == {
        "events": 15,
        "blocks": 3,
        "open_blocks": 0,
        "visible_deltas": 5,
        "ignored_events": 0,
        "unknown_events": 0,
    }


def test_running_result_before_the_terminal() -> None:
    m = started(Open(0, "text"), Append(0, "text", "so far"))
    r = m.result()
    assert (r.status, r.stop_reason, r.error) == ("running", None, None)
    assert [b.text for b in r.blocks] == ["so far"]


def test_model_falls_back_to_the_requested_one() -> None:
    m = machine()
    assert briefs(run(m, [Start(None)])) == ["start requested"]


def test_missing_call_id_is_synthesized_and_flagged() -> None:
    m = started()
    (ev,) = run(m, [Open("k", "tool_call", name="f")])
    assert isinstance(ev, BlockStart)
    assert (ev.block.call_id, ev.block.call_id_synthesized) == ("call_s:1_0", True)
    (ev,) = run(m, [Close("k"), Open("j", "tool_call", name="f", call_id="c9")])[1:]
    assert isinstance(ev, BlockStart)
    assert (ev.block.call_id, ev.block.call_id_synthesized) == ("c9", False)


def test_block_start_carries_only_the_fields_of_its_kind() -> None:
    m = started()
    events = run(
        m,
        [
            Open(1, "text", name="x", call_id="y", visibility="public", encrypted=True),
            Append(1, "text", "t"),
            Open(2, "reasoning", visibility="public"),
            Append(2, "text", "r"),
            Open(3, "refusal"),
            Append(3, "text", "no"),
            Open(4, "reasoning", encrypted=True),
            Append(4, "signature", "enc"),
        ],
    )
    blocks = [e.block for e in events if isinstance(e, BlockStart)]
    assert [(b.kind, b.name, b.call_id, b.visibility, b.encrypted) for b in blocks] == [
        ("text", None, None, None, False),
        ("reasoning", None, None, "public", False),
        ("refusal", None, None, None, False),
        ("reasoning", None, None, "internal", True),
    ]
    assert b"encrypted" not in encode_event(events[0])  # absent unless true: 1.0 events are unchanged


# -- a content block starts at its first non-empty content ----------------------------------------


def test_a_content_block_starts_at_its_first_non_empty_content() -> None:
    m = started()
    assert run(m, [Open("t", "text"), Append("t", "text", ""), Append("t", "signature", "")]) == []
    events = run(m, [Append("t", "text", "hi")])
    assert briefs(events) == ["open 0 text", "delta 0 text 'hi'"]
    assert [e.raw for e in events] == [[1], [1]]  # both from the provider event with the content


@pytest.mark.parametrize("kind", ["text", "reasoning", "refusal"])
def test_a_content_block_without_content_never_starts_nor_stops(kind: str) -> None:
    m = started(Open("t", kind), Append("t", "text", ""))  # type: ignore[arg-type]
    events = run(m, [Close("t"), Finish("stop", "end_turn")])
    assert briefs(events) == ["done stop end_turn"] and events[0].seq == 2
    assert m.result().blocks == [] and m.statistics()["blocks"] == 0


def test_a_signature_is_content() -> None:
    m = started(Open("r", "reasoning"))
    assert briefs(run(m, [Append("r", "signature", "sig"), Close("r")])) == [
        "open 0 reasoning internal",
        "delta 0 signature 'sig'",
        "stop 0",
    ]


def test_a_tool_call_starts_at_its_open() -> None:
    m = started()
    assert briefs(run(m, [Open("c", "tool_call", name="f", call_id="id")])) == ["open 0 tool_call f id"]


def test_a_closed_key_may_be_reused_for_a_new_block() -> None:
    m = started(Open(0, "text"), Append(0, "text", "a"), Close(0))
    assert briefs(run(m, [Open(0, "text"), Append(0, "text", "b")])) == ["open 1 text", "delta 1 text 'b'"]


def test_warn_and_ignore() -> None:
    m = started()
    events = run(
        m,
        [
            Ignore("ping", unknown=False),
            Ignore("mystery"),
            Ignore("mystery"),
            Ignore("other"),
            Warn("odd", "something odd"),
            Finish("stop", "end_turn"),
        ],
    )
    assert briefs(events) == ["warning odd 1", "warning unknown_events_skipped 3", "done stop end_turn"]
    assert m.statistics()["ignored_events"] == 4
    assert m.unknown_events == 3
    check([*run(machine(), [Start("model-x")]), *events])


def test_ignore_before_start_is_counted_and_reported_at_the_end() -> None:
    m = machine()
    assert run(m, [Ignore("early")]) == []
    assert m.state is State.IDLE
    assert briefs(run(m, [Start(None), Finish("stop", None)])) == [
        "start requested",
        "warning unknown_events_skipped 1",
        "done stop None",
    ]


# -- stop reasons and usage -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kinds", "given", "want"),
    [
        ((), "stop", "stop"),
        (("text",), "stop", "stop"),
        (("text", "tool_call"), "stop", "tool_use"),
        (("refusal",), "stop", "refusal"),
        (("text", "refusal"), "stop", "refusal"),
        (("refusal", "tool_call"), "stop", "tool_use"),
        (("tool_call",), "length", "length"),  # only a natural stop is upgraded
        (("refusal",), "content_filter", "content_filter"),
        (("tool_call",), "tool_use", "tool_use"),
        (("text",), "other", "other"),
    ],
)
def test_stop_reason_upgrade(kinds: tuple[str, ...], given: str, want: str) -> None:
    actions: list[Action] = []
    for i, kind in enumerate(kinds):
        content = Append(i, "json_text", "{}") if kind == "tool_call" else Append(i, "text", "x")
        actions += [Open(i, kind), content, Close(i)]  # type: ignore[arg-type]
    m = started(*actions)
    (done,) = run(m, [Finish(given, "raw")])  # type: ignore[arg-type]
    assert isinstance(done, StreamDone)
    assert (done.stop_reason, done.provider_stop_reason) == (want, "raw")


def test_usage_is_merged_field_by_field_never_summed() -> None:
    m = started(
        SetUsage(Usage(input_tokens=42, output_tokens=1, cache_read_tokens=10, cache_write_tokens=0)),
        SetUsage(Usage(output_tokens=30)),
        SetUsage(Usage(output_tokens=57, reasoning_tokens=5)),
    )
    (done,) = run(m, [Finish("stop", "end_turn", usage=Usage(input_tokens=43))])
    assert isinstance(done, StreamDone)
    assert done.usage == Usage(
        input_tokens=43, output_tokens=57, reasoning_tokens=5, cache_read_tokens=10, cache_write_tokens=0
    )
    assert m.result().usage == done.usage


def test_no_usage_at_all_is_null() -> None:
    (done,) = run(started(), [Finish("stop", None)])
    assert isinstance(done, StreamDone) and done.usage is None


# -- tool arguments -------------------------------------------------------------------------------


def _tool(*fragments: str, **kw: int) -> tuple[StreamMachine, list[Action]]:
    return started(Open("c", "tool_call", name="f", call_id="id"), **kw), [
        Append("c", "json_text", f) for f in fragments
    ]


@pytest.mark.parametrize("fragments", [(), ("",), ("  ", "\n")])
def test_empty_arguments_mean_an_empty_object(fragments: tuple[str, ...]) -> None:
    m, actions = _tool(*fragments)
    events = run(m, [*actions, Close("c")])
    assert briefs(events)[-1] == "stop 0 {}"


def test_arguments_are_parsed_once_at_close() -> None:
    m, actions = _tool('{"q": "a\\', 'nb", "n": [1, ', "2]}")
    events = run(m, [*actions, Close("c")])
    stop = events[-1]
    assert isinstance(stop, BlockStop) and stop.arguments == {"q": "a\nb", "n": [1, 2]}


@pytest.mark.parametrize("text", ['{"a": 1', '{"a": }', "{'a': 1}", '{"a": 1}}', "{}{}"])
def test_invalid_tool_json_is_a_protocol_error_with_the_block_index(text: str) -> None:
    m = started(Open("t", "text"), Append("t", "text", "before"), Close("t"))
    run(m, [Open("c", "tool_call", name="f", call_id="id"), Append("c", "json_text", text)])
    # The stop waits for the terminal: only a cut (stop reason length) would excuse the JSON.
    assert m.process(Close("c"), ts=0) == []
    with pytest.raises(ProviderProtocolError) as ei:
        m.process(Finish("tool_use", "tool_use"), ts=0)
    assert ei.value.block_index == 1
    assert "block 1" in ei.value.message
    assert m.state is State.STREAMING and not m.terminal  # unchanged: the caller fails it
    events = m.fail("protocol", ei.value.message, ts=0, block_index=ei.value.block_index)
    assert briefs(events) == ["failed protocol None retryable=False"]
    err = events[0]
    assert isinstance(err, StreamError) and err.error.block_index == 1
    r = m.result()
    assert r.status == "failed"
    assert [(b.text, b.arguments, b.arguments_text) for b in r.blocks] == [
        ("before", None, None),
        (None, None, text),
    ]


# -- truncation: a tool call the provider cut at its token limit ----------------------------------


def _cut(*after: Action) -> tuple[StreamMachine, list[Event]]:
    """A machine whose tool call got cut JSON, and the events after its text block."""
    m = started(Open("t", "text"), Append("t", "text", "Saving."), Close("t"))
    events = run(
        m, [Open("c", "tool_call", name="save", call_id="id"), Append("c", "json_text", '{"lines": ["a'), *after]
    )
    return m, events


def test_all_of_a_cut_stream_passes_the_checker() -> None:
    m = machine()
    events = run(
        m,
        [
            Start("x"),
            Open("c", "tool_call", name="save", call_id="id"),
            Append("c", "json_text", '{"a'),
            Close("c"),
            Ignore("mystery"),
            Finish("length", "max_tokens"),
        ],
    )
    assert briefs(events)[-3:] == [
        "stop 0 null truncated",
        "warning unknown_events_skipped 1",
        "done length max_tokens",
    ]
    check(events)


def test_a_cut_tool_call_stops_truncated_when_the_terminal_says_length() -> None:
    m, events = _cut(Close("c"), SetUsage(Usage(output_tokens=9)), Ignore("ping", unknown=False))
    assert briefs(events) == ["open 1 tool_call save id", 'delta 1 json_text \'{"lines": ["a\'']
    done = m.process(Finish("length", "max_tokens"), ts=8, raw=[9])
    assert briefs(done) == ["stop 1 null truncated", "done length max_tokens"]
    stop = done[0]
    assert isinstance(stop, BlockStop) and stop.arguments is None and stop.arguments_error == "truncated"
    assert stop.raw == [1, 9]  # where the provider closed the call, and the terminal that explains it
    assert b'"arguments_error":"truncated"' in encode_event(stop)
    r = m.result()
    assert (r.status, r.stop_reason) == ("completed", "length")
    assert [(b.arguments, b.arguments_text, b.arguments_error) for b in r.blocks[1:]] == [
        (None, '{"lines": ["a', "truncated")
    ]


def test_the_stop_of_a_whole_call_carries_no_arguments_error() -> None:
    m, _ = _cut(Append("c", "json_text", '"]}'))
    (stop,) = run(m, [Close("c")])
    assert isinstance(stop, BlockStop) and stop.arguments_error is msgspec.UNSET
    assert b"arguments_error" not in encode_event(stop)


@pytest.mark.parametrize("reason", ["stop", "tool_use", "content_filter", "other", "pause_turn"])
def test_invalid_json_without_a_cut_is_a_protocol_error(reason: str) -> None:
    m, _ = _cut(Close("c"))
    with pytest.raises(ProviderProtocolError, match="block 1 are not valid JSON"):
        m.process(Finish(reason, reason), ts=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "more",
    [
        [Open("u", "tool_call", name="g", call_id="id2")],
        [Open("t2", "text"), Append("t2", "text", "more")],
    ],
)
def test_content_after_the_cut_call_makes_it_a_protocol_error(more: list[Action]) -> None:
    m, _ = _cut(Close("c"))
    with pytest.raises(ProviderProtocolError, match="block 1 are not valid JSON"):
        run(m, more)
    assert m.open_blocks <= 1 and not m.terminal


def test_only_the_call_with_the_last_content_can_be_cut() -> None:
    # OpenAI Chat closes every call at [DONE]: the first call's JSON is broken, not cut.
    m = started(Open("a", "tool_call", name="f", call_id="a"), Append("a", "json_text", '{"x": '))
    run(m, [Open("b", "tool_call", name="g", call_id="b"), Append("b", "json_text", "{}"), Close("a"), Close("b")])
    with pytest.raises(ProviderProtocolError, match="block 0"):
        m.process(Finish("length", "length"), ts=0)


def test_the_last_of_several_calls_is_cut() -> None:
    m = started(Open("a", "tool_call", name="f", call_id="a"), Append("a", "json_text", "{}"))
    events = run(
        m,
        [
            Open("b", "tool_call", name="g", call_id="b"),
            Append("b", "json_text", '{"x": '),
            Close("a"),
            Close("b"),
            Finish("length", "length"),
        ],
    )
    assert briefs(events)[-3:] == ["stop 0 {}", "stop 1 null truncated", "done length length"]


def test_two_cut_calls_are_a_protocol_error() -> None:
    m = started(Open("a", "tool_call", name="f", call_id="a"), Append("a", "json_text", "{"))
    run(m, [Open("b", "tool_call", name="g", call_id="b"), Append("b", "json_text", "{"), Close("b")])
    with pytest.raises(ProviderProtocolError, match="block 1"):
        m.process(Close("a"), ts=0)


def test_a_call_cut_then_an_error_or_eof_never_stops_publicly() -> None:
    m, _ = _cut(Close("c"))
    assert briefs(m.fail("overloaded", "busy", ts=0)) == ["failed overloaded None retryable=True"]
    assert m.result().blocks[1].arguments_error is None
    m, _ = _cut(Close("c"))
    assert briefs(m.interrupt("transport", "eof", ts=0)) == ["interrupted transport None retryable=False"]


def test_json_that_is_not_an_object_is_never_a_cut() -> None:
    m, _ = _cut()
    run(m, [Append("c", "json_text", '"]}')])
    m2 = started(Open("c", "tool_call", name="f", call_id="i"), Append("c", "json_text", "[1, 2]"))
    with pytest.raises(ProviderProtocolError, match="not an object"):
        m2.process(Close("c"), ts=0)


@pytest.mark.parametrize("text", ["[1, 2]", "1", '"x"', "null", "true"])
def test_non_object_arguments_are_a_protocol_error(text: str) -> None:
    m, actions = _tool(text)
    run(m, actions)
    with pytest.raises(ProviderProtocolError, match="not an object") as ei:
        m.process(Close("c"), ts=0)
    assert ei.value.block_index == 0


def test_tool_argument_cap_counts_utf8_bytes() -> None:
    m, actions = _tool('{"a":"', "яя", **{"max_tool_argument_bytes": 10})  # 6 + 4 bytes: at the cap
    run(m, actions)
    with pytest.raises(LimitExceeded) as ei:
        m.process(Append("c", "json_text", "x"), ts=0)
    assert (ei.value.block_index, ei.value.limit, ei.value.what) == (0, 10, "tool-call arguments")
    assert m.state is State.STREAMING
    assert m.result().blocks[0].arguments_text == '{"a":"яя'  # the rejected fragment was not kept
    events = m.fail("limit_exceeded", ei.value.message, ts=0, block_index=0)
    assert briefs(events) == ["failed limit_exceeded None retryable=False"]


def test_signatures_do_not_count_towards_the_argument_cap() -> None:
    m, actions = _tool("{}", **{"max_tool_argument_bytes": 2})
    events = run(m, [*actions, Append("c", "signature", "S" * 100), Close("c")])
    assert briefs(events) == ["delta 0 json_text '{}'", f"delta 0 signature '{'S' * 100}'", "stop 0 {}"]


# -- invariants broken on purpose -----------------------------------------------------------------


@pytest.mark.parametrize(
    "action",
    [
        Open(0, "text"),
        Append(0, "text", "x"),
        Close(0),
        SetUsage(Usage(input_tokens=1)),
        Warn("w", "w"),
        Finish("stop", "end_turn"),
    ],
    ids=lambda a: type(a).__name__,
)
def test_anything_but_start_before_start_is_a_provider_error(action: Action) -> None:
    m = machine()
    with pytest.raises(ProviderProtocolError, match="before the stream started"):
        m.process(action, ts=0)
    assert (m.state, m.seq) == (State.IDLE, 0)


def test_second_start_is_a_provider_error() -> None:
    m = started()
    with pytest.raises(ProviderProtocolError, match="start after the stream started"):
        m.process(Start("again"), ts=0)
    assert (m.state, m.seq) == (State.STREAMING, 1)


def test_append_to_unknown_or_closed_key() -> None:
    m = started(Open(0, "text"), Append(0, "text", "a"), Close(0))
    for key in (0, 1, "0"):
        with pytest.raises(ProviderProtocolError, match="not open"):
            m.process(Append(key, "text", "b"), ts=0)
    assert m.seq == 4


@pytest.mark.parametrize(
    ("block", "delta"),
    [
        ("text", "json_text"),
        ("reasoning", "json_text"),
        ("refusal", "json_text"),
        ("refusal", "signature"),
        ("tool_call", "text"),
    ],
)
def test_wrong_delta_kind(block: str, delta: str) -> None:
    m = started(Open("x", "text"), Append("x", "text", "a"), Open("k", block))  # type: ignore[arg-type]
    with pytest.raises(ProviderProtocolError) as ei:
        m.process(Append("k", delta, "v"), ts=0)  # type: ignore[arg-type]
    # A content block with no content yet has no index to name.
    assert ei.value.block_index == (1 if block == "tool_call" else None)
    # An empty fragment of the wrong kind is still wrong.
    with pytest.raises(ProviderProtocolError):
        m.process(Append("k", delta, ""), ts=0)  # type: ignore[arg-type]


def test_double_open_of_a_key() -> None:
    m = started(Open("a", "text"), Append("a", "text", "x"), Open("b", "text"), Append("b", "text", "y"))
    with pytest.raises(ProviderProtocolError, match="opened twice") as ei:
        m.process(Open("b", "tool_call"), ts=0)
    assert ei.value.block_index == 1
    assert m.statistics()["blocks"] == 2


def test_close_of_a_closed_or_unknown_key() -> None:
    m = started(Open(0, "text"), Close(0))
    with pytest.raises(ProviderProtocolError, match="not open"):
        m.process(Close(0), ts=0)
    with pytest.raises(ProviderProtocolError, match="not open"):
        m.process(Close(5), ts=0)


def test_finish_with_an_open_block() -> None:
    m = started(Open(0, "text"), Append(0, "text", "x"), Close(0), Open(1, "tool_call", call_id="c"))
    with pytest.raises(ProviderProtocolError, match="block 1 is still open") as ei:
        m.process(Finish("tool_use", "tool_use"), ts=0)
    assert ei.value.block_index == 1
    assert m.state is State.STREAMING and not m.terminal
    assert briefs(m.fail("protocol", ei.value.message, ts=0)) == ["failed protocol None retryable=False"]


def _terminal(state: State) -> StreamMachine:
    m = started(Open(0, "text"), Append(0, "text", "x"))
    if state is State.COMPLETED:
        run(m, [Close(0), Finish("stop", None)])
    elif state is State.FAILED:
        m.fail("overloaded", "busy", ts=0)
    else:
        m.interrupt("transport", "eof", ts=0)
    assert m.state is state
    return m


ANY_ACTION = [
    Start(None),
    Open(9, "text"),
    Append(0, "text", "y"),
    Close(0),
    SetUsage(Usage()),
    Finish("stop", None),
    Fail("overloaded", "e", "m"),
    Warn("w", "w"),
    Ignore("ping", unknown=False),
]


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED, State.INTERRUPTED])
@pytest.mark.parametrize("action", ANY_ACTION, ids=lambda a: type(a).__name__)
def test_anything_after_the_terminal_is_a_contract_violation(state: State, action: Action) -> None:
    m = _terminal(state)
    seq = m.seq
    with pytest.raises(ContractViolation):
        m.process(action, ts=0)
    assert (m.state, m.seq) == (state, seq)


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED, State.INTERRUPTED])
def test_a_second_terminal_is_a_contract_violation(state: State) -> None:
    m = _terminal(state)
    with pytest.raises(ContractViolation, match="second terminal"):
        m.fail("protocol", "again", ts=0)
    with pytest.raises(ContractViolation, match="second terminal"):
        m.interrupt("transport", "again", ts=0)
    assert m.state is state


@pytest.mark.parametrize(
    "action",
    [
        Open(0, "image"),  # type: ignore[arg-type]
        Open(0, "reasoning", visibility="secret"),
        Append(0, "html", "x"),  # type: ignore[arg-type]
        Finish("done", None),  # type: ignore[arg-type]
        Fail("boom", None, "m"),  # type: ignore[arg-type]
        "not an action",
    ],
    ids=repr,
)
def test_actions_outside_the_vocabulary_are_contract_violations(action: Action) -> None:
    m = started(Open(0, "text"))
    with pytest.raises(ContractViolation):
        m.process(action, ts=0)
    assert m.state is State.STREAMING
    with pytest.raises(ContractViolation):
        m.fail("boom", "m", ts=0)
    assert not m.terminal


# -- fail and interrupt ---------------------------------------------------------------------------


def test_fail_from_idle_emits_stream_start_first() -> None:
    m = machine()
    run(m, [Ignore("weird")])
    events = m.fail("rate_limit", "slow down", ts=3, raw=[4], provider_code="rate_limit_error")
    assert briefs(events) == [
        "start requested",
        "warning unknown_events_skipped 1",
        "failed rate_limit rate_limit_error retryable=True",
    ]
    assert [(e.seq, e.ts, e.raw) for e in events] == [(1, 3, [4]), (2, 3, [4]), (3, 3, [4])]
    check(events)


def test_interrupt_from_idle_emits_stream_start_first() -> None:
    m = machine()
    events = m.interrupt("timeout", "idle timer", ts=0)
    assert briefs(events) == ["start requested", "interrupted timeout None retryable=False"]
    assert m.result().status == "interrupted"


@pytest.mark.parametrize(
    ("action", "want"),
    [
        (Fail("overloaded", "overloaded_error", "busy"), "failed overloaded overloaded_error retryable=True"),
        (Fail("server_error", "api_error", "x"), "failed server_error api_error retryable=True"),
        (Fail("invalid_request", "bad", "x"), "failed invalid_request bad retryable=False"),
        (Fail("overloaded", None, "x", retryable=False), "failed overloaded None retryable=False"),
        (Fail("unknown", None, "x", retryable=True), "failed unknown None retryable=True"),
    ],
)
def test_fail_action_retryable(action: Fail, want: str) -> None:
    assert briefs(run(started(), [action])) == [want]


@pytest.mark.parametrize("how", ["fail", "interrupt"])
def test_no_block_stop_after_fail_or_interrupt_and_the_result_keeps_text(how: str) -> None:
    m = started(
        Open(0, "text"),
        Append(0, "text", "Hello, "),
        Append(0, "text", "wor"),
        Open(1, "tool_call", name="f", call_id="c1"),
        Append(1, "json_text", '{"a": 1}'),
        Open(2, "reasoning"),
        Append(2, "signature", "sig"),
    )
    seq = m.seq
    end = m.fail("overloaded", "x", ts=0) if how == "fail" else m.interrupt("transport", "eof", ts=0)
    assert len(end) == 1 and isinstance(end[0], StreamError) and end[0].seq == seq + 1
    assert m.open_blocks == 0
    r = m.result()
    assert r.status == ("failed" if how == "fail" else "interrupted")
    assert r.stop_reason is None and r.error is not None
    assert [(b.text, b.signature, b.arguments, b.arguments_text) for b in r.blocks] == [
        ("Hello, wor", None, None, None),
        (None, None, None, '{"a": 1}'),  # whole-looking JSON, but never parsed: nothing to execute
        ("", "sig", None, None),
    ]


def test_closed_tool_call_arguments_are_withheld_unless_completed() -> None:
    m = started(Open(0, "tool_call", name="f", call_id="c"), Append(0, "json_text", "{}"), Close(0))
    m.interrupt("transport", "eof", ts=0)
    assert [(b.arguments, b.arguments_text) for b in m.result().blocks] == [(None, "{}")]


# -- the table is total (h2) ----------------------------------------------------------------------

_KEYS = st.sampled_from([0, 1, "k"])
_FRAGMENTS = st.one_of(
    st.sampled_from(["", "{", "}", '{"a": 1}', '"x"', ":", "1", "[]", "null", " ", "яё", "😀", "\u2028"]),
    st.text(max_size=6),
)
_USAGE = st.builds(
    Usage,
    input_tokens=st.none() | st.integers(0, 99),
    output_tokens=st.none() | st.integers(0, 99),
    reasoning_tokens=st.none() | st.integers(0, 99),
    cache_read_tokens=st.none() | st.integers(0, 99),
    total_tokens=st.none() | st.integers(0, 99),
)
_BY_TYPE: dict[type, st.SearchStrategy[Action]] = {
    Start: st.builds(Start, st.none() | st.sampled_from(["m1", "m2"])),
    Open: st.builds(
        Open,
        _KEYS,
        st.sampled_from(BLOCK_KINDS),
        name=st.none() | st.just("fn"),
        call_id=st.none() | st.sampled_from(["", "c1", "c2"]),
        visibility=st.sampled_from([None, "internal", "public"]),
    ),
    Append: st.builds(Append, _KEYS, st.sampled_from(["text", "json_text", "signature"]), _FRAGMENTS),
    Close: st.builds(Close, _KEYS),
    SetUsage: st.builds(SetUsage, _USAGE),
    Finish: st.builds(Finish, st.sampled_from(STOP_REASONS), st.none() | st.just("raw"), usage=st.none() | _USAGE),
    Fail: st.builds(
        Fail,
        st.sampled_from(ERROR_CATEGORIES),
        st.none() | st.just("code"),
        st.just("message"),
        retryable=st.none() | st.booleans(),
    ),
    Warn: st.builds(Warn, st.just("w"), st.just("w")),
    Ignore: st.builds(Ignore, st.sampled_from(["ping", "mystery"]), unknown=st.booleans()),
}
ACTIONS: st.SearchStrategy[Action] = st.one_of(*_BY_TYPE.values())


def test_the_strategies_cover_every_action_type() -> None:
    assert set(_BY_TYPE) == set(ACTION_TYPES)
    assert {t for _, t in TRANSITIONS} <= set(ACTION_TYPES)


def _in_state(state: State, prefix: list[Action]) -> StreamMachine:
    m = machine(max_tool_argument_bytes=16)
    if state is State.IDLE:
        return m
    for a in [Start(None), *prefix]:
        with contextlib.suppress(ProviderProtocolError, LimitExceeded):
            m.process(a, ts=0)  # a random prefix: keep whatever state it reached legally
    if state is State.COMPLETED:
        for key in (0, 1, "k"):
            if m.open_blocks:
                with contextlib.suppress(ProviderProtocolError):
                    m.process(Close(key), ts=0)
        if m.open_blocks:
            m.fail("protocol", "x", ts=0)
            return _in_state(state, [])
        try:
            m.process(Finish("stop", None), ts=0)
        except ProviderProtocolError:  # a tool call whose JSON was cut (its stop held): only `length` ends it
            return _in_state(state, [])
    elif state is State.FAILED:
        m.fail("protocol", "x", ts=0)
    elif state is State.INTERRUPTED:
        m.interrupt("transport", "x", ts=0)
    assert m.state is state
    return m


@pytest.mark.parametrize(("state", "kind"), list(itertools.product(State, ACTION_TYPES)))
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_transition_table_is_total(state: State, kind: type, data: st.DataObject) -> None:
    prefix = data.draw(st.lists(ACTIONS.filter(lambda a: not isinstance(a, Fail | Finish)), max_size=6))
    m = _in_state(state, prefix)
    action = data.draw(_BY_TYPE[kind])
    before = (m.state, m.seq, m.open_blocks)
    legal = (state, kind) in TRANSITIONS
    try:
        m.process(action, ts=0)
    except WorkerError as exc:
        if state in (State.COMPLETED, State.FAILED, State.INTERRUPTED):
            assert type(exc) is ContractViolation
        else:
            assert type(exc) in (ProviderProtocolError, LimitExceeded)
            if not legal:
                assert type(exc) is ProviderProtocolError
        assert (m.state, m.seq, m.open_blocks) == before  # a refused move changes nothing
    else:
        assert legal
        assert m.state is TRANSITIONS[(state, kind)]


# -- random sequences never break the contract -----------------------------------------------------


def drive(m: StreamMachine, actions: Sequence[Action]) -> list[Event]:
    """Exactly how normalizer/stream.py drives the machine: provider faults end the stream failed, and
    the end of the input without a terminal is an interruption."""
    events: list[Event] = []
    for i, action in enumerate(actions, 1):
        if m.terminal:
            break
        try:
            events += m.process(action, ts=i, raw=[i])
        except ProviderProtocolError as exc:
            events += m.fail("protocol", exc.message, ts=i, raw=[i], block_index=exc.block_index)
        except LimitExceeded as exc:
            events += m.fail("limit_exceeded", exc.message, ts=i, raw=[i], block_index=exc.block_index)
    if not m.terminal:
        events += m.interrupt("transport", "eof", ts=0)
    return events


_DOCS = ("", "{}", '{"a": 1}', '{"q": "я\\n😀", "n": [1, {"b": null}]}', "[1]", '{"a": ', "{'a': 1}", " ")
_ALLOWED = {
    "text": ("text", "signature"),
    "reasoning": ("text", "signature"),
    "refusal": ("text",),
    "tool_call": ("json_text", "json_text", "signature"),
}
# Strategies are built once: building them inside the draw loop dominated the run time.
_MOVES = st.sampled_from(("other", "open", "open", "append", "append", "append", "close", "close", "illegal"))
_QUIET = st.one_of(_BY_TYPE[SetUsage], _BY_TYPE[Warn], _BY_TYPE[Ignore])
_NATURAL = st.just([Finish("stop", "natural")])
_ENDINGS = st.one_of(_NATURAL, _NATURAL, st.just([]), st.lists(ACTIONS, max_size=2))


def _pick(draw: st.DrawFn, options: Sequence[object]) -> Any:
    return options[draw(st.integers(0, len(options) - 1))]


@st.composite
def action_sequences(draw: st.DrawFn) -> list[Action]:
    """Mostly legal turns (so deep states are reached: closed tool calls, natural stops after them,
    failures with open blocks) with arbitrary actions mixed in as noise; a terminal may come anywhere."""
    out: list[Action] = [Start("m")] if draw(st.integers(0, 9)) else []
    open_: dict[object, str] = {}
    docs: dict[object, str] = {}  # what is left to stream of each tool call's arguments
    for _ in range(draw(st.integers(0, 40))):
        move = draw(_MOVES)
        free = [k for k in (0, 1, "k") if k not in open_]
        keys = sorted(open_, key=str)
        if move == "open" and free:
            key, kind = _pick(draw, free), _pick(draw, BLOCK_KINDS)
            open_[key], docs[key] = kind, _pick(draw, _DOCS)
            out.append(Open(key, kind, name="fn", call_id=_pick(draw, (None, "", "c"))))
        elif move == "append" and keys:
            key = _pick(draw, keys)
            delta = _pick(draw, _ALLOWED[open_[key]])
            if delta == "json_text":
                cut = draw(st.integers(0, len(docs[key])))
                text, docs[key] = docs[key][:cut], docs[key][cut:]
            else:
                text = draw(_FRAGMENTS)
            out.append(Append(key, delta, text))
        elif move == "illegal" and draw(st.integers(0, 2)) == 0:
            # A near miss: a delta of any kind into any key, or a stop of any key (maybe closed).
            key = _pick(draw, (0, 1, "k"))
            delta = _pick(draw, ("text", "json_text", "signature"))
            out.append(_pick(draw, (Close(key), Append(key, delta, "x"))))
        elif move == "close" and keys:
            key = _pick(draw, keys)
            if open_[key] == "tool_call" and docs[key]:
                out.append(Append(key, "json_text", docs[key]))
            out.append(Close(key))
            del open_[key]
        else:
            out.append(draw(_QUIET))
        if draw(st.integers(0, 24)) == 0:
            out.append(draw(ACTIONS))  # noise: anything at all
    if draw(st.integers(0, 3)):
        out += [Close(k) for k in sorted(open_, key=str)]
    out += draw(_ENDINGS)
    return out


@settings(max_examples=600, deadline=None)
@given(actions=action_sequences())
def test_random_action_sequences_never_break_the_contract(actions: list[Action]) -> None:
    m = machine(max_tool_argument_bytes=16)
    events = drive(m, actions)
    check(events)
    for ev in events:  # every event is on-contract (strict decode checks the vocabularies)
        assert decode_event(encode_event(ev)) == ev
    term = events[-1]
    assert isinstance(term, StreamDone | StreamError)
    r = m.result()
    assert r.status == term.status
    starts = [e for e in events if isinstance(e, BlockStart)]
    assert [b.index for b in r.blocks] == [e.block.index for e in starts]
    for b in r.blocks:
        deltas = [e.delta for e in events if isinstance(e, BlockDelta) and e.block.index == b.index]
        body = "".join(d.text for d in deltas if d.kind != "signature")
        sig = "".join(d.text for d in deltas if d.kind == "signature") or None
        assert b.signature == sig
        stops = [e for e in events if isinstance(e, BlockStop) and e.block.index == b.index]
        if b.kind == "tool_call":
            assert (b.text, b.arguments_text) == (None, body)
            want = stops[0].arguments if stops and isinstance(term, StreamDone) else None
            assert b.arguments == want
        else:
            assert (b.text, b.arguments, b.arguments_text) == (body, None, None)
    if isinstance(term, StreamDone) and term.stop_reason == "stop":
        # A natural stop is upgraded when the turn made a tool call or a refusal; explicit reasons stay.
        assert not {"tool_call", "refusal"} & {b.kind for b in r.blocks}
    if isinstance(term, StreamError):
        assert r.error == term.error


def test_drive_reaches_every_terminal_kind() -> None:
    # The property above is only meaningful if random sequences reach each outcome; pin one of each.
    seqs: dict[str, list[Action]] = {
        "completed": [Start(None), Open(0, "text"), Close(0), Finish("stop", None)],
        "failed": [Start(None), Append(0, "text", "x")],
        "interrupted": [Start(None), Open(0, "text")],
    }
    for status, actions in seqs.items():
        events = drive(machine(), actions)
        check(events)
        assert msgspec.structs.asdict(events[-1])["status"] == status
