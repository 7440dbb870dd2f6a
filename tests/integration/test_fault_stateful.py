"""Random interleavings of faults over a few concurrent requests (issue 13's method, the stateful part):
lost Redis replies, worker processes killed (SIGKILL) and started, and Redis itself killed and restarted
(AOF with ``appendfsync always``, so what it acknowledged survives), on a limited route also for longer than
the workers' ``redis_outage_limit``. Whatever hypothesis chooses, no worker exits on its own, and once the
faults stop every request ends with exactly one terminal status and one terminal-stream entry, its attempts
are valid streams whose raw references exist, its job is acked, no attempt reached the provider twice, and
no secret is stored.

The machine runs on a private Redis the test starts (it kills it), behind a RESP fault proxy; workers are
real processes; the event loop (proxy, fake provider) runs in a portal thread, as hypothesis' stateful
tests are synchronous.
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import anyio
import anyio.from_thread
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sluice.harness.embedded_redis import redis_server_binary
from sluice.harness.fake.provider import serve_fake_provider
from sluice.schemas.keys import Keys, decode_lease
from sluice.worker.capacity import scripts as cs
from tests.faults.invariants import TERMINAL_STATES, assert_no_secret, check_request
from tests.faults.persistent_redis import PersistentRedis
from tests.faults.resp_proxy import Fault, RespFaultProxy
from tests.integration.conftest import API_KEY, KEY_ENV, spawn_worker, write_config_file
from tests.integration.test_fault_enumeration import classifier

PREFIX = "sluice-stateful"
_OUTAGE_LIMIT = 1.0  # the limited machine's workers' redis_outage_limit (seconds)
LABELS = ["jobs_read", "claim", "append", "finalize", "publish", "mark_published", "ack", "heartbeat"]


class FaultMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.redis = PersistentRedis()
        self.redis.start()
        self.keys = Keys(PREFIX)
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self.fake_cm = self.portal.wrap_async_context_manager(serve_fake_provider(api_key=API_KEY))
        self.fake = self.fake_cm.__enter__()
        self.proxy_cm = self.portal.wrap_async_context_manager(
            RespFaultProxy.for_url(self.redis.url, classifier(self.keys))
        )
        self.proxy = self.proxy_cm.__enter__()
        self.tmp = Path(tempfile.mkdtemp(prefix="sluice-stateful-w-"))
        self.config = write_config_file(
            self.tmp / "c.toml",
            self.proxy.url_for(self.redis.url),
            PREFIX,
            self.fake.base_url,
            claim_idle_ms=1000,
            heartbeat_ms=200,
            redis_socket_timeout=2.0,
            shutdown_grace=1.0,
            redis_outage_limit=getattr(self, "_outage_limit", 60.0),
        )
        if getattr(self, "_limited", False):  # CapacityFaultMachine: the jobs' route has a limit
            text = self.config.read_text().replace(
                '[routes."anthropic"]\n', '[routes."anthropic"]\nmax_concurrency = 2\n'
            )
            self.config.write_text(text)
        if getattr(self, "_budgeted", False):  # BudgetFaultMachine: tenant acme's jobs under a budget
            self.config.write_text(
                self.config.read_text() + '\n[prices."anthropic"]\ninput = 1\noutput = 1\ncurrency = "USD"\n'
                '[budgets.acme]\namount = "0.0015"\ncurrency = "USD"\nroutes = ["anthropic"]\n'
            )
        self.workers: list[subprocess.Popen[bytes]] = []
        # The workers this machine started and has not killed. Rules choose from this list, never from the
        # processes' own state: hypothesis replays a case by its choices, and a precondition that read a
        # process's liveness would change them (a worker that died on its own fails the invariant instead).
        self.live: list[subprocess.Popen[bytes]] = []
        self.requests: list[str] = []
        self.disruptions = 0  # worker kills and Redis restarts
        os.environ[KEY_ENV] = API_KEY
        self.configs = self.worker_configs()
        self.start_worker()
        self._client(lambda r: _wait_group(r, self.keys))  # the first worker is up before the faults begin

    # -- rules --------------------------------------------------------------------------------------------

    @initialize(deltas=st.lists(st.integers(5, 60), min_size=2, max_size=3))
    def requests_in_flight(self, deltas: list[int]) -> None:
        for n in deltas:
            self.enqueue(n)

    @precondition(lambda self: len(self.requests) < 5)
    @rule(deltas=st.integers(2, 60))
    def enqueue(self, deltas: int) -> None:
        rid = f"s{len(self.requests)}"
        self.requests.append(rid)
        job = self.job(rid, deltas)
        self._client(lambda r: _enqueue(r, self.keys, job))

    def job(self, rid: str, deltas: int) -> dict[str, object]:
        return {
            "route": "anthropic",
            "model": f"synthetic;deltas={deltas};pace_ms=15",
            "request_id": rid,
            "request": {"messages": [{"role": "user", "content": "hi"}]},
        }

    @rule(label=st.sampled_from(LABELS), mode=st.sampled_from(["lose_reply", "drop_command"]))
    def fault_the_next(self, label: str, mode: str) -> None:
        self.proxy.arm(Fault(label, 1, mode))  # type: ignore[arg-type]

    @precondition(lambda self: len(self.live) < 2)
    @rule()
    def start_worker(self) -> None:
        n = len(self.workers)
        worker = spawn_worker(self.configs[n % len(self.configs)], self.tmp / f"w{n}.log")
        self.workers.append(worker)
        self.live.append(worker)

    @precondition(lambda self: len(self.live) > 0)
    @rule(data=st.data())
    def kill_worker(self, data: st.DataObject) -> None:
        victim = data.draw(st.sampled_from(self.live))
        self.live.remove(victim)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        self.disruptions += 1

    @rule()
    def restart_redis(self) -> None:
        self.disruptions += 1
        self.redis.kill()
        time.sleep(0.1)
        self.redis.start()

    @rule(seconds=st.sampled_from([0.1, 0.3, 0.8]))
    def let_time_pass(self, seconds: float) -> None:
        time.sleep(seconds)

    @invariant()
    def workers_never_crash_on_their_own(self) -> None:
        for p in self.live:
            assert p.poll() is None, (p.args, p.returncode, self._log_tail(p))

    def worker_configs(self) -> list[Path]:
        """The workers' configurations, used in turn as workers start."""
        return [self.config]

    def _log_tail(self, p: subprocess.Popen[bytes]) -> str:
        log = self.tmp / f"w{self.workers.index(p)}.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    # -- the end ------------------------------------------------------------------------------------------

    def _client(self, fn):  # type: ignore[no-untyped-def]
        async def run():  # type: ignore[no-untyped-def]
            r = aioredis.Redis.from_url(self.redis.url)
            try:
                return await fn(r)
            finally:
                await r.aclose()

        return self.portal.call(run)

    def _all_terminal(self) -> None:
        """Every request terminal and its job acked, or a failure that says which are not and what the
        workers logged."""
        unfinished = self._client(lambda r: _wait_all_terminal(r, self.keys, self.requests))
        if unfinished is not None:
            logs = "".join(f"\n-- w{i} (exit {p.poll()}):\n{self._log_tail(p)}" for i, p in enumerate(self.workers))
            raise AssertionError(f"{unfinished}{logs}")

    def teardown(self) -> None:
        try:
            self.proxy.arm(None)
            if not self.live:
                self.start_worker()
            self._all_terminal()
            for rid in self.requests:
                facts = self._client(lambda r, rid=rid: check_request(r, self.keys, rid))
                upstream = len(self.fake.stats.find(request_id=rid))
                assert facts.provider_attempts <= upstream <= len(facts.attempts), (rid, upstream, facts.attempts)
            self._client(lambda r: assert_no_secret(r, PREFIX, API_KEY))
        finally:
            for p in self.workers:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            self.proxy_cm.__exit__(None, None, None)
            self.fake_cm.__exit__(None, None, None)
            self._portal_cm.__exit__(None, None, None)
            self.redis.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


