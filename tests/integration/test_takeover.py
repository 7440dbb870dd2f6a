"""Crashed and frozen workers (issue 5), with real processes: SIGKILL -> takeover; SIGSTOP -> fenced."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import anyio
import pytest

from sluice.schemas.events import BlockDelta, StreamDone, StreamError
from sluice.schemas.invariants import ContractChecker
from sluice.schemas.keys import Keys
from tests.helpers import wait_all_acked
from tests.integration.conftest import cleanup, client_for, make_config, spawn_worker, write_config_file

pytestmark = pytest.mark.asyncio


def _config_file(path: Path, redis_url: str, prefix: str, base_url: str) -> Path:
    return write_config_file(
        path, redis_url, prefix, base_url, claim_idle_ms=3000, heartbeat_ms=300, shutdown_grace=2.0
    )


class Workers:
    def __init__(self, cfg: Path, logdir: Path) -> None:
        self.cfg, self.logdir, self.procs = cfg, logdir, []  # type: ignore[var-annotated]

    def start(self, name: str) -> subprocess.Popen[bytes]:
        p = spawn_worker(self.cfg, self.logdir / f"{name}.log")
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text()

    async def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            for p in self.procs:
                await anyio.to_thread.run_sync(p.wait)


def _check_attempt(events: list) -> None:  # type: ignore[type-arg]
    checker = ContractChecker()
    for ev in events:
        checker.process(ev)  # seq +1, nothing after the terminal, no duplicate
    assert checker.terminal


async def _wait_for_delta(client, rid: str) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(30):
        async for ev in client.events(rid):
            if isinstance(ev, BlockDelta):
                return


async def _until(predicate) -> None:  # type: ignore[no-untyped-def]
    """Until ``predicate()`` holds: state in the fake provider, which notifies only when a request ends."""
    with anyio.fail_after(30):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def test_sigkill_mid_stream_is_taken_over_as_worker_lost(fake, redis_url, key_prefix, redis_client, tmp_path):
    workers = Workers(_config_file(tmp_path / "c.toml", redis_url, key_prefix, fake.base_url), tmp_path)
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with client_for(config) as client:
            a = workers.start("a")
            rid = await client.enqueue(
                {
                    "route": "anthropic",
                    "model": "synthetic;deltas=200;pace_ms=30",
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                }
            )
            await _wait_for_delta(client, rid)
            workers.start("b")
            a.send_signal(signal.SIGKILL)
            result = await client.result(rid, timeout=60)
            events = await client.read_attempt(rid, 1)
            status = await client.status(rid)
        assert result.status == "interrupted" and result.error is not None
        assert result.error.category == "worker_lost"
        _check_attempt(events)
        assert isinstance(events[-1], StreamError) and events[-1].error.category == "worker_lost"
        assert any(isinstance(e, BlockDelta) for e in events)  # what was visible is kept
        assert status.attempt == 1 and status.epoch == 2
        assert len(await redis_client.xrange(Keys(key_prefix).terminal)) == 1
        await wait_all_acked(redis_client, Keys(key_prefix).jobs, "sluice-workers")
    finally:
        await workers.stop_all()
        await cleanup(redis_client, key_prefix)


async def test_sigkill_before_anything_visible_completes_in_a_new_attempt(
    fake, redis_url, key_prefix, redis_client, tmp_path
):
    workers = Workers(_config_file(tmp_path / "c.toml", redis_url, key_prefix, fake.base_url), tmp_path)
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with client_for(config) as client:
            a = workers.start("a")
            model = "synthetic;deltas=5;first_byte_ms=20000;times=1;id=kill2"
            rid = await client.enqueue(
                {"route": "openai-chat", "model": model, "request": {"messages": [{"role": "user", "content": "hi"}]}}
            )
            await _until(lambda: bool(fake.stats.find(request_id=rid)))  # the request is at the provider
            a.send_signal(signal.SIGKILL)
            workers.start("b")
            result = await client.result(rid, timeout=60)
            first = await client.read_attempt(rid, 1)
            second = await client.read_attempt(rid, 2)
        assert result.status == "completed"
        _check_attempt(first)
        _check_attempt(second)
        assert isinstance(first[-1], StreamError) and first[-1].error.category == "worker_lost"
        assert not any(isinstance(e, BlockDelta) for e in first)
        assert isinstance(second[-1], StreamDone)
    finally:
        await workers.stop_all()
        await cleanup(redis_client, key_prefix)


async def test_sigstopped_worker_is_fenced_after_takeover(fake, redis_url, key_prefix, redis_client, tmp_path):
    workers = Workers(_config_file(tmp_path / "c.toml", redis_url, key_prefix, fake.base_url), tmp_path)
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with client_for(config) as client:
            a = workers.start("a")
            rid = await client.enqueue(
                {
                    "route": "gemini",
                    "model": "synthetic;deltas=300;pace_ms=20",
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                }
            )
            await _wait_for_delta(client, rid)
            a.send_signal(signal.SIGSTOP)
            workers.start("b")
            result = await client.result(rid, timeout=60)
            before = await client.read_attempt(rid, 1)
            a.send_signal(signal.SIGCONT)  # it wakes up with a stale epoch and buffered chunks
            with anyio.fail_after(20):
                while "fenced" not in workers.log("a"):  # noqa: ASYNC110 - polling a log file
                    await anyio.sleep(0.1)
            after = await client.read_attempt(rid, 1)
        assert result.status == "interrupted" and result.error is not None
        assert result.error.category == "worker_lost"
        assert after == before  # its appends were refused: nothing after the terminal
        _check_attempt(after)
        assert len(await redis_client.xrange(Keys(key_prefix).terminal)) == 1
    finally:
        await workers.stop_all()
        await cleanup(redis_client, key_prefix)


async def test_a_woken_zombie_neither_keeps_nor_delays_a_job_taken_over(
    fake, redis_url, key_prefix, redis_client, tmp_path
):
    """Worker A is frozen past the claim idle time while its upstream is quiet; B takes the job over. When A
    wakes, its heartbeat must not claim the job back (it refreshes only what it still owns) and its attempt
    stops at once (its upstream connection closes), so when B dies too, C can take the job over."""
    keys = Keys(key_prefix)
    cfg = write_config_file(
        tmp_path / "c.toml",
        redis_url,
        key_prefix,
        fake.base_url,
        claim_idle_ms=1500,
        heartbeat_ms=200,
        shutdown_grace=2.0,
    )
    workers = Workers(cfg, tmp_path)
    config = make_config(redis_url, key_prefix, fake.base_url)
    # The first two requests (A's and B's attempts) get no response headers: a quiet upstream.
    model = "synthetic;deltas=5;stall_headers=1;times=2;id=zombie"
    try:
        async with client_for(config) as client:
            a = workers.start("a")
            rid = await client.enqueue(
                {"route": "anthropic", "model": model, "request": {"messages": [{"role": "user", "content": "hi"}]}}
            )
            await _until(lambda: len(fake.stats.find(request_id=rid)) == 1)
            entry = (await client.status(rid)).job_entry
            a.send_signal(signal.SIGSTOP)
            b = workers.start("b")
            await _until(lambda: len(fake.stats.find(request_id=rid)) == 2)  # B took it over: attempt 2 is sent
            owner_b = (await redis_client.xpending_range(keys.jobs, "sluice-workers", entry, entry, 1))[0]["consumer"]
            a.send_signal(signal.SIGCONT)
            await _until(lambda: fake.stats.find(request_id=rid)[0].disconnected)  # A's attempt stopped at once
            with anyio.fail_after(20):
                while "lost a job to another worker" not in workers.log("a"):  # noqa: ASYNC110 - a log file
                    await anyio.sleep(0.1)
            await anyio.sleep(0.6)  # three of A's heartbeats: none may take the entry back
            pending = await redis_client.xpending_range(keys.jobs, "sluice-workers", entry, entry, 1)
            assert pending[0]["consumer"] == owner_b
            b.send_signal(signal.SIGKILL)
            workers.start("c")
            result = await client.result(rid, timeout=60)
            attempts = {n: await client.read_attempt(rid, n) for n in (1, 2, 3)}
        assert result.status == "completed"
        for n in (1, 2):
            assert isinstance(attempts[n][-1], StreamError) and attempts[n][-1].error.category == "worker_lost"
        assert isinstance(attempts[3][-1], StreamDone)
        assert len(fake.stats.find(request_id=rid)) == 3
        assert len([f for _, f in await redis_client.xrange(keys.terminal) if f[b"request_id"] == rid.encode()]) == 1
    finally:
        await workers.stop_all()
        await cleanup(redis_client, key_prefix)


async def test_sigterm_lets_short_streams_finish_and_cancels_long_ones(
    fake, redis_url, key_prefix, redis_client, tmp_path
):
    workers = Workers(_config_file(tmp_path / "c.toml", redis_url, key_prefix, fake.base_url), tmp_path)
    config = make_config(redis_url, key_prefix, fake.base_url)
    try:
        async with client_for(config) as client:
            a = workers.start("a")
            job = {"route": "openai-chat", "request": {"messages": [{"role": "user", "content": "hi"}]}}
            short = await client.enqueue({**job, "model": "synthetic;deltas=20;pace_ms=25"})  # ~0.5 s
            long = await client.enqueue({**job, "model": "synthetic;deltas=2000;pace_ms=25"})  # ~50 s
            await _wait_for_delta(client, short)
            await _wait_for_delta(client, long)
            a.send_signal(signal.SIGTERM)  # grace is 2 s
            with anyio.fail_after(20):
                code = await anyio.to_thread.run_sync(a.wait)
            done = await client.result(short, timeout=5)
            cut = await client.result(long, timeout=5)
            events = await client.read_attempt(long, 1)
            with anyio.fail_after(10):  # the upstream connection was closed, not left streaming
                await fake.stats.wait_until(lambda st: any(r.disconnected for r in st.find(request_id=long)))
        assert code == 0
        assert done.status == "completed"
        assert cut.status == "interrupted" and cut.error is not None and cut.error.category == "cancelled"
        _check_attempt(events)
        await wait_all_acked(redis_client, Keys(key_prefix).jobs, "sluice-workers")
    finally:
        await workers.stop_all()
        await cleanup(redis_client, key_prefix)
