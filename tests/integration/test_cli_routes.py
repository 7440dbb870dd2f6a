"""``sluice routes`` and the live reason of ``sluice status`` against a real Redis: a seeded capacity store
(as the capacity scripts write it) printed exactly, its ``--json`` shape, and the error / empty paths."""

from __future__ import annotations

import json
from collections.abc import Iterator

import msgspec
import pytest
import redis

from sluice.schemas.keys import Keys
from sluice.worker.pipeline.membership import Member
from sluice.worker.redis.connect import safe_url
from tests.helpers import run_cli

FAR = 4102444800000  # 2100-01-01T00:00:00.000Z: a cooldown that is on whenever the test runs

LIMITS = {
    "c": 20,
    "rpm": 600,
    "tpm": 0,
    "margin": 1000,
    "cmin": 250,
    "cmax": 30000,
    "cbase": 1000,
    "tenants": {"acme": {"w": 2, "c": 5}, "*": {"w": 1}},
}


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _now_ms(r: redis.Redis) -> int:
    secs, micros = r.time()
    return int(secs) * 1000 + int(micros) // 1000


def _register(r: redis.Redis, keys: Keys, consumer: str, routes: list[str]) -> None:
    r.hset(keys.workers, consumer, msgspec.json.encode(Member(routes=routes, at=_now_ms(r))))


def _seed(r: redis.Redis, keys: Keys, route: str, *, cooldown_until: int = 0) -> None:
    rk = keys.route(route)
    now = _now_ms(r)
    r.hset(
        rk.state,
        mapping={
            "limits": json.dumps(LIMITS),
            "limits_by": "w1",
            "cooldown_until": cooldown_until,
            "cooldown_reason": "rate_limit",
            "cooldown_streak": 2,
            "admitted": 120,
            "parked": 30,
            "refused_concurrency": 14,
            "refused_rate": 2,
            "expired": 1,
            "provider_429": 3,
        },
    )
    # three live permits, one past its expiry (a dead worker's, not yet swept): 3 in flight
    r.zadd(rk.permits, {"t1": now + 600_000, "t2": now + 600_000, "t3": now + 600_000, "dead": now - 5})
    r.zadd(rk.reserved, {"t4": now + 600_000})
    # two admissions inside the window, one before it
    r.zadd(rk.rpm, {"t1": now - 1000, "t2": now - 30_000, "old": now - 120_000})
    r.hset(
        rk.drr,
        mapping={
            "n:interactive:acme": 2,
            "n:batch:bulk": 7,
            "n:batch:": 3,
            "n:batch:gone": 0,
            "d:batch:bulk": 1,
            "f:acme": 2,
            "f:bulk": 1,
            "f:idle": 0,
        },
    )


EXPECTED = """\
claude
  limits       max_concurrency 20, requests_per_minute 600, tokens_per_minute none
  tenants      * weight 1; acme weight 2 max_concurrency 5
  in flight    3 of 20 (reserved 1)
  held by      acme 2, bulk 1
  last minute  2 of 600 requests, 0 tokens
  waiting      12: interactive 2 (acme 2), batch 10 ((no tenant) 3, bulk 7)
  cooldown     until 2100-01-01T00:00:00.000Z (rate_limit, streak 2)
  admitted     120
  parked       30
  refused      cooldown 0, concurrency 14, rate 2, tokens 0
  expired      1
  cooldowns    3
  now          refusing: cooldown
"""


