"""``sluice budgets`` against a real Redis: each budget's current window (amount, spent, reserved, left, window
end), per tenant or all of a prefix, as text and JSON; past windows are not shown."""

from __future__ import annotations

import asyncio
import json
import time
from decimal import Decimal

import pytest
import redis.asyncio as aioredis

from sluice.normalizer.pricing import Prices
from sluice.schemas.keys import Keys
from sluice.worker.capacity.budgets import budgets_for
from sluice.worker.capacity.spend import Spend
from sluice.worker.config import Budget, Config, Route, TenantBudget
from sluice.worker.redis.route import SlotRouter
from tests.helpers import run_cli
from tests.integration.conftest import cleanup


async def _spend(url: str, prefix: str) -> None:
    config = Config(
        redis_url=url,
        key_prefix=prefix,
        routes={"r": Route(dialect="anthropic", base_url="http://h")},
        prices={"r": Prices(input="1", output="1")},
        budgets={
            "acme": TenantBudget(
                amount="10", currency="EUR", keys={"p1": Budget(amount="2", currency="EUR", window="day")}
            ),
            "*": TenantBudget(amount="1", currency="EUR"),
        },
    )
    r = aioredis.Redis.from_url(url)
    router = SlotRouter.for_client(r, socket_timeout=5, connect_timeout=5)
    try:
        s = Spend(config, Keys(prefix), router)
        now = int(time.time() * 1000)
        acme = budgets_for(config, "acme", "p1", "r")
        await s.reserve("a:1", acme, Decimal("0.5"), now)
        await s.settle("acme", "a:1", Decimal("0.25"), sent=True)
        await s.reserve("b:1", acme, Decimal("0.125"), now)
        await s.reserve("old:1", acme, Decimal("1"), now - 2 * 86_400_000)  # two days ago: a past window of p1
        await s.reserve("c:1", budgets_for(config, "bob", None, "r"), Decimal("0.5"), now)
    finally:
        router.close()
        await r.aclose()


async def _cleanup(url: str, prefix: str) -> None:
    r = aioredis.Redis.from_url(url)
    try:
        await cleanup(r, prefix)
    finally:
        await r.aclose()


def test_sluice_budgets_shows_each_budget_s_current_window(
    capsys: pytest.CaptureFixture[str], redis_url: str, key_prefix: str
) -> None:
    common = ("--redis-url", redis_url, "--key-prefix", key_prefix)
    try:
        code, out, err = run_cli(capsys, "budgets", *common)
        assert (code, out) == (0, "")
        assert err.startswith("sluice budgets: no budget has been reserved in under key prefix")
        asyncio.run(_spend(redis_url, key_prefix))
        code, out, err = run_cli(capsys, "budgets", "--tenant", "acme", *common)
        assert code == 0 and err == ""
        blocks = out.strip().split("\n\n")
        # acme's own budget holds every reservation (the old one too: window "none")
        assert blocks[0].splitlines()[:5] == [
            "budgets.acme",
            "  amount       10 EUR",
            "  spent        0.25",
            "  reserved     1.125",
            "  left         8.625",
        ]
        assert blocks[0].splitlines()[5] == "  window end   none (never resets)"
        # p1's day window: the old reservation counts in its own (past) day, not shown
        assert blocks[1].splitlines()[:5] == [
            "budgets.acme.keys.p1",
            "  amount       2 EUR",
            "  spent        0.25",
            "  reserved     0.125",
            "  left         1.625",
        ]
        assert blocks[1].splitlines()[5].startswith("  window end   20") and len(blocks) == 2
        code, out, _ = run_cli(capsys, "budgets", "--json", *common)
        doc = json.loads(out)
        assert [(b["name"], b["tenant"], b["left"]) for b in doc["budgets"]] == [
            ("budgets.acme", "acme", "8.625"),
            ("budgets.acme.keys.p1", "acme", "1.625"),
            ("budgets.bob", "bob", "0.5"),
        ]
        assert doc["budgets"][1]["window_end_ms"] > doc["now_ms"] and doc["budgets"][0]["window_end_ms"] is None
    finally:
        asyncio.run(_cleanup(redis_url, key_prefix))
