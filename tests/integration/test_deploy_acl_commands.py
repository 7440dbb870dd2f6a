"""Every documented command as the ACL user the docs name for it, against a real redis-server with
ops/deploy/users.acl loaded (never the shared Redis: a private server of this module's own).

The table this pins is in the operations docs (``USERS`` below is the same table): each command exits
as it should and ACL LOG stays empty, so no command of any of them was refused; the terminal-feed
consumer is refused what it must not do; the consumer guide's redis-cli recipes run as that consumer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from sluice.client import SluiceClient
from sluice.harness.embedded_redis import EmbeddedRedis
from sluice.schemas.keys import Keys
from sluice.worker.redis.connect import QUIET
from tests.integration.conftest import API_KEY, KEY_ENV, make_config, running_worker
from tests.integration.test_consumer_guide import guide_recipe
from tests.integration.test_deploy_acl import PASSWORDS, PREFIX, _url, acl_redis

pytestmark = pytest.mark.asyncio
__all__ = ["acl_redis"]

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = "sluice-consumer"
ACL_PASSWORDS = {**PASSWORDS, CONSUMER: "consumer-dev-password"}
# command -> the user the operations docs name for it
USERS = {
    "enqueue": "sluice-producer",
    "cancel": "sluice-producer",
    "dlq list": "sluice-producer",
    "tail": "sluice-reader",
    "status": "sluice-reader",
    "audit": CONSUMER,
    "terminal feed": CONSUMER,
    "dlq requeue": "sluice-admin",
    "dlq delete": "sluice-admin",
    "dlq purge": "sluice-admin",
    "worker": "sluice-worker",
}


def _as(server: EmbeddedRedis, user: str) -> str:
    return f"redis://{user}:{ACL_PASSWORDS[user]}@127.0.0.1:{server.port}/0"


async def _cli(server: EmbeddedRedis, command: str, *args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    """``sluice <command> ...`` as a user runs it (a process), as the user named for the command."""
    env = {**os.environ, "REDIS_URL": _as(server, USERS[command]), "SLUICE_KEY_PREFIX": PREFIX}
    env.pop("SLUICE_CONFIG", None)
    done = await anyio.run_process(
        [sys.executable, "-m", "sluice.cli.main", *command.split(), *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        check=False,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def _job(request_id: str, model: str = "synthetic;deltas=6;tools=1;pace_ms=5") -> bytes:
    return json.dumps(
        {
            "route": "anthropic",
            "model": model,
            "request_id": request_id,
            "request": {"messages": [{"role": "user", "content": "hi"}]},
        }
    ).encode()


def _refused(server: EmbeddedRedis) -> list[Any]:
    r = redis.Redis.from_url(_url(server, "sluice-admin"))
    try:
        return list(r.acl_log())
    finally:
        r.close()


async def test_every_documented_command_runs_as_its_user(acl_redis: EmbeddedRedis, fake, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    admin = aioredis.Redis.from_url(_url(acl_redis, "sluice-admin"))
    await admin.flushall()
    await admin.acl_log_reset()
    keys = Keys(PREFIX)
    config = make_config(_as(acl_redis, "sluice-worker"), PREFIX, fake.base_url)
    consumer = SluiceClient(_as(acl_redis, CONSUMER), key_prefix=PREFIX)
    try:
        async with running_worker(config):
            code, out, err = await _cli(acl_redis, "enqueue", "-", "--follow", stdin=_job("acl-one"))
            assert code == 0, err
            code, out, err = await _cli(acl_redis, "enqueue", "-", stdin=_job("acl-one"))  # the same id: runs once
            assert (code, out.strip()) == (0, "acl-one"), err
            code, out, err = await _cli(acl_redis, "status", "acl-one")
            assert code == 0 and json.loads(out)["state"] == "completed", err
            code, out, err = await _cli(acl_redis, "tail", "acl-one", "--json")
            assert code == 0 and json.loads(out.splitlines()[-1])["type"] == "stream.done", err
            code, out, err = await _cli(acl_redis, "tail", "acl-one", "--raw")
            assert code == 0 and out.strip(), err
            slow = "acl-slow"
            code, out, err = await _cli(acl_redis, "enqueue", "-", stdin=_job(slow, "synthetic;deltas=2000;pace_ms=20"))
            assert code == 0, err
            with anyio.fail_after(20):
                while (await admin.hget(keys.request(slow).status, "state")) != b"running":  # noqa: ASYNC110 - Redis state
                    await anyio.sleep(0.05)
            code, out, err = await _cli(acl_redis, "cancel", slow, "--wait")
            assert code == 4, err  # the exit table: a cancel that took effect ends the request interrupted
            assert (await admin.hget(keys.request(slow).status, "state")) == b"interrupted"
            code, out, err = await _cli(acl_redis, "audit", "acl-one")
            assert code == 0, out + err
            code, out, err = await _cli(acl_redis, "audit", "--since", "10m")
            assert code == 0, out + err
            # the terminal feed, as a billing service consumes it
            async with consumer.terminals("notifications", "n-1") as feed:
                seen = {}
                with anyio.fail_after(20):
                    async for t in feed:
                        seen[t.request_id] = t.status
                        await feed.ack(t)
                        if len(seen) == 2:
                            break
            assert seen == {"acl-one": "completed", slow: "interrupted"}
            # a job no worker can decode is dead-lettered; listed by the producer, handled by the admin
            await admin.xadd(keys.jobs, {"job": b"not json"})
            await admin.xadd(keys.jobs, {"job": b"not json either"})
            with anyio.fail_after(20):
                while await admin.xlen(keys.dead_letters) < 2:  # noqa: ASYNC110 - Redis state
                    await anyio.sleep(0.05)
        code, out, err = await _cli(acl_redis, "dlq list", "--json")
        assert code == 0, err
        ids = [json.loads(line)["id"] for line in out.splitlines()]
        assert len(ids) == 2
        code, out, err = await _cli(acl_redis, "dlq list")
        assert code == 0 and all(i in out for i in ids), err
        code, out, err = await _cli(acl_redis, "dlq requeue", ids[0], "--force")
        assert code == 0, err
        code, out, err = await _cli(acl_redis, "dlq delete", ids[1])
        assert code == 0, err
        await admin.xadd(keys.dead_letters, {"reason": "x", "job": b"{}"})
        code, out, err = await _cli(acl_redis, "dlq purge", "--yes")
        assert code == 0, err
        assert await admin.xlen(keys.dead_letters) == 0
        if shutil.which("redis-cli") is not None:  # the consumer guide's recipes, as the consumer user
            env = {**os.environ, "REDIS_URL": _as(acl_redis, CONSUMER), "PREFIX": PREFIX, "RID": "acl-one"}
            done = await anyio.run_process(["bash", "-c", guide_recipe("redis-cli-terminal-feed")], env=env)
            assert done.stdout.decode().split() == [i.decode() for i, _ in await admin.xrange(keys.terminal)]
            done = await anyio.run_process(["bash", "-c", guide_recipe("redis-cli-request-group")], env=env)
            events = await admin.xrange(keys.request("acl-one").events)
            assert done.stdout.decode().split() == [i.decode() for i, _ in events]
        assert _refused(acl_redis) == []
    finally:
        await consumer.aclose()
        await admin.aclose()


async def test_the_terminal_feed_consumer_is_refused_what_it_must_not_do(acl_redis: EmbeddedRedis) -> None:
    keys = Keys(PREFIX)
    rk = keys.request("acl-confined")
    r = aioredis.Redis.from_url(_as(acl_redis, CONSUMER), **QUIET)
    try:
        for method, args in [
            ("xadd", (keys.terminal, {"request_id": "forged"})),  # no forged terminal entries
            ("xadd", (rk.events, {"type": "x"})),  # no forged events
            ("hset", (rk.status, "state", "completed")),  # no status edits
            ("xadd", (keys.jobs, {"job": "{}"})),  # no enqueueing
            ("xreadgroup", ("sluice-workers", "c", {keys.jobs: ">"})),  # no taking jobs
            ("xgroup_create", (rk.status, "g")),  # groups only on the streams it consumes
            ("delete", (keys.terminal,)),
            ("get", ("other:key",)),
        ]:
            with pytest.raises(NoPermissionError):
                await getattr(r, method)(*args)
    finally:
        await r.aclose()
