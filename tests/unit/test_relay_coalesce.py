"""The coalescing UI projection (pure: times are passed in)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.relay.coalesce import Coalescer, Frame
from sluice.relay.positions import Entry, Position
from sluice.schemas.events import (
    Block,
    BlockDelta,
    BlockStart,
    BlockStop,
    Delta,
    Event,
    OpenBlock,
    StreamDone,
    StreamStart,
    encode_event,
)


def _tag(ev: Event) -> str:
    return type(ev).__struct_config__.tag  # type: ignore[return-value]


class Stream:
    """Entries of one attempt, built step by step: ``open``, ``delta``, ``close``, ``done``."""

    def __init__(self, attempt: int = 1) -> None:
        self.attempt = attempt
        self.entries: list[Entry] = []
        self._add(StreamStart(**self._base(), provider="p", dialect="anthropic", model="m", attempt=attempt))

    def _base(self) -> dict[str, object]:
        seq = len(self.entries) + 1
        return {"stream_id": f"r:{self.attempt}", "request_id": "r", "seq": seq, "ts": seq, "raw": [seq]}

    def _add(self, ev: Event) -> Entry:
        entry = Entry(Position(self.attempt, ev.seq), _tag(ev), encode_event(ev), ev)
        self.entries.append(entry)
        return entry

    def open(self, index: int, kind: str = "text", visibility: str | None = None) -> Entry:
        if kind == "reasoning" and visibility is None:
            visibility = "internal"
        block = OpenBlock(id=f"b{index}", index=index, kind=kind, visibility=visibility)  # type: ignore[arg-type]
        return self._add(BlockStart(**self._base(), block=block))

    def delta(self, index: int, text: str, kind: str = "text", dkind: str = "text") -> Entry:
        block = Block(id=f"b{index}", index=index, kind=kind)  # type: ignore[arg-type]
        return self._add(BlockDelta(**self._base(), block=block, delta=Delta(kind=dkind, text=text)))  # type: ignore[arg-type]

    def close(self, index: int, kind: str = "text") -> Entry:
        return self._add(BlockStop(**self._base(), block=Block(id=f"b{index}", index=index, kind=kind)))  # type: ignore[arg-type]

    def done(self) -> Entry:
        return self._add(StreamDone(**self._base(), stop_reason="stop", provider_stop_reason=None, usage=None))


def brief(frame: Frame) -> str:
    doc = msgspec.json.decode(frame.data)
    out = f"{frame.position} {frame.type}"
    if frame.type == "block.delta":
        out += f" {doc['delta']['text']!r}"
    if "coalesced" in doc:
        c = doc["coalesced"]
        out += f" [{c['first_seq']}..{c['last_seq']}]"
    return out


def test_text_deltas_merge_until_the_window_closes() -> None:
    s = Stream()
    start, opened = s.entries[0], s.open(0)
    d = [s.delta(0, t) for t in ("Hel", "lo", ", ", "wor", "ld")]
    c = Coalescer(0.05)
    assert [brief(f) for f in c.push(start, 0.0)] == ["1-1 stream.start"]
    assert [brief(f) for f in c.push(opened, 0.0)] == ["1-2 block.start"]
    assert c.push(d[0], 0.00) == [] and c.deadline() == 0.05
    assert c.push(d[1], 0.01) == []
    assert c.push(d[2], 0.04) == []
    assert c.due(0.049) == []
    assert [brief(f) for f in c.due(0.05)] == ["1-5 block.delta 'Hello, ' [3..5]"]
    assert c.deadline() is None
    # a new run starts its own window; a run of one passes unchanged, byte for byte
    assert c.push(d[3], 0.06) == []
    assert c.due(0.11) == [Frame(Position(1, 6), "block.delta", d[3].data)]
    assert c.push(d[4], 0.2) == [] and c.flush() == [Frame(Position(1, 7), "block.delta", d[4].data)]


def test_the_merged_event_is_the_last_delta_with_joined_text_and_raw_refs() -> None:
    s = Stream()
    s.open(0)
    a, b = s.delta(0, "ab"), s.delta(0, "cd")
    c = Coalescer(1.0)
    c.push(a, 0)
    c.push(b, 0)
    (frame,) = c.flush()
    assert frame.position == Position(1, 4) and frame.merged == 2
    assert msgspec.json.decode(frame.data) == {
        "type": "block.delta",
        "stream_id": "r:1",
        "request_id": "r",
        "seq": 4,
        "ts": 4,
        "raw": [3, 4],
        "block": {"id": "b0", "index": 0, "kind": "text"},
        "delta": {"kind": "text", "text": "abcd"},
        "coalesced": {"first_seq": 3, "last_seq": 4, "count": 2},
    }


def test_everything_else_flushes_the_run_and_is_never_delayed() -> None:
    s = Stream()
    s.open(0)
    x, y = s.delta(0, "x"), s.delta(0, "y")
    stop, tool_open = s.close(0), s.open(1, "tool_call")
    args = [s.delta(1, t, "tool_call", "json_text") for t in ('{"a"', ":1}")]
    tool_stop, done = s.close(1, "tool_call"), s.done()
    c = Coalescer(10.0)
    c.push(x, 0)
    c.push(y, 0)
    # the block.stop goes out at once, right after the run it ends
    assert [brief(f) for f in c.push(stop, 0.001)] == ["1-4 block.delta 'xy' [3..4]", "1-5 block.stop"]
    for e in (tool_open, *args, tool_stop, done):  # tool-call argument deltas pass one to one
        assert c.push(e, 0.002) == [Frame(e.position, e.type, e.data)]
    assert c.deadline() is None and c.merged_frames == 1


def test_only_adjacent_deltas_of_the_same_block_merge() -> None:
    s = Stream()
    s.open(0)
    s.open(1, "reasoning", "public")
    a0, r1, a0b = s.delta(0, "a"), s.delta(1, "r", "reasoning"), s.delta(0, "b")
    sig = s.delta(1, "sig", "reasoning", "signature")
    c = Coalescer(10.0)
    assert c.push(a0, 0) == []
    assert [brief(f) for f in c.push(r1, 0)] == ["1-4 block.delta 'a'"]  # another block: the run ends
    assert [brief(f) for f in c.push(a0b, 0)] == ["1-5 block.delta 'r'"]
    assert [brief(f) for f in c.push(sig, 0)] == ["1-6 block.delta 'b'", "1-7 block.delta 'sig'"]
    # a gap in seq (an event withheld in between) also ends the run
    t = Stream()
    t.open(0)
    first, _, third = t.delta(0, "1"), t.delta(0, "2"), t.delta(0, "3")
    c = Coalescer(10.0)
    c.push(first, 0)
    assert [brief(f) for f in c.push(third, 0)] == ["1-3 block.delta '1'"]
    # and so does a new attempt (seqs restart)
    u = Stream(2)
    u.open(0)
    assert [brief(f) for f in c.push(u.delta(0, "n"), 0)] == ["1-5 block.delta '3'"]


def test_size_cap_and_zero_window() -> None:
    s = Stream()
    s.open(0)
    c = Coalescer(10.0, max_chars=5)
    assert c.push(s.delta(0, "abc"), 0) == []
    assert [brief(f) for f in c.push(s.delta(0, "de"), 0)] == ["1-4 block.delta 'abcde' [3..4]"]
    c = Coalescer(0.0)
    e = s.delta(0, "f")
    assert c.push(e, 0) == [Frame(e.position, e.type, e.data)]


@st.composite
def _streams(draw: st.DrawFn) -> tuple[list[Entry], list[float]]:
    s = Stream(draw(st.integers(1, 3)))
    kinds = ["text", "reasoning", "refusal", "tool_call"]
    for index in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(kinds))
        s.open(index, kind, "public" if kind == "reasoning" else None)
        for text in draw(st.lists(st.text(min_size=1, max_size=4), max_size=12)):
            dkind = "json_text" if kind == "tool_call" else draw(st.sampled_from(["text", "text", "signature"]))
            s.delta(index, text, kind, dkind)
        s.close(index, kind)
    s.done()
    gaps = draw(st.lists(st.floats(0, 0.03), min_size=len(s.entries), max_size=len(s.entries)))
    return s.entries, gaps


@settings(max_examples=200, deadline=None)
@given(_streams(), st.floats(0.001, 0.05))
def test_output_reexpands_exactly_and_only_text_deltas_wait(
    stream: tuple[list[Entry], list[float]], window: float
) -> None:
    entries, gaps = stream
    c = Coalescer(window)
    frames: list[Frame] = []
    now = 0.0
    for entry, gap in zip(entries, gaps, strict=True):
        now += gap
        frames += c.due(now)
        out = c.push(entry, now)
        ev = entry.event
        if not (isinstance(ev, BlockDelta) and ev.delta.kind == "text" and ev.block.kind != "tool_call"):
            assert out[-1] == Frame(entry.position, entry.type, entry.data)  # sent on arrival
        frames += out
    frames += c.flush()
    by_pos = {e.position: e for e in entries}
    covered: list[Position] = []
    for f in frames:
        doc = msgspec.json.decode(f.data)
        if "coalesced" in doc:
            span = [Position(f.position.attempt, s) for s in range(doc["coalesced"]["first_seq"], f.position.seq + 1)]
            assert doc["delta"]["text"] == "".join(by_pos[p].event.delta.text for p in span)  # type: ignore[union-attr]
            covered += span
        else:
            assert f.data == by_pos[f.position].data
            covered.append(f.position)
    assert covered == [e.position for e in entries]