async def _enqueue(r: aioredis.Redis, keys: Keys, job: dict[str, object]) -> None:
    # What the client does, retried here as a producer would: the test's own Redis may be restarting.
    import msgspec

    for _ in range(200):
        try:
            status = keys.request(str(job["request_id"])).status
            if await r.hsetnx(status, "state", "queued"):
                await r.xadd(keys.jobs, {"job": msgspec.json.encode(job)})
            return
        except (redis.ConnectionError, redis.BusyLoadingError):
            await anyio.sleep(0.05)
    raise AssertionError("could not enqueue")


async def _wait_group(r: aioredis.Redis, keys: Keys) -> None:
    with anyio.fail_after(30):
        while True:
            try:
                if await r.exists(keys.jobs) and await r.xinfo_groups(keys.jobs):
                    return
            except redis.ResponseError:
                pass
            await anyio.sleep(0.05)


async def _wait_all_terminal(r: aioredis.Redis, keys: Keys, rids: list[str]) -> str | None:
    """None once every request is terminal and no job is pending; after 90 s without that, what was not."""
    deadline = time.monotonic() + 90
    unfinished = "Redis never answered"
    while time.monotonic() < deadline:
        try:
            statuses = {rid: await r.hgetall(keys.request(rid).status) for rid in rids}
            pending = await r.xpending(keys.jobs, "sluice-workers") if rids else {"pending": 0}
        except (redis.ConnectionError, redis.BusyLoadingError, redis.ResponseError) as exc:
            unfinished = f"Redis did not answer: {type(exc).__name__}: {exc}"
            await anyio.sleep(0.1)
            continue
        open_ = {rid: status for rid, status in statuses.items() if status.get(b"state") not in TERMINAL_STATES}
        if not open_ and not pending["pending"]:
            return None
        unfinished = f"not terminal: {open_}; pending jobs: {pending}"
        await anyio.sleep(0.1)
    return unfinished


