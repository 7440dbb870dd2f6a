"""Worker processes as an operator runs them: two `python -m worker` processes share one consumer group."""

from __future__ import annotations

import signal

import anyio
import pytest

from sluice.schemas.events import BlockDelta, StreamDone
from sluice.schemas.invariants import ContractChecker
from sluice.schemas.keys import Keys
from tests.helpers import wait_all_acked
from tests.integration.conftest import (
    API_KEY,
    DIALECTS,
    cleanup,
    client_for,
    make_config,
    spawn_worker,
    write_config_file,
)

pytestmark = pytest.mark.asyncio


async def test_two_worker_processes_run_200_jobs_unmixed(fake, redis_url, key_prefix, redis_client, tmp_path) -> None:
    cfg_path = tmp_path / "sluice.toml"
    write_config_file(
        cfg_path,
        redis_url,
        key_prefix,
        fake.base_url,
        model="synthetic",
        max_in_flight=150,
        shutdown_grace=5.0,
        timeouts={"connect": 5.0, "first_byte": 20.0, "idle": 20.0, "total": 120.0},
    )
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    procs = [spawn_worker(cfg_path, log) for log in logs]
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with client_for(config) as client:
            rids = []
            for i in range(200):
                model = f"synthetic;deltas=15;pace_ms=3;seed={i}"
                rids.append(
                    await client.enqueue(
                        {
                            "route": DIALECTS[i % 4],
                            "model": model,
                            "request_id": f"job-{i}",
                            "request": {"messages": [{"role": "user", "content": f"question {i}"}]},
                        }
                    )
                )
            workers = set()
            for rid in rids:
                result = await client.result(rid, timeout=120)
                assert result.status == "completed", (rid, result)
                events = await client.read_attempt(rid, 1)
                checker = ContractChecker()
                for ev in events:
                    checker.process(ev)
                    assert ev.request_id == rid and ev.stream_id == f"{rid}:1"
                assert isinstance(events[-1], StreamDone)
                text = "".join(e.delta.text for e in events if isinstance(e, BlockDelta) and e.block.kind == "text")
                assert text == "".join(b.text or "" for b in result.blocks if b.kind == "text") != ""
                workers.add((await client.status(rid)).worker)
        assert len(workers) == 2, workers
        assert len(await redis_client.xrange(Keys(key_prefix).terminal)) == 200
        await wait_all_acked(redis_client, Keys(key_prefix).jobs, "sluice-workers")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            codes = [await anyio.to_thread.run_sync(p.wait) for p in procs]
        await cleanup(redis_client, key_prefix)
    assert codes == [0, 0]
    for log in logs:
        text = log.read_bytes()
        assert API_KEY.encode() not in text
        assert b"worker started" in text and b"worker stopped" in text
        # structured JSON lines that name the request and its attempt
        finished = [line for line in text.splitlines() if b'"msg":"request finished"' in line]
        assert finished and all(b'"request_id":"job-' in line and b'"attempt":1' in line for line in finished)
