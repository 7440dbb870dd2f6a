"""Integration fixtures: the real fake provider on loopback, a worker configuration pointing at it, and
an in-process worker running on the test's event loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from ops.client import SluiceClient
from ops.fake_provider import serve_fake_provider
from worker.config import Config, RetryPolicy, Route, Timeouts
from worker.consumer import Worker

API_KEY = "sk-test-SECRET-9f8e7d6c5b4a"
KEY_ENV = "SLUICE_TEST_API_KEY"
DIALECTS = ("anthropic", "openai-chat", "openai-responses", "gemini")


@pytest.fixture(autouse=True)
def _api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[object]:
    async with serve_fake_provider(api_key=API_KEY) as server:
        yield server


def make_config(redis_url: str, prefix: str, base_url: str, **overrides: object) -> Config:
    routes = {d: Route(dialect=d, base_url=base_url, model="synthetic", api_key_env=KEY_ENV) for d in DIALECTS}
    fields: dict[str, object] = {
        "redis_url": redis_url, "key_prefix": prefix, "consumer": "w-test", "routes": routes,
        "timeouts": Timeouts(connect=5, first_byte=10, idle=10, total=60),
        "retry": RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, max_total=5),
        "claim_idle_ms": 60_000, "shutdown_grace": 5.0,
    }  # fmt: skip
    fields.update(overrides)
    return Config(**fields)  # type: ignore[arg-type]


@pytest_asyncio.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    yield r
    await r.aclose()


@contextlib.asynccontextmanager
async def running_worker(config: Config) -> AsyncIterator[Worker]:
    worker = Worker(config)
    async with anyio.create_task_group() as tg:
        ready = anyio.Event()
        tg.start_soon(lambda: worker.run(ready=ready.set))
        await ready.wait()
        try:
            yield worker
        finally:
            worker.stop()


@contextlib.asynccontextmanager
async def client_for(config: Config) -> AsyncIterator[SluiceClient]:
    c = SluiceClient(config.redis_url, key_prefix=config.key_prefix)
    try:
        yield c
    finally:
        await c.aclose()


async def cleanup(redis: aioredis.Redis, prefix: str) -> None:
    async for key in redis.scan_iter(match=f"{prefix}:*", count=1000):
        await redis.delete(key)
