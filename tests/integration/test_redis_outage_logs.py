"""A running worker whose Redis goes away and comes back empty (issue 20, item 10): its loops back off as
start-up does and log one line per change of state, with the server's own message (NOGROUP), not a line
every half second. Against a redis-server this test starts, stops and starts again itself."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import anyio
import pytest

from sluice.harness.embedded_redis import embedded_redis, free_port
from tests.integration.conftest import make_config, running_worker

pytestmark = pytest.mark.asyncio
_OUTAGE = 4.0  # how long Redis stays away: the scenario's length (every step after it waits on state)


def _lines(records: list[logging.LogRecord], start: str) -> list[str]:
    return [r.getMessage() for r in records if r.name == "sluice.worker" and r.getMessage().startswith(start)]


async def _until(predicate: Callable[[], object]) -> None:
    with anyio.fail_after(30):
        while not predicate():  # noqa: ASYNC110 - the state is in the captured log records
            await anyio.sleep(0.05)


@pytest.mark.server  # starts its own server
async def test_a_redis_outage_is_logged_once_per_state_change_with_the_servers_message(
    caplog: pytest.LogCaptureFixture, key_prefix: str
) -> None:
    port = free_port()
    caplog.set_level(logging.INFO, logger="sluice.worker")
    with embedded_redis(port=port) as server:
        config = make_config(server.url, key_prefix, "http://127.0.0.1:9", redis_socket_timeout=2.0)
        async with running_worker(config):
            os.kill(server.pid, signal.SIGTERM)  # this test's own server (the embedded one exits with the block)
            await _until(lambda: _lines(caplog.records, "reading jobs failed"))
            await _until(lambda: _lines(caplog.records, "reading cancels failed"))
            began = time.monotonic()
            await anyio.sleep(_OUTAGE)
            during = [r for r in caplog.records if r.name == "sluice.worker" and r.levelno >= logging.WARNING]
            with embedded_redis(port=port):  # back, empty, where the worker waits
                await _until(lambda: _lines(caplog.records, "reading jobs works again"))
                await _until(lambda: _lines(caplog.records, "reading cancels works again"))
                seen = list(caplog.records)  # before this server stops too, under the running worker
    assert time.monotonic() - began >= _OUTAGE
    # One line for the read loop going down (not one per half second), one for the control reader.
    assert len(_lines(seen, "reading jobs failed (ConnectionError")) == 1
    assert len(_lines(seen, "reading cancels failed (ConnectionError")) == 1
    assert len(during) <= 4, [r.getMessage() for r in during]
    # Back with an empty Redis: the jobs stream and its group are gone, said with Redis's own words.
    nogroup = _lines(seen, "reading jobs failed (ResponseError: NOGROUP")
    assert len(nogroup) == 1 and "consumer group" in nogroup[0]
    assert len(_lines(seen, "reading jobs works again")) == 1
