"""Issue 22 item 4: fallback routes against the real fake provider. An attempt that fails before anything
was visible with an availability category goes at once to the next route of the chain (another dialect,
its own stream, its own stream.start naming the route); never after a visible delta, never on a refusal;
the retry policy resumes on the job's own route after the chain; every attempt's route is recorded."""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from sluice.schemas.events import BlockDelta, Event, StreamDone, StreamError, StreamStart, StreamWarning
from sluice.schemas.keys import Keys
from sluice.worker.config import RetryPolicy, Route
from tests.helpers import wait_all_acked
from tests.integration.conftest import KEY_ENV, cleanup, client_for, make_config, running_worker
from tests.integration.test_failures import FAST, _attempts
from tests.integration.test_takeover import Workers, _until

pytestmark = pytest.mark.asyncio

OK_GPT = "synthetic;deltas=3;text=from%20gpt"
OK_RESPONSES = "synthetic;deltas=2;text=from%20responses"


def _route(dialect: str, base_url: str, model: str | None = None, fallbacks: Sequence[str] = ()) -> Route:
    return Route(
        dialect=dialect,
        base_url=base_url,
        model=model,
        api_key_env=KEY_ENV,
        send_request_id=True,
        fallbacks=list(fallbacks),
    )


def _routes(base_url: str, *, claude: Sequence[str], gpt: str = OK_GPT, resp: str = OK_RESPONSES) -> dict[str, Route]:
    return {
        "claude": _route("anthropic", base_url, fallbacks=claude),  # no model: the job's is the scenario
        "gpt": _route("openai-chat", base_url, gpt),
        "resp": _route("openai-responses", base_url, resp),
    }


async def _run(fake, redis_url, key_prefix, redis_client, routes, model, *, retry=None, **job_extra):  # type: ignore[no-untyped-def]
    overrides: dict[str, Any] = {"routes": routes}
    if retry is not None:
        overrides["retry"] = retry
    config = make_config(redis_url, key_prefix, fake.base_url, **overrides)
    job = {
        "route": "claude",
        "model": model,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
        "timeouts": FAST,
        **job_extra,
    }
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await client.enqueue(job)
            result = await client.result(rid, timeout=60)
            events = [ev async for ev in client.events(rid)]
            status = await client.status(rid)
            record = await client.status_record(rid)
        await wait_all_acked(redis_client, Keys(key_prefix).jobs, config.group)
        return rid, result, _attempts(events), status, record
    finally:
        await cleanup(redis_client, key_prefix)


def _start(evs: Sequence[Event]) -> StreamStart:
    assert isinstance(evs[0], StreamStart)
    return evs[0]


def _ending(evs: Sequence[Event]) -> str:
    last = evs[-1]
    if isinstance(last, StreamDone):
        return "completed"
    assert isinstance(last, StreamError)
    return f"{last.status}/{last.error.category}"


def _text(evs: Sequence[Event]) -> str:
    return "".join(e.delta.text for e in evs if isinstance(e, BlockDelta) and e.block.kind == "text")


def _seen(fake: Any, rid: str) -> list[tuple[str | None, str | None, int]]:
    return [(r.dialect, r.scenario, r.status) for r in fake.stats.find(request_id=rid)]


async def test_a_529_before_the_first_byte_falls_back_to_another_dialect_at_once(
    fake, redis_url, key_prefix, redis_client, caplog
):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="sluice.worker")
    # A back-off this long would outlast the test: the hop must not wait for one.
    slow = RetryPolicy(max_attempts=3, base_delay=120.0, max_delay=120.0, max_total=600.0)
    rid, result, attempts, status, record = await _run(
        fake, redis_url, key_prefix, redis_client, _routes(fake.base_url, claude=["gpt"]), "synthetic;status=529",
        retry=slow,
    )  # fmt: skip
    assert list(attempts) == [1, 2]
    first, second = _start(attempts[1]), _start(attempts[2])
    assert (first.route, first.dialect, _ending(attempts[1])) == ("claude", "anthropic", "failed/overloaded")
    assert (second.route, second.dialect, second.provider) == ("gpt", "openai-chat", "openai")
    assert _ending(attempts[2]) == "completed" and _text(attempts[2]) == "from gpt"
    assert result.status == "completed" and result.dialect == "openai-chat"
    # the status: the job's own route, the route that served it, every attempt's route in order
    assert (status.route, status.attempt_route, status.routes_tried) == ("claude", "gpt", ["claude", "gpt"])
    assert record["routes_tried"] == '["claude","gpt"]' and status.attempt == 2
    # the fake saw the Anthropic request refused, then the OpenAI one, with the gpt route's own model
    assert _seen(fake, rid) == [("anthropic", "synthetic;status=529", 529), ("openai-chat", OK_GPT, 200)]
    said = [r.getMessage() for r in caplog.records if getattr(r, "request_id", None) == rid]
    assert "falling back" in said and "retrying" not in said


