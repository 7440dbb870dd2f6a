"""Resume positions and SSE/WebSocket framing of the relay (pure)."""

from __future__ import annotations

import msgspec
import pytest

from sluice.relay.app import sse_frame, ws_message
from sluice.relay.coalesce import Frame
from sluice.relay.positions import START, Position, PositionError, parse_position


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, START),
        ("", START),
        ("  ", START),
        ("0", START),
        ("0-0", START),
        ("7", Position(1, 7)),
        ("1-7", Position(1, 7)),
        ("2-0", Position(2, 0)),
        (" 3-12 ", Position(3, 12)),
    ],
)
def test_parse_position(text: str | None, expected: Position) -> None:
    assert parse_position(text) == expected


@pytest.mark.parametrize("text", ["x", "1-", "-1", "1-2-3", "1.5", "a-1", "1-b", "1 - 2", "99999999999999999999-1"])
def test_bad_positions_are_rejected(text: str) -> None:
    with pytest.raises(PositionError):
        parse_position(text)


def test_positions_order_across_attempts() -> None:
    ordered = [START, Position(1, 1), Position(1, 2), Position(1, 10), Position(2, 1), Position(10, 1)]
    assert sorted(reversed(ordered)) == ordered
    assert [str(p) for p in ordered] == ["0-0", "1-1", "1-2", "1-10", "2-1", "10-1"]
    assert Position.from_entry_id(b"3-14") == Position(3, 14) == Position.from_entry_id("3-14")


def test_sse_frame_layout() -> None:
    data = '{"type":"block.delta","text":"a\u2028b"}'.encode()
    assert sse_frame(Frame(Position(2, 5), "block.delta", data)) == (
        b"id: 2-5\nevent: block.delta\ndata: " + data + b"\n\n"
    )
    # a raw line break (never written by the worker) cannot end the event early: it splits data lines
    assert sse_frame(Frame(Position(1, 1), "x", b'{"a":\r\n1,\r"b":\n2}')) == (
        b'id: 1-1\nevent: x\ndata: {"a":\ndata: 1,\ndata: "b":\ndata: 2}\n\n'
    )


def test_ws_message_layout() -> None:
    msg = ws_message(Frame(Position(1, 3), "stream.done", b'{"type":"stream.done","seq":3}'))
    assert msgspec.json.decode(msg) == {"id": "1-3", "event": "stream.done", "data": {"type": "stream.done", "seq": 3}}
