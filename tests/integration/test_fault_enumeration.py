"""Every Redis command a request's lifecycle sends, faulted one at a time (issue 13's method).

A clean run lists the commands the worker sends for one request (the job read, the claim, each append,
the finalize, the status read, the terminal publish, the published flag, the ack). Then, for each of them,
the same request runs again with that command executed but its reply lost (the connection reset after
Redis ran it), and again with that command never reaching Redis. Heartbeats and the jobs stream's trim,
which come on a timer, are faulted the same way (the trim beside a second group that holds entries). After
each run the request must look exactly as after a clean one: one terminal status (completed), one
terminal-stream entry, one attempt and one upstream request, seq 1..n with one stream.start and one
terminal, raw references that exist, the job acked, no secret stored.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from decimal import Decimal

import anyio
import msgspec
import pytest

from sluice.client import RedisUnavailable
from sluice.normalizer.pricing import Prices
from sluice.schemas.jobs import Job, encode_job
from sluice.schemas.keys import Keys
from sluice.worker.capacity import scripts as capacity_scripts
from sluice.worker.config import Route, TenantBudget
from sluice.worker.redis import scripts
from tests.faults.invariants import assert_no_secret, check_request
from tests.faults.resp_proxy import Command, Fault, RespFaultProxy
from tests.helpers import wait_all_handled
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config, running_worker

pytestmark = pytest.mark.asyncio

_SHA = {
    hashlib.sha1(src.encode()).hexdigest().encode(): name
    for name, src in (
        ("claim", scripts.CLAIM),
        ("append", scripts.APPEND),
        ("finalize", scripts.FINALIZE),
        ("once", scripts.PUBLISH),
        ("heartbeat", scripts.HEARTBEAT),
        ("trim", scripts.TRIM_JOBS),
        ("offer", capacity_scripts.OFFER),
        ("admit", capacity_scripts.ADMIT),
        ("acquire", capacity_scripts.ACQUIRE),
        ("renew", capacity_scripts.RENEW),
        ("release", capacity_scripts.RELEASE),
        ("reserve", capacity_scripts.RESERVE),
        ("extend", capacity_scripts.EXTEND),
        ("settle", capacity_scripts.SETTLE),
    )
}


def classifier(keys: Keys):  # type: ignore[no-untyped-def]
    def classify(args: list[bytes]) -> str | None:
        if not args:
            return None
        name = args[0].upper()
        if name in (b"EVALSHA", b"EVAL"):
            script = _SHA.get(args[1]) if name == b"EVALSHA" else _SHA.get(hashlib.sha1(args[1]).hexdigest().encode())
            if script == "once":
                return "publish" if args[3] == keys.terminal.encode() else "dead_letter"
            return script
        if name == b"XACK":
            return "ack"
        if name == b"XREADGROUP":
            return "jobs_read"
        if name == b"HMGET" and args[1].endswith(b":status"):
            return "status_read"
        if name == b"HSET" and args[1].endswith(b":status") and b"published" in args[2:]:
            return "mark_published"
        return None

    return classify


def _ran(proxy: RespFaultProxy, since: int) -> list[Command]:
    """The labelled commands since ``since`` that Redis ran. An EVALSHA answered NOSCRIPT ran nothing: the
    server had not cached the script yet (the first test to use it on a fresh server, as each parallel worker's
    own one is in the Valkey pass), and the EVAL the worker sends next carries the same label."""
    return [c for c in proxy.labelled(since) if not (c.reply or b"").startswith(b"-NOSCRIPT")]


def _job(model: str, rid: str, route: str = "anthropic") -> dict[str, object]:
    return {
        "route": route,
        "model": model,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }


async def _run(client, redis, keys: Keys, group: str, model: str, rid: str, route: str = "anthropic"):  # type: ignore[no-untyped-def]
    await client.enqueue(_job(model, rid, route))
    with anyio.fail_after(30):
        result = await client.result(rid, timeout=30)
    await wait_all_handled(redis, keys.jobs, group)
    return result


@pytest.mark.parametrize(
    ("route", "outcome"),
    [("anthropic", "completed"), ("no-such-route", "failed")],
    ids=["a-stream", "a-dead-lettered-job"],
)
async def test_each_command_of_a_request_faulted_once_leaves_the_same_log(
    fake, redis_url, key_prefix, redis_client, route, outcome
):
    keys = Keys(key_prefix)
    model = "synthetic;deltas=3;pace_ms=30"
    async with RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy:
        # A short claim idle time: a lost job read is taken over by the worker itself.
        config = make_config(
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            claim_idle_ms=600,
            heartbeat_ms=60_000,
            redis_socket_timeout=3.0,
        )
        direct = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with running_worker(config), client_for(direct) as client:
                since = len(proxy.commands)
                await _run(client, redis_client, keys, config.group, model, "clean", route)
                labels = [c.label for c in _ran(proxy, since) if c.label != "jobs_read" or c.reply]
                # the read that carried the job, not the empty ones that timed out before it
                labels = [lab for lab in labels if lab is not None]
                assert {"claim", "append", "finalize", "publish", "ack"} <= set(labels), labels
                assert ("dead_letter" in labels) == (outcome == "failed"), labels
                cases: list[Fault] = []
                seen: Counter[str] = Counter()
                for lab in labels:
                    seen[lab] += 1
                    for mode in ("lose_reply", "drop_command"):
                        cases.append(Fault(lab, seen[lab], mode))  # type: ignore[arg-type]
                fired = 0
                for i, fault in enumerate(cases):
                    rid = f"f{i}-{fault.label}-{fault.mode}"
                    if fault.label == "jobs_read":
                        fault.nth = 1
                        fault.reply_matches = lambda reply, rid=rid: rid.encode() in reply  # type: ignore[misc]
                    proxy.arm(fault)
                    result = await _run(client, redis_client, keys, config.group, model, rid, route)
                    proxy.arm(None)
                    fired += fault.fired
                    where = f"{fault.mode} on {fault.label} #{fault.nth}"
                    assert result.status == outcome, (where, result.error)
                    facts = await check_request(redis_client, keys, rid)
                    assert list(facts.attempts) == [1], where  # a lost reply never costs an attempt
                    # one upstream request, or none for a job that can never run
                    assert len(fake.stats.find(request_id=rid)) == (outcome == "completed"), where
                    letters = [
                        f for _, f in await redis_client.xrange(keys.dead_letters) if f[b"request_id"] == rid.encode()
                    ]
                    assert len(letters) == (outcome == "failed"), where  # one dead letter per job at most
                # Append batching follows read timing, so a late occurrence may not exist in every run;
                # nearly all must have fired, or the enumeration tested nothing.
                assert fired >= len(cases) - 2, (fired, len(cases))
            await assert_no_secret(redis_client, key_prefix, API_KEY)
        finally:
            await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("mode", ["lose_reply", "drop_command"])
async def test_a_faulted_heartbeat_neither_loses_nor_duplicates_the_job(
    fake, redis_url, key_prefix, redis_client, mode
):
    keys = Keys(key_prefix)
    async with RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy:
        config = make_config(proxy.url_for(redis_url), key_prefix, fake.base_url, claim_idle_ms=1_000, heartbeat_ms=100)
        direct = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with running_worker(config), client_for(direct) as client:
                for nth in (1, 3):
                    rid = f"hb-{mode}-{nth}"
                    fault = Fault("heartbeat", nth, mode)  # type: ignore[arg-type]
                    proxy.arm(fault)
                    result = await _run(client, redis_client, keys, config.group, "synthetic;deltas=12;pace_ms=60", rid)
                    proxy.arm(None)
                    assert fault.fired, nth
                    assert result.status == "completed", result.error
                    facts = await check_request(redis_client, keys, rid)
                    assert list(facts.attempts) == [1]
                    assert len(fake.stats.find(request_id=rid)) == 1
        finally:
            await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("mode", ["lose_reply", "drop_command"])
async def test_a_faulted_trim_removes_only_what_every_group_settled(
    fake, redis_url, key_prefix, redis_client, mode, caplog
):
    """TRIM_JOBS on its timer, faulted: whether it ran or not, what is gone afterwards is exactly the prefix
    every group settled (a second group holds an entry pending, so it holds the rest); requests before and
    after run once each; the failure is one log line and the recovery another."""
    import logging

    keys = Keys(key_prefix)
    r = redis_client
    await r.xgroup_create(keys.jobs, "tap", id="0", mkstream=True)
    async with RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy:
        config = make_config(
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            claim_idle_ms=1_000,
            heartbeat_ms=100,
            jobs_trim_interval=0.1,
            redis_socket_timeout=3.0,
        )
        direct = make_config(redis_url, key_prefix, fake.base_url)
        caplog.set_level(logging.INFO, logger="sluice.worker")
        try:
            async with running_worker(config), client_for(direct) as client:
                rids = [f"trim-{mode}-{i}" for i in range(3)]
                for rid in rids:
                    await _run(client, r, keys, config.group, "synthetic;deltas=3", rid)
                ids = [i for i, _ in await r.xrange(keys.jobs)]
                assert len(ids) == 3  # the tap holds them all (undelivered there)
                await r.xreadgroup("tap", "c", {keys.jobs: ">"}, count=2)
                await r.xack(keys.jobs, "tap", ids[0])  # settled in both groups: only the first
                fault = Fault("trim", 1, mode)  # type: ignore[arg-type]
                proxy.arm(fault)
                with anyio.fail_after(20):
                    while not fault.fired:  # noqa: ASYNC110 - the proxy counts the trims
                        await anyio.sleep(0.02)
                proxy.arm(None)
                with anyio.fail_after(20):  # ran (reply lost) or re-sent on the next turn: the same end
                    while [i for i, _ in await r.xrange(keys.jobs)] != ids[1:]:  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                since = len(proxy.commands)
                late = f"trim-{mode}-late"
                await _run(client, r, keys, config.group, "synthetic;deltas=3", late)
                with anyio.fail_after(20):  # two trims since: ids[1] is still pending in the tap
                    while sum(c.label == "trim" for c in proxy.labelled(since)) < 2:  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                assert [i for i, _ in await r.xrange(keys.jobs)][:2] == ids[1:]
                assert await r.xlen(keys.jobs) == 3
            for rid in [*rids, late]:
                facts = await check_request(r, keys, rid)
                assert list(facts.attempts) == [1], rid
                assert len(fake.stats.find(request_id=rid)) == 1, rid
            lines = [x.getMessage() for x in caplog.records if x.getMessage().startswith("trimming the jobs stream")]
            assert len(lines) == 2 and lines[1] == "trimming the jobs stream works again", lines
        finally:
            await cleanup(r, key_prefix)


@pytest.mark.parametrize("mode", ["lose_reply", "drop_command"])
async def test_an_enqueue_retried_after_its_xadd_failed_runs_the_request_once(
    fake, redis_url, key_prefix, redis_client, mode
):
    """The producer's side: the jobs-stream XADD ran and lost its reply, or never reached Redis. The client
    raises; the producer enqueues the same request id again; the request runs exactly once."""
    keys = Keys(key_prefix)

    def classify(args: list[bytes]) -> str | None:
        return "enqueue" if args and args[0].upper() == b"XADD" and args[1] == keys.jobs.encode() else None

    config = make_config(redis_url, key_prefix, fake.base_url)
    async with RespFaultProxy.for_url(redis_url, classify) as proxy:
        producer = make_config(proxy.url_for(redis_url), key_prefix, fake.base_url)
        try:
            async with running_worker(config), client_for(producer) as client:
                rid = f"enq-{mode}"
                proxy.arm(Fault("enqueue", 1, mode))  # type: ignore[arg-type]
                with pytest.raises(RedisUnavailable):
                    await client.enqueue(_job("synthetic;deltas=3", rid))
                assert proxy.fault is not None and proxy.fault.fired
                assert await client.enqueue(_job("synthetic;deltas=3", rid)) == rid  # the producer retries
                result = await client.result(rid, timeout=30)
                await wait_all_handled(redis_client, keys.jobs, config.group)
            assert result.status == "completed"
            facts = await check_request(redis_client, keys, rid)
            assert list(facts.attempts) == [1]
            assert len(fake.stats.find(request_id=rid)) == 1
            entries = await redis_client.xrange(keys.jobs)
            # dropped: the retry added the only entry; lost reply: a duplicate entry when no worker had claimed
            # the first one yet, refused by the claim (run once either way)
            assert len(entries) in ((1, 2) if mode == "lose_reply" else (1,))
        finally:
            await cleanup(redis_client, key_prefix)


# Timer-driven commands (the admit loop's polls, heartbeats, renewals) are not one request's own.
_TIMED = {"admit", "heartbeat", "renew", "extend", "jobs_read", "trim"}


@pytest.mark.parametrize("retry", [False, True], ids=["one-attempt", "a-retry"])
async def test_each_command_of_a_limited_routes_request_faulted_once_leaks_no_permit(
    fake, redis_url, key_prefix, redis_client, retry
):
    """A route with limits adds OFFER and RELEASE to a request's commands (and ACQUIRE to a retry): each with
    its reply lost and never arriving, the request ends as after a clean run, and the route's store holds
    nothing afterwards: no permit, lease, reservation or waiting job left, every tenant count 0, and the RPM
    window holds one admission per request the provider received (none counted twice)."""
    keys = Keys(key_prefix)
    rk = keys.route("anthropic")

    def model(n: int) -> str:  # times=1: the first request of this exact scenario fails (a retry ACQUIREs)
        return f"synthetic;deltas=3;pace_ms=30;seed={n}" + (";status=500;times=1" if retry else "")

    async with RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy:
        route = Route(
            dialect="anthropic",
            base_url=fake.base_url,
            model="synthetic",
            api_key_env=KEY_ENV,
            send_request_id=True,
            max_concurrency=2,
            requests_per_minute=10_000,
        )
        config = make_config(
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            routes={"anthropic": route},
            claim_idle_ms=5_000,
            heartbeat_ms=1_000,
            redis_socket_timeout=3.0,
        )
        direct = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with running_worker(config), client_for(direct) as client:
                since = len(proxy.commands)
                await _run(client, redis_client, keys, config.group, model(0), "clean")
                labels = [c.label for c in _ran(proxy, since)]
                labels = [lab for lab in labels if lab is not None and lab not in _TIMED]
                assert {"offer", "claim", "append", "finalize", "release", "publish"} <= set(labels), labels
                assert (labels.count("acquire"), labels.count("release")) == ((1, 2) if retry else (0, 1)), labels
                # A single instance: the OFFER acks the jobs entry itself (its lost reply covers the ack too).
                assert "ack" not in labels and labels.index("offer") < labels.index("claim"), labels
                assert labels.index("finalize") < len(labels) - 1 - labels[::-1].index("release"), labels
                cases: list[Fault] = []
                seen: Counter[str] = Counter()
                for lab in labels:
                    seen[lab] += 1
                    for mode in ("lose_reply", "drop_command"):
                        cases.append(Fault(lab, seen[lab], mode))  # type: ignore[arg-type]
                fired = 0
                for i, fault in enumerate(cases):
                    rid = f"c{i}-{fault.label}-{fault.mode}"
                    proxy.arm(fault)
                    result = await _run(client, redis_client, keys, config.group, model(i + 1), rid)
                    proxy.arm(None)
                    fired += fault.fired
                    where = f"{fault.mode} on {fault.label} #{fault.nth}"
                    assert result.status == "completed", (where, result.error)
                    # The job was acked at intake: the publish and the RELEASE follow the status the client saw.
                    with anyio.fail_after(10):
                        while await redis_client.zcard(rk.permits):  # noqa: ASYNC110 - the state is in Redis
                            await anyio.sleep(0.01)
                    facts = await check_request(redis_client, keys, rid)
                    assert list(facts.attempts) == ([1, 2] if retry else [1]), where
                    assert len(fake.stats.find(request_id=rid)) == 1 + retry, where
                    assert await redis_client.zcard(rk.held) == 0, where
                    assert await redis_client.hlen(rk.lease) == 0, where
                    assert await redis_client.zcard(rk.reserved) == 0, where
                    assert await redis_client.hlen(rk.waiting) == 0, where
                    drr = await redis_client.hgetall(rk.drr)
                    assert all(int(v) == 0 for v in drr.values()), (where, drr)
                    provider = len([r for r in fake.stats.requests if r.request_id])
                    assert await redis_client.zcard(rk.rpm) == provider, where  # one admission per request sent
                assert fired >= len(cases) - 2, (fired, len(cases))
                assert fake.stats.limiter.peak_in_flight <= 2
            await assert_no_secret(redis_client, key_prefix, API_KEY)
        finally:
            await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("mode", ["lose_reply", "drop_command"])
async def test_a_read_batchs_offer_faulted_once_admits_each_job_once(fake, redis_url, key_prefix, redis_client, mode):
    """Jobs waiting when the worker starts come in one read batch, so one OFFER carries them all (4 jobs, 3 run
    slots, a route capped at 2: admitted and parked jobs in one call). With its reply lost, or the call never
    arriving, it is sent again and answers as the first time: every job completes once, with one attempt and
    one provider request, each is admitted once, and the route's store holds nothing afterwards."""
    keys = Keys(key_prefix)
    rk = keys.route("anthropic")
    rids = [f"batch-{i}" for i in range(4)]
    await redis_client.script_load(capacity_scripts.OFFER)  # the call faulted is the OFFER, not a NOSCRIPT
    async with RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy:
        route = Route(
            dialect="anthropic",
            base_url=fake.base_url,
            model="synthetic",
            api_key_env=KEY_ENV,
            send_request_id=True,
            max_concurrency=2,
            requests_per_minute=10_000,
        )
        config = make_config(
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            routes={"anthropic": route},
            max_in_flight=3,
            claim_idle_ms=5_000,
            heartbeat_ms=1_000,
            redis_socket_timeout=3.0,
        )
        direct = make_config(redis_url, key_prefix, fake.base_url)
        fault = Fault("offer", 1, mode)  # type: ignore[arg-type]
        try:
            async with client_for(direct) as client:
                for i, rid in enumerate(rids):
                    await client.enqueue(_job(f"synthetic;deltas=3;pace_ms=30;seed={i}", rid))
                proxy.arm(fault)
                async with running_worker(config):
                    with anyio.fail_after(30):
                        results = [await client.result(rid, timeout=30) for rid in rids]
                    await wait_all_handled(redis_client, keys.jobs, config.group)
                    with anyio.fail_after(10):  # the last RELEASE follows the status the client saw
                        while await redis_client.hlen(rk.lease):  # noqa: ASYNC110 - the state is in Redis
                            await anyio.sleep(0.01)
                proxy.arm(None)
            assert fault.fired and fault.fired_on is not None
            args = fault.fired_on.args
            argv = args[3 + int(args[2]) :]
            assert int(argv[4]) == len(rids), argv[:5]  # the whole read batch in the faulted call
            assert [r.status for r in results] == ["completed"] * len(rids), [r.error for r in results]
            for rid in rids:
                facts = await check_request(redis_client, keys, rid)
                assert list(facts.attempts) == [1], rid
                assert len(fake.stats.find(request_id=rid)) == 1, rid
            assert int(await redis_client.hget(rk.state, "admitted")) == len(rids)  # each admitted once
            assert await redis_client.zcard(rk.rpm) == len(rids)
            assert await redis_client.zcard(rk.permits) == 0 and await redis_client.zcard(rk.held) == 0
            assert await redis_client.hlen(rk.waiting) == 0 and await redis_client.zcard(rk.reserved) == 0
            drr = await redis_client.hgetall(rk.drr)
            assert all(int(v) == 0 for v in drr.values()), drr
            assert fake.stats.limiter.peak_in_flight <= 2
            await assert_no_secret(redis_client, key_prefix, API_KEY)
        finally:
            await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("mode", ["lose_reply", "drop_command"])