async def test_no_fallback_after_a_visible_delta(fake, redis_url, key_prefix, redis_client):  # type: ignore[no-untyped-def]
    rid, result, attempts, status, _ = await _run(
        fake, redis_url, key_prefix, redis_client, _routes(fake.base_url, claude=["gpt"]),
        "synthetic;deltas=8;error_after=4;error=overloaded",
    )  # fmt: skip
    assert list(attempts) == [1]
    assert _text(attempts[1]) != "" and _ending(attempts[1]) == "failed/overloaded"
    assert result.status == "failed"
    assert (status.attempt_route, status.routes_tried) == ("claude", ["claude"])
    assert [d for d, _, _ in _seen(fake, rid)] == ["anthropic"]


@pytest.mark.parametrize(("code", "category"), [(401, "authentication"), (400, "invalid_request")])
async def test_no_fallback_on_a_refusal(fake, redis_url, key_prefix, redis_client, code, category):  # type: ignore[no-untyped-def]
    rid, result, attempts, status, _ = await _run(
        fake, redis_url, key_prefix, redis_client, _routes(fake.base_url, claude=["gpt"]), f"synthetic;status={code}"
    )
    assert list(attempts) == [1] and _ending(attempts[1]) == f"failed/{category}"
    assert status.routes_tried == ["claude"] and result.error is not None
    assert _seen(fake, rid) == [("anthropic", f"synthetic;status={code}", code)]


async def test_the_chain_is_tried_in_order(fake, redis_url, key_prefix, redis_client):  # type: ignore[no-untyped-def]
    routes = _routes(fake.base_url, claude=["gpt", "resp"], gpt="synthetic;status=503")
    rid, result, attempts, status, _ = await _run(
        fake, redis_url, key_prefix, redis_client, routes, "synthetic;status=429"
    )
    assert [(_start(a).route, _start(a).dialect, _ending(a)) for a in attempts.values()] == [
        ("claude", "anthropic", "failed/rate_limit"),
        ("gpt", "openai-chat", "failed/overloaded"),
        ("resp", "openai-responses", "completed"),
    ]
    assert _text(attempts[3]) == "from responses" and result.dialect == "openai-responses"
    assert (status.attempt_route, status.routes_tried) == ("resp", ["claude", "gpt", "resp"])
    assert [d for d, _, _ in _seen(fake, rid)] == ["anthropic", "openai-chat", "openai-responses"]


async def test_the_attempt_budget_is_max_attempts_plus_the_chain(fake, redis_url, key_prefix, redis_client):  # type: ignore[no-untyped-def]
    # Every route overloaded: the chain once, then the retry policy on the job's own route.
    routes = _routes(fake.base_url, claude=["gpt", "resp"], gpt="synthetic;status=529", resp="synthetic;status=500")
    retry = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.05, max_total=5)
    rid, result, attempts, status, _ = await _run(
        fake, redis_url, key_prefix, redis_client, routes, "synthetic;status=529", retry=retry
    )
    assert [(_start(a).route, _ending(a)) for a in attempts.values()] == [
        ("claude", "failed/overloaded"),
        ("gpt", "failed/overloaded"),
        ("resp", "failed/server_error"),
        ("claude", "failed/overloaded"),
    ]
    assert result.status == "failed" and result.error is not None and result.error.category == "overloaded"
    assert status.routes_tried == ["claude", "gpt", "resp", "claude"] and status.attempt == 4
    assert len(_seen(fake, rid)) == 4


async def test_a_timeout_before_the_first_byte_falls_back(fake, redis_url, key_prefix, redis_client):  # type: ignore[no-untyped-def]
    _, result, attempts, status, _ = await _run(
        fake, redis_url, key_prefix, redis_client, _routes(fake.base_url, claude=["gpt"]),
        "synthetic;deltas=3;stall_headers=1",
    )  # fmt: skip
    assert [(_start(a).route, _ending(a)) for a in attempts.values()] == [
        ("claude", "interrupted/timeout"),
        ("gpt", "completed"),
    ]
    assert result.status == "completed" and status.routes_tried == ["claude", "gpt"]


async def test_a_jobs_fallbacks_replace_the_routes(fake, redis_url, key_prefix, redis_client):  # type: ignore[no-untyped-def]
    routes = _routes(fake.base_url, claude=["gpt"])
    _, _, attempts, status, _ = await _run(
        fake, redis_url, key_prefix, redis_client, routes, "synthetic;status=529", fallbacks=["resp"]
    )
    assert [_start(a).route for a in attempts.values()] == ["claude", "resp"]
    assert status.state == "completed" and status.routes_tried == ["claude", "resp"]
    # an empty list: no fallback for this job, the retry policy alone (three attempts on its own route)
    _, _, attempts, status, _ = await _run(
        fake, redis_url, key_prefix, redis_client, routes, "synthetic;status=529", fallbacks=[]
    )
    assert [_start(a).route for a in attempts.values()] == ["claude", "claude", "claude"]
    assert status.state == "failed" and status.routes_tried == ["claude", "claude", "claude"]


