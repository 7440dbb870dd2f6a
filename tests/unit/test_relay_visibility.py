"""Withholding internal reasoning from clients without the grant (pure)."""

from __future__ import annotations

from sluice.relay.visibility import VisibilityFilter
from tests.unit.test_relay_coalesce import Stream


def _kept(f: VisibilityFilter, s: Stream) -> list[str]:
    return [str(e.position) for e in s.entries if f.keep(e)]


def _sample() -> Stream:
    s = Stream()
    s.open(0, "reasoning")  # internal by default
    s.delta(0, "private", "reasoning")
    s.delta(0, "sig", "reasoning", "signature")
    s.close(0, "reasoning")
    s.open(1, "text")
    s.delta(1, "hi")
    s.open(2, "reasoning", "public")
    s.delta(2, "summary", "reasoning")
    s.close(2, "reasoning")
    s.close(1)
    s.done()
    return s


def test_internal_block_is_withheld_whole_and_nothing_else() -> None:
    f = VisibilityFilter(allow_internal=False)
    assert _kept(f, _sample()) == ["1-1", "1-6", "1-7", "1-8", "1-9", "1-10", "1-11", "1-12"]
    assert f.withheld == 4


def test_the_grant_shows_everything() -> None:
    s = _sample()
    assert _kept(VisibilityFilter(allow_internal=True), s) == [str(e.position) for e in s.entries]


def test_blocks_are_per_attempt() -> None:
    f = VisibilityFilter(allow_internal=False)
    one = Stream(1)
    one.open(0, "reasoning")
    one.delta(0, "x", "reasoning")
    two = Stream(2)  # index 0 of attempt 2 is a text block: shown
    two.open(0, "text")
    two.delta(0, "y")
    assert _kept(f, one) == ["1-1"]
    assert _kept(f, two) == ["2-1", "2-2", "2-3"]


def test_a_reasoning_delta_whose_start_was_never_seen_is_withheld() -> None:
    s = Stream()
    s.open(0, "reasoning", "public")
    s.delta(0, "shown", "reasoning")
    s.open(1, "text")
    s.delta(1, "t")
    f = VisibilityFilter(allow_internal=False)
    late = [e for e in s.entries if e.position.seq in (3, 5)]  # joined after both block starts
    assert [f.keep(e) for e in late] == [False, True]
