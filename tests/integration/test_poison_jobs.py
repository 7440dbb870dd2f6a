"""Poison jobs (issue 36, item 9): entries a real worker process cannot decode, whatever their bytes, each end
(``failed`` with ``invalid_request``, or ``limit_exceeded`` past the size limit, where a request id can be
read; a dead letter in every case) and the worker keeps serving. Deep (2,000 and 100,000 levels), wide,
huge and non-UTF-8 jobs, as fresh deliveries and as pending entries a dead consumer left, some past
``max_deliveries`` with nothing readable; among the pending ones, the running jobs of a SIGKILLed worker,
which the survivor takes over all the same.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis

from sluice.schemas.keys import Keys
from tests.faults.invariants import TERMINAL_STATES
from tests.integration.conftest import cleanup, spawn_worker, write_config_file

pytestmark = pytest.mark.asyncio
GROUP = "sluice-workers"
MAX_DELIVERIES = 3
_WAIT_S = 60.0  # bounds a failing run; every wait is on state


def _job(rid: bytes | None, extra: bytes = b"{}", content: bytes = b'"hi"', model: bytes = b"synthetic") -> bytes:
    """A job as the client encodes it (route, request, then request_id: the id after the request)."""
    body = b'{"route":"anthropic","model":"' + model + b'","request":{"messages":[{"role":"user","content":' + content
    body += b'}],"extra":'
    return body + extra + b"}" + (b',"request_id":' + rid if rid is not None else b"") + b"}"


def _deep(n: int) -> bytes:
    return b'{"x":' + b"[" * n + b"]" * n + b"}"


def _wide(n: int) -> bytes:
    return b'{"x":[' + b",".join([b"0"] * n) + b"]}"


# request id (None: none can be read) -> (payload, the terminal's category)
FRESH: dict[str, tuple[bytes, str]] = {
    "deep-2k": (_job(b'"deep-2k"', _deep(2_000)), "invalid_request"),
    "deep-100k": (_job(b'"deep-100k"', _deep(100_000)), "invalid_request"),
    "wide": (_job(b'"wide"', _wide(200_000)), "invalid_request"),
    "huge": (_job(b'"huge"', b'{"x":"' + b"a" * (2 << 20) + b'"}'), "limit_exceeded"),
    "not-utf8": (_job(b'"not-utf8"', content=b'"h\xff\xfei"'), "invalid_request"),
}
# Payloads whose request id cannot be read: dead letters only.
UNREADABLE = {
    "deep-unnamed": b"[" * 100_000 + b"]" * 100_000,
    "not-utf8-id": _job(b'"id-\xff"'),
    "not-json": b"\xff\xfe\x00 not json at all",
}


async def _until(
    what: str, predicate: Callable[[], Awaitable[bool]], worker: subprocess.Popen[bytes], log: Path
) -> None:
    try:
        with anyio.fail_after(_WAIT_S):
            while not await predicate():
                assert worker.poll() is None, f"the worker exited ({worker.returncode}): {_tail(log)}"
                await anyio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {_WAIT_S:g} s: {what}; log: {_tail(log)}") from None


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _records(log: Path) -> list[dict[str, Any]]:
    return [msgspec.json.decode(x) for x in log.read_text(errors="replace").splitlines() if x.startswith("{")]


async def test_poison_jobs_each_end_and_never_stall_a_takeover(
    fake: Any, redis_url: str, key_prefix: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix)
    r = redis_client
    common: dict[str, object] = {"heartbeat_ms": 200, "max_deliveries": MAX_DELIVERIES, "shutdown_grace": 1.0}
    # The victim never takes anything over (it must not settle the dead consumer's entries before it dies).
    victim_cfg = write_config_file(
        tmp_path / "a.toml", redis_url, key_prefix, fake.base_url, consumer="victim", claim_idle_ms=600_000, **common
    )
    survivor_cfg = write_config_file(
        tmp_path / "b.toml", redis_url, key_prefix, fake.base_url, consumer="survivor", claim_idle_ms=1_000, **common
    )
    await r.xgroup_create(keys.jobs, GROUP, id="0", mkstream=True)
    entry_of: dict[str, str] = {}
    try:
        # A consumer that read poison entries and died: pending, first in the stream. Two are past
        # max_deliveries already (XCLAIM RETRYCOUNT), one of them unreadable through and through.
        for name, (payload, _) in FRESH.items():
            entry_of[f"pending-{name}"] = (
                await r.xadd(
                    keys.jobs, {"job": payload.replace(b'"' + name.encode() + b'"', f'"pending-{name}"'.encode())}
                )
            ).decode()
        for name, payload in UNREADABLE.items():
            entry_of[f"pending-{name}"] = (await r.xadd(keys.jobs, {"job": payload})).decode()
        entry_of["pending-no-field"] = (await r.xadd(keys.jobs, {"other": b"\xff"})).decode()
        await r.xreadgroup(GROUP, "dead", {keys.jobs: ">"}, count=len(entry_of))
        for name in ("pending-deep-unnamed", "pending-deep-100k"):  # the takeover's delivery passes the limit
            await r.execute_command("XCLAIM", keys.jobs, GROUP, "dead", 0, entry_of[name], "RETRYCOUNT", MAX_DELIVERIES)
        for name in FRESH:  # a request id that can be read has a status record, as the client writes it
            for rid in (name, f"pending-{name}"):
                await r.hsetnx(keys.request(rid).status, "state", "queued")

        # The victim runs five long jobs, then is killed: its entries are orphans behind the poison ones.
        victim_log = tmp_path / "victim.log"
        victim = spawn_worker(victim_cfg, victim_log)
        orphans = [f"orphan-{i}" for i in range(5)]
        for rid in orphans:
            await r.hsetnx(keys.request(rid).status, "state", "queued")
            await r.xadd(keys.jobs, {"job": _job(f'"{rid}"'.encode(), model=b"synthetic;deltas=400;pace_ms=25")})

        async def running() -> bool:
            states = [await r.hmget(keys.request(rid).status, "state", "worker") for rid in orphans]
            return all(s == [b"running", b"victim"] for s in states)

        await _until("the victim runs the five jobs", running, victim, victim_log)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)

        log = tmp_path / "survivor.log"
        survivor = spawn_worker(survivor_cfg, log)
        try:
            # Fresh poison deliveries, read by the survivor as any job, and a plain job after them.
            for name, (payload, _) in FRESH.items():
                entry_of[name] = (await r.xadd(keys.jobs, {"job": payload})).decode()
            for name, payload in UNREADABLE.items():
                entry_of[name] = (await r.xadd(keys.jobs, {"job": payload})).decode()
            await r.xadd(keys.jobs, {"job": _job(b'"plain"', model=b"synthetic;deltas=3")})

            async def settled() -> bool:
                rids = [*orphans, "plain", *FRESH, *(f"pending-{n}" for n in FRESH)]
                states = [await r.hget(keys.request(rid).status, "state") for rid in rids]
                pending = (await r.xpending(keys.jobs, GROUP))["pending"]
                return all(s in TERMINAL_STATES for s in states) and pending == 0

            await _until("every job ends, every entry acked", settled, survivor, log)
            assert survivor.poll() is None
            assert await r.hget(keys.request("plain").status, "state") == b"completed"
            for rid in orphans:  # taken over: a new attempt or the lost one's end, never left running
                assert await r.hget(keys.request(rid).status, "state") in TERMINAL_STATES

            letters = {f[b"entry_id"].decode(): f for _, f in await r.xrange(keys.dead_letters)}
            for name, (_, category) in FRESH.items():
                for rid in (name, f"pending-{name}"):
                    status = await r.hgetall(keys.request(rid).status)
                    if rid == "pending-deep-100k":  # past max_deliveries: dead-lettered as delivered too often
                        assert status[b"state"] == b"failed", (rid, status)
                        assert msgspec.json.decode(status[b"error"])["category"] == "worker_lost"
                    else:
                        assert status[b"state"] == b"failed", (rid, status)
                        error = msgspec.json.decode(status[b"error"])
                        assert error["category"] == category, (rid, error)
                        assert "\n" not in error["message"], error
                    letter = letters[entry_of[rid]]
                    assert letter[b"request_id"] == rid.encode(), (rid, letter)
            for name in [*UNREADABLE, *(f"pending-{n}" for n in UNREADABLE), "pending-no-field"]:
                letter = letters[entry_of[name]]
                assert b"request_id" not in letter or letter[b"request_id"].startswith(b"req-"), (name, letter)
                assert b"\n" not in letter[b"reason"], letter
            reasons = {
                name: letters[entry_of[name]][b"reason"].decode() for name in ("deep-2k", "pending-deep-unnamed")
            }
            assert reasons["deep-2k"] == "job nests 2003 levels deep, over the limit of 128", reasons
            assert reasons["pending-deep-unnamed"] == f"delivered {MAX_DELIVERIES + 1} times", reasons
            assert len(letters) == 2 * (len(FRESH) + len(UNREADABLE)) + 1  # one per poison entry, none twice

            messages = [str(x.get("msg")) for x in _records(log)]
            assert not [m for m in messages if m == "job failed unexpectedly" or m.startswith("reclaim failed")], (
                messages
            )
        finally:
            survivor.send_signal(signal.SIGTERM)
            survivor.wait(15)
    finally:
        await cleanup(r, key_prefix)
