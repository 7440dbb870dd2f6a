"""Redis faults during a stream (issue 5), through a TCP proxy between the worker and Redis."""

from __future__ import annotations

import signal

import anyio
import psutil
import pytest

from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import BlockDelta, StreamDone, StreamError
from sluice.schemas.invariants import ContractChecker
from sluice.schemas.keys import Keys
from tests.faults import TcpProxy
from tests.integration.conftest import (
    DIALECTS,
    cleanup,
    client_for,
    make_config,
    raw_log_as_sse,
    running_worker,
    spawn_worker,
    without_ts,
    write_config_file,
)

pytestmark = pytest.mark.asyncio


def _check(events: list) -> None:  # type: ignore[type-arg]
    checker = ContractChecker()
    for ev in events:
        checker.process(ev)  # no duplicate, no gap, nothing after the terminal
    assert checker.terminal


async def _wait_for_deltas(client, rid: str, n: int) -> None:  # type: ignore[no-untyped-def]
    seen = 0
    with anyio.fail_after(30):
        async for ev in client.events(rid):
            seen += isinstance(ev, BlockDelta)
            if seen >= n:
                return


async def test_connection_cut_mid_stream_completes_without_gap_or_duplicate(fake, redis_url, key_prefix, redis_client):
    async with TcpProxy.for_url(redis_url) as proxy:
        config = make_config(proxy.url_for(redis_url), key_prefix, fake.base_url)
        direct = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with running_worker(config), client_for(direct) as client:
                rid = await client.enqueue(
                    {
                        "route": "anthropic",
                        "model": "synthetic;deltas=120;pace_ms=10",
                        "request": {"messages": [{"role": "user", "content": "hi"}]},
                    }
                )
                await _wait_for_deltas(client, rid, 10)
                assert proxy.cut() > 0
                await _wait_for_deltas(client, rid, 40)
                assert proxy.cut() > 0
                result = await client.result(rid, timeout=60)
                events = await client.read_attempt(rid, 1)
            assert result.status == "completed"
            _check(events)
            assert isinstance(events[-1], StreamDone)
            raw = await redis_client.xrange(Keys(key_prefix).request(rid).raw)
            assert [e[0] for e in raw] == [f"1-{i}".encode() for i in range(len(raw))]
            info = StreamInfo(f"{rid}:1", rid, "", "anthropic", 1, "synthetic;deltas=120;pace_ms=10", route="anthropic")
            _, offline, _ = normalize_bytes([raw_log_as_sse(raw)], "anthropic", info)
            assert [without_ts(e) for e in events] == [without_ts(e) for e in offline]
        finally:
            await cleanup(redis_client, key_prefix)


async def test_redis_away_past_the_limit_cancels_upstream_and_writes_terminal_on_return(
    fake, redis_url, key_prefix, redis_client
):
    async with TcpProxy.for_url(redis_url) as proxy:
        config = make_config(
            proxy.url_for(redis_url), key_prefix, fake.base_url, redis_outage_limit=1.0, redis_socket_timeout=2.0
        )
        direct = make_config(redis_url, key_prefix, fake.base_url)
        try:
            async with running_worker(config), client_for(direct) as client:
                rid = await client.enqueue(
                    {
                        "route": "openai-chat",
                        "model": "synthetic;deltas=2000;pace_ms=10",
                        "request": {"messages": [{"role": "user", "content": "hi"}]},
                    }
                )
                await _wait_for_deltas(client, rid, 5)
                proxy.refuse(True)
                proxy.cut()
                with anyio.fail_after(30):  # the worker gives up on Redis and closes the provider connection
                    await fake.stats.wait_until(lambda s: any(r.disconnected for r in s.find(request_id=rid)))
                assert (await client.status(rid)).state == "running"
                proxy.refuse(False)  # Redis is back: the held batches and the terminal are written
                result = await client.result(rid, timeout=60)
                events = await client.read_attempt(rid, 1)
            assert result.status == "interrupted" and result.error is not None
            assert result.error.category == "transport" and "Redis" in result.error.message
            _check(events)
            assert isinstance(events[-1], StreamError)
        finally:
            await cleanup(redis_client, key_prefix)


async def test_worker_memory_stays_bounded_when_redis_is_slow(fake, redis_url, key_prefix, redis_client, tmp_path):
    """100 streams flat out while Redis is throttled: reading pauses instead of buffering."""
    async with TcpProxy.for_url(redis_url) as proxy:
        cfg = write_config_file(
            tmp_path / "c.toml",
            proxy.url_for(redis_url),
            key_prefix,
            fake.base_url,
            max_in_flight=100,
            shutdown_grace=0.5,
            redis_socket_timeout=60.0,
            timeouts={"total": 600.0, "idle": 600.0, "first_byte": 600.0},
        )
        proc = spawn_worker(cfg)
        direct = make_config(redis_url, key_prefix, fake.base_url)
        try:
            ps = psutil.Process(proc.pid)
            async with client_for(direct) as client:
                # The baseline is taken after one stream per dialect ran: what the first jobs load once
                # (adapters, decoders, connections) is not growth under load.
                warm = [
                    await client.enqueue(
                        {
                            "route": d,
                            "model": "synthetic;deltas=20",
                            "request": {"messages": [{"role": "user", "content": "hi"}]},
                        }
                    )
                    for d in DIALECTS
                ]
                for rid in warm:
                    assert (await client.result(rid, timeout=30)).status == "completed"
                baseline = ps.memory_info().rss
                proxy.throttle(20_000)  # bytes/s per connection
                model = "synthetic;deltas=3000;words=8-12"  # about 1 MB per stream, 100 MB in all
                for i in range(100):
                    await client.enqueue(
                        {
                            "route": DIALECTS[i % 4],
                            "model": f"{model};seed={i}",
                            "request": {"messages": [{"role": "user", "content": "hi"}]},
                        }
                    )
                peak = baseline
                # Eight seconds of load once every stream has started (the jobs themselves come through the
                # throttle, so on a busy machine the last ones start late).
                with anyio.fail_after(60):
                    while len(fake.stats.requests) < 104:
                        await anyio.sleep(0.2)
                        peak = max(peak, ps.memory_info().rss)
                for _ in range(40):
                    await anyio.sleep(0.2)
                    peak = max(peak, ps.memory_info().rss)
                served = sum(r.bytes_sent for r in fake.stats.requests)
        finally:
            proc.send_signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(proc.wait)
            proxy.throttle(None)
            await cleanup(redis_client, key_prefix)
        assert len(fake.stats.requests) == 104
        growth = peak - baseline
        # Had the worker buffered what the provider could send, it would hold (a multiple of) that.
        print(f"RSS growth {growth / 2**20:.1f} MiB; provider sent {served / 2**20:.1f} MiB")
        # What the provider sent beyond what Redis took sits in kernel socket buffers, not in the worker:
        # had the worker read it all into memory, it would hold (a multiple of) that.
        assert served > 40 * 2**20
        assert growth < 60 * 2**20, f"RSS grew {growth / 2**20:.0f} MiB"
