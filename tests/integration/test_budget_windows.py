"""A budget store keeps a window's lines through the window after it, then removes them (docs/capacity.md#budgets):
at most ``CLEAN_BATCH`` a script call, never one still holding a reservation, never a windowless one; a
cleaned line is gone from ``reserved``, ``spent``, the state hash, the ``lines`` index and ``sluice budgets``;
every script sent again (a lost reply) leaves the store as sent once, after the store's next calls."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.schemas.keys import BudgetKeys, Keys
from sluice.worker.capacity import scripts as cs
from sluice.worker.capacity.budgets import budgets_for, removable_from, window_bounds
from sluice.worker.capacity.spend import Reserved, Spend
from sluice.worker.capacity.state import read_budgets
from sluice.worker.config import Budget, Config, Route, TenantBudget
from sluice.worker.redis.route import SlotRouter
from tests.integration.conftest import cleanup

T0 = 2_115_619_200_000  # 2037-01-15T08:00:00Z: ahead of Redis's own clock, so `sluice budgets` shows every line
HOUR, DAY = 3_600_000, 86_400_000
D1 = T0 // DAY * DAY  # day 1's start (UTC)
D2, D3, D4 = D1 + DAY, D1 + 2 * DAY, D1 + 3 * DAY
BIG = 100 * DAY  # a lease that outlives the test's clock jumps: a reservation held until settled


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def _config(prefix: str, url: str) -> Config:
    day = Budget(amount="100", currency="USD", window="day")
    return Config(
        redis_url=url,
        key_prefix=prefix,
        claim_idle_ms=10_000,
        routes={"r": Route(dialect="anthropic", base_url="http://h", max_tokens=100)},
        budgets={
            "acme": TenantBudget(
                amount="1000",
                currency="USD",
                window="day",
                keys={
                    "p1": day,
                    "m": Budget(amount="100", currency="USD", window="month", time_zone="Pacific/Auckland"),
                    "f": Budget(amount="100", currency="USD"),  # window "none"
                    "ny": Budget(amount="100", currency="USD", window="day", time_zone="America/New_York"),
                    "*": day,
                },
            )
        },
    )


@dataclass
class Store:
    spend: Spend
    clock: Clock
    r: aioredis.Redis
    bk: BudgetKeys

    def refs(self, key: str | None) -> Any:
        return budgets_for(self.spend.config, "acme", key, "r")

    async def reserve(self, rid: str, key: str | None, amount: str = "0.5") -> Reserved:
        return await self.spend.reserve(rid, self.refs(key), Decimal(amount), self.clock.now)

    async def touch(self) -> Any:
        """The next script on the store (an EXTEND renewing nothing, as a heartbeat of another worker)."""
        return await self.r.eval(cs.EXTEND, len(self.bk.script_keys()), *self.bk.script_keys(), self.clock.now, 1)  # type: ignore[misc]

    async def lines(self) -> dict[str, tuple[int, int, float | None]]:
        """Each line of the store: (reserved, spent, its removal time in the index), checking that its fields
        come and go together."""
        state = {k.decode()[5:] for k in await self.r.hkeys(self.bk.state) if k.startswith(b"line:")}
        reserved = {k.decode(): int(v) for k, v in (await self.r.hgetall(self.bk.reserved)).items()}
        spent = {k.decode(): int(v) for k, v in (await self.r.hgetall(self.bk.spent)).items()}
        index = {k.decode(): s for k, s in await self.r.zrange(self.bk.lines, 0, -1, withscores=True)}
        assert set(reserved) == state and set(spent) <= state, (state, reserved, spent)
        assert set(index) == {line for line in state if not line.endswith("|0")}, (state, index)
        return {line: (reserved[line], spent.get(line, 0), index.get(line)) for line in state}


async def _store(redis_url: str, prefix: str) -> tuple[Store, SlotRouter]:
    r = aioredis.Redis.from_url(redis_url)
    router = SlotRouter.for_client(r, socket_timeout=5, connect_timeout=5)
    clock = Clock()
    spend = Spend(_config(prefix, redis_url), Keys(prefix), router, clock=clock)
    return Store(spend, clock, r, Keys(prefix).budget("acme")), router


@pytest_asyncio.fixture
async def store(redis_url: str, key_prefix: str) -> AsyncIterator[Store]:
    s, router = await _store(redis_url, key_prefix)
    try:
        yield s
    finally:
        router.close()
        await cleanup(s.r, key_prefix)
        await s.r.aclose()


def test_a_window_is_removable_once_the_window_after_it_ends() -> None:
    cfg = _config("x", "redis://h")
    day, month, none = cfg.budgets["acme"], cfg.budgets["acme"].keys["m"], cfg.budgets["acme"].keys["f"]
    assert removable_from(day, window_bounds(day, T0)[1]) == D3
    # A month in Auckland: January's figures go when February ends there (28 days on, not January's 31).
    _, jan_end = window_bounds(month, T0)
    feb_end = removable_from(month, jan_end)
    assert feb_end is not None and feb_end - jan_end == 28 * DAY
    # The day before a DST change (New York, 2037-03-08 is 23 hours): removable when the short day ends.
    ny = cfg.budgets["acme"].keys["ny"]
    _, mar7_end = window_bounds(ny, 2_120_058_000_000)  # 2037-03-07T17:00:00Z
    assert removable_from(ny, mar7_end) == mar7_end + 23 * HOUR
    assert removable_from(none, window_bounds(none, T0)[1]) is None


@pytest.mark.asyncio
@pytest.mark.parametrize("ends", ["settled", "expired"])
async def test_three_days_of_a_day_budget(store: Store, ends: str) -> None:
    s, clock = store, store.clock
    # Day 1: a settled request (acme and p1, day windows); one held on (acme, and f: windowless) across days.
    assert await s.reserve("a:1", "p1") == Reserved("ok")
    await s.spend.settle("acme", "a:1", Decimal("0.25"), sent=True)
    s.spend.lease_ms = BIG
    assert await s.reserve("h:1", "f") == Reserved("ok")
    s.spend.lease_ms = 10_000
    # Day 2: another settled request.
    clock.now = D2 + 1000
    await s.reserve("b:1", "p1")
    await s.spend.settle("acme", "b:1", Decimal("0.125"), sent=True)
    d1, d2 = (
        {"budgets.acme": f"budgets.acme|{D1}", "p1": f"budgets.acme.keys.p1|{D1}"},
        {
            "budgets.acme": f"budgets.acme|{D2}",
            "p1": f"budgets.acme.keys.p1|{D2}",
        },
    )
    f = "budgets.acme.keys.f|0"
    clock.now = D3 - 1  # the last moment of day 2: day 1 is the previous window, kept whole
    await s.touch()
    assert set(await s.lines()) == {*d1.values(), *d2.values(), f}
    clock.now = D3  # day 3 starts: day 1's p1 line goes; acme's waits for the reservation held in it
    await s.touch()
    lines = await s.lines()
    assert set(lines) == {d1["budgets.acme"], *d2.values(), f}
    assert lines[d1["budgets.acme"]] == (500_000, 250_000, D3 + 60_000)  # looked at again a minute later
    assert int(await s.r.hget(s.bk.state, "removed")) == 1
    if ends == "settled":
        clock.now = D3 + 1000
        assert await s.spend.settle("acme", "h:1", Decimal("0.0625"), sent=True) == "cost:62500"
        assert (await s.lines())[d1["budgets.acme"]] == (0, 312_500, D3 + 60_000)  # settled in its own line
    else:
        s.spend.forget("acme", "h:1")  # its worker died: it expires when its line is looked at again
        await s.r.zadd(s.bk.held, {"h:1": D3 + 60_000}, xx=True)
    clock.now = D3 + 59_999
    await s.touch()
    assert d1["budgets.acme"] in await s.lines()
    clock.now = D3 + 60_000
    await s.touch()  # (expired: charged whole, then removed, in this one call)
    lines = await s.lines()
    assert set(lines) == {*d2.values(), f}
    assert lines[f] == (0, 62_500 if ends == "settled" else 500_000, None)  # windowless: kept, with its spend
    # sluice budgets reads the remaining lines (by Redis's own clock all of them are in current windows).
    now, shown = await read_budgets(s.r, s.bk)
    assert now < D1 and {(b.name, b.window_start) for b in shown} == {
        ("budgets.acme", D2),
        ("budgets.acme.keys.p1", D2),
        ("budgets.acme.keys.f", 0),
    }
    # Day 4: day 2 goes; the windowless line stays, a year on too.
    clock.now = D4
    await s.touch()
    assert set(await s.lines()) == {f}
    clock.now = D4 + 400 * DAY
    await s.touch()
    assert set(await s.lines()) == {f}
    assert int(await s.r.hget(s.bk.state, "removed")) == 4


@pytest.mark.asyncio
async def test_at_most_a_batch_a_call_and_the_current_window_stays(store: Store) -> None:
    s, clock = store, store.clock
    n = 2 * cs.CLEAN_BATCH + 5
    for i in range(n):  # day 1: one line per end user
        await s.reserve(f"u{i}:1", f"user{i:02d}", "0.001")
        await s.spend.settle("acme", f"u{i}:1", Decimal("0.001"), sent=True)
    clock.now = D3 + 5  # day 3 (a new end user reserves in it)
    assert await s.reserve("now:1", "user00", "0.001") == Reserved("ok")  # its call removes a batch first
    removed = []
    for _ in range(3):
        removed.append(int(await s.r.hget(s.bk.state, "removed")))
        await s.touch()
    # Batches of CLEAN_BATCH (one removal time: by name, so acme's own day-1 line last).
    assert removed == [cs.CLEAN_BATCH, 2 * cs.CLEAN_BATCH, n + 1]
    today = {f"budgets.acme|{D3}", f"budgets.acme.keys.user00|{D3}"}
    assert set(await s.lines()) == today


@pytest.mark.asyncio
async def test_a_reservation_of_nothing_does_not_bring_its_removed_lines_back(store: Store) -> None:
    """A worst case of 0 (a free model) holds nothing, so its lines may go while it is held; its settlement
    (here above its worst case) then counts nowhere instead of making half a line again."""
    s, clock = store, store.clock
    s.spend.lease_ms = BIG
    assert await s.reserve("z:1", "p1", "0") == Reserved("ok")
    clock.now = D3
    await s.touch()
    assert await s.lines() == {}
    assert await s.spend.settle("acme", "z:1", Decimal("0.01"), sent=True) == "cost:10000"
    assert await s.lines() == {} and int(await s.r.hget(s.bk.state, "overrun")) == 1


# -- sent again ---------------------------------------------------------------------------------------------------


async def _build(s: Store) -> None:
    """Day 1: more lines than two batches (settled), one reservation held on; then day 3 starts."""
    for i in range(2 * cs.CLEAN_BATCH + 5):
        await s.reserve(f"u{i}:1", f"user{i:02d}", "0.001")
        await s.spend.settle("acme", f"u{i}:1", Decimal("0.001"), sent=True)
    s.spend.lease_ms = BIG
    await s.reserve("h:1", "f")
    s.spend.lease_ms = 10_000
    s.clock.now = D3 + 1000


async def _call(s: Store, script: str) -> object:
    if script == "reserve":
        return await s.reserve("x:1", "p1")
    if script == "extend":
        return await s.spend.extend()
    return await s.spend.settle("acme", "h:1", Decimal("0.0625"), sent=True)


async def _dump(s: Store) -> dict[str, object]:
    """The whole store, after its next calls removed every line that may go."""
    for _ in range(10):
        before = await s.r.hget(s.bk.state, "removed")
        await s.touch()
        if await s.r.hget(s.bk.state, "removed") == before:
            break
    return {
        "lines": await s.lines(),
        "state": await s.r.hgetall(s.bk.state),
        "held": await s.r.zrange(s.bk.held, 0, -1, withscores=True),
        "res": await s.r.hgetall(s.bk.res),
        "settled": await s.r.zrange(s.bk.settled, 0, -1, withscores=True),
        "charged": await s.r.hgetall(s.bk.charged),
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("script", ["reserve", "extend", "settle"])
async def test_each_script_sent_again_removes_nothing_more(redis_url: str, script: str) -> None:
    """Each script with its reply lost (so sent again: run twice) and never arriving (another call runs, then it
    is sent again): the same reply, and, after the store's next calls, the same store as a clean run; the run
    sent again may remove a second batch, which the next call would have removed all the same."""
    got: dict[str, tuple[list[object], dict[str, object]]] = {}
    for mode, runs in (("clean", 1), ("lose_reply", 2), ("drop_command", 1)):
        prefix = f"sluicetest:{uuid.uuid4().hex[:12]}"
        s, router = await _store(redis_url, prefix)
        try:
            await _build(s)
            if mode == "drop_command":
                await s.touch()  # it never reached Redis; another worker's call runs before it is sent again
            replies = [await _call(s, script) for _ in range(runs)]
            if mode == "lose_reply":
                # The first run removed one batch, the run sent again another: never more than the due lines.
                assert int(await s.r.hget(s.bk.state, "removed")) == 2 * cs.CLEAN_BATCH
            got[mode] = (replies[-1:], await _dump(s))
        finally:
            router.close()
            await cleanup(s.r, prefix)
            await s.r.aclose()
    assert got["lose_reply"] == got["clean"] == got["drop_command"]
    lines = got["clean"][1]["lines"]
    assert isinstance(lines, dict)
    held = f"budgets.acme|{D1}" in lines
    assert held is (script != "settle")  # acme's day-1 line goes only once nothing is held in it (a minute on)


# -- a property ---------------------------------------------------------------------------------------------------

_KEYS = [None, "p1", "m", "f", "ny", "anon"]
_op = st.one_of(
    st.tuples(st.just("reserve"), st.sampled_from(_KEYS), st.booleans()),  # (key, keep it held)
    st.tuples(st.just("settle"), st.integers(0, 20), st.just(False)),
    st.tuples(st.just("advance"), st.integers(1, 3 * DAY), st.just(False)),
)


@dataclass
class Model:
    """What the store must keep: every line created whose removal time is still ahead, every windowless line,
    every line a held reservation counts in; with the exact spend settled in it."""

    spent: dict[str, int] = field(default_factory=dict)
    until: dict[str, int | None] = field(default_factory=dict)
    held: dict[str, list[str]] = field(default_factory=dict)  # reservation id -> its lines


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(_op, max_size=30))
def test_lines_go_only_when_past_their_time_and_free(redis_url: str, ops: list[tuple[str, object, bool]]) -> None:
    asyncio.run(_property(redis_url, ops))


async def _property(redis_url: str, ops: list[tuple[str, object, bool]]) -> None:
    prefix = f"sluicetest:{uuid.uuid4().hex[:12]}"
    s, router = await _store(redis_url, prefix)
    s.spend.lease_ms = BIG
    m = Model()
    try:
        for i, (op, arg, keep) in enumerate(ops):
            if op == "reserve":
                refs = s.refs(arg)  # type: ignore[arg-type]
                assert await s.reserve(f"r{i}:1", arg, "0.01") == Reserved("ok")  # type: ignore[arg-type]
                lines = []
                for ref in refs:
                    start, end = window_bounds(ref.budget, s.clock.now)
                    line = f"{ref.name}|{start}"
                    lines.append(line)
                    m.until[line] = removable_from(ref.budget, end)
                    m.spent.setdefault(line, 0)
                m.held[f"r{i}:1"] = lines
                if not keep:
                    await s.spend.settle("acme", f"r{i}:1", Decimal("0.003"), sent=True)
                    for line in m.held.pop(f"r{i}:1"):
                        m.spent[line] += 3000
            elif op == "settle" and m.held:
                rid = sorted(m.held)[int(arg) % len(m.held)]  # type: ignore[call-overload]
                await s.spend.settle("acme", rid, Decimal("0.001"), sent=True)
                for line in m.held.pop(rid):
                    m.spent[line] += 1000
            elif op == "advance":
                s.clock.now += int(arg)  # type: ignore[call-overload]
                await s.touch()
            _check(m, await s.lines(), s.clock.now)
        # Once nothing is held and a minute passed, the next calls leave exactly the lines not yet due.
        for rid in sorted(m.held):
            await s.spend.settle("acme", rid, None, sent=False)
        m.held.clear()
        s.clock.now += 60_000
        for _ in range(len(m.until) // cs.CLEAN_BATCH + 1):
            await s.touch()
        kept = {line for line, until in m.until.items() if until is None or until > s.clock.now}
        assert set(await s.lines()) == kept
    finally:
        router.close()
        await cleanup(s.r, prefix)
        await s.r.aclose()


def _check(m: Model, lines: dict[str, tuple[int, int, float | None]], now: int) -> None:
    must = {line for line, until in m.until.items() if until is None or until > now}
    must |= {line for held in m.held.values() for line in held}
    assert must <= set(lines) <= set(m.until), (must - set(lines), set(lines) - set(m.until))
    for line, (reserved, spent, score) in lines.items():
        assert spent == m.spent[line], line
        assert reserved == 10_000 * sum(line in held for held in m.held.values()), line
        until = m.until[line]
        assert (score is None) is (until is None) and (score is None or score >= until), line
