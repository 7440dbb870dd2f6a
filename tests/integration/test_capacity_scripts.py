"""The capacity scripts against a real Redis: the Lua makes the pure model's choices (tests.oracles.discipline)
on random inputs, each script is idempotent for its caller (sent twice = once), and the windows, the cooldown
and the expiry of a dead worker's lease behave as docs/design-capacity.md B.3-B.6 say."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.schemas.keys import Keys, WaitRecord
from sluice.worker.capacity.admission import Admission, LimitsMismatch, OfferJob
from sluice.worker.config import Config, Route, Tenant
from sluice.worker.redis.route import SlotRouter
from tests.oracles.discipline import Discipline, TenantShare

T0 = 1_800_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def _config(prefix: str, url: str, tenants: dict[str, Tenant] | None = None, **limits: int) -> Config:
    route = Route(dialect="anthropic", base_url="http://h", **limits)  # type: ignore[arg-type]
    return Config(redis_url=url, key_prefix=prefix, routes={"r": route}, tenants=tenants or {})


@pytest_asyncio.fixture
async def router(redis_url: str) -> AsyncIterator[SlotRouter]:
    r = aioredis.Redis.from_url(redis_url)
    router = SlotRouter.for_client(r, socket_timeout=5, connect_timeout=5)
    yield router
    router.close()
    await r.aclose()


async def _admission(router: SlotRouter, config: Config, clock: Clock, consumer: str = "w1") -> Admission:
    adm = Admission(config, Keys(config.key_prefix), router, consumer, clock=clock)
    await adm.publish_limits(set())
    return adm


def _rec(tenant: str, prio: str, at: int, est: int = 10) -> WaitRecord:
    return WaitRecord(
        tenant=tenant, priority=prio, shard=0, job_entry=f"{at}-0", queued_at=at, est_tokens=est, job="{}"
    )  # type: ignore[arg-type]


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), st.sampled_from(["a", "b", "c", ""]), st.sampled_from(["interactive", "batch"])),
        st.tuples(st.just("admit"), st.integers(1, 4), st.just("")),
        st.tuples(st.just("release"), st.integers(0, 50), st.just("")),
    ),
    max_size=60,
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=_ops, cap=st.integers(1, 4), wa=st.integers(1, 3), capb=st.integers(0, 2))
def test_the_lua_makes_the_models_choices(
    redis_url: str, ops: list[tuple[str, object, str]], cap: int, wa: int, capb: int
) -> None:
    asyncio.run(_compare(redis_url, ops, cap, wa, capb))


async def _compare(redis_url: str, ops: list[tuple[str, object, str]], cap: int, wa: int, capb: int) -> None:
    client = aioredis.Redis.from_url(redis_url)
    router = SlotRouter.for_client(client, socket_timeout=5, connect_timeout=5)
    try:
        await _compare_on(router, redis_url, ops, cap, wa, capb)
    finally:
        router.close()
        await client.aclose()


async def _compare_on(
    router: SlotRouter, redis_url: str, ops: list[tuple[str, object, str]], cap: int, wa: int, capb: int
) -> None:
    prefix = f"sluicetest:{uuid.uuid4().hex[:12]}"
    tenants = {"a": Tenant(weight=wa), "b": Tenant(weight=1, max_concurrency=capb or None)}
    clock = Clock()
    adm = await _admission(router, _config(prefix, redis_url, tenants, max_concurrency=cap), clock)
    model = Discipline(
        max_concurrency=cap,
        tenants={"a": TenantShare(wa), "b": TenantShare(1, capb)},
    )
    held: list[tuple[str, str]] = []  # (rid, lease token), in admission order
    for i, (op, arg, prio) in enumerate(ops):
        clock.now += 1
        if op == "offer":
            rid = f"r{i:03d}"
            got = await adm.offer("r", rid, f"tok{i}", _rec(str(arg), prio, clock.now), start_now=True)
            want = model.offer(rid, str(arg), prio, clock.now)  # type: ignore[arg-type]
            assert got.outcome == want, (i, op)
            if want == "admitted":
                held.append((rid, got.token))
        elif op == "admit":
            adm_ = await adm.admit("r", int(arg))  # type: ignore[call-overload]
            assert [j.request_id for j in adm_.jobs] == model.admit(int(arg)), (i, op)  # type: ignore[call-overload]
            held += [(j.request_id, j.token) for j in adm_.jobs]
        elif held:
            rid, tok = held.pop(int(arg) % len(held))  # type: ignore[call-overload]
            rel = await adm.release("r", rid, tok, tok, final=True, outcome="ok")
            assert not rel.fenced
            model.release(rid)
    # Everything still waiting drains in the model's order once nothing is held.
    for rid, tok in held:
        await adm.release("r", rid, tok, tok, final=True, outcome="ok")
        model.release(rid)
    while True:
        jobs = (await adm.admit("r", 1)).jobs
        want = model.admit(1)
        assert [j.request_id for j in jobs] == want
        if not jobs:
            break
        await adm.release("r", jobs[0].request_id, jobs[0].token, jobs[0].token, final=True, outcome="ok")
        model.release(jobs[0].request_id)
    rk = Keys(prefix).route("r")
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await r.zcard(rk.permits) == 0 and await r.hlen(rk.lease) == 0 and await r.hlen(rk.waiting) == 0
        drr = {k.decode(): int(v) for k, v in (await r.hgetall(rk.drr)).items()}
        assert all(v == 0 for v in drr.values()), drr
    finally:
        await r.aclose()


@pytest.mark.asyncio
async def test_an_offer_without_a_free_run_slot_parks_the_job_for_a_worker_that_has_one(
    router: SlotRouter, redis_url: str, key_prefix: str
) -> None:
    """The route has room, but the offering worker has no free run slot: the job is parked (``worker``), not
    admitted to a worker that would hold it idle; another worker's ADMIT, or a RELEASE's handoff, starts it."""
    clock = Clock()
    config = _config(key_prefix, redis_url, max_concurrency=10)
    full = await _admission(router, config, clock, consumer="small")
    roomy = await _admission(router, config, clock, consumer="big")
    rk = Keys(key_prefix).route("r")
    r = aioredis.Redis.from_url(redis_url)
    try:
        got = await full.offer("r", "a", "ta", _rec("", "interactive", 1), start_now=False)
        assert (got.outcome, got.waiting_on, got.retry_at) == ("parked", "worker", clock.now + 250)
        assert await r.hlen(rk.lease) == 0 and await r.zcard(rk.permits) == 0 and await r.hlen(rk.waiting) == 1
        # Sent again (a lost reply): still parked, once.
        again = await full.offer("r", "a", "ta", _rec("", "interactive", 1), start_now=False)
        assert (again.outcome, await r.hlen(rk.waiting), int(await r.hget(rk.state, "parked"))) == ("parked", 1, 1)
        # A job behind it waits its turn even from a worker with a slot (no queue to jump).
        behind = await roomy.offer("r", "b", "tb", _rec("", "interactive", 2), start_now=True)
        assert (behind.outcome, behind.waiting_on) == ("parked", "concurrency")
        took = await roomy.admit("r", 5)
        assert [j.request_id for j in took.jobs] == ["a", "b"]
        leases = {k.decode(): msgspec.json.decode(v)["worker"] for k, v in (await r.hgetall(rk.lease)).items()}
        assert leases == {"a": "big", "b": "big"}
        # The refusal counts are the route's: no worker's slots are counted as a route refusal.
        assert not [k for k in await r.hkeys(rk.state) if k.startswith(b"refused")]
    finally:
        await r.aclose()


@pytest.mark.asyncio
async def test_a_late_offer_of_a_finished_request_admits_nothing(
    router: SlotRouter, redis_url: str, key_prefix: str
) -> None:
    clock = Clock()
    adm = await _admission(router, _config(key_prefix, redis_url, max_concurrency=1, requests_per_minute=100), clock)
    rk = Keys(key_prefix).route("r")
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert (await adm.offer("r", "x", "t1", _rec("", "interactive", 1), start_now=True)).outcome == "admitted"
        assert (await adm.offer("r", "y", "t9", _rec("", "interactive", 2), start_now=True)).outcome == "parked"
        fenced = await adm.release("r", "y", "t9", "t9", final=True, outcome="ok")  # not its lease: no mark
        assert fenced.fenced is False and await r.zscore(rk.finished, "y") is None
        await adm.release("r", "x", "t1", "t1", final=True, outcome="ok")
        assert await r.zscore(rk.finished, "x") == clock.now + adm.finished_ms
        # The first OFFER sent again after a lost reply, and another delivery of the jobs entry, landing after
        # the job ran and finished: neither admits it (nor takes the slot y waits for).
        for tok in ("t1", "t2"):
            assert (await adm.offer("r", "x", tok, _rec("", "interactive", 1), start_now=True)).outcome == "done"
        assert await r.zcard(rk.rpm) == 1 and await r.hlen(rk.lease) == 0 and await r.zcard(rk.permits) == 0
        assert [j.request_id for j in (await adm.admit("r", 2)).jobs] == ["y"]
        # Past the caller's window the mark is gone with the next call: the store holds nothing of x.
        clock.now += adm.finished_ms
        await adm.renew("r")
        assert await r.zcard(rk.finished) == 0
    finally:
        await r.aclose()


@pytest.mark.asyncio
async def test_every_script_sent_twice_counts_once(router: SlotRouter, redis_url: str, key_prefix: str) -> None:
    clock = Clock()
    adm = await _admission(router, _config(key_prefix, redis_url, max_concurrency=2, requests_per_minute=100), clock)
    rk = Keys(key_prefix).route("r")
    r = aioredis.Redis.from_url(redis_url)
    try:
        for _ in range(2):  # OFFER: a re-sent offer answers as the first
            assert (await adm.offer("r", "x", "tx", _rec("", "interactive", 1), start_now=True)).outcome == "admitted"
        assert await r.zcard(rk.permits) == 1 and await r.zcard(rk.rpm) == 1
        assert (await adm.offer("r", "x", "other", _rec("", "interactive", 1), start_now=True)).outcome == "held"
        assert (
            await adm.offer("r", "w0", "t0", _rec("", "interactive", 10), start_now=True)
        ).outcome == "admitted"  # room
        for i in (1, 2):
            assert (
                await adm.offer("r", f"w{i}", f"t{i}", _rec("", "interactive", 10 + i), start_now=True)
            ).outcome == "parked"
        await adm.release("r", "w0", "t0", "t0", final=True, outcome="ok")
        a1 = await adm.admit("r", 5, call_id="c1")
        a2 = await adm.admit("r", 5, call_id="c1")  # ADMIT: the same call id, the same jobs, nothing new
        assert [j.request_id for j in a1.jobs] == [j.request_id for j in a2.jobs] == ["w1"]
        assert await r.zcard(rk.permits) == 2 and await r.zcard(rk.rpm) == 3
        for _ in range(2):  # ACQUIRE: refused on concurrency, a reservation; again: the same one
            acq = await adm.acquire("r", "tx:2", True, request_id="x", lease_token="tx")
            assert (acq.outcome, acq.waiting_on) == ("wait", "concurrency")
        assert await r.zcard(rk.reserved) == 1
        w1 = a1.jobs[0].token
        for _ in range(2):  # RELEASE final=0 of w1: its permit once; the handoff admits nobody (w2 waits behind
            # the reservation)
            rel = await adm.release("r", "w1", w1, w1, final=False, outcome="ok", handoff=3)
            assert rel.handoff.jobs == []
        for _ in range(2):
            assert (await adm.acquire("r", "tx:2", True, request_id="x", lease_token="tx")).outcome == "ok"
        assert await r.zcard(rk.permits) == 2 and await r.zcard(rk.reserved) == 0 and await r.zcard(rk.rpm) == 4
        for _ in range(2):  # RENEW: only expiries
            assert await adm.renew("r") == []
        assert await r.zcard(rk.permits) == 2
        assert (await adm.acquire("r", "tx:3", True, request_id="x", lease_token="nope")).outcome == "fenced"
    finally:
        await r.aclose()


@pytest.mark.asyncio
async def test_a_429_cools_the_route_for_every_worker(router: SlotRouter, redis_url: str, key_prefix: str) -> None:
    clock = Clock()
    config = _config(key_prefix, redis_url, max_concurrency=5)
    one, two = await _admission(router, config, clock, "w1"), await _admission(router, config, clock, "w2")
    assert (await one.offer("r", "a", "ta", _rec("", "interactive", 1), start_now=True)).outcome == "admitted"
    for _ in range(2):  # counted once per attempt token
        await one.release("r", "a", "ta", "ta", final=True, outcome="rate_limit", retry_after_ms=4000)
    got = await two.offer("r", "b", "tb", _rec("", "interactive", 2), start_now=True)
    assert (got.outcome, got.waiting_on, got.retry_at) == ("parked", "cooldown", T0 + 4000)
    clock.now = T0 + 3999
    assert (await two.admit("r", 1)).waiting_on == "cooldown"
    clock.now = T0 + 4000
    assert [j.request_id for j in (await two.admit("r", 1)).jobs] == ["b"]


@pytest.mark.asyncio
async def test_the_rpm_window_refuses_until_its_oldest_admission_leaves(
    router: SlotRouter, redis_url: str, key_prefix: str
) -> None:
    clock = Clock()
    adm = await _admission(router, _config(key_prefix, redis_url, requests_per_minute=2), clock)
    for i in range(3):
        clock.now += 1
        o = await adm.offer("r", f"j{i}", f"t{i}", _rec("", "interactive", clock.now), start_now=True)
        await adm.release("r", f"j{i}", f"t{i}", f"t{i}", final=True, outcome="ok")
    assert (o.outcome, o.waiting_on, o.retry_at) == ("parked", "rate", T0 + 1 + 61_000)
    clock.now = T0 + 61_000  # the window (now - 61 s, now] still holds the first admission
    assert (await adm.admit("r", 1)).waiting_on == "rate"
    clock.now += 1
    assert [j.request_id for j in (await adm.admit("r", 1)).jobs] == ["j2"]


@pytest.mark.asyncio
async def test_a_dead_workers_lease_expires_and_its_job_goes_first_again(
    router: SlotRouter, redis_url: str, key_prefix: str
) -> None:
    clock = Clock()
    config = _config(key_prefix, redis_url, max_concurrency=1)
    dead, live = await _admission(router, config, clock, "dead"), await _admission(router, config, clock, "live")
    assert (await dead.offer("r", "a", "ta", _rec("t", "interactive", 1), start_now=True)).outcome == "admitted"
    assert (await live.offer("r", "b", "tb", _rec("t", "interactive", 2), start_now=True)).outcome == "parked"
    clock.now += config.claim_idle_ms  # nobody renewed the lease
    jobs = (await live.admit("r", 1)).jobs
    assert [j.request_id for j in jobs] == ["a"]  # first of its tenant again: its queued_at
    assert await dead.renew("r") == ["a"]  # the frozen worker wakes: its lease is gone
    assert (await dead.release("r", "a", "ta", "ta", final=True, outcome="ok")).fenced
    rk = Keys(key_prefix).route("r")
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await r.zcard(rk.permits) == 1 and int(await r.hget(rk.state, "expired") or 0) == 1
    finally:
        await r.aclose()


@pytest.mark.asyncio
async def test_a_worker_with_other_limits_refuses_to_start(router: SlotRouter, redis_url: str, key_prefix: str) -> None:
    clock = Clock()
    await _admission(router, _config(key_prefix, redis_url, max_concurrency=2), clock, "w1")
    other = Admission(_config(key_prefix, redis_url, max_concurrency=3), Keys(key_prefix), router, "w2")
    with pytest.raises(LimitsMismatch) as info:
        await other.publish_limits({"w1", "w2"})
    assert (
        info.value.message.startswith('routes.r: this worker\'s limits {"c":3,')
        and "live worker w1" in info.value.message
    )
    await other.publish_limits({"w2"})  # w1 is gone: the new limits are the fleet's now


@pytest.mark.asyncio
async def test_tokens_are_estimated_at_admission_and_settled_once_at_release(
    router: SlotRouter, redis_url: str, key_prefix: str
) -> None:
    clock = Clock()
    config = _config(key_prefix, redis_url, tokens_per_minute=250, max_tokens=10)
    adm = await _admission(router, config, clock)
    rk = Keys(key_prefix).route("r")
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert (
            await adm.offer("r", "big", "tb", _rec("", "interactive", 1, est=251), start_now=True)
        ).outcome == "too_large"
        assert (
            await adm.offer("r", "a", "ta", _rec("", "interactive", 1, est=200), start_now=True)
        ).outcome == "admitted"
        got = await adm.offer("r", "b", "tb", _rec("", "interactive", 2, est=100), start_now=True)
        assert (got.outcome, got.waiting_on) == ("parked", "tokens")
        handed = []
        for _ in range(2):  # settled from the usage: the difference once
            rel = await adm.release("r", "a", "ta", "ta", final=True, outcome="ok", actual_tokens=30, handoff=1)
            handed.append([j.request_id for j in rel.handoff.jobs])
        assert int(await r.hget(rk.state, "tpm_sum") or 0) == 130  # a settled (30) + b admitted by the handoff
        assert handed == [["b"], []]
        clock.now += 61_000  # both leave the window
        await adm.renew("r")
        assert int(await r.hget(rk.state, "tpm_sum") or 0) == 0 and await r.hlen(rk.tpm_cost) == 0
    finally:
        await r.aclose()


@pytest.mark.asyncio
async def test_one_offer_of_a_read_batch_answers_each_job_as_alone_and_admits_at_most_its_slots(
    router: SlotRouter, redis_url: str, key_prefix: str
) -> None:
    """A read batch's OFFER with 2 run slots: each job's answer in order (admitted, too large, held by another
    worker, done, admitted, parked for a worker, at its tenant's cap, behind a waiting job), the hand-over
    acking every entry the route took and writing each parked job's status; sent again (a lost reply), the
    same answers and nothing counted twice."""
    clock = Clock()
    tenants = {"t": Tenant(weight=1, max_concurrency=1)}
    config = _config(key_prefix, redis_url, tenants, max_concurrency=4, tokens_per_minute=1000)
    adm = await _admission(router, config, clock)
    other = await _admission(router, config, clock, consumer="w2")
    keys = Keys(key_prefix)
    rk, jobs = keys.route("r"), keys.shard(0).jobs
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert (await other.offer("r", "h", "th", _rec("", "interactive", 1), start_now=True)).outcome == "admitted"
        assert (await adm.offer("r", "d", "td", _rec("", "interactive", 2), start_now=True)).outcome == "admitted"
        await adm.release("r", "d", "td", "td", final=True, outcome="ok")
        batch = [("a", "", 10), ("big", "", 11), ("h", "", 12), ("d", "", 13), ("t1", "t", 14), ("w", "", 15)]
        batch += [("t2", "t", 16), ("b", "", 17)]
        for _, _, at in batch:
            await r.xadd(jobs, {"job": "{}"}, id=f"{at}-0")
        await r.xgroup_create(jobs, config.group, id="0")
        await r.xreadgroup(config.group, "w1", {jobs: ">"})
        offers = [
            OfferJob(rid, f"tok-{rid}", _rec(t, "interactive", at, est=2000 if rid == "big" else 10), status=s)
            for rid, t, at in batch
            for s in [keys.request(rid).status]
        ]
        got = await adm.offer_many("r", offers, slots=2, hand_over=jobs)
        assert [(g.outcome, g.token, g.waiting_on, g.retry_at, g.handed) for g in got] == [
            ("admitted", "tok-a", "", 0, True),
            ("too_large", "", "", 0, False),
            ("held", "", "", 0, True),
            ("done", "", "", 0, True),
            ("admitted", "tok-t1", "", 0, True),
            ("parked", "", "worker", T0 + 250, True),  # the route has room, the caller's 2 slots are used
            ("parked", "", "tenant", T0 + 250, True),
            ("parked", "", "concurrency", T0 + 50, True),  # behind w and t2: no queue to jump
        ]
        pending = await r.xpending_range(jobs, config.group, "-", "+", 10)
        assert [p["message_id"] for p in pending] == [b"11-0"]  # the too large job's entry: its worker fails it
        for rid, waiting_on in (("w", b"worker"), ("t2", b"tenant"), ("b", b"concurrency")):
            status = keys.request(rid).status
            fields = await r.hmget(status, ["state", "waiting_on", "waiting_route", "waiting_since"])
            assert fields == [b"queued", waiting_on, b"r", str(T0).encode()], rid
        assert not await r.exists(*(keys.request(rid).status for rid in ("a", "big", "h", "d", "t1")))
        leases = {k.decode(): msgspec.json.decode(v) for k, v in (await r.hgetall(rk.lease)).items()}
        assert {rid: (x["token"], x["worker"]) for rid, x in leases.items()} == {
            "h": ("th", "w2"),
            "a": ("tok-a", "w1"),
            "t1": ("tok-t1", "w1"),
        }
        assert adm.held["r"].leases == {"a": "tok-a", "t1": "tok-t1"}  # renewed by this worker's heartbeat
        counts = (await r.zcard(rk.permits), await r.zcard(rk.rpm), await r.hlen(rk.waiting))
        assert counts == (3, 4, 3)
        assert (int(await r.hget(rk.state, "admitted")), int(await r.hget(rk.state, "parked"))) == (4, 3)
        # Sent again after a lost reply: the same jobs admitted under the same tokens, the waiting ones parked
        # (the route refuses nothing now: the reason a waiting job gives), nothing counted again.
        clock.now += 1
        again = await adm.offer_many("r", offers, slots=2, hand_over=jobs)
        assert [(g.outcome, g.token, g.waiting_on) for g in again] == [
            ("admitted", "tok-a", ""),
            ("too_large", "", ""),
            ("held", "", ""),
            ("done", "", ""),
            ("admitted", "tok-t1", ""),
            ("parked", "", "concurrency"),
            ("parked", "", "concurrency"),
            ("parked", "", "concurrency"),
        ]
        assert (await r.zcard(rk.permits), await r.zcard(rk.rpm), await r.hlen(rk.waiting)) == counts
        assert (int(await r.hget(rk.state, "admitted")), int(await r.hget(rk.state, "parked"))) == (4, 3)
    finally:
        await r.aclose()


@pytest.mark.asyncio
async def test_an_offer_sent_again_never_answers_more_jobs_admitted_than_its_slots(
    router: SlotRouter, redis_url: str, key_prefix: str
) -> None:
    """Sent again after a lost reply, the jobs the first OFFER admitted count against its slots again: a job it
    did not admit then (u: done, its finished mark gone by the time the call is sent again) is parked, not
    admitted into a slot another job of the call already holds."""
    clock = Clock()
    adm = await _admission(router, _config(key_prefix, redis_url, max_concurrency=4), clock)
    rk = Keys(key_prefix).route("r")
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert (await adm.offer("r", "u", "tu", _rec("", "interactive", 1), start_now=True)).outcome == "admitted"
        await adm.release("r", "u", "tu", "tu", final=True, outcome="ok")
        offers = [OfferJob("u", "tu2", _rec("", "interactive", 1)), OfferJob("p", "tp", _rec("", "interactive", 2))]
        got = await adm.offer_many("r", offers, slots=1)
        assert [(g.outcome, g.token) for g in got] == [("done", ""), ("admitted", "tp")]
        await r.zrem(rk.finished, "u")
        again = await adm.offer_many("r", offers, slots=1)
        assert [(g.outcome, g.waiting_on) for g in again] == [("parked", "worker"), ("admitted", "")]
        assert list((await r.hgetall(rk.lease)).keys()) == [b"p"]  # ``worker``: the route had room for u
    finally:
        await r.aclose()


@pytest.mark.asyncio
async def test_a_cooling_route_answers_cooldown_to_a_job_with_fallbacks_once_per_slot(
    router: SlotRouter, redis_url: str, key_prefix: str
) -> None:
    """A job with fallbacks on a cooling route is answered ``cooldown`` (never parked on it), the first ones
    each taking one of the call's slots for its fallback attempt, the next without one (its worker waits for a
    slot); a job without fallbacks waits on the route."""
    clock = Clock()
    adm = await _admission(router, _config(key_prefix, redis_url, max_concurrency=4), clock)
    assert (await adm.offer("r", "a", "ta", _rec("", "interactive", 1), start_now=True)).outcome == "admitted"
    await adm.release("r", "a", "ta", "ta", final=True, outcome="rate_limit", retry_after_ms=4000)
    offers = [
        OfferJob("f1", "t1", _rec("", "interactive", 2), fallbacks=True),
        OfferJob("n1", "t2", _rec("", "interactive", 3)),
        OfferJob("f2", "t3", _rec("", "interactive", 4), fallbacks=True),
    ]
    got = await adm.offer_many("r", offers, slots=1)
    assert [(g.outcome, g.waiting_on, g.retry_at, g.slot) for g in got] == [
        ("cooldown", "", T0 + 4000, True),
        ("parked", "cooldown", T0 + 4000, False),
        ("cooldown", "", T0 + 4000, False),
    ]
