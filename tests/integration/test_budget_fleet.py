"""The budget of issue 38, measured on a fleet: three worker processes, 500 jobs of one tenant against a budget
that holds a small part of them, lost replies on the budget scripts and a worker SIGKILLed mid-run. Settled
spend never passes the budget, nothing stays reserved once idle, every job ends (completed, or refused
``budget_exceeded``, or a lost worker's attempt), and another tenant's jobs are never refused."""

from __future__ import annotations

import signal
import time
from decimal import ROUND_CEILING, Decimal
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sluice.harness.fake.provider import serve_fake_provider
from sluice.schemas.keys import Keys
from sluice.worker.capacity import scripts as cs
from tests.faults.resp_proxy import Fault, RespFaultProxy
from tests.integration.conftest import API_KEY, cleanup, client_for, make_config, write_config_file
from tests.integration.test_fault_enumeration import classifier
from tests.integration.test_takeover import Workers

pytestmark = pytest.mark.asyncio

ACME_JOBS, BOB_JOBS = 500, 50
AMOUNT = "0.004"  # USD at 1 USD per million tokens: 4,000 micro-units
TERMINAL = (b"completed", b"failed", b"interrupted")


def _job(rid: str, tenant: str) -> dict[str, object]:
    return {
        "route": "anthropic",
        "model": "synthetic;deltas=4;pace_ms=20",
        "request_id": rid,
        "tenant": tenant,
        "request": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20},
    }


async def _states(r: aioredis.Redis, keys: Keys, rids: list[str]) -> dict[str, dict[bytes, bytes]]:
    pipe = r.pipeline(transaction=False)
    for rid in rids:
        pipe.hmget(keys.request(rid).status, "state", "error", "cost")
    out = await pipe.execute()
    return {
        rid: dict(zip((b"state", b"error", b"cost"), vals, strict=True)) for rid, vals in zip(rids, out, strict=True)
    }


async def test_a_fleet_under_a_budget_never_passes_it(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix)
    bk = keys.budget("acme")
    async with (
        serve_fake_provider(api_key=API_KEY) as fake,
        RespFaultProxy.for_url(redis_url, classifier(keys)) as proxy,
    ):
        path = write_config_file(
            tmp_path / "c.toml",
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            claim_idle_ms=2000,
            heartbeat_ms=200,
            shutdown_grace=2.0,
            redis_socket_timeout=3.0,
        )
        path.write_text(
            path.read_text()
            + '[prices."anthropic"]\ninput = 1\noutput = 1\ncurrency = "USD"\n'
            + f'[budgets.acme]\namount = "{AMOUNT}"\ncurrency = "USD"\nroutes = ["anthropic"]\n'
            + '[budgets."*"]\namount = "100"\ncurrency = "USD"\nroutes = ["anthropic"]\n'
        )
        workers = Workers(path, tmp_path)
        acme = [f"acme-{i}" for i in range(ACME_JOBS)]
        bob = [f"bob-{i}" for i in range(BOB_JOBS)]
        try:
            async with client_for(make_config(redis_url, key_prefix, fake.base_url)) as client:
                for name in ("a", "b", "c"):
                    workers.start(name)
                # Lost replies and commands that never arrive, on the budget scripts, one after another; a worker
                # SIGKILLed while jobs run.
                faults = [
                    Fault(lab, 1, mode) for lab in ("reserve", "settle") for mode in ("lose_reply", "drop_command")
                ]
                state = {"armed": False, "fired": 0, "killed": False}

                def step() -> None:
                    if faults and not state["armed"]:
                        proxy.arm(faults[0])
                        state["armed"] = True
                    elif faults and faults[0].fired:
                        state["fired"] += 1
                        faults.pop(0)
                        proxy.arm(None)
                        state["armed"] = False

                started = time.monotonic()
                for i, rid in enumerate(acme):
                    await client.enqueue(_job(rid, "acme"))
                    if i % 10 == 0:
                        await client.enqueue(_job(bob[i // 10], "bob"))
                    if i % 5 == 0:
                        step()
                    if i == ACME_JOBS // 2:
                        victim = workers.procs[1]
                        victim.send_signal(signal.SIGKILL)
                        await anyio.to_thread.run_sync(victim.wait)
                        state["killed"] = True
                with anyio.fail_after(240):
                    while True:
                        step()
                        states = await _states(redis_client, keys, acme + bob)
                        if all(s[b"state"] in TERMINAL for s in states.values()):
                            break
                        await anyio.sleep(0.1)
                proxy.arm(None)
                elapsed = time.monotonic() - started
                assert state["killed"] and state["fired"] >= 3, state
                # Idle: a killed worker's reservation is charged at expiry by the store's next script.
                with anyio.fail_after(30):
                    while await redis_client.hlen(bk.res):
                        await anyio.sleep(0.2)
                        await redis_client.eval(cs.EXTEND, len(bk.script_keys()), *bk.script_keys(), "", 1)  # type: ignore[misc]
        finally:
            await workers.stop_all()
        try:
            states = await _states(redis_client, keys, acme + bob)
            line = "budgets.acme|0"
            spent = int(await redis_client.hget(bk.spent, line) or 0)
            assert spent <= 4000, spent  # never past the budget
            assert int(await redis_client.hget(bk.reserved, line) or 0) == 0
            assert await redis_client.zcard(bk.held) == 0
            completed = [s for rid, s in states.items() if rid.startswith("acme") and s[b"state"] == b"completed"]
            refused = [
                s for rid, s in states.items() if rid.startswith("acme") and b"budget_exceeded" in (s[b"error"] or b"")
            ]
            lost = [s for rid, s in states.items() if rid.startswith("acme") and b"worker_lost" in (s[b"error"] or b"")]
            assert len(completed) + len(refused) + len(lost) == ACME_JOBS
            assert completed and refused
            costs = sum(
                int((Decimal(s[b"cost"].decode()) * 1_000_000).to_integral_value(ROUND_CEILING)) for s in completed
            )
            assert spent >= costs, (spent, costs)
            for rid in bob:  # the other tenant: never refused
                assert b"budget_exceeded" not in (states[rid][b"error"] or b""), rid
            bob_done = sum(1 for rid in bob if states[rid][b"state"] == b"completed")
            assert bob_done >= BOB_JOBS - 3, bob_done
            print(
                f"fleet: {ACME_JOBS + BOB_JOBS} jobs in {elapsed:.1f} s; acme completed {len(completed)}, refused "
                f"{len(refused)}, lost {len(lost)}; spent {spent} of 4000 micro-units (completed costs {costs}); "
                f"bob completed {bob_done}"
            )
        finally:
            await cleanup(redis_client, key_prefix)
