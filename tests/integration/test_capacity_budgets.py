"""The budget scripts (RESERVE, EXTEND, SETTLE) against a real Redis: room in every nested budget or none,
each call idempotent for its caller (sent twice = once), settlement to the reported cost, whole without one,
nothing for a request never sent, a dead worker's reservation charged whole at expiry, and windows apart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from decimal import Decimal

import msgspec
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from sluice.normalizer.pricing import Prices, format_cost
from sluice.schemas.jobs import Job, encode_job
from sluice.schemas.keys import Keys
from sluice.schemas.status import Status
from sluice.worker.capacity.budgets import budgets_for
from sluice.worker.capacity.spend import Reserved, Spend
from sluice.worker.config import Budget, Config, Route, TenantBudget
from sluice.worker.redis.route import SlotRouter
from tests.integration.conftest import cleanup

pytestmark = pytest.mark.asyncio

T0 = 1_800_000_000_000  # 2027-01-15T08:00:00Z


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def _config(prefix: str, url: str) -> Config:
    return Config(
        redis_url=url,
        key_prefix=prefix,
        claim_idle_ms=10_000,
        routes={"r": Route(dialect="anthropic", base_url="http://h", max_tokens=100)},
        prices={"r": Prices(input="3", output="15")},
        budgets={
            "acme": TenantBudget(
                amount="1.00",
                currency="USD",
                window="day",
                keys={"p1": Budget(amount="0.30", currency="USD"), "*": Budget(amount="0.50", currency="USD")},
            )
        },
    )


@pytest_asyncio.fixture
async def spend(redis_url: str, key_prefix: str) -> AsyncIterator[tuple[Spend, Clock, aioredis.Redis, Keys]]:
    r = aioredis.Redis.from_url(redis_url)
    router = SlotRouter.for_client(r, socket_timeout=5, connect_timeout=5)
    clock = Clock()
    config = _config(key_prefix, redis_url)
    try:
        yield Spend(config, Keys(key_prefix), router, clock=clock), clock, r, Keys(key_prefix)
    finally:
        router.close()
        await cleanup(r, key_prefix)
        await r.aclose()


def _lines(r: dict[bytes, bytes]) -> dict[str, int]:
    return {k.decode().split("|")[0]: int(v) for k, v in r.items()}


async def _figures(r: aioredis.Redis, keys: Keys) -> tuple[dict[str, int], dict[str, int]]:
    bk = keys.budget("acme")
    return _lines(await r.hgetall(bk.spent)), _lines(await r.hgetall(bk.reserved))


async def test_room_in_every_nested_budget_or_none(spend: tuple[Spend, Clock, aioredis.Redis, Keys]) -> None:
    s, clock, r, keys = spend
    p1 = budgets_for(s.config, "acme", "p1", "r")
    assert await s.reserve("a:1", p1, Decimal("0.2"), clock.now) == Reserved("ok")
    # 0.2 of p1's 0.30 is held: another 0.2 does not fit p1, and nothing is held anywhere for it.
    full = await s.reserve("b:1", p1, Decimal("0.2"), clock.now)
    assert full == Reserved("full", "budgets.acme.keys.p1", Decimal("0.1"))
    assert await _figures(r, keys) == ({}, {"budgets.acme": 200_000, "budgets.acme.keys.p1": 200_000})
    # Another key has its own budget of the default's size; the tenant's holds both.
    other = budgets_for(s.config, "acme", "p2", "r")
    assert await s.reserve("c:1", other, Decimal("0.45"), clock.now) == Reserved("ok")
    assert await s.reserve("d:1", other, Decimal("0.4"), clock.now) == Reserved("full", "budgets.acme", Decimal("0.35"))


async def test_each_call_counts_once_when_sent_again(spend: tuple[Spend, Clock, aioredis.Redis, Keys]) -> None:
    s, clock, r, keys = spend
    refs = budgets_for(s.config, "acme", "p1", "r")
    assert await s.reserve("a:1", refs, Decimal("0.1"), clock.now) == Reserved("ok")
    assert await s.reserve("a:1", refs, Decimal("0.1"), clock.now) == Reserved("ok")  # a lost reply, sent again
    assert (await _figures(r, keys))[1] == {"budgets.acme": 100_000, "budgets.acme.keys.p1": 100_000}
    assert await s.settle("acme", "a:1", Decimal("0.0123451"), sent=True) == "cost:12346"  # rounded up
    assert await s.settle("acme", "a:1", Decimal("0.0123451"), sent=True) == "cost:12346"  # the memo
    assert await s.reserve("a:1", refs, Decimal("0.1"), clock.now) == Reserved("done")  # a late RESERVE
    assert await _figures(r, keys) == (
        {"budgets.acme": 12_346, "budgets.acme.keys.p1": 12_346},
        {"budgets.acme": 0, "budgets.acme.keys.p1": 0},
    )


async def test_whole_without_usage_and_nothing_when_never_sent(
    spend: tuple[Spend, Clock, aioredis.Redis, Keys],
) -> None:
    s, clock, r, keys = spend
    refs = budgets_for(s.config, "acme", None, "r")
    await s.reserve("a:1", refs, Decimal("0.1"), clock.now)
    await s.reserve("b:1", refs, Decimal("0.2"), clock.now)
    assert await s.settle("acme", "a:1", None, sent=True) == "whole:100000"
    assert await s.settle("acme", "b:1", None, sent=False) == "release:0"
    assert await _figures(r, keys) == ({"budgets.acme": 100_000}, {"budgets.acme": 0})


async def test_a_reservation_not_renewed_is_charged_whole_at_expiry(
    spend: tuple[Spend, Clock, aioredis.Redis, Keys],
) -> None:
    s, clock, r, keys = spend
    refs = budgets_for(s.config, "acme", None, "r")
    await s.reserve("a:1", refs, Decimal("0.1"), clock.now)
    await s.reserve("b:1", refs, Decimal("0.1"), clock.now)
    s.forget("acme", "b:1")  # its worker stops renewing it (fenced, or dead)
    clock.now += 6_000
    assert await s.extend() == []
    clock.now += 6_000  # a:1 renewed at +6 s lives to +16 s; b:1 expired at +10 s
    assert await s.extend() == []
    assert await _figures(r, keys) == ({"budgets.acme": 100_000}, {"budgets.acme": 100_000})
    # Its late settlement changes nothing and answers what expiry charged.
    assert await s.settle("acme", "b:1", Decimal("0.001"), sent=True) == "expired:100000"
    clock.now += 20_000
    s.held["acme"].add("a:1")
    assert await s.extend() == ["a:1"]  # expired meanwhile: charged whole, named as lost


async def test_windows_count_apart(spend: tuple[Spend, Clock, aioredis.Redis, Keys]) -> None:
    s, clock, r, keys = spend
    refs = budgets_for(s.config, "acme", None, "r")
    await s.reserve("a:1", refs, Decimal("0.9"), clock.now)
    await s.settle("acme", "a:1", Decimal("0.9"), sent=True)
    # The settled spend alone leaves no room: refused for good in this window (no reservation to wait for).
    assert await s.reserve("b:1", refs, Decimal("0.2"), clock.now) == Reserved(
        "full", "budgets.acme", Decimal("0.1"), settled=True
    )
    clock.now += 24 * 3600 * 1000  # the next calendar day (UTC): a new window
    assert await s.reserve("b:1", refs, Decimal("0.2"), clock.now) == Reserved("ok")
    spent = await r.hgetall(keys.budget("acme").spent)
    assert sorted(int(v) for v in spent.values()) == [900_000]


# -- through a worker ---------------------------------------------------------------------------------------------


def _job(rid: str, tenant: str, key: str | None = None) -> dict[str, object]:
    job: dict[str, object] = {
        "route": "anthropic",
        "request_id": rid,
        "tenant": tenant,
        "request": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
        "model": "synthetic;deltas=3",
    }
    if key is not None:
        job["budget_key"] = key
    return job


async def test_a_worker_settles_to_the_reported_cost_and_refuses_what_does_not_fit(
    fake: object, redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    from tests.integration.conftest import client_for, make_config, running_worker

    base = make_config(redis_url, key_prefix, fake.base_url)  # type: ignore[attr-defined]
    config = make_config(
        redis_url,
        key_prefix,
        fake.base_url,  # type: ignore[attr-defined]
        prices={"anthropic": Prices(input="1", output="1")},
        budgets={
            "acme": TenantBudget(amount="0.0001", currency="USD", routes=["anthropic"]),  # below one worst case
            "*": TenantBudget(amount="5", currency="USD", routes=["anthropic"]),
        },
    )
    keys = Keys(key_prefix)
    try:
        async with running_worker(config), client_for(base) as client:
            await client.enqueue(_job("ok-1", "bob"))
            done = await client.result("ok-1", timeout=30)
            assert done.status == "completed"
            status = await client.status_record("ok-1")
            await client.enqueue(_job("refused-1", "acme"))
            refused = await client.result("refused-1", timeout=30)
        assert refused.status == "failed" and refused.error is not None
        assert refused.error.category == "budget_exceeded" and refused.error.retryable is False
        assert refused.error.message.startswith("budgets.acme has 0.0001 USD left, this attempt's worst case is 0.000")
        assert len(fake.stats.find(request_id="refused-1")) == 0  # type: ignore[attr-defined]
        # The status (and so the archive row) names the budgets each request was charged in.
        assert status["budgets"] == '["budgets.bob"]'
        refused_status = Status.from_record(await client_status(redis_client, keys, "refused-1"))
        assert refused_status.budgets == ["budgets.acme"]
        # bob's spend is its request's cost, rounded up to a micro-unit; nothing is left reserved.
        bob = keys.budget("bob")
        spent = {k.decode(): int(v) for k, v in (await redis_client.hgetall(bob.spent)).items()}
        charged = int((Decimal(status["cost"]) * 1_000_000).to_integral_value(rounding="ROUND_CEILING"))
        assert spent == {"budgets.bob|0": charged} and charged > 0
        assert {int(v) for v in (await redis_client.hgetall(bob.reserved)).values()} == {0}
        assert await redis_client.zcard(bob.held) == 0
    finally:
        await cleanup(redis_client, key_prefix)


async def client_status(r: aioredis.Redis, keys: Keys, rid: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (await r.hgetall(keys.request(rid).status)).items()}


async def test_budget_gauges_report_the_named_budgets_current_windows(
    spend: tuple[Spend, Clock, aioredis.Redis, Keys],
) -> None:
    from sluice.worker.capacity.gauges import BUDGET_METRICS, BudgetGauges
    from tests.helpers import metric_points
    from tests.integration.test_route_metrics import Reader

    s, _, r, keys = spend
    otel = Reader()
    try:
        now = int(time.time() * 1000)
        await s.reserve("a:1", budgets_for(s.config, "acme", "p1", "r"), Decimal("0.25"), now)
        await s.settle("acme", "a:1", Decimal("0.125"), sent=True)
        await s.reserve("b:1", budgets_for(s.config, "acme", "someone", "r"), Decimal("0.0625"), now)
        gauges = BudgetGauges(otel.telemetry, r, keys, s.config)
        await gauges.refresh()
        points = {
            name: {dict(p.attributes)["budget"]: p.value for p in pts}
            for name, pts in metric_points(otel.reader).items()
            if name in BUDGET_METRICS
        }
        # "budgets.acme.keys.someone" (from keys."*") is not a series: only the budgets the configuration names.
        assert points == {
            "sluice.budget.amount": {"budgets.acme": 1.0, "budgets.acme.keys.p1": 0.3},
            "sluice.budget.spent": {"budgets.acme": 0.125, "budgets.acme.keys.p1": 0.125},
            "sluice.budget.reserved": {"budgets.acme": 0.0625, "budgets.acme.keys.p1": 0.0},
        }
        families = {f.name: f for f in otel.registry.collect()}
        spent = {smp.labels["budget"]: smp.value for smp in families["sluice_budget_spent"].samples}
        assert spent == {"budgets.acme": 0.125, "budgets.acme.keys.p1": 0.125}
    finally:
        otel.meters.shutdown()
        otel.tracers.shutdown()


async def test_a_job_waits_while_attempts_in_flight_hold_the_room(
    fake: object, redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    """A budget with room for one worst case at a time: three jobs at once all complete, one after another
    (the later ones wait for the first's settlement instead of being refused)."""
    from tests.integration.conftest import client_for, make_config, running_worker

    base = make_config(redis_url, key_prefix, fake.base_url)  # type: ignore[attr-defined]

    def job(i: int) -> dict[str, object]:
        return {**_job(f"w-{i}", "acme"), "model": "synthetic;deltas=6;pace_ms=30"}

    job_bytes = len(encode_job(msgspec.convert(job(0), Job)))
    # Room for one worst case (job bytes + max_tokens 50, at 1 USD per million tokens), not two.
    amount = format_cost(Decimal(int((job_bytes + 50) * 1.5)) / 1_000_000)
    config = make_config(
        redis_url,
        key_prefix,
        fake.base_url,  # type: ignore[attr-defined]
        prices={"anthropic": Prices(input="1", output="1")},
        budgets={"acme": TenantBudget(amount=amount, currency="USD", routes=["anthropic"])},
    )
    try:
        async with running_worker(config), client_for(base) as client:
            for i in range(3):
                await client.enqueue(job(i))
            results = [await client.result(f"w-{i}", timeout=30) for i in range(3)]
        assert [r.status for r in results] == ["completed"] * 3, [r.error for r in results]
        bk = keys_of(key_prefix).budget("acme")
        assert int(await redis_client.hget(bk.reserved, "budgets.acme|0") or 0) == 0
        assert int(await redis_client.hget(bk.state, "refused") or 0) >= 1  # they did wait for room
    finally:
        await cleanup(redis_client, key_prefix)


def keys_of(prefix: str) -> Keys:
    return Keys(prefix)


@pytest.mark.parametrize("when_full", ["wait", "refuse"])
async def test_a_full_budget_refuses_or_waits_for_its_window_to_turn(
    spend: tuple[Spend, Clock, aioredis.Redis, Keys], when_full: str
) -> None:
    import anyio

    from sluice.worker.capacity.spend import AttemptBudget

    s, clock, r, keys = spend
    config = msgspec.structs.replace(
        s.config,
        budgets={"acme": TenantBudget(amount="0.001", currency="USD", window="day", when_full=when_full)},  # type: ignore[arg-type]
        prices={"r": Prices(input="1", output="1")},
    )
    s.config = config
    refs = budgets_for(config, "acme", None, "r")
    await s.reserve("x:1", refs, Decimal("0.0009"), clock.now)
    await s.settle("acme", "x:1", Decimal("0.0009"), sent=True)  # 100 micro-units left today
    job = msgspec.convert(
        {"route": "r", "tenant": "acme", "request": {"messages": [{"role": "user", "content": "hi"}]}}, Job
    )
    budget = AttemptBudget(s, config, job, "j")
    got: list[tuple[str, str] | None] = []
    async with anyio.create_task_group() as tg:

        async def attempt() -> None:
            got.append(await budget.reserve("r", "m", 1, wait_s=10))

        tg.start_soon(attempt)
        await anyio.sleep(0.5)
        clock.now += 24 * 3600 * 1000  # the next day: a new window
    if when_full == "refuse":
        assert got[0] is not None and got[0][0] == "budget_exceeded"
        assert got[0][1].startswith("budgets.acme has 0.0001 USD left, this attempt's worst case is ")
    else:
        assert got == [None] and budget.charged_to == ["budgets.acme"]
        reserved = {k.decode(): int(v) for k, v in (await r.hgetall(keys.budget("acme").reserved)).items()}
        day = (T0 // 86_400_000 + 1) * 86_400_000
        assert reserved[f"budgets.acme|{day}"] > 0  # held in the new day's window


async def test_calls_of_one_pass_go_in_one_script_call_each_answered_as_if_alone(
    spend: tuple[Spend, Clock, aioredis.Redis, Keys],
) -> None:
    """Five RESERVEs asked in one event-loop pass are one call, taken in order: the budget (0.30 for key p1)
    holds three of 0.1, the fourth gets ``full`` with what the ones before left, and the first one asked again
    in the same pass answers as held (``ok``, counted once); then their SETTLEs are one call."""
    s, clock, r, keys = spend
    sent: list[int] = []
    send = s._batches._send

    async def counting(tenant: str, source: str, args: list[object]) -> object:
        sent.append(len(args))
        return await send(tenant, source, args)

    s._batches._send = counting  # the real script on the real Redis, counted
    refs = budgets_for(s.config, "acme", "p1", "r")
    ids = ["a:1", "b:1", "c:1", "d:1", "a:1"]
    got = await asyncio.gather(*(s.reserve(i, refs, Decimal("0.1"), clock.now) for i in ids))
    assert got == [Reserved("ok")] * 3 + [Reserved("full", "budgets.acme.keys.p1", Decimal("0.0"))] + [Reserved("ok")]
    assert len(sent) == 1
    memos = await asyncio.gather(*(s.settle("acme", i, Decimal("0.01"), sent=True) for i in ("a:1", "b:1", "c:1")))
    assert memos == ["cost:10000"] * 3 and len(sent) == 2
    assert await _figures(r, keys) == (
        {"budgets.acme": 30_000, "budgets.acme.keys.p1": 30_000},
        {"budgets.acme": 0, "budgets.acme.keys.p1": 0},
    )
