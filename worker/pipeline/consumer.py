"""The worker process's loop: read jobs from the consumer group, run at most N at once, keep owned jobs
alive, take over jobs of lost workers, listen for cancels, and shut down without leaving a request
without a terminal status.

Rule: XREADGROUP blocks briefly (so shutdown never cancels a command mid-flight); the worker reads every
job shard (one reader each: a cluster serves one slot per command), and all readers together only read as
many entries as it has free slots; a live worker refreshes the pending entries it still owns (the
``HEARTBEAT`` script) so they never look idle, and one it no longer owns (taken over while this worker
was frozen) is dropped and its attempt fenced at once; entries idle past ``claim_idle_ms`` are taken
over with XAUTOCLAIM, following its cursor to the end, shard by shard; entries delivered more than
``max_deliveries`` times are dead-lettered; every ``jobs_trim_interval`` each job shard loses the entries
every group on it has settled (``TRIM_JOBS``: never one pending or undelivered in any group). A job entry
is known by (shard, entry id): ids repeat across shards.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import cast

import anyio
import redis.asyncio as aioredis
from anyio.abc import TaskGroup
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from sluice.schemas.errors import StorageError
from sluice.schemas.jobs import JOB_FIELD, peek_request_id
from sluice.schemas.keys import Keys, ShardKeys, key_slot
from sluice.schemas.replies import range_entries, read_entries
from sluice.worker.capacity.admission import ADMIT_MAX, Admission, AdmittedJob, Offered, check_unlimited_routes
from sluice.worker.capacity.gauges import run_route_gauges
from sluice.worker.capacity.permits import FirstRoute
from sluice.worker.capacity.spend import Spend
from sluice.worker.clock import now_ms
from sluice.worker.config import Config
from sluice.worker.http import HttpClient, make_http_client
from sluice.worker.observability.admin import Admin
from sluice.worker.observability.archive_watch import observe_archive_lag
from sluice.worker.observability.telemetry import Telemetry
from sluice.worker.pipeline.context import Deps
from sluice.worker.pipeline.intake import (
    Intake,
    dead_letter,
    fail_without_upstream,
    fallback_request_id,
    handle_entry,
    intake_of,
    offer_entries,
    run_leased,
    settle_offer,
    settled,
)
from sluice.worker.pipeline.membership import announce, leave, live_members
from sluice.worker.pipeline.slots import RunSlots
from sluice.worker.redis import scripts
from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import QUIET, AnyRedis, check_layout, connect, ensure_group
from sluice.worker.redis.retry import Fenced, LoopBackoff, is_transient
from sluice.worker.redis.route import SlotRouter

__all__ = ["Worker", "install_signal_handlers"]

log = logging.getLogger("sluice.worker")
_READ_BLOCK_MS = 1000
# The most entries one trim call removes (TRIM_JOBS): a backlog of settled entries goes in steps of this size.
_TRIM_BATCH = 10_000
# The background loops log and go on whatever Redis answers: one bad reply must not stop the worker. redis-py
# lets a reset that lands mid-write surface as RuntimeError / AttributeError (``redis.retry.is_transient``);
# a call through ``with_retry`` (the capacity scripts, dead letters, acks) raises StorageError once Redis
# stayed away past ``redis_outage_limit``: an outage of any length is one more failure to back off from.
_LOOP_ERRORS = (RedisError, OSError, RuntimeError, AttributeError, StorageError)


# An entry of the jobs streams: (shard index, entry id).
Owned = tuple[int, str]
# An entry its read batch's OFFER answered: the entry, the answer, the run slots held for it (0 or 1).
_Offered = tuple[Intake, Offered, int]


class Worker:
    def __init__(
        self,
        config: Config,
        *,
        redis: AnyRedis | None = None,
        http: HttpClient | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        """``telemetry``: injected (the caller shuts it down), else built from ``config.telemetry``.
        Raises ``ConfigError`` when that asks for an exporter that is not installed."""
        self.config = config
        self.keys = Keys(config.key_prefix, config.job_shards, config.redis_cluster)
        self.consumer = config.consumer_name
        if redis is None and config.redis_cluster:
            # Every blocked read holds one of a node's connections; redis-py raises at the cap.
            redis = connect(
                config.redis_url,
                cluster=True,
                max_connections=max(1000, 4 * config.max_in_flight),
                socket_timeout=config.redis_socket_timeout,
                socket_connect_timeout=config.redis_socket_timeout,
                health_check_interval=30,
            )
        elif redis is None:
            # Appends, and claims with finalizes, have direct connections (SlotRouter); the rest (acks, the
            # terminal stream, the worker's own loops) share a small pool that waits for a free connection
            # instead of failing. Not one connection per in-flight stream: redis-py's connection set-up
            # costs milliseconds of CPU, and 1,000 streams would open 1,000 connections.
            pool = aioredis.BlockingConnectionPool.from_url(
                config.redis_url,
                **QUIET,
                max_connections=min(config.max_in_flight, 32) + 16,
                timeout=None,
                socket_timeout=config.redis_socket_timeout,
                socket_connect_timeout=config.redis_socket_timeout,
                health_check_interval=30,
            )
            redis = aioredis.Redis(connection_pool=pool)
        self.redis: AnyRedis = redis
        self.http = http or make_http_client(config.http_client, config.max_in_flight)
        self._own_telemetry = telemetry is None
        self.admin = Admin(
            config
        )  # /healthz, /readyz, /metrics when admin_port is set (sluice.worker.observability.admin)
        self.health = self.admin.health
        self.telemetry = telemetry or Telemetry.from_config(
            config.telemetry, instance_id=self.consumer, registry=self.admin.registry
        )
        observe_archive_lag(self.telemetry, self.consumer, config.archive_group)  # retention safety's gauge
        if config.cluster_appends != "pipe":
            log.warning(
                f"cluster_appends = {config.cluster_appends!r} is ignored: appends always go on the routed pipes"
            )
        # The worker's scripts (claims, appends, finalizes) go on connections of its own to each slot's master
        # (a single instance is a cluster of one); redis-py serves everything else.
        timeouts = {"socket_timeout": config.redis_socket_timeout, "connect_timeout": config.redis_socket_timeout}
        if isinstance(self.redis, aioredis.Redis):
            self.router = SlotRouter.for_client(self.redis, **timeouts)
        else:
            self.router = SlotRouter.for_url(config.redis_url, cluster=True, **timeouts)
        self.deps = Deps(config, self.redis, self.http, self.keys, self.consumer, self.router, telemetry=self.telemetry)
        # Limited routes (docs/design-capacity.md): their jobs go through the route's store; others as before.
        self.admission: Admission | None = None
        self._slots = RunSlots(config.max_in_flight)
        # Leased jobs whose run slot went on to a job a RELEASE handed off (``Admission.pass_slot``).
        self._passed: set[str] = set()
        if any(r.limited for r in config.routes.values()):
            self.admission = self.deps.admission = Admission(config, self.keys, self.router, self.consumer)
            self.admission.take_slots = self._slots.take
            self.admission.give_slots = self._slots.give
            self.admission.pass_slot = self._passed.add
            # A stopping worker takes no more jobs, neither by its admit loops nor by a RELEASE's handoff.
            self.admission.accepting = lambda: not self.stopping.is_set()
        if config.budgets:  # docs/capacity.md#budgets: each attempt's worst case held before it is sent
            self.deps.spend = Spend(config, self.keys, self.router)
        self._leased: dict[str, str] = {}  # request id -> route: jobs admitted to this worker, running
        self.stopping = anyio.Event()
        self._slot_freed = anyio.Event()
        self._owned: dict[Owned, float] = {}  # (shard, job entry id) -> when taken
        self._idle = anyio.Event()  # set whenever nothing is owned: the drain waits on it
        self._idle.set()
        self._heartbeat = self.redis.register_script(scripts.HEARTBEAT)
        self._trim = self.redis.register_script(scripts.TRIM_JOBS)
        self.retry_start = True  # Redis failing mid-start is waited out (False: raised, for --fail-fast)

    def stop(self) -> None:
        """Stop taking jobs; in-flight requests get ``shutdown_grace`` seconds, then are cancelled."""
        self.stopping.set()

    async def _connect(self) -> None:
        """A cluster's slot maps (ours and redis-py's) before any command; the layout; the consumer groups."""
        if isinstance(self.redis, SluiceCluster):
            try:
                await self.redis.initialize()
                await self.router.refresh()
            except RedisClusterException as exc:
                raise RedisConnectionError(f"Redis Cluster not reachable ({exc})") from exc
        await check_layout(self.redis, self.keys)
        for shard in self.keys.shards:
            await ensure_group(self.redis, shard.jobs, self.config.group)
        if self.router.cluster:
            masters = {s.jobs: self.router.master(key_slot(s.jobs)) for s in self.keys.shards}
            log.info("job shards by master", extra={"shards": {k: f"{a[0]}:{a[1]}" for k, a in masters.items() if a}})

    async def run(self, *, ready: Callable[[], Awaitable[None] | None] | None = None) -> None:
        """Raises ``GroupMismatch`` when a live worker of the same prefix serves other routes, ``ConfigError``
        when the recorded job shard count differs (or the admin port cannot be bound)."""
        async with self.admin.serving(self):
            await self._run(ready)

    async def _join(self) -> None:
        """Groups, membership, the fleet's limits: every step idempotent, so Redis going away in the middle
        (a restart, a failover) is waited out with back-off and the whole start runs again, as the wait for
        Redis before it does (``retry_start`` False: the failure is raised, for ``--fail-fast``)."""
        backoff = LoopBackoff(log, "starting")
        while True:
            try:
                await self._connect()
                await announce(self.redis, self.keys, self.consumer, self.config, check=True)
                live = set(await live_members(self.redis, self.keys, self.config))
                await check_unlimited_routes(self.router, self.config, self.keys, self.consumer, live)
                if self.admission is not None:
                    await self.admission.publish_limits(live)
                return
            except _LOOP_ERRORS as exc:
                transient = is_transient(exc) or isinstance(exc, StorageError)
                if not transient or not self.retry_start or self.stopping.is_set():
                    raise
                with anyio.move_on_after(backoff.failed(exc)):  # a stop ends the wait
                    await self.stopping.wait()

    async def _run(self, ready: Callable[[], Awaitable[None] | None] | None) -> None:
        try:
            await self._join()
            log.info("worker started", extra={"consumer": self.consumer})
            self.health.started()
            # Heartbeats and cancels keep running through the drain, so in-flight jobs stay owned.
            async with anyio.create_task_group() as bg:
                bg.start_soon(self._control_loop)
                bg.start_soon(self._heartbeat_loop)
                bg.start_soon(
                    run_route_gauges, self.deps.telemetry, self.deps.redis, self.deps.keys, self.deps.config
                )  # the limited routes' metrics (B.9)
                async with anyio.create_task_group() as jobs_tg:
                    jobs_tg.start_soon(self._reclaim_loop, jobs_tg)
                    jobs_tg.start_soon(self._trim_loop)
                    if self.admission is not None:
                        adm = self.admission
                        adm.on_handoff = lambda route, jobs: self._start_leased(jobs_tg, route, jobs)
                        for route in adm.routes:
                            jobs_tg.start_soon(self._admit_loop, route, jobs_tg)
                    if ready is not None:
                        res = ready()
                        if res is not None:
                            await res
                    await self._read_loop(jobs_tg)
                    await self._drain()
                bg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(*_LOOP_ERRORS), anyio.move_on_after(2):
                    await leave(self.redis, self.keys, self.consumer)
                self.router.close()
                await self.http.aclose()
                if isinstance(self.redis, aioredis.Redis):
                    await self.redis.aclose(close_connection_pool=True)
                else:
                    await self.redis.aclose()
                if self._own_telemetry:
                    # Flushes the last spans and metrics; the exporters block, so off the event loop.
                    with anyio.move_on_after(10):
                        await anyio.to_thread.run_sync(self.telemetry.shutdown, abandon_on_cancel=True)
            log.info("worker stopped", extra={"consumer": self.consumer})

    async def _drain(self) -> None:
        with anyio.move_on_after(self.config.shutdown_grace):
            await self._idle.wait()
        for handle in list(self.deps.inflight.values()):
            handle.cancel("the worker shut down before the request finished")

    def _free(self) -> int:
        return self.config.max_in_flight - len(self._owned) - len(self._leased)

    def _busy(self) -> bool:
        return bool(self._owned or self._leased)

    async def _wait_for_slot(self) -> None:
        event = self._slot_freed
        with anyio.move_on_after(1.0):
            await event.wait()

    def _own(self, job: Owned) -> None:
        self._owned[job] = now_ms()  # owned (and kept alive by the heartbeat) from this moment
        self._idle = anyio.Event() if self._idle.is_set() else self._idle

    def _start(self, jobs_tg: TaskGroup, job: Owned, fields: dict[bytes, bytes]) -> None:
        self._own(job)
        jobs_tg.start_soon(self._run_job, job, fields)

    async def _read_loop(self, jobs_tg: TaskGroup) -> None:
        shards = self.keys.shards
        if len(shards) == 1:
            await self._read_shard(shards[0], jobs_tg, 1)
            return
        async with anyio.create_task_group() as readers:
            for shard in shards:
                readers.start_soon(self._read_shard, shard, jobs_tg, len(shards))

    async def _read_shard(self, shard: ShardKeys, jobs_tg: TaskGroup, readers: int) -> None:
        backoff = LoopBackoff(log, "reading jobs", stream=shard.jobs)
        # Serving a limited route, intake is not gated by run slots: its jobs are parked at once, where the
        # discipline sees them (a job of another route read beyond the slots waits owned, heartbeated).
        extra = self.config.intake_batch if self.admission is not None else 0
        while not self.stopping.is_set():
            free = self._free() + extra
            if free <= 0:
                await self._wait_for_slot()
                continue
            # Each of the shards' readers asks for its share of the free slots (at least one), so together
            # they take at most a few more jobs than there are slots (those wait for a slot here, owned),
            # and a reader blocked on an idle shard holds no slots another shard's jobs could use.
            count = max(1, free // readers)
            try:
                resp = await self.redis.xreadgroup(
                    self.config.group, self.consumer, {shard.jobs: ">"}, count=count, block=_READ_BLOCK_MS
                )
            except _LOOP_ERRORS as exc:
                delay = backoff.failed(exc)
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    # The jobs stream was deleted (or Redis came back empty): recreate it and read at once.
                    with contextlib.suppress(*_LOOP_ERRORS):
                        await ensure_group(self.redis, shard.jobs, self.config.group)
                        continue
                with anyio.move_on_after(delay):  # a stopping worker stops reading at once
                    await self.stopping.wait()
                continue
            backoff.ok()
            entries = [((shard.index, eid.decode()), fields) for eid, fields in read_entries(resp)]
            if self.admission is None:
                for job, fields in entries:
                    self._start(jobs_tg, job, fields)
            elif entries:
                for job, _ in entries:
                    self._own(job)
                jobs_tg.start_soon(self._offer_batch, jobs_tg, entries)

    async def _offer_batch(self, jobs_tg: TaskGroup, entries: list[tuple[Owned, dict[bytes, bytes]]]) -> None:
        """A read batch, serving limited routes: one OFFER per route for its jobs (``offer_entries``), with
        run slots taken for them first; every other entry runs on its own as before (``handle_entry``)."""
        groups: dict[str, list[Intake]] = {}
        for job, fields in entries:
            try:
                entry = intake_of(self.deps, job[1], fields, job[0])
            except Exception:
                entry = None  # handle_entry meets the same failure and settles or logs it
            if entry is None:
                jobs_tg.start_soon(partial(self._run_job, job, fields, offer=False))
            else:
                groups.setdefault(entry.job.route, []).append(entry)
        for route, group in groups.items():
            jobs_tg.start_soon(self._offer_route, jobs_tg, route, group)

    async def _offer_route(self, jobs_tg: TaskGroup, route: str, group: list[Intake]) -> None:
        """One OFFER for ``group``, with run slots taken for it first: each job it admits runs in one of them,
        each it answers ``cooldown`` tries its fallbacks in one; the rest go back at once."""
        adm = self.admission
        assert adm is not None
        taken = self._slots.take(len(group)) if adm.accepting() else 0
        got: list[Offered] | None = None
        try:
            got = await offer_entries(self.deps, route, group, taken)
        except Exception:
            # A bug or Redis failing past its limits: the entries stay pending and are taken over (after
            # claim_idle_ms) like any job whose worker failed on it.
            log.exception("offering jobs failed", extra={"route": route, "entries": [e.entry_id for e in group]})
        finally:
            if got is None:
                self._slots.give(taken)
        if got is None:
            for entry in group:
                self._owned.pop((entry.shard, entry.entry_id), None)
            self._done()
            return
        for entry, offered in zip(group, got, strict=True):
            job = (entry.shard, entry.entry_id)
            if settled(offered):  # parked (most of a backlog): nothing more to do, no task
                self._owned.pop(job, None)
                continue
            held = int(offered.outcome == "admitted" or offered.slot)  # at most ``taken`` of them (OFFER)
            taken -= held
            jobs_tg.start_soon(self._run_job, job, entry.fields, (entry, offered, held))
        self._slots.give(taken)
        self._done()

    async def _run_job(
        self, job: Owned, fields: dict[bytes, bytes], offered: _Offered | None = None, *, offer: bool = True
    ) -> None:
        """``offered``: its read batch's OFFER answered the entry, with the run slot held for it (1 or 0);
        else, with ``offer``, a limited route's entry is offered here first."""
        shard, entry_id = job
        first: FirstRoute | None = None
        held = offered[2] if offered else 0  # run slots this task holds
        try:
            taken: tuple[str, AdmittedJob] | FirstRoute | bool = False
            if self.admission is not None and (offer or offered):
                entry, got = (offered[0], offered[1]) if offered else (None, None)
                if offered is None and (entry := intake_of(self.deps, entry_id, fields, shard)) is not None:
                    # Admitted at once only into a slot taken now; without one its route parks it for a worker
                    # that has one (this one's admit loop, or another's).
                    held = self._slots.take(1) if self.admission.accepting() else 0
                    got = (await offer_entries(self.deps, entry.job.route, [entry], held))[0]
                if entry is not None and got is not None:
                    if got.outcome == "cooldown" and not held:
                        # Its route cools: its fallbacks are tried in a run slot, waited for here (held by its
                        # jobs entry), never parked on the cooling route while a fallback may take it.
                        await self._slots.acquire()
                        held = 1
                    taken = await settle_offer(self.deps, entry, got, start_now=held == 1)
                if isinstance(taken, tuple):
                    route, admitted = taken
                    self._owned.pop(job, None)  # acked: the route's lease holds it now
                    self._leased[admitted.request_id] = route
                    try:
                        await run_leased(self.deps, route, admitted)
                    finally:
                        self._leased.pop(admitted.request_id, None)
                        held -= self._slot_passed(admitted.request_id)
                    return
                if isinstance(taken, FirstRoute):
                    first = taken  # its route cooled at admission; a fallback's permit, held by its entry
                elif taken:
                    return
            if not held:  # never more than max_in_flight at once, however jobs arrived
                await self._slots.acquire()
                held = 1
            if job in self._owned:  # not lost while it waited for a slot
                await handle_entry(self.deps, entry_id, fields, shard, first)
                first = None
            if first is not None and first.token and self.admission is not None:
                # Lost while it waited for a slot: its fallback permit goes back (the new owner admits it anew).
                await self.admission.release(first.route, "", first.token, "", final=False)
        except Exception:
            # handle_entry stores a terminal status for everything it expects; this is a bug or Redis
            # failing past its limits. The entry stays pending and another worker takes it over.
            log.exception("job failed unexpectedly", extra={"entry_id": entry_id, "shard": shard})
        finally:
            self._slots.give(held)
            self._owned.pop(job, None)
            self._done()

    def _slot_passed(self, request_id: str) -> int:
        """1 when the leased job's slot went on to a handed-off job (not given back), else 0."""
        if request_id in self._passed:
            self._passed.discard(request_id)
            return 1
        return 0

    def _done(self) -> None:
        if not self._busy():
            self._idle.set()
        self._slot_freed.set()
        self._slot_freed = anyio.Event()

    def _start_leased(self, jobs_tg: TaskGroup, route: str, jobs: list[AdmittedJob]) -> None:
        """Each job holds a run slot taken for the call that admitted it."""
        for job in jobs:
            self._leased[job.request_id] = route
            self._idle = anyio.Event() if self._idle.is_set() else self._idle
            jobs_tg.start_soon(self._run_leased, route, job)

    async def _run_leased(self, route: str, job: AdmittedJob) -> None:
        try:
            await run_leased(self.deps, route, job)
        except Exception:
            # The lease expires and another worker takes the job over (as an unacked entry would be).
            log.exception("job failed unexpectedly", extra={"request_id": job.request_id, "route": route})
        finally:
            self._leased.pop(job.request_id, None)
            self._slots.give(1 - self._slot_passed(job.request_id))
            self._done()

    async def _admit_loop(self, route: str, jobs_tg: TaskGroup) -> None:
        """Pull this route's waiting jobs into free slots (ADMIT), polling when capacity frees with time
        (its ``retry_at``, at most 250 ms, with jitter); a RELEASE's handoff does the rest. The slots are taken
        before the call and the unused ones given back after it. A call that failed (Redis away, past its
        outage limit too) is sent again with the same call id and size, its slots still taken, once Redis
        answers: the script's memo returns what it admitted, if it ran, so no admission is lost to a reply
        that was."""
        adm = self.admission
        assert adm is not None
        backoff = LoopBackoff(log, "admitting", route=route)
        call_id, n = "", 0
        try:
            while not self.stopping.is_set():
                delay = 0.25
                if not call_id:
                    n = self._slots.take(min(self._slots.free, ADMIT_MAX))
                    call_id = adm.call_id() if n else ""
                if call_id:
                    try:
                        got = await adm.admit(route, n, call_id=call_id)
                    except _LOOP_ERRORS as exc:
                        delay = backoff.failed(exc)
                        if isinstance(exc, StorageError):
                            delay = min(delay, 1.0)  # the call itself waited out the outage limit, polling
                    else:
                        backoff.ok()
                        self._slots.give(n - len(got.jobs))
                        asked, call_id, n = n, "", 0
                        if got.jobs:
                            self._start_leased(jobs_tg, route, got.jobs)
                            if len(got.jobs) == asked:
                                continue
                        if got.retry_at:
                            delay = min(0.25, max(0.01, (got.retry_at - now_ms()) / 1000))
                with anyio.move_on_after(delay * random.uniform(0.8, 1.0)):
                    await self.stopping.wait()
        finally:
            self._slots.give(n)  # a call never answered: its lease expires, the slots are this worker's

    async def _heartbeat_loop(self) -> None:
        """Keep owned entries non-idle so no other worker takes them over while this one lives; an entry
        this consumer no longer owns (taken over while it was frozen) is dropped and its attempt fenced."""
        heartbeat = LoopBackoff(log, "heartbeat")
        # RENEW goes through with_retry (StorageError past the outage limit): a state of its own, per route, so
        # the heartbeat's connection failures and its outage do not take turns logging.
        renewing: dict[str, LoopBackoff] = {}
        while True:
            await anyio.sleep(self.config.heartbeat_ms / 1000)
            sent_at = self.health.heartbeat_started()
            try:  # one HSET: the round trip the admin endpoint reports
                await announce(self.redis, self.keys, self.consumer, self.config, check=False)
            except _LOOP_ERRORS as exc:
                self.health.redis_failed(exc)
            else:
                self.health.redis_answered(sent_at)
            by_shard: dict[int, list[str]] = {}
            for shard, entry_id in self._owned:
                by_shard.setdefault(shard, []).append(entry_id)
            for shard, ids in by_shard.items():
                jobs = self.keys.shard(shard).jobs
                try:
                    lost = await self._heartbeat(keys=[jobs], args=[self.config.group, self.consumer, *ids])
                except _LOOP_ERRORS as exc:
                    heartbeat.failed(exc)  # paced by the heartbeat interval: no back-off of its own
                    continue
                heartbeat.ok()
                for raw in cast(list[bytes], lost):
                    self._lose((shard, raw.decode()))
            if self.admission is not None:
                await self._renew(renewing)
            if self.deps.spend is not None:
                try:
                    if lost := await self.deps.spend.extend():  # charged whole at expiry: the worker was away
                        log.warning("budget reservations expired before their attempts ended", extra={"lost": lost})
                except _LOOP_ERRORS as exc:
                    heartbeat.failed(exc)
            self.health.heartbeat_done()

    async def _renew(self, renewing: dict[str, LoopBackoff]) -> None:
        """RENEW this worker's leases and permits; a lease it lost (taken over while it was frozen) fences
        its attempt at once, like ``_lose``."""
        adm = self.admission
        assert adm is not None
        for route in adm.routes:
            backoff = renewing.setdefault(route, LoopBackoff(log, "renewing leases", route=route))
            try:
                lost = await adm.renew(route)
            except _LOOP_ERRORS as exc:
                backoff.failed(exc)  # paced by the heartbeat interval: no back-off of its own
                continue
            backoff.ok()
            for rid in lost:
                handle = self.deps.inflight.get(rid)
                if handle is not None:
                    handle.fence()
                log.warning("lost a lease to another worker; its attempt is fenced", extra={"request_id": rid})

    def _lose(self, job: Owned) -> None:
        """This consumer no longer owns ``job``: whatever runs it stops now and writes nothing more."""
        if self._owned.pop(job, None) is None:
            return
        if not self._busy():
            self._idle.set()
        shard, entry_id = job
        for handle in list(self.deps.inflight.values()):
            if handle.entry_id == entry_id and handle.shard == shard:
                handle.fence()
        log.warning("lost a job to another worker; its attempt is fenced", extra={"entry_id": entry_id, "shard": shard})

    async def _reclaim_loop(self, jobs_tg: TaskGroup) -> None:
        """Take over jobs of lost workers; stops taking any once the worker is stopping."""
        interval = max(0.05, self.config.claim_idle_ms / 4000)
        backoff = LoopBackoff(log, "reclaim")
        while not self.stopping.is_set():
            with anyio.move_on_after(interval):
                await self.stopping.wait()
            if self.stopping.is_set():
                return
            try:
                await self._reclaim_once(jobs_tg)
            except _LOOP_ERRORS as exc:
                backoff.failed(exc)  # paced by its interval: no back-off of its own
                continue
            backoff.ok()

    async def _trim_loop(self) -> None:
        """Trim the jobs streams every ``jobs_trim_interval`` (never when it is 0) until the worker stops."""
        trimming = LoopBackoff(log, "trimming the jobs stream")
        next_trim = self._next_trim()
        while not self.stopping.is_set() and next_trim < math.inf:
            with anyio.move_on_after(max(0.0, next_trim - time.monotonic())):
                await self.stopping.wait()
            if self.stopping.is_set():
                return
            next_trim = await self._trim_jobs(trimming)

    def _next_trim(self) -> float:
        """When to trim next: ``jobs_trim_interval`` from now, less up to a quarter at random so a fleet's
        workers (each trims; any one would do) spread over the interval; never when it is 0."""
        every = self.config.jobs_trim_interval
        return time.monotonic() + every * random.uniform(0.75, 1.0) if every > 0 else math.inf

    async def _trim_jobs(self, trimming: LoopBackoff) -> float:
        """Remove each job shard's entries every group has settled (``TRIM_JOBS``: never one pending or not yet
        delivered in any group). Returns when to trim next: at once when a shard had more than a batch."""
        more = False
        for shard in self.keys.shards:
            try:
                removed = int(await self._trim(keys=[shard.jobs], args=[_TRIM_BATCH]))
            except _LOOP_ERRORS as exc:
                trimming.failed(exc)  # paced by the interval: the next trim is the retry
                continue
            trimming.ok()
            more = more or removed > _TRIM_BATCH // 2
            if removed:
                log.debug("trimmed the jobs stream", extra={"stream": shard.jobs, "removed": removed})
        return time.monotonic() if more else self._next_trim()

    async def _reclaim_once(self, jobs_tg: TaskGroup) -> None:
        """Raises the first shard's failure after trying every shard (one master away: the others are still
        taken over)."""
        failure: BaseException | None = None
        for shard in self.keys.shards:
            try:
                await self._reclaim_shard(shard, jobs_tg)
            except _LOOP_ERRORS as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    async def _reclaim_shard(self, shard: ShardKeys, jobs_tg: TaskGroup) -> None:
        """Each entry on its own: one that cannot be settled (Redis failing on it, a bug) never keeps the
        others of its batch from being taken over; the first Redis failure is raised after the batch."""
        cursor = "0-0"
        failure: BaseException | None = None
        while not self.stopping.is_set():
            free = self._free()
            if free <= 0:
                break
            res = await self.redis.xautoclaim(
                shard.jobs,
                self.config.group,
                self.consumer,
                self.config.claim_idle_ms,
                start_id=cursor,
                count=free,
            )
            cursor = res[0]
            entries = cast(list[tuple[bytes, dict[bytes, bytes] | None]], res[1])
            for entry_id, fields in entries:
                job = (shard.index, entry_id.decode())
                if job in self._owned:  # already running here (its heartbeat was late): never twice
                    continue
                try:
                    if fields is None:  # deleted from the stream meanwhile
                        await self.redis.xack(shard.jobs, self.config.group, job[1])
                        continue
                    if await self._too_many_deliveries(shard, job[1], fields):
                        continue
                except _LOOP_ERRORS as exc:  # it stays pending: taken over again after claim_idle_ms
                    failure = failure or exc
                    continue
                except Exception:
                    log.exception("taking over a job failed", extra={"entry_id": job[1], "shard": shard.index})
                    continue
                self._start(jobs_tg, job, fields)
            if cursor in (b"0-0", "0-0"):
                break
        if failure is not None:
            raise failure

    async def _too_many_deliveries(self, shard: ShardKeys, entry_id: str, fields: dict[bytes, bytes]) -> bool:
        """A job delivered more than ``max_deliveries`` times (it keeps killing workers) is dead-lettered,
        and its request ends ``failed`` / ``worker_lost`` so nobody waits on it forever; one whose request id
        cannot be read (no job field, not JSON, nested past any parse) is dead-lettered all the same, under
        the id made from its entry."""
        pending = await self.redis.xpending_range(shard.jobs, self.config.group, entry_id, entry_id, 1)
        delivered = int(pending[0]["times_delivered"]) if pending else 0
        if delivered <= self.config.max_deliveries:
            return False
        payload = fields.get(JOB_FIELD.encode())
        reason = f"delivered {delivered} times"
        rid = peek_request_id(payload) if payload is not None else None
        rid = rid or fallback_request_id(self.deps, entry_id, shard.index)
        await dead_letter(self.deps, entry_id, reason, payload, rid, shard.index)
        if await self.redis.exists(self.keys.request(rid).status):
            try:
                await fail_without_upstream(
                    self.deps, entry_id, rid, None, "", "worker_lost", f"job {reason}", shard.index
                )
            except Fenced:
                return True  # another worker took it meanwhile: theirs now, not acked here
        await self.redis.xack(shard.jobs, self.config.group, entry_id)
        return True

    async def _control_loop(self) -> None:
        """Cancel requests reach every worker; the one running the request cancels its upstream."""
        backoff = LoopBackoff(log, "reading cancels", stream=self.keys.control)
        last = ""
        while True:
            try:
                if not last:
                    newest = range_entries(await self.redis.xrevrange(self.keys.control, count=1))
                    last = newest[0][0].decode() if newest else "0-0"
                resp = await self.redis.xread({self.keys.control: last}, block=_READ_BLOCK_MS, count=100)
            except _LOOP_ERRORS as exc:
                await anyio.sleep(backoff.failed(exc))  # runs through the drain too: no early wake-up
                continue
            backoff.ok()
            for entry_id, fields in read_entries(resp):
                last = entry_id.decode()
                rid = fields.get(b"request_id", b"").decode()
                handle = self.deps.inflight.get(rid)
                if handle is not None and fields.get(b"action") == b"cancel":
                    handle.cancel("cancelled on request")


def install_signal_handlers(worker: Worker, tg: TaskGroup) -> None:
    async def watch() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                log.info("signal received: stopping")
                worker.stop()
                return

    tg.start_soon(watch)
