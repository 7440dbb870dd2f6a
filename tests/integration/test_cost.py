"""Cost on every terminal, from the real worker against the fake provider: completed, failed and interrupted
requests carry ``cost``, ``currency`` and ``prices_version`` in the status and the terminal entry, computed
from the usage the status records; a stream cut before any usage report says ``usage_reported = 0``."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import anyio
import msgspec
import pytest

from sluice.client.terminals import Terminal
from sluice.normalizer.pricing import Prices, cost_of, format_cost
from sluice.schemas.events import Usage
from sluice.schemas.status import Status
from tests.integration.conftest import DIALECTS, client_for, make_config, running_worker

PRICES = Prices(input="3", output="15", cache_read="0.3", cache_write="3.75", reasoning="15", currency="EUR")
CASES = [(d, "synthetic;deltas=5;reasoning=2", "completed") for d in DIALECTS] + [
    ("anthropic", "synthetic;deltas=6;error_after=3", "failed"),
    ("openai-responses", "synthetic;deltas=20;reset=3", "interrupted"),
    ("openai-chat", "synthetic;deltas=20;reset=3", "interrupted"),
]


async def _run(redis_url: str, key_prefix: str, base_url: str, **config: object) -> list[tuple[dict, dict]]:
    cfg = make_config(redis_url, key_prefix, base_url, **config)
    out = []
    async with running_worker(cfg), client_for(cfg) as c:
        rids = []
        for i, (route, model, _) in enumerate(CASES):
            job = {
                "route": route,
                "model": model,
                "request_id": f"cost-{i}",
                "request": {"messages": [{"role": "user", "content": "hi"}]},
            }
            await c.redis.xadd(c.keys.jobs, {"job": msgspec.json.encode(job)})
            rids.append(f"cost-{i}")
        for rid in rids:
            with anyio.fail_after(30):
                while (st := await c.status_record(rid)).get("published") != "1":  # noqa: ASYNC110 - Redis state
                    await anyio.sleep(0.02)
            entry = next(
                {k.decode(): v.decode() for k, v in f.items()}
                for _, f in await c.redis.xrange(c.keys.terminal)
                if f[b"request_id"].decode() == rid
            )
            out.append((st, entry))
    return out


@pytest.mark.asyncio
async def test_every_terminal_carries_its_cost(redis_url: str, key_prefix: str, fake: object) -> None:
    prices = {d: PRICES for d in DIALECTS}
    results = await _run(redis_url, key_prefix, fake.base_url, prices=prices, prices_version="2026-12-01")  # type: ignore[attr-defined]
    for (route, _, state), (st, entry) in zip(CASES, results, strict=True):
        assert st["state"] == state, (route, st)
        if st.get("usage"):
            usage = msgspec.json.decode(st["usage"], type=Usage)
            want = format_cost(cost_of(usage, PRICES, route) or Decimal(0))
            assert (st["usage_reported"], st["cost"], st["currency"], st["prices_version"]) == (
                "1",
                want,
                "EUR",
                "2026-12-01",
            ), (route, st)
            assert Decimal(want) > 0
        else:
            assert st["usage_reported"] == "0" and "cost" not in st, (route, st)
        for name in ("usage_reported", "cost", "currency", "prices_version"):
            assert entry.get(name) == st.get(name), (route, name)
        typed = Status.from_record(st)
        assert typed.usage_reported is (st["usage_reported"] == "1") and typed.cost == st.get("cost")
        t = Terminal.from_entry("s", "1-0", {k.encode(): v.encode() for k, v in entry.items()})
        assert (t.usage_reported, t.cost, t.currency) == (
            typed.usage_reported,
            st.get("cost", ""),
            st.get("currency", ""),
        )
    states = [st["state"] for st, _ in results]
    assert states.count("failed") == 1 and states.count("interrupted") == 2
    # The cut OpenAI Chat stream ended before its usage chunk: no usage, so no cost (not a cost of 0).
    assert results[-1][0]["usage_reported"] == "0"
    assert any(st["state"] != "completed" and "cost" in st for st, _ in results)  # failed ones are billed too


@pytest.mark.asyncio
async def test_a_litellm_price_file_prices_by_model(
    redis_url: str, key_prefix: str, fake: object, tmp_path: Path
) -> None:
    path = tmp_path / "model_prices_and_context_window.json"
    path.write_text(
        json.dumps(
            {"synthetic;deltas=5;reasoning=2": {"input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05}}
        )
    )
    results = await _run(redis_url, key_prefix, fake.base_url, price_file=str(path))  # type: ignore[attr-defined]
    priced = [(route, st) for (route, model, _), (st, _) in zip(CASES, results, strict=True) if "cost" in st]
    assert [r for r, _ in priced] == list(DIALECTS)  # only the model the file names
    for route, st in priced:
        usage = msgspec.json.decode(st["usage"], type=Usage)
        assert st["cost"] == format_cost(cost_of(usage, Prices(input="3", output="15"), route) or Decimal(0))
        assert st["currency"] == "USD" and st["prices_version"].startswith("sha256:")


@pytest.mark.asyncio
async def test_a_fallback_attempt_is_priced_by_its_own_route(redis_url: str, key_prefix: str, fake: object) -> None:
    home, other = Prices(input="100", output="100"), Prices(input="1", output="2", currency="EUR")
    cfg = make_config(redis_url, key_prefix, fake.base_url, prices={"anthropic": home, "openai-chat": other})  # type: ignore[attr-defined]
    async with running_worker(cfg), client_for(cfg) as c:
        job = {
            "route": "anthropic",
            "model": "synthetic;status=529",
            "fallbacks": ["openai-chat"],
            "request_id": "cost-fallback",
            "request": {"messages": [{"role": "user", "content": "hi"}]},
        }
        await c.redis.xadd(c.keys.jobs, {"job": msgspec.json.encode(job)})
        with anyio.fail_after(30):
            while (st := await c.status_record("cost-fallback")).get("published") != "1":  # noqa: ASYNC110
                await anyio.sleep(0.02)
    assert (st["state"], st["attempt_route"]) == ("completed", "openai-chat"), st
    usage = msgspec.json.decode(st["usage"], type=Usage)
    assert st["cost"] == format_cost(cost_of(usage, other, "openai-chat") or Decimal(0)) and st["currency"] == "EUR"