def test_routes_prints_a_seeded_store_exactly(
    r: redis.Redis, redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(key_prefix)
    _register(r, keys, "w1", ["claude", "plain"])  # "plain" has no limits: no store, not shown
    _seed(r, keys, "claude", cooldown_until=FAR)
    code, out, err = run_cli(capsys, "routes", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert (code, err) == (0, "")
    assert out == EXPECTED


def test_routes_live_reason_follows_the_refusal_order(
    r: redis.Redis, redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(key_prefix)
    _register(r, keys, "w1", ["claude"])
    _seed(r, keys, "claude")  # no cooldown: 3 + 1 reserved of 20, 2 of 600: admitting
    code, out, _ = run_cli(capsys, "routes", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert code == 0 and out.splitlines()[7:8] == ["  cooldown     none"]
    assert out.splitlines()[-1] == "  now          admitting"
    rk = keys.route("claude")
    now = _now_ms(r)
    r.zadd(rk.rpm, {f"x{i}": now - 10 for i in range(598)})  # 600 in the window: rate
    _, out, _ = run_cli(capsys, "routes", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert out.splitlines()[-1] == "  now          refusing: rate"
    r.zadd(rk.permits, {f"p{i}": now + 600_000 for i in range(16)})  # 19 + 1 reserved of 20: concurrency first
    _, out, _ = run_cli(capsys, "routes", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert out.splitlines()[-1] == "  now          refusing: concurrency"


def test_routes_json_is_one_document_of_the_same_figures(
    r: redis.Redis, redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(key_prefix)
    _register(r, keys, "w1", ["claude"])
    _seed(r, keys, "claude", cooldown_until=FAR)
    before = _now_ms(r)
    code, out, err = run_cli(capsys, "routes", "--json", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert set(doc) == {"prefix", "now_ms", "routes"} and doc["prefix"] == key_prefix
    assert before <= doc["now_ms"] <= _now_ms(r)
    (route,) = doc["routes"]
    remaining = route.pop("cooldown_remaining_ms")
    assert remaining == FAR - doc["now_ms"]
    assert route == {
        "route": "claude",
        "limits": {
            "max_concurrency": 20,
            "requests_per_minute": 600,
            "tokens_per_minute": 0,
            "rate_window_margin_ms": 1000,
            "cooldown_min_ms": 250,
            "cooldown_max_ms": 30000,
            "cooldown_base_ms": 1000,
            "tenants": {"*": {"weight": 1, "max_concurrency": 0}, "acme": {"weight": 2, "max_concurrency": 5}},
        },
        "in_flight": 3,
        "reserved": 1,
        "requests_last_window": 2,
        "tokens_last_window": 0,
        "waiting": {"interactive": {"acme": 2}, "batch": {"": 3, "bulk": 7}},
        "waiting_total": 12,
        "tenants_in_flight": {"acme": 2, "bulk": 1},
        "cooldown_until": FAR,
        "cooldown_reason": "rate_limit",
        "cooldown_streak": 2,
        "counters": {
            "admitted": 120,
            "parked": 30,
            "refused": {"cooldown": 0, "concurrency": 14, "rate": 2, "tokens": 0},
            "expired": 1,
            "cooldowns": 3,
        },
        "live_reason": "cooldown",
    }


def test_routes_route_filter_and_several_routes(
    r: redis.Redis, redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(key_prefix)
    _register(r, keys, "w1", ["b", "a"])
    _seed(r, keys, "a")
    _seed(r, keys, "b")
    _, out, _ = run_cli(capsys, "routes", "--json", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert [x["route"] for x in json.loads(out)["routes"]] == ["a", "b"]
    _, out, _ = run_cli(capsys, "routes", "--route", "b", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert out.splitlines()[0] == "b" and "\na\n" not in out
    code, out, err = run_cli(capsys, "routes", "--route", "zz", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert (code, out) == (2, "")
    assert err == (
        f"sluice routes: route 'zz' has no capacity store under key prefix {key_prefix!r} at "
        f"{safe_url(redis_url)} (a route without limits?)\n"
    )


def test_routes_unknown_prefix_exits_2_naming_it(
    redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "routes", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert (code, out) == (2, "")
    assert err == (
        f"sluice routes: nothing under key prefix {key_prefix!r} at {safe_url(redis_url)}: no worker ever "
        "registered and no route store; check --key-prefix / --redis-url against the workers' configuration\n"
    )


def test_routes_without_limits_says_so_and_exits_0(
    r: redis.Redis, redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _register(r, Keys(key_prefix), "w1", ["plain", "other"])
    code, out, err = run_cli(capsys, "routes", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert (code, out) == (0, "")
    assert err == (
        f"sluice routes: no route of key prefix {key_prefix!r} at {safe_url(redis_url)} has capacity limits "
        "(routes: other, plain)\n"
    )
    code, out, _ = run_cli(capsys, "routes", "--json", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert code == 0 and json.loads(out) == {"prefix": key_prefix, "now_ms": None, "routes": []}


def test_status_of_a_parked_job_shows_its_route_now(
    r: redis.Redis, redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(key_prefix)
    _seed(r, keys, "claude", cooldown_until=FAR)
    r.hset(
        keys.request("p-1").status,
        mapping={
            "state": "queued",
            "request_id": "p-1",
            "route": "claude",
            "waiting_on": "cooldown",
            "waiting_route": "claude",
            "waiting_since": 1700000000000,
        },
    )
    code, out, err = run_cli(capsys, "status", "p-1", "--redis-url", redis_url, "--key-prefix", key_prefix)
    assert (code, err) == (5, "")
    doc = json.loads(out)
    assert (doc["waiting_on"], doc["waiting_route"], doc["waiting_since"]) == ("cooldown", "claude", 1700000000000)
    now = doc["waiting_route_now"].pop("now_ms")
    assert now > 1700000000000
    assert doc["waiting_route_now"] == {
        "live_reason": "cooldown",
        "in_flight": 3,
        "max_concurrency": 20,
        "requests_last_window": 2,
        "requests_per_minute": 600,
        "waiting": 12,
        "cooldown_until": FAR,
    }


@pytest.mark.asyncio
async def test_routes_and_status_against_a_running_worker_with_waiting_jobs(
    redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import anyio
    import redis.asyncio as aioredis

    from sluice.harness.fake.provider import serve_fake_provider
    from sluice.worker.config import Route
    from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, client_for, make_config, running_worker

    def job(scenario: str, **extra: object) -> dict[str, object]:
        return {
            "route": "claude",
            "model": scenario,
            "request": {"messages": [{"role": "user", "content": "hi"}]},
            **extra,
        }

    async def cli(*argv: str) -> tuple[int, str, str]:  # the command runs its own event loop: in a thread
        return await anyio.to_thread.run_sync(
            lambda: run_cli(capsys, *argv, "--redis-url", redis_url, "--key-prefix", key_prefix)
        )

    r = aioredis.Redis.from_url(redis_url)
    try:
        async with serve_fake_provider(api_key=API_KEY) as fake:
            route = Route(
                dialect="anthropic",
                base_url=fake.base_url,
                model="synthetic",
                api_key_env=KEY_ENV,
                send_request_id=True,
                max_concurrency=1,
            )
            config = make_config(redis_url, key_prefix, fake.base_url, routes={"claude": route}, consumer="w1")
            async with running_worker(config), client_for(config) as client:
                held = await client.enqueue(job("synthetic;deltas=2;hold=g"))
                with anyio.fail_after(30):
                    await fake.stats.wait_until(lambda s: s.limiter.in_flight == 1)
                waiting = [
                    await client.enqueue(job("synthetic;deltas=2", tenant="a", priority="batch")),
                    await client.enqueue(job("synthetic;deltas=2", tenant="a", priority="batch")),
                    await client.enqueue(job("synthetic;deltas=2", tenant="b")),
                ]
                with anyio.fail_after(30):
                    for rid in waiting:
                        status = Keys(key_prefix).request(rid).status
                        while await r.hget(status, "waiting_on") != b"concurrency":  # noqa: ASYNC110
                            await anyio.sleep(0.02)  # the worker writes it: nothing to wait on but a poll
                code, out, err = await cli("routes", "--json")
                assert (code, err) == (0, "")
                (view,) = json.loads(out)["routes"]
                assert view["route"] == "claude" and view["limits"]["max_concurrency"] == 1
                assert (view["in_flight"], view["waiting_total"], view["live_reason"]) == (1, 3, "concurrency")
                assert view["waiting"] == {"interactive": {"b": 1}, "batch": {"a": 2}}
                assert view["tenants_in_flight"] == {"": 1}
                assert view["counters"]["admitted"] == 1 and view["counters"]["parked"] == 3
                code, out, _ = await cli("routes")
                assert code == 0 and "  waiting      3: interactive 1 (b 1), batch 2 (a 2)\n" in out
                assert out.endswith("  now          refusing: concurrency\n")
                code, out, _ = await cli("status", waiting[2])
                doc = json.loads(out)
                assert code == 5 and (doc["state"], doc["waiting_on"], doc["waiting_route"]) == (
                    "queued",
                    "concurrency",
                    "claude",
                )
                assert doc["waiting_route_now"]["live_reason"] == "concurrency"
                assert doc["waiting_route_now"]["in_flight"] == 1 and doc["waiting_route_now"]["waiting"] == 3
                fake.release("g")
                results = [await client.result(rid, timeout=60) for rid in [held, *waiting]]
            assert [x.status for x in results] == ["completed"] * 4
            code, out, _ = await cli("routes", "--json")
            (view,) = json.loads(out)["routes"]
            # the worker gone (it left the registry): the store is still found and shown
            assert (view["in_flight"], view["waiting_total"], view["counters"]["admitted"]) == (0, 0, 4)
    finally:
        await cleanup(r, key_prefix)
        await r.aclose()
