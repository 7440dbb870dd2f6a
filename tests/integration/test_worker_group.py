"""Workers of one key prefix serve the same routes: one that would take jobs for routes it lacks refuses to
start (naming the live worker that differs), instead of failing the fleet's jobs one by one."""

from __future__ import annotations

import sys

import anyio
import msgspec
import pytest

from sluice.worker.pipeline.consumer import Worker
from sluice.worker.pipeline.membership import GroupMismatch
from tests.integration.conftest import (
    API_KEY,
    KEY_ENV,
    ROOT,
    cleanup,
    client_for,
    make_config,
    running_worker,
    write_config_file,
)

pytestmark = pytest.mark.asyncio


async def test_a_worker_with_other_routes_refuses_to_join_a_live_group(
    fake, redis_url, key_prefix, redis_client, tmp_path
):
    full = make_config(redis_url, key_prefix, fake.base_url)
    fewer = msgspec.structs.replace(
        full, consumer="w-fewer", routes={k: v for k, v in full.routes.items() if k == "anthropic"}
    )
    try:
        async with running_worker(full), client_for(full) as client:
            with pytest.raises(GroupMismatch, match="serves routes anthropic, but worker w-test"):
                await Worker(fewer).run()
            # the same, through the real entry point: one line, exit 2
            cfg = write_config_file(tmp_path / "c.toml", redis_url, key_prefix, fake.base_url)
            text = cfg.read_text().split('[routes."openai-chat"]')[0]  # anthropic only
            cfg.write_text(text)
            done = await anyio.run_process(
                [sys.executable, "-m", "sluice.worker", "--config", str(cfg), "--fail-fast"],
                cwd=ROOT,
                env={"PATH": "/usr/bin:/bin", KEY_ENV: API_KEY},
                check=False,
            )
            err = done.stderr.decode()
            assert done.returncode == 2, err
            assert err.strip().splitlines()[-1].startswith("sluice worker: this worker serves routes anthropic"), err
            # the group itself goes on serving every route
            rid = await client.enqueue(
                {
                    "route": "gemini",
                    "model": "synthetic;deltas=2",
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                }
            )
            assert (await client.result(rid, timeout=30)).status == "completed"
        # a worker of the same routes joins; once the group is gone (no heartbeat), any worker may start
        async with running_worker(msgspec.structs.replace(full, consumer="w-same")):
            pass
    finally:
        await cleanup(redis_client, key_prefix)