async def test_a_job_naming_an_unconfigured_fallback_is_refused_and_dead_lettered(
    fake, redis_url, key_prefix, redis_client
):  # type: ignore[no-untyped-def]
    config = make_config(redis_url, key_prefix, fake.base_url, routes=_routes(fake.base_url, claude=[]))
    job = {"route": "claude", "fallbacks": ["gtp"], "request": {"messages": [{"role": "user", "content": "hi"}]}}
    try:
        async with running_worker(config), client_for(config) as client:
            rid = await client.enqueue(job)
            result = await client.result(rid, timeout=30)
            status = await client.status(rid)
        assert result.status == "failed" and result.error is not None
        assert (result.error.category, result.error.message) == (
            "invalid_request",
            "invalid job: fallbacks names an unknown route 'gtp'",
        )
        assert status.routes_tried == []  # nothing was sent anywhere
        letters = await redis_client.xrange(Keys(key_prefix).shard(0).dead_letters)
        assert [f[b"reason"] for _, f in letters] == [b"invalid job: fallbacks names an unknown route 'gtp'"]
        assert fake.stats.find(request_id=rid) == []
    finally:
        await cleanup(redis_client, key_prefix)


async def test_the_fallback_request_is_built_for_its_dialect_and_says_what_it_left_out(
    fake, redis_url, key_prefix, redis_client
):  # type: ignore[no-untyped-def]
    """Anthropic thinking in the conversation goes to the Anthropic route as it is; the OpenAI fallback
    cannot take it back, so its attempt (only that one) says so in a request_adapted warning."""
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "reasoning", "dialect": "anthropic", "text": "thinking", "signature": "c2lnbmF0dXJl"},
                {"type": "text", "text": "hello"},
            ],
        },
        {"role": "user", "content": "and then?"},
    ]
    _, result, attempts, _, _ = await _run(
        fake, redis_url, key_prefix, redis_client, _routes(fake.base_url, claude=["gpt"]), "synthetic;status=529",
        request={"messages": messages},
    )  # fmt: skip
    assert result.status == "completed" and list(attempts) == [1, 2]
    assert [e for e in attempts[1] if isinstance(e, StreamWarning)] == []
    (warning,) = [e for e in attempts[2] if isinstance(e, StreamWarning)]
    assert warning.code == "request_adapted" and warning.message == (
        "messages[1]: reasoning left out (openai-chat has no place for it)"
    )
    assert attempts[2][-2] == warning  # just before the terminal, as on any attempt


async def test_after_a_takeover_the_lost_workers_routes_are_kept_and_the_chain_starts_again(
    fake, redis_url, key_prefix, redis_client, tmp_path
):  # type: ignore[no-untyped-def]
    """Worker a (a process, configured by TOML) hops to gpt and is killed while gpt trickles its answer;
        b takes over: the lost attempt on gpt ends worker_lost (nothing was visible), b runs its own claim from
        the job's route (529 again, the chain again), and routes_tried names the lost worker's routes too, as
    far as their streams tell ("" for the lost attempt, which stored no stream.start)."""
    slow_gpt = "synthetic;deltas=3;byte_ms=1000;times=1;id=fb-takeover"  # the head, then a byte a second
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'redis_url = "{redis_url}"\nkey_prefix = "{key_prefix}"\n'
        "claim_idle_ms = 3000\nheartbeat_ms = 300\nshutdown_grace = 2.0\n"
        f'[routes.claude]\ndialect = "anthropic"\nbase_url = "{fake.base_url}"\napi_key_env = "{KEY_ENV}"\n'
        'send_request_id = true\nfallbacks = ["gpt"]\n'
        f'[routes.gpt]\ndialect = "openai-chat"\nbase_url = "{fake.base_url}"\napi_key_env = "{KEY_ENV}"\n'
        f'send_request_id = true\nmodel = "{slow_gpt}"\n'
    )
    workers = Workers(cfg, tmp_path)
    config = make_config(redis_url, key_prefix, fake.base_url)
    job = {
        "route": "claude",
        "model": "synthetic;status=529",
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }
    try:
        async with client_for(config) as client:
            a = workers.start("a")
            rid = await client.enqueue(job)
            await _until(lambda: [r.dialect for r in fake.stats.find(request_id=rid)] == ["anthropic", "openai-chat"])
            with anyio.fail_after(30):  # until a's gpt attempt has stored something (the response head)
                while (await client.status(rid)).attempt < 2:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            a.send_signal(signal.SIGKILL)
            workers.start("b")
            result = await client.result(rid, timeout=60)
            status = await client.status(rid)
            attempts = {n: await client.read_attempt(rid, n) for n in range(1, status.attempt + 1)}
        assert result.status == "completed"
        assert [(_start(a).route or "", _ending(a)) for a in attempts.values()] == [
            ("claude", "failed/overloaded"),
            ("", "interrupted/worker_lost"),  # a stored only gpt's response head, no stream.start: b cannot tell
            ("claude", "failed/overloaded"),
            ("gpt", "completed"),
        ]
        assert (status.route, status.attempt_route) == ("claude", "gpt")
        assert status.routes_tried == ["claude", "", "claude", "gpt"]  # a's first attempt read from its stream
    finally:
        await workers.stop_all()
        await cleanup(redis_client, key_prefix)
