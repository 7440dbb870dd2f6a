"""With ``durability = "replica"`` an OFFER is followed by a WAIT on its own connection before the worker
acks the jobs entry: the route's store holds the parked job on the replicas first (on a Cluster the route's
slot and the shard's may be on two masters, so the append-prefix argument of one instance no longer covers
it). Against a private primary and replica: the WAIT is sent only with that setting (the primary's own
command counts), and a replica that does not answer (SIGSTOP) makes the offer say so, once its wait ends,
while the job is still offered."""

from __future__ import annotations

import logging
import os
import signal

import anyio
import pytest
import redis.asyncio as aioredis

from sluice.harness.embedded_redis import embedded_redis
from sluice.schemas.keys import Keys, WaitRecord
from sluice.worker.capacity.admission import Admission
from sluice.worker.config import Config, Route
from sluice.worker.redis.route import SlotRouter

pytestmark = pytest.mark.asyncio


def _rec(at: int) -> WaitRecord:
    return WaitRecord(
        tenant="", priority="interactive", shard=0, job_entry=f"{at}-0", queued_at=at, est_tokens=1, job="{}"
    )


async def _waits(r: aioredis.Redis) -> int:
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


@pytest.mark.server  # starts its own server
async def test_an_offer_waits_for_the_replica_only_with_durability_replica(key_prefix, caplog) -> None:  # type: ignore[no-untyped-def]
    with embedded_redis() as primary, embedded_redis(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]) as rep:
        r = aioredis.Redis.from_url(primary.url)
        router = SlotRouter.for_client(r, socket_timeout=5, connect_timeout=5)
        try:
            with anyio.fail_after(30):
                while (await r.info("replication")).get("slave0", {}).get("state") != "online":  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            route = Route(dialect="anthropic", base_url="http://h", max_concurrency=1)
            plain = Config(redis_url=primary.url, key_prefix=key_prefix, routes={"r": route})
            durable = Config(
                redis_url=primary.url,
                key_prefix=key_prefix,
                routes={"r": route},
                durability="replica",
                durability_timeout_ms=300,
            )
            first = Admission(plain, Keys(key_prefix), router, "w1")
            await first.publish_limits(set())  # the limits the scripts enforce live in the route's state
            before = await _waits(r)
            got = await first.offer("r", "a", "ta", _rec(1), start_now=True)
            assert got.outcome == "admitted" and await _waits(r) == before  # no WAIT without the setting
            adm = Admission(durable, Keys(key_prefix), router, "w2")
            with caplog.at_level(logging.WARNING, logger="sluice.worker"):
                got = await adm.offer("r", "b", "tb", _rec(2), start_now=True)
                assert got.outcome == "parked" and await _waits(r) == before + 1
                assert not [m for m in caplog.messages if "fewer replicas" in m]  # the replica acknowledged
                os.kill(rep.pid, signal.SIGSTOP)
                try:
                    got = await adm.offer("r", "c", "tc", _rec(3), start_now=True)
                finally:
                    os.kill(rep.pid, signal.SIGCONT)
            assert got.outcome == "parked" and await _waits(r) == before + 2
            assert [m for m in caplog.messages if "fewer replicas" in m] == [
                "an offered job reached fewer replicas than asked within the wait"
            ]
            waiting = await r.hkeys(Keys(key_prefix).route("r").waiting)
            assert sorted(waiting) == [b"b", b"c"]  # offered all the same
        finally:
            router.close()
            await r.aclose()