async def test_a_faulted_renew_neither_loses_the_lease_nor_counts_twice(
    fake, redis_url, key_prefix, redis_client, mode
):
    """RENEW on the heartbeat's timer, faulted: the next one renews (the lease outlives several heartbeats)."""
    keys = Keys(key_prefix)
    rk = keys.route("anthropic")
    async with RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy:
        route = Route(
            dialect="anthropic",
            base_url=fake.base_url,
            model="synthetic",
            api_key_env=KEY_ENV,
            send_request_id=True,
            max_concurrency=1,
        )
        config = make_config(
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            routes={"anthropic": route},
            claim_idle_ms=1_000,
            heartbeat_ms=100,
        )
        direct = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with running_worker(config), client_for(direct) as client:
                for nth in (1, 3):
                    rid = f"renew-{mode}-{nth}"
                    fault = Fault("renew", nth, mode)  # type: ignore[arg-type]
                    proxy.arm(fault)
                    result = await _run(client, redis_client, keys, config.group, "synthetic;deltas=24;pace_ms=60", rid)
                    proxy.arm(None)
                    assert fault.fired, nth
                    assert result.status == "completed", result.error
                    facts = await check_request(redis_client, keys, rid)
                    assert list(facts.attempts) == [1]
                    assert len(fake.stats.find(request_id=rid)) == 1
                    assert int(await redis_client.hget(rk.state, "expired") or 0) == 0
        finally:
            await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("variant", ["a-fallback", "cooling-at-admission"])