FaultMachine.TestCase.settings = settings(
    max_examples=5,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.server  # starts its own server
def test_random_interleavings_of_faults_keep_every_log_provable() -> None:
    if shutil.which("redis-server") is None:
        redis_server_binary()  # raises with a clear message when there is none at all
    FaultMachine.TestCase("runTest").runTest()


class CapacityFaultMachine(FaultMachine):
    """The same machine with the jobs' route limited (max_concurrency = 2): the capacity scripts join the
    faulted commands, and at the end the route's store holds nothing (no permit, lease, reservation or waiting
    job, every tenant count 0) and its RPM window counts each request sent once at most: every request the
    provider received, plus at most the admissions that a killed worker never sent (their leases expired).
    Its workers' ``redis_outage_limit`` is short, and Redis may stay away longer than it: every capacity
    call of every loop fails past its limit (StorageError), and no worker exits. Its workers are of two sizes
    (1 and 3 run slots, alternately): after every step, no live worker holds more of the route's leases than
    its run slots, except for the leases a failed RELEASE left until they expire (``lease_ms``)."""

    _SIZES = (1, 3)

    def __init__(self) -> None:
        self._limited = True
        self._outage_limit = _OUTAGE_LIMIT
        self._settled_after = 0.0  # monotonic time after which no abandoned lease can be left
        super().__init__()

    def worker_configs(self) -> list[Path]:
        paths = [self.config.with_name(f"c{size}.toml") for size in self._SIZES]
        for size, path in zip(self._SIZES, paths, strict=True):  # the same file, another max_in_flight
            path.write_text(f"max_in_flight = {size}\n" + self.config.read_text())
        return paths

    def _disrupted(self) -> None:
        # A RELEASE that failed past the outage limit leaves its lease to expire (claim_idle_ms), its run slot
        # already free: until then the worker may hold one lease per slot more.
        self._settled_after = time.monotonic() + 1.0 + 2 * _OUTAGE_LIMIT + 0.5

    @rule()
    def redis_away_past_the_outage_limit(self) -> None:
        self.disruptions += 1
        self.redis.kill()
        time.sleep(_OUTAGE_LIMIT * 2)  # the fault is its length: past the limit, with_retry gives up
        self.redis.start()
        self._disrupted()

    @rule()
    def restart_redis(self) -> None:
        super().restart_redis()
        self._disrupted()

    @invariant()
    def no_worker_holds_more_leases_than_run_slots(self) -> None:
        if time.monotonic() < self._settled_after:
            return
        host = socket.gethostname()
        sizes = {f"{host}-{p.pid}": self._SIZES[self.workers.index(p) % 2] for p in self.live}
        held = self._client(lambda r: r.hvals(self.keys.route("anthropic").lease))
        by_worker = collections.Counter(decode_lease(v).worker for v in held)
        over = {w: (n, sizes[w]) for w, n in by_worker.items() if w in sizes and n > sizes[w]}
        assert not over, over

    @rule(
        label=st.sampled_from([*LABELS, "offer", "release", "acquire", "renew", "admit"]),
        mode=st.sampled_from(["lose_reply", "drop_command"]),
    )
    def fault_a_capacity_command(self, label: str, mode: str) -> None:
        self.proxy.arm(Fault(label, 1, mode))  # type: ignore[arg-type]

    def teardown(self) -> None:
        try:
            self.proxy.arm(None)
            if not self.live:
                self.start_worker()
            self._all_terminal()
            self._client(self._store_is_empty)
        finally:
            super().teardown()

    async def _store_is_empty(self, r: aioredis.Redis) -> None:
        rk = self.keys.route("anthropic")
        assert await r.hget(rk.state, "limits")  # the route is limited: its jobs went through the store
        assert int(await r.hget(rk.state, "admitted") or 0) >= len(self.requests)
        with anyio.fail_after(30):  # the RELEASE follows the terminal status; a dead worker's lease expires
            while await r.zcard(rk.permits) or await r.hlen(rk.lease) or await r.hlen(rk.waiting):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert await r.zcard(rk.reserved) == 0
        assert all(int(v) == 0 for v in (await r.hgetall(rk.drr)).values())
        sent = len([x for x in self.fake.stats.requests if x.request_id])
        expired = int(await r.hget(rk.state, "expired") or 0)
        # Every request sent was admitted (the lower bound: nothing passes the limits). Above: each admission
        # is a request sent or a lease that expired; a late OFFER of a finished request (re-sent after a lost
        # reply, or another delivery of its entry) admits nothing (docs/capacity.md, "Exactly once").
        rpm = await r.zcard(rk.rpm)
        if not sent <= rpm <= sent + expired:
            raise AssertionError(await self._explain_rpm(r, sent, expired))

    async def _explain_rpm(self, r: aioredis.Redis, sent: int, expired: int) -> str:
        """What a failed RPM bound needs to be traced: the tokens counted, each request's claim, the
        provider's requests and what the workers logged above info."""
        rk = self.keys.route("anthropic")
        lines = [f"sent {sent}, expired {expired}, disruptions {self.disruptions}"]
        lines.append(f"rpm tokens: {sorted(m.decode() for m in await r.zrange(rk.rpm, 0, -1))}")
        for rid in self.requests:
            st = await r.hmget(self.keys.request(rid).status, "state", "claim_token", "attempt", "epoch")
            lines.append(f"{rid}: {st}, provider requests {len(self.fake.stats.find(request_id=rid))}")
        for i in range(len(self.workers)):
            log = self.tmp / f"w{i}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            lines += [f"w{i}: {line[:400]}" for line in text.splitlines() if '"level":"info"' not in line]
        return "\n".join(lines)


CapacityFaultMachine.TestCase.settings = FaultMachine.TestCase.settings


@pytest.mark.server  # starts its own server
def test_random_interleavings_of_faults_on_a_limited_route_leak_no_permit() -> None:
    if shutil.which("redis-server") is None:
        redis_server_binary()
    CapacityFaultMachine.TestCase("runTest").runTest()


class BudgetFaultMachine(FaultMachine):
    """The same machine with tenant acme's jobs under a budget that binds (about four worst cases): RESERVE,
    EXTEND and SETTLE join the faulted commands. At the end nothing is reserved or held, the settled spend never
    passed the budget, and it covers at least every completed request's reported cost (none lost)."""

    AMOUNT_MICRO = 1500

    def __init__(self) -> None:
        self._budgeted = True
        super().__init__()

    def job(self, rid: str, deltas: int) -> dict[str, object]:
        job = super().job(rid, deltas)
        request = dict(job["request"])  # type: ignore[call-overload]
        return {**job, "tenant": "acme", "request": {**request, "max_tokens": 100}}

    @rule(
        label=st.sampled_from([*LABELS, "reserve", "settle", "extend"]),
        mode=st.sampled_from(["lose_reply", "drop_command"]),
    )
    def fault_a_budget_command(self, label: str, mode: str) -> None:
        self.proxy.arm(Fault(label, 1, mode))  # type: ignore[arg-type]

    def teardown(self) -> None:
        try:
            self.proxy.arm(None)
            if not self.live:
                self.start_worker()
            self._all_terminal()
            self._client(self._budget_holds)
        finally:
            super().teardown()

    async def _budget_holds(self, r: aioredis.Redis) -> None:
        bk = self.keys.budget("acme")
        line = "budgets.acme|0"
        with anyio.fail_after(30):  # a dead worker's reservation is charged at expiry by the next script call
            while await r.hlen(bk.res):
                await anyio.sleep(0.05)
                # expiry runs inside the scripts: an EXTEND of nothing runs it, as any worker's next call would
                await r.eval(cs.EXTEND, len(bk.script_keys()), *bk.script_keys(), "", 1)  # type: ignore[misc]
        assert await r.zcard(bk.held) == 0
        assert int(await r.hget(bk.reserved, line) or 0) == 0
        spent = int(await r.hget(bk.spent, line) or 0)
        assert spent <= self.AMOUNT_MICRO, spent
        completed = 0
        for rid in self.requests:
            status = await r.hgetall(self.keys.request(rid).status)
            if status.get(b"state") == b"completed" and b"cost" in status:
                completed += math.ceil(float(status[b"cost"].decode()) * 1_000_000 - 1e-9)
        assert spent >= completed, (spent, completed)


BudgetFaultMachine.TestCase.settings = FaultMachine.TestCase.settings


@pytest.mark.server  # starts its own server (the machine stops and starts it)
def test_random_interleavings_of_faults_under_a_budget_never_pass_it() -> None:
    if shutil.which("redis-server") is None:
        redis_server_binary()
    BudgetFaultMachine.TestCase("runTest").runTest()
