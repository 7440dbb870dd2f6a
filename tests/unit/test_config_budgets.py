"""Budgets in the configuration (docs/capacity.md#budgets): each refusal's exact one-line message, which
budgets a job falls under, the windows in a time zone, and the worst case a job holds."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from sluice.normalizer.pricing import Prices
from sluice.schemas.errors import ConfigError, JobError
from sluice.schemas.jobs import decode_job
from sluice.worker.capacity.budgets import budgets_for, window_bounds, worst_case
from sluice.worker.config import Budget, Config, load_config

_ROUTES = (
    '[routes.claude]\ndialect = "anthropic"\nbase_url = "http://h"\nfallbacks = ["gpt"]\n'
    '[routes.gpt]\ndialect = "openai-chat"\nbase_url = "http://h"\nmodel = "m"\n'
    '[routes.local]\ndialect = "openai-chat"\nbase_url = "http://h"\n'
    '[prices.claude]\ninput = 3\noutput = 15\ncurrency = "USD"\n'
    '[prices.gpt]\ninput = 2\noutput = 8\ncurrency = "USD"\n'
)
_ACME = '[budgets.acme]\namount = "100"\ncurrency = "USD"\nroutes = ["claude"]\n'


def _load(tmp_path: Path, body: str) -> Config:
    p = tmp_path / "sluice.toml"
    p.write_text(body)
    return load_config(p, env={})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            _ROUTES + '[budgets.acme]\namount = 100\nroutes = ["claude"]\n',
            'budgets.acme.currency is required (a budget is an amount in one currency, e.g. "USD")',
        ),
        (
            _ROUTES + '[budgets.acme]\ncurrency = "USD"\nroutes = ["claude"]\n',
            'budgets.acme.amount is required (the money the budget holds, e.g. "100.00")',
        ),
        (
            _ROUTES + '[budgets.acme]\namount = -5\ncurrency = "USD"\nroutes = ["claude"]\n',
            "budgets.acme.amount = -5: must be at least 0",
        ),
        (
            _ROUTES + '[budgets.acme]\namount = 1e10\ncurrency = "USD"\nroutes = ["claude"]\n',
            "budgets.acme.amount = 10000000000.0: must be at most 9000000000 (the store counts micro-units exactly)",
        ),
        (
            _ROUTES + '[budgets.acme]\namount = "ten"\ncurrency = "USD"\nroutes = ["claude"]\n',
            "budgets.acme.amount must be a decimal number, not 'ten'",
        ),
        (
            _ROUTES + _ACME + '[budgets.acme.keys.p1]\namount = "-0.01"\ncurrency = "USD"\n',
            "budgets.acme.keys.p1.amount = -0.01: must be at least 0",
        ),
        (
            _ROUTES + _ACME + '[budgets.acme.keys.p1]\namount = "1"\n',
            'budgets.acme.keys.p1.currency is required (a budget is an amount in one currency, e.g. "USD")',
        ),
        (
            _ROUTES + '[budgets."*"]\namount = 1\ncurrency = "USD"\n',
            "budgets.'*': route 'local' has no prices (set [prices.local] or price_file); a budget holds a job's"
            " worst case at its route's prices",
        ),
        (
            _ROUTES.replace('output = 8\ncurrency = "USD"', 'output = 8\ncurrency = "EUR"') + _ACME,
            "budgets.acme.currency = USD: route 'gpt' is priced in EUR (prices.gpt.currency); one budget holds one"
            " currency",
        ),
        (
            _ROUTES + _ACME + '[budgets.acme.keys."*"]\namount = "1"\ncurrency = "EUR"\n',
            "budgets.acme.keys.'*'.currency = EUR: the tenant's budget is in USD; budgets that nest hold one currency",
        ),
        (
            _ROUTES + '[budgets.acme]\namount = 1\ncurrency = "USD"\nroutes = ["nope"]\n',
            "budgets.acme.routes: unknown route 'nope'",
        ),
        (
            _ROUTES + _ACME + 'window = "day"\ntime_zone = "Mars/Olympus"\n',
            "budgets.acme.time_zone: unknown time zone 'Mars/Olympus' (an IANA name such as 'UTC' or 'Europe/Berlin')",
        ),
        (
            _ROUTES + _ACME + '[budgets.acme.keys.""]\namount = "1"\ncurrency = "USD"\n',
            "budgets.acme.keys.'': a budget key is 1-128 bytes",
        ),
    ],
)
def test_each_budget_refusal_is_one_line_naming_the_key(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, body)
    assert info.value.message == message


def test_a_budget_covers_its_routes_and_their_fallbacks_only(tmp_path: Path) -> None:
    # "local" has no prices, but no budget covers it: accepted.
    config = _load(tmp_path, _ROUTES + _ACME + '[budgets.acme.keys."*"]\namount = 5\ncurrency = "USD"\n')
    assert [b.name for b in budgets_for(config, "acme", None, "claude")] == ["budgets.acme"]
    assert budgets_for(config, "acme", "p1", "local") == []
    assert budgets_for(config, "bob", "p1", "claude") == []


def test_nesting_named_keys_and_the_defaults(tmp_path: Path) -> None:
    config = _load(
        tmp_path,
        _ROUTES.replace("[routes.local]", "[routes.localx]")
        + '[prices.localx]\ninput = 0\noutput = 0\ncurrency = "USD"\n'
        + '[budgets."*"]\namount = 10\ncurrency = "USD"\n'
        + '[budgets.acme]\namount = 100\ncurrency = "USD"\n'
        + '[budgets.acme.keys.p1]\namount = 7\ncurrency = "USD"\nwindow = "day"\n'
        + '[budgets.acme.keys."*"]\namount = 2\ncurrency = "USD"\n',
    )
    p1 = budgets_for(config, "acme", "p1", "gpt")
    assert [(b.name, b.budget.amount) for b in p1] == [("budgets.acme", 100), ("budgets.acme.keys.p1", 7)]
    other = budgets_for(config, "acme", "other key", "gpt")
    assert [(b.name, b.key, b.budget.amount) for b in other] == [
        ("budgets.acme", None, 100),
        ("budgets.acme.keys.'other key'", "other key", 2),
    ]
    # A tenant not named gets its own budget of the default's size, and its keys have no budget of their own.
    assert [(b.name, b.tenant) for b in budgets_for(config, "bob", "p1", "claude")] == [("budgets.bob", "bob")]
    assert [b.name for b in budgets_for(config, "", None, "claude")] == ["budgets.''"]


def _ms(text: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(text).timestamp() * 1000)


def test_windows_are_calendar_days_and_months_in_the_time_zone() -> None:
    now = _ms("2026-03-29T00:30:00+00:00")  # 01:30 in Berlin, the night clocks go forward
    day = Budget(amount=1, currency="EUR", window="day", time_zone="Europe/Berlin")
    assert window_bounds(day, now) == (_ms("2026-03-29T00:00:00+01:00"), _ms("2026-03-30T00:00:00+02:00"))
    month = Budget(amount=1, currency="EUR", window="month", time_zone="Europe/Berlin")
    assert window_bounds(month, _ms("2026-12-31T23:30:00+00:00")) == (
        _ms("2027-01-01T00:00:00+01:00"),
        _ms("2027-02-01T00:00:00+01:00"),
    )
    assert window_bounds(Budget(amount=1, currency="EUR"), now) == (0, None)
    utc_day = Budget(amount=1, currency="USD", window="day")
    assert window_bounds(utc_day, now) == (_ms("2026-03-29T00:00:00+00:00"), _ms("2026-03-30T00:00:00+00:00"))


def test_the_worst_case_takes_the_dearest_input_and_output_prices() -> None:
    plain = Prices(input="3", output="15")
    assert worst_case(plain, 1000, 100) == Decimal("0.0045")
    cached = Prices(input="3", output="15", cache_read="0.30", cache_write="3.75", reasoning="20")
    assert worst_case(cached, 1000, 100) == Decimal("0.00575")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (',"budget_key":""', "invalid job: budget_key must be 1-128 bytes, not 0"),
        (',"budget_key":"' + "é" * 65 + '"', "invalid job: budget_key must be 1-128 bytes, not 130"),
    ],
)
def test_a_job_with_a_bad_budget_key_is_refused(extra: str, message: str) -> None:
    with pytest.raises(JobError) as info:
        decode_job('{"route":"a","request":{"messages":[{"role":"user","content":"hi"}]}' + extra + "}")
    assert info.value.message == message


def test_a_job_carries_its_budget_key() -> None:
    job = decode_job('{"route":"a","request":{"messages":[{"role":"user","content":"hi"}]},"budget_key":"p1"}')
    assert job.budget_key == "p1"
