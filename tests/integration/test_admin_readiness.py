"""``/readyz`` of a worker process started on a fresh key prefix (issue 36, item 4): from the first answer of
its admin endpoint it says "starting" until the worker joined its group, then 200, and 200 it stays; never
"the consumer group is missing" for a group its own start created.

A real ``sluice worker`` process with ``admin_port`` set, probed over HTTP as the kubelet probes it, as fast
as it answers.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio as aioredis

from sluice.harness.embedded_redis import free_port
from sluice.schemas.keys import Keys
from tests.integration.conftest import cleanup, spawn_worker, write_config_file

pytestmark = pytest.mark.asyncio
_WAIT_S = 30.0  # bounds a failing run; every wait is on an answer
_WATCH_S = 6.0  # how long ready must stay ready: past the admin poller's period (5 s)


async def test_readyz_is_ready_as_soon_as_the_worker_joined_on_a_fresh_prefix(
    fake: Any, redis_url: str, key_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    port = free_port()
    config = write_config_file(tmp_path / "c.toml", redis_url, key_prefix, fake.base_url, admin_port=port)
    keys = Keys(key_prefix)
    assert not await redis_client.exists(keys.jobs)  # fresh: no stream, no group
    worker = spawn_worker(config, tmp_path / "w.log")
    answers: list[tuple[int, str]] = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=2) as http:
            with anyio.fail_after(_WAIT_S):
                while not answers or answers[-1][0] != 200:
                    assert worker.poll() is None, (tmp_path / "w.log").read_text()
                    try:
                        resp = await http.get("/readyz")
                    except httpx.TransportError:  # not listening yet
                        await anyio.sleep(0.01)
                        continue
                    answers.append((resp.status_code, resp.text.strip()))
            groups = await redis_client.xinfo_groups(keys.jobs)
            assert [g["name"] for g in groups] == [b"sluice-workers"]
            until = time.monotonic() + _WATCH_S
            while time.monotonic() < until:
                resp = await http.get("/readyz")
                answers.append((resp.status_code, resp.text.strip()))
                await anyio.sleep(0.05)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(15)
        await cleanup(redis_client, key_prefix)
    first_ok = next(i for i, (code, _) in enumerate(answers) if code == 200)
    starting = answers[:first_ok]
    assert all(code == 503 and text.startswith("starting:") for code, text in starting), starting
    assert all(a == (200, "ok") for a in answers[first_ok:]), [a for a in answers[first_ok:] if a[0] != 200]
    assert len(answers) - first_ok > 20  # it was watched, not merely asked once
