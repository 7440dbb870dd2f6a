"""The fake provider's own capacity, as a pure object: the cap and the sliding RPM window, exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.harness.fake.limits import Limiter, ProviderLimits, Refusal


def test_the_window_refuses_the_rpm_plus_first_until_the_oldest_leaves() -> None:
    lim = Limiter(ProviderLimits(requests_per_minute=3))
    assert [lim.admit(t) for t in (100.0, 101.0, 102.5)] == [None, None, None]
    for _ in range(3):
        lim.release()
    refusal = lim.admit(112.4)
    assert refusal == Refusal(limit="rate", status=429, retry_after_s=pytest.approx(47.6), limit_value=3)
    assert (refusal.retry_after_header, refusal.retry_after_text) == ("48", "47.6")
    assert lim.admit(159.999) is not None  # the oldest (100.0) is still inside (100.0, 160.0]
    assert lim.admit(160.0) is None  # ... and leaves exactly at 100 + 60
    refusal = lim.admit(160.5)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(0.5) and refusal.retry_after_header == "1"
    assert lim.statistics() == {
        "in_flight": 1,
        "peak_in_flight": 3,
        "admitted": 4,
        "refused_concurrency": 0,
        "refused_rate": 3,
    }


def test_the_cap_counts_admitted_requests_until_released() -> None:
    lim = Limiter(ProviderLimits(max_concurrency=2, concurrency_status=529, concurrency_retry_after=2.5))
    assert lim.admit(0) is None and lim.admit(0) is None
    assert lim.admit(0) == Refusal(limit="concurrency", status=529, retry_after_s=2.5, limit_value=2)
    lim.release()
    assert lim.admit(0) is None
    assert lim.statistics() == {
        "in_flight": 2,
        "peak_in_flight": 2,
        "admitted": 3,
        "refused_concurrency": 1,
        "refused_rate": 0,
    }


def test_a_refused_request_takes_no_place_in_the_window() -> None:
    lim = Limiter(ProviderLimits(max_concurrency=1, requests_per_minute=2))
    assert lim.admit(0) is None
    assert lim.admit(1) is not None and lim.admit(2) is not None  # the cap refuses: the window keeps one
    lim.release()
    assert lim.admit(3) is None  # the second admission of the window, not the fourth request
    lim.release()
    refusal = lim.admit(4)
    assert refusal is not None and refusal.limit == "rate" and refusal.retry_after_s == 56


def test_no_limits_admit_everything_and_still_count() -> None:
    lim = Limiter(ProviderLimits())
    assert all(lim.admit(0) is None for _ in range(1000))
    assert lim.statistics()["peak_in_flight"] == 1000
    with pytest.raises(RuntimeError):
        for _ in range(1001):
            lim.release()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_concurrency": 0}, "max_concurrency=0"),
        ({"requests_per_minute": -5}, "requests_per_minute=-5"),
        ({"window_s": 0}, "window_s=0"),
        ({"concurrency_status": 500}, "concurrency_status=500"),
        ({"concurrency_retry_after": -1}, "concurrency_retry_after=-1"),
    ],
)
def test_limits_that_cannot_be_meant_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProviderLimits(**kwargs)  # type: ignore[arg-type]


# One step: advance the clock by dt seconds, then admit one request ("a") or release the oldest ("r").
_steps = st.lists(st.tuples(st.floats(0, 30, allow_nan=False), st.sampled_from("ar")), max_size=200)


@given(cap=st.integers(1, 5), rpm=st.integers(1, 8), steps=_steps)
def test_never_more_than_the_cap_open_nor_rpm_in_any_window(cap: int, rpm: int, steps: list[tuple[float, str]]) -> None:
    lim = Limiter(ProviderLimits(max_concurrency=cap, requests_per_minute=rpm))
    now, open_ = 0.0, 0
    admitted_at: list[float] = []
    for dt, op in steps:
        now += dt
        if op == "r":
            if open_:
                lim.release()
                open_ -= 1
            continue
        refusal = lim.admit(now)
        in_window = sum(1 for t in admitted_at if t > now - 60)
        if refusal is None:
            admitted_at.append(now)
            open_ += 1
        elif refusal.limit == "rate":
            # Refused only when full, and the hint is exact: the oldest admission leaves at now + wait.
            assert in_window >= rpm and refusal.retry_after_s > 0
            oldest = min(t for t in admitted_at if t > now - 60)
            assert refusal.retry_after_s == pytest.approx(oldest + 60 - now)
        else:
            assert open_ >= cap and in_window < rpm
        assert open_ <= cap and sum(1 for t in admitted_at if t > now - 60) <= rpm
        assert lim.in_flight == open_
    assert lim.admitted == len(admitted_at)