async def test_each_command_of_a_fallback_attempt_on_a_limited_route_faulted_once_leaks_no_permit(
    fake, redis_url, key_prefix, redis_client, variant
):
    """Fallbacks with capacity add ACQUIRE home=0 and RELEASE final=0 without a lease on the fallback route
    (a-fallback: the job's own route answers 529, the hop takes a permit on ``gpt``), and OFFER answering
    ``cooldown`` with the admission's ACQUIRE on the fallback (cooling-at-admission: the job's route cools, the
    job runs on ``gpt`` held by its jobs entry). Each command with its reply lost and never arriving: the
    request ends as after a clean run, both routes' stores hold nothing after, and each RPM window holds one
    admission per request its provider endpoint received."""
    keys = Keys(key_prefix)
    home, gpt = keys.route("anthropic"), keys.route("gpt")
    fallback = variant == "a-fallback"

    def model(n: int) -> str:  # times=1: the first request of this exact scenario answers 529 (the hop)
        return f"synthetic;deltas=3;pace_ms=30;seed={n}" + (";status=529;times=1" if fallback else "")

    async with RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy:
        # A 1 ms cooldown: the home route's 529 must not send the next case down the admission path.
        route = Route(
            dialect="anthropic",
            base_url=fake.base_url,
            api_key_env=KEY_ENV,
            send_request_id=True,
            max_concurrency=2,
            cooldown_min_ms=1,
            cooldown_base_ms=1,
            cooldown_max_ms=1,
            fallbacks=["gpt"],
        )
        other = Route(
            dialect="openai-chat",
            base_url=fake.base_url,
            model="synthetic;deltas=3;pace_ms=30",
            api_key_env=KEY_ENV,
            send_request_id=True,
            max_concurrency=2,
            requests_per_minute=10_000,
        )
        config = make_config(
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            routes={"anthropic": route, "gpt": other},
            claim_idle_ms=5_000,
            heartbeat_ms=1_000,
            redis_socket_timeout=3.0,
        )
        direct = make_config(redis_url, key_prefix, fake.base_url)

        def sent(dialect: str) -> int:
            return len([r for r in fake.stats.requests if r.request_id and r.dialect == dialect])

        try:
            async with running_worker(config), client_for(direct) as client:
                if not fallback:
                    secs, _ = await redis_client.time()
                    await redis_client.hset(home.state, "cooldown_until", (int(secs) + 3600) * 1000)
                since = len(proxy.commands)
                await _run(client, redis_client, keys, config.group, model(0), "clean")
                labels = [c.label for c in _ran(proxy, since)]
                labels = [lab for lab in labels if lab is not None and lab not in _TIMED]
                assert {"offer", "acquire", "claim", "append", "finalize", "release", "publish"} <= set(labels)
                assert (labels.count("acquire"), labels.count("release")) == ((1, 3) if fallback else (1, 1)), labels
                if not fallback:  # held by its entry: acked after the terminal, not at intake
                    assert labels.index("offer") < labels.index("acquire") < labels.index("claim"), labels
                    assert labels.index("finalize") < labels.index("ack"), labels
                else:  # admitted on its own route: the OFFER acked the entry (a single instance)
                    assert "ack" not in labels, labels
                cases: list[Fault] = []
                seen: Counter[str] = Counter()
                for lab in labels:
                    seen[lab] += 1
                    for mode in ("lose_reply", "drop_command"):
                        cases.append(Fault(lab, seen[lab], mode))  # type: ignore[arg-type]
                fired = 0
                for i, fault in enumerate(cases):
                    rid = f"f{i}-{fault.label}-{fault.mode}"
                    proxy.arm(fault)
                    result = await _run(client, redis_client, keys, config.group, model(i + 1), rid)
                    proxy.arm(None)
                    fired += fault.fired
                    where = f"{fault.mode} on {fault.label} #{fault.nth}"
                    assert result.status == "completed", (where, result.error)
                    with anyio.fail_after(10):
                        while await redis_client.zcard(home.permits) + await redis_client.zcard(gpt.permits):  # noqa: ASYNC110
                            await anyio.sleep(0.01)
                        while await redis_client.hlen(home.lease):  # noqa: ASYNC110 - the final RELEASE follows
                            await anyio.sleep(0.01)
                    facts = await check_request(redis_client, keys, rid)
                    assert list(facts.attempts) == ([1, 2] if fallback else [1]), where
                    dialects = [r.dialect for r in fake.stats.find(request_id=rid)]
                    assert dialects == (["anthropic", "openai-chat"] if fallback else ["openai-chat"]), where
                    status = await client.status(rid)
                    assert status.routes_tried == (["anthropic", "gpt"] if fallback else ["gpt"]), where
                    for rk in (home, gpt):
                        assert await redis_client.zcard(rk.held) == 0, where
                        assert await redis_client.zcard(rk.reserved) == 0, where
                        assert await redis_client.hlen(rk.waiting) == 0, where
                        drr = await redis_client.hgetall(rk.drr)
                        assert all(int(v) == 0 for v in drr.values()), (where, drr)
                    assert await redis_client.zcard(home.rpm) == sent("anthropic"), where
                    assert await redis_client.zcard(gpt.rpm) == sent("openai-chat"), where
                assert fired >= len(cases) - 2, (fired, len(cases))
            await assert_no_secret(redis_client, key_prefix, API_KEY)
        finally:
            await cleanup(redis_client, key_prefix)


