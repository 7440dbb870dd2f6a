"""The one fold of events into blocks: the machine's result is ``assemble`` of its own events (hash and
all), folding event by event gives what folding the whole prefix gives, a new attempt starts over, a
capped log keeps what it holds, and the CLI views show the fold's blocks."""

from __future__ import annotations

import io
from pathlib import Path

import msgspec
import pytest

from sluice.cli.tail_view import PlainView, RequestModel
from sluice.normalizer.actions import Append, Close, Fail, Finish, Open, Start
from sluice.normalizer.assemble import Assembly, assemble
from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.schemas.events import BlockDelta, BlockStart, Event, StreamStart
from sluice.schemas.result import result_hash
from tests.helpers import TRANSCRIPTS, run

CASES = sorted(TRANSCRIPTS.glob("*/*.sse"))


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.stem}"


@pytest.mark.parametrize("path", CASES, ids=_id)
def test_the_machines_result_is_the_fold_of_its_events(path: Path) -> None:
    _, events, result = run(path.parent.name, path.read_bytes())
    folded = assemble(events)
    assert folded == result and result_hash(folded) == result_hash(result)
    golden = msgspec.json.decode(path.with_suffix(".result.json").read_bytes())
    assert result_hash(folded) == result_hash(msgspec.convert(golden, type(result)))


@pytest.mark.parametrize("path", CASES, ids=_id)
def test_each_prefix_folds_to_the_deltas_it_holds(path: Path) -> None:
    _, events, _ = run(path.parent.name, path.read_bytes())
    fold = Assembly()
    for n, ev in enumerate(events, 1):
        fold.apply(ev)
        got = fold.result()
        texts: dict[int, str] = {}
        for e in events[:n]:
            if isinstance(e, BlockDelta) and e.delta.kind != "signature":
                texts[e.block.index] = texts.get(e.block.index, "") + e.delta.text
        shown = {b.index: b.arguments_text if b.kind == "tool_call" else b.text for b in got.blocks}
        assert shown == {i: texts.get(i, "") for i in shown} and set(texts) <= set(shown)
        ending = events[-1] if n == len(events) else None
        assert got.status == (getattr(ending, "status", None) or "running")


def _attempt(attempt: int, actions: list[object]) -> list[Event]:
    m = StreamMachine(StreamInfo(f"r:{attempt}", "r", "anthropic", "anthropic", attempt))
    out: list[Event] = []
    for a in actions:
        out += m.process(a, ts=attempt, raw=[])  # type: ignore[arg-type]
    return out


FIRST = [Start("m"), Open("t", "text"), Append("t", "text", "lost "), Fail("overloaded", None, "busy")]
SECOND = [Start("m"), Open("t", "text"), Append("t", "text", "kept"), Close("t"), Finish("stop", "end_turn")]


def test_a_new_attempt_starts_the_fold_over() -> None:
    first, second = _attempt(1, FIRST), _attempt(2, SECOND)
    assert assemble(first + second) == assemble(second)
    assert [b.text for b in assemble(first + second).blocks] == ["kept"]
    model = RequestModel()
    for ev in first + second:
        model.apply(ev)
    assert model.attempt == 2 and list(model.blocks) == [(2, 0)] and model.blocks[(2, 0)].text == "kept"


def test_a_capped_log_keeps_the_blocks_it_still_holds() -> None:
    events = _attempt(
        1,
        [
            Start("m"),
            Open("a", "reasoning"),
            Append("a", "text", "x"),
            Append("a", "text", "y"),
            Close("a"),
            Open("b", "text"),
            Append("b", "text", "z"),
            Close("b"),
            Finish("stop", None),
        ],
    )
    assert isinstance(events[2], BlockDelta) and isinstance(events[1], BlockStart)
    tail = events[3:]  # stream.start, the reasoning block's start and first delta trimmed away
    result = assemble(tail)
    assert [(b.index, b.kind, b.text) for b in result.blocks] == [(0, "reasoning", "y"), (1, "text", "z")]
    assert result.status == "completed" and result.dialect is None  # the dialect was in the trimmed start
    assert not any(isinstance(e, StreamStart) for e in tail)


@pytest.mark.parametrize("path", CASES, ids=_id)
def test_the_tail_view_shows_the_folded_blocks(path: Path) -> None:
    _, events, result = run(path.parent.name, path.read_bytes())
    out = io.StringIO()
    view = PlainView(out)
    for ev in events:
        view.feed(ev)
    view.close()
    shown = [(b.index, b.kind, b.text) for b in view.model.fold.blocks.values()]
    assert shown == [(b.index, b.kind, b.text if b.kind != "tool_call" else b.arguments_text) for b in result.blocks]
    assert view.model.terminal == (events[-1] if result.status != "running" else None)
