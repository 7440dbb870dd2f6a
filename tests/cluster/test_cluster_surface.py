"""The operator surface on a real Redis Cluster: the CLI with --redis-cluster (enqueue, status, tail, cancel,
audit, dlq) and the relay with --redis-cluster, against a worker with sharded jobs."""

from __future__ import annotations

import json
import uuid

import anyio
import httpx
import pytest

from sluice.cli.main import main
from sluice.client import SluiceClient
from sluice.relay import serve_relay
from sluice.schemas.keys import Keys
from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import connect
from tests.cluster.harness import Cluster
from tests.integration.conftest import make_config, running_worker, write_config_file
from tests.integration.test_relay import AUTH, config_for, events_url, read_sse

pytestmark = pytest.mark.asyncio

SHARDS = 3


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await anyio.to_thread.run_sync(main, list(argv))  # each command runs its own event loop
    out, err = capsys.readouterr()
    return code, out, err


async def test_cli_and_relay_with_redis_cluster(cluster: Cluster, fake, tmp_path, capsys) -> None:
    prefix = f"cs{uuid.uuid4().hex[:10]}"
    config = make_config(cluster.seed_url, prefix, fake.base_url, redis_cluster=True, job_shards=SHARDS)
    # the CLI reads the worker's file for its routes and limits; the cluster flag and URL come from the options
    path = write_config_file(tmp_path / "sluice.toml", "redis://127.0.0.1:1", prefix, fake.base_url, job_shards=SHARDS)
    redis = ["--redis-url", cluster.seed_url, "--redis-cluster", "-c", str(path)]
    rc = connect(cluster.seed_url, cluster=True)
    assert isinstance(rc, SluiceCluster)
    try:
        async with running_worker(config):
            code, out, err = await _cli(
                capsys, "enqueue", "--route", "anthropic", "--prompt", "hi", "--json", "--follow", *redis
            )
            assert code == 0, err
            rid = out.splitlines()[0]
            assert json.loads(out.splitlines()[-1])["type"] == "stream.done"
            code, out, err = await _cli(capsys, "status", rid, *redis)
            assert code == 0 and json.loads(out)["state"] == "completed", err
            code, out, err = await _cli(capsys, "audit", rid, *redis)
            assert code == 0, (out, err)
            code, out, err = await _cli(capsys, "audit", "--since", "1h", *redis)
            assert code == 0 and "1 ok" in out, (out, err)
            # a job for an unknown route is dead-lettered in its shard; dlq list finds it there
            async with SluiceClient(cluster.seed_url, key_prefix=prefix, cluster=True) as client:
                bad = await client.enqueue(
                    {"route": "nowhere", "request": {"messages": [{"role": "user", "content": "x"}]}}
                )
                assert (await client.result(bad, timeout=30)).status == "failed"
                relay_config = config_for(cluster.seed_url, prefix, redis_cluster=True)
                live = [f"{prefix}-live-{i}" for i in range(3)]
                async with serve_relay(relay_config) as relay, httpx.AsyncClient() as http:
                    got = {rid: await read_sse(http, events_url(relay.url, rid), headers=AUTH)}  # finished
                    for r in live:  # streaming while the relay follows them, a lane per slot
                        await client.enqueue(
                            {
                                "route": "gemini",
                                "model": "synthetic;deltas=30;pace_ms=20",
                                "request_id": r,
                                "request": {"messages": [{"role": "user", "content": "x"}]},
                            }
                        )

                    async def follow(r: str) -> None:
                        got[r] = await read_sse(http, events_url(relay.url, r), headers=AUTH)

                    async with anyio.create_task_group() as tg:
                        for r in live:
                            tg.start_soon(follow, r)
                for r in [rid, *live]:
                    stored = [f[b"event"] for _, f in await rc.xrange(Keys(prefix).request(r).events)]
                    assert got[r].ended and [data for _, _, data in got[r].contract] == stored, r
            code, out, err = await _cli(capsys, "dlq", "list", "--json", *redis)
            assert code == 0, err
            letters = [json.loads(line) for line in out.splitlines()]
            assert [d["request_id"] for d in letters] == [bad]
            dead = Keys(prefix, SHARDS, cluster=True).shard_for(bad).dead_letters
            assert [eid.decode() for eid, _ in await rc.xrange(dead)] == [letters[0]["id"]]
    finally:
        keys = [key async for key in rc.scan_iter(match=f"{prefix}:*", count=1000)]
        for key in keys:
            await rc.delete(key)
        await rc.aclose()


async def test_the_demo_on_the_cluster(cluster: Cluster, capsys) -> None:
    prefix = f"cd{uuid.uuid4().hex[:10]}"
    code, out, err = await _cli(
        capsys,
        "demo",
        "--redis-url",
        cluster.seed_url,
        "--redis-cluster",
        "--key-prefix",
        prefix,
        "--plain",
        "--pace-ms",
        "5",
    )
    assert code == 0, (out, err)
    assert "all as expected" in out and "--redis-cluster" in out
    rc = connect(cluster.seed_url, cluster=True)
    try:
        assert isinstance(rc, SluiceCluster)
        keys = [key async for key in rc.scan_iter(match=f"{prefix}:*", count=1000)]
        assert any(b"{shard-" in k for k in keys)  # the sharded layout's streams
        for key in keys:
            await rc.delete(key)
    finally:
        await rc.aclose()