@pytest.mark.parametrize("retry", [False, True], ids=["one-attempt", "a-retry"])
async def test_each_budget_command_faulted_once_counts_once(fake, redis_url, key_prefix, redis_client, retry):
    """A budgeted job adds RESERVE and SETTLE to each attempt (a retry reserves again): each with its reply
    lost and never arriving, the request ends as after a clean run, nothing stays reserved, and the budget's
    spend is exactly the sum of the requests' costs, each rounded up to a micro-unit (none counted twice).
    Before each run the store gets more past lines than one call removes: the run's calls remove each once."""
    keys = Keys(key_prefix)
    bk = keys.budget("acme")

    def job(n: int, rid: str) -> dict[str, object]:
        model = f"synthetic;deltas=3;pace_ms=30;seed={n}" + (";status=500;times=1" if retry else "")
        return {
            "route": "anthropic",
            "model": model,
            "request_id": rid,
            "tenant": "acme",
            "request": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
        }

    async with RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy:
        config = make_config(
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            claim_idle_ms=5_000,
            heartbeat_ms=1_000,
            redis_socket_timeout=3.0,
            prices={"anthropic": Prices(input="1", output="1")},
            budgets={"acme": TenantBudget(amount="100", currency="USD", routes=["anthropic"])},
        )
        direct = make_config(redis_url, key_prefix, fake.base_url)
        expected = 0
        old = capacity_scripts.CLEAN_BATCH + 5

        async def run(n: int, rid: str) -> None:
            nonlocal expected
            for k in range(old):  # a past day's lines of end users' budgets, due long ago and holding nothing
                line = f"budgets.acme.keys.u{k}|{n}"
                meta = json.dumps(
                    {"name": f"budgets.acme.keys.u{k}", "limit": "1", "window_end": "1", "currency": "USD"}
                )
                await redis_client.hset(bk.state, f"line:{line}", meta)
                await redis_client.hset(bk.reserved, line, 0)
                await redis_client.hset(bk.spent, line, 7)
                await redis_client.zadd(bk.lines, {line: 2})
            await client.enqueue(job(n, rid))
            with anyio.fail_after(30):
                result = await client.result(rid, timeout=30)
            await wait_all_handled(redis_client, keys.jobs, config.group)
            assert result.status == "completed", (rid, result.error)
            # Only the live line is left, and each past one was removed once (RESERVE and SETTLE, at least).
            assert await redis_client.hkeys(bk.spent) == [b"budgets.acme|0"], rid
            assert await redis_client.hkeys(bk.reserved) == [b"budgets.acme|0"], rid
            assert await redis_client.zcard(bk.lines) == 0, rid
            assert int(await redis_client.hget(bk.state, "removed")) == old * (n + 1), rid
            cost = Decimal((await client.status_record(rid))["cost"])
            expected += int((cost * 1_000_000).to_integral_value(rounding="ROUND_CEILING"))
            if retry:  # the failed first attempt reported no usage: its worst case, charged whole (1 USD/M tokens)
                expected += len(encode_job(msgspec.convert(job(n, rid), Job))) + 50

        try:
            async with running_worker(config), client_for(direct) as client:
                since = len(proxy.commands)
                await run(0, "clean")
                # (a script new to this Redis answers NOSCRIPT once, then runs: one call)
                labels = [c.label for c in proxy.labelled(since) if not (c.reply or b"").startswith(b"-NOSCRIPT")]
                labels = [lab for lab in labels if lab is not None and lab not in _TIMED]
                assert (labels.count("reserve"), labels.count("settle")) == ((2, 2) if retry else (1, 1)), labels
                assert labels.index("reserve") < labels.index("settle") < labels.index("finalize"), labels
                cases: list[Fault] = []
                seen: Counter[str] = Counter()
                for lab in labels:
                    if lab in ("reserve", "settle"):
                        seen[lab] += 1
                        for mode in ("lose_reply", "drop_command"):
                            cases.append(Fault(lab, seen[lab], mode))  # type: ignore[arg-type]
                fired = 0
                for i, fault in enumerate(cases):
                    rid = f"b{i}-{fault.label}-{fault.mode}"
                    proxy.arm(fault)
                    await run(i + 1, rid)
                    proxy.arm(None)
                    fired += fault.fired
                    where = f"{fault.mode} on {fault.label} #{fault.nth}"
                    facts = await check_request(redis_client, keys, rid)
                    assert list(facts.attempts) == ([1, 2] if retry else [1]), where
                    assert len(fake.stats.find(request_id=rid)) == 1 + retry, where
                    assert await redis_client.zcard(bk.held) == 0, where
                    assert await redis_client.hlen(bk.res) == 0, where
                    assert int(await redis_client.hget(bk.reserved, "budgets.acme|0") or 0) == 0, where
                    assert int(await redis_client.hget(bk.spent, "budgets.acme|0") or 0) == expected, where
                assert fired == len(cases), (fired, len(cases))
            await assert_no_secret(redis_client, key_prefix, API_KEY)
        finally:
            await cleanup(redis_client, key_prefix)
