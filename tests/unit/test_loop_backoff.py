"""A background loop's back-off (``sluice.worker.redis.retry.LoopBackoff``): the delays of start-up, and one
log line per change of state with the failure's own message."""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import ResponseError

from sluice.worker.redis.retry import BACKOFF_FIRST, BACKOFF_MAX, LoopBackoff


def test_the_back_off_doubles_to_the_start_up_cap_and_logs_each_change_of_state_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("sluice.worker")
    b = LoopBackoff(log, "reading jobs", stream="s")
    with caplog.at_level(logging.INFO, logger="sluice.worker"):
        down = [b.failed(ConnectionError(f"refused {i}")) for i in range(9)]
        assert down == [min(BACKOFF_FIRST * 2**i, BACKOFF_MAX) for i in range(9)]
        nogroup = ResponseError("NOGROUP No such key 's' or consumer group 'g' in XREADGROUP with GROUP option")
        assert b.failed(nogroup) == BACKOFF_FIRST  # Redis answers again: the next try comes soon
        b.ok()
        b.ok()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "reading jobs failed (ConnectionError: refused 0); retrying with back-off",
        f"reading jobs failed (ResponseError: {nogroup}); retrying with back-off",
        "reading jobs works again",
    ]
    assert not b.failing and b.delay == BACKOFF_FIRST
