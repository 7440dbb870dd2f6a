"""The tail views, fed hand-built event sequences: exact plain text, exact JSON lines, and a rich live
view rendered into a recording console (the styles are asserted through their escape codes)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from sluice.cli.tail_view import JsonView, LiveView, PlainView, RequestModel, make_view
from sluice.normalizer.actions import Action, Append, Close, Fail, Finish, Open, SetUsage, Start, Warn
from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.schemas.events import Event, Usage, encode_event

T0 = 1_700_000_000_000


def events(actions: list[Action], attempt: int = 1, step_ms: int = 100) -> list[Event]:
    m = StreamMachine(StreamInfo(f"r:{attempt}", "r", "anthropic", "anthropic", attempt, "claude-x"))
    out: list[Event] = []
    for i, a in enumerate(actions):
        out += m.process(a, ts=T0 + i * step_ms, raw=[i + 1])
    return out


TURN = [
    Start("claude-x"),
    Open("r", "reasoning"),
    Append("r", "text", "Let me "),
    Append("r", "text", "think."),
    Append("r", "signature", "sig=="),
    Close("r"),
    Open("t", "text"),
    Append("t", "text", "Привет, "),
    Append("t", "text", "мир 🙂"),
    Close("t"),
    Open("c", "tool_call", name="get_weather", call_id="toolu_1"),
    Append("c", "json_text", '{"city": '),
    Append("c", "json_text", '"Paris"}'),
    Close("c"),
    SetUsage(Usage(input_tokens=12)),
    Finish("stop", "end_turn", Usage(output_tokens=40)),
]


def _plain(evs: list[Event]) -> str:
    out = io.StringIO()
    view = PlainView(out)
    for ev in evs:
        view.feed(ev)
    view.close()
    return out.getvalue()


def test_plain_view_exact_output() -> None:
    assert _plain(events(TURN)).splitlines() == [
        "[attempt 1 · anthropic (anthropic) · model claude-x]",
        "[reasoning]",
        "Let me think.",
        "[text]",
        "Привет, мир 🙂",
        "[tool_call get_weather · toolu_1]",
        '{"city": "Paris"}',
        "[completed: tool_use · seq 15 · attempt 1 · 1.50s · tokens input 12, output 40]",
    ]


def test_plain_view_interleaved_blocks_refusal_warning_and_failure() -> None:
    evs = events(
        [
            Start(None),
            Open("a", "tool_call", name="f", call_id="c1"),
            Open("b", "tool_call", name="g", call_id="c2"),
            Append("a", "json_text", '{"x":'),
            Append("b", "json_text", "{}"),
            Append("a", "json_text", "1}"),
            Close("a"),
            Close("b"),
            Open("r", "refusal"),
            Append("r", "text", "I can't help with that."),
            Warn("odd", "something was odd"),
            Fail("overloaded", "overloaded_error", "Overloaded"),
        ]
    )
    assert _plain(evs).splitlines() == [
        "[attempt 1 · anthropic (anthropic) · model claude-x]",
        "[tool_call f · c1]",
        "[tool_call g · c2]",
        "[tool_call f · c1, continued]",
        '{"x":',
        "[tool_call g · c2, continued]",
        "{}",
        "[tool_call f · c1, continued]",
        "1}",
        "[refusal]",
        "I can't help with that.",
        "[warning odd: something was odd]",
        "[failed: overloaded (overloaded_error) · Overloaded · seq 12 · attempt 1 · 1.10s · retryable]",
    ]


def test_plain_view_follows_a_retry_into_the_next_attempt() -> None:
    first = events([Start(None), Fail("overloaded", None, "busy")])
    second = events([Start(None), Open("t", "text"), Append("t", "text", "ok"), Close("t"), Finish("stop", None)], 2)
    lines = _plain(first + second).splitlines()
    assert lines[1].startswith("[failed: overloaded · busy · seq 2 · attempt 1")
    assert lines[2:5] == ["[attempt 2 · anthropic (anthropic) · model claude-x]", "[text]", "ok"]
    assert lines[5].startswith("[completed: stop · seq 5 · attempt 2 · ")


def test_json_view_writes_the_contract_events() -> None:
    evs = events(TURN)
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8")
    view = JsonView(out)
    for ev in evs:
        view.feed(ev)
    view.close()
    assert raw.getvalue() == b"".join(encode_event(ev) + b"\n" for ev in evs)
    text = io.StringIO()  # a text stream without a byte buffer works too
    JsonView(text).feed(evs[0])
    assert text.getvalue() == encode_event(evs[0]).decode() + "\n"


def _live(evs: list[Event], *, color: bool = False) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, height=30, color_system="standard" if color else None)
    with LiveView(console, refresh_per_second=50) as view:
        for ev in evs:
            view.feed(ev)
    return out.getvalue()


def test_live_view_renders_blocks_and_the_terminal_status() -> None:
    text = _live(events(TURN))
    for part in (
        "r · attempt 1 · anthropic (anthropic) · claude-x",
        "thinking (signed)",
        "Let me think.",
        "Привет, мир 🙂",
        "⚙ get_weather  toolu_1",
        '"city": "Paris"',
        "✓ completed: tool_use · seq 15 · attempt 1 · 1.50s",
    ):
        assert part in text, part
    # finished blocks are printed in order, the terminal status last
    assert text.index("Let me think.") < text.index("Привет, мир") < text.index("get_weather") < text.index("✓")


def test_live_view_styles_reasoning_dim_and_refusals_red() -> None:
    evs = events(
        [
            Start(None),
            Open("r", "reasoning"),
            Append("r", "text", "hmm"),
            Close("r"),
            Open("x", "refusal"),
            Append("x", "text", "No."),
            Close("x"),
            Finish("refusal", "refusal"),
        ]
    )
    text = _live(evs, color=True)
    assert "\x1b[2;3mhmm" in text  # dim italic
    assert "\x1b[1;31m⛔ refusal" in text and "\x1b[31mNo." in text  # marked, in red
    assert "✓ completed: refusal" in text


def test_live_view_shows_an_unfinished_block_cut_off_by_a_failure() -> None:
    evs = events([Start(None), Open("t", "text"), Append("t", "text", "half a sent"), Fail("overloaded", None, "x")])
    text = _live(evs)
    assert "half a sent  [cut off]" in text and "✗ failed: overloaded · x" in text


def test_model_elapsed_and_open_blocks() -> None:
    m = RequestModel()
    evs = events(TURN)
    for ev in evs[:8]:
        m.apply(ev)
    assert [b.kind for b in m.open_blocks()] == ["text"] and m.elapsed() == 0.7
    for ev in evs[8:]:
        m.apply(ev)
    assert m.open_blocks() == [] and m.elapsed() == 1.5  # the request's own duration, whenever it is tailed
    assert m.blocks[(1, 2)].arguments == {"city": "Paris"}


@pytest.mark.parametrize(("mode", "cls"), [("json", JsonView), ("plain", PlainView), ("auto", PlainView)])
def test_make_view_is_plain_when_not_a_terminal(mode: str, cls: type) -> None:
    assert isinstance(make_view(mode, out=io.StringIO()), cls)


def test_make_view_is_live_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(make_view("auto", out=Tty()), LiveView)


def _checked_events(policy: str, answer: bool = False) -> list[Event]:
    from dataclasses import replace

    from sluice.normalizer.checks import Checker, ValidatorCache
    from sluice.schemas.checks import CheckSpec

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3}}, "required": ["city"]}
    spec = CheckSpec(answer=schema) if answer else CheckSpec(tools={"get_weather": schema})
    info = replace(
        StreamInfo("r:1", "r", "anthropic", "anthropic", 1, "claude-x"),
        checks=Checker.compile(spec, policy, ValidatorCache()),  # type: ignore[arg-type]
    )
    m = StreamMachine(info)
    answer_turn = [Start("claude-x"), Open("t", "text"), Append("t", "text", '{"city": "Paris"}'), Close("t")]
    actions = [*answer_turn, Finish("stop", "end_turn")] if answer else TURN[:1] + TURN[10:]
    out: list[Event] = []
    for i, a in enumerate(actions):
        if not m.terminal:  # under "fail" the invalid call ended the stream
            out += m.process(a, ts=T0 + i * 100, raw=[i + 1])
    return out


def test_the_views_show_verdicts() -> None:
    assert _plain(_checked_events("record")).splitlines()[2:] == [
        '{"city": "Paris"}',
        '[verdict: invalid (schema): /city maxLength: "Paris" is longer than 3 characters]',
        "[completed: tool_use · seq 6 · attempt 1 · 0.60s · tokens input 12, output 40 · 1 invalid call]",
    ]
    assert _plain(_checked_events("fail")).splitlines()[-1] == (
        "[failed: invalid_output · tool call get_weather (block 0): does not match its schema at /city (maxLength)"
        " · seq 6 · attempt 1 · 0.40s · 1 invalid call]"
    )
    assert _plain(_checked_events("record", answer=True)).splitlines()[-1].endswith(" · answer invalid]")
    live = _live(_checked_events("record"))
    assert 'invalid (schema): /city maxLength: "Paris" is longer than 3 characters' in live
