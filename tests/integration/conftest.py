"""Integration fixtures: the real fake provider on loopback, a worker configuration pointing at it, and
an in-process worker running on the test's event loop."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from sluice.client import SluiceClient
from sluice.harness.fake.provider import serve_fake_provider
from sluice.worker.config import Config, RetryPolicy, Route, Timeouts
from sluice.worker.pipeline.consumer import Worker

API_KEY = "sk-test-SECRET-9f8e7d6c5b4a"
KEY_ENV = "SLUICE_TEST_API_KEY"
DIALECTS = ("anthropic", "openai-chat", "openai-responses", "gemini")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[object]:
    async with serve_fake_provider(api_key=API_KEY) as server:
        yield server


def make_config(redis_url: str, prefix: str, base_url: str, **overrides: object) -> Config:
    # send_request_id: the fake provider tells requests apart by the header (real routes leave it off)
    routes = {
        d: Route(dialect=d, base_url=base_url, model="synthetic", api_key_env=KEY_ENV, send_request_id=True)
        for d in DIALECTS
    }
    fields: dict[str, object] = {
        "redis_url": redis_url,
        "key_prefix": prefix,
        "consumer": "w-test",
        "routes": routes,
        "timeouts": Timeouts(connect=5, first_byte=10, idle=10, total=60),
        "retry": RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, max_total=5),
        "claim_idle_ms": 60_000,
        "shutdown_grace": 5.0,
    }
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


def write_config_file(
    path: Path,
    redis_url: str,
    prefix: str,
    base_url: str,
    *,
    model: str | None = None,
    timeouts: dict[str, float] | None = None,
    **settings: object,
) -> Path:
    """A worker TOML file as an operator writes one: one route per dialect, pointing at the fake provider."""

    def value(v: object) -> str:
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"redis_url = {value(redis_url)}", f"key_prefix = {value(prefix)}"]
    lines += [f"{k} = {value(v)}" for k, v in settings.items()]
    if timeouts:
        lines += ["[timeouts]", *(f"{k} = {value(v)}" for k, v in timeouts.items())]
    for d in DIALECTS:
        lines += [f'[routes."{d}"]', f'dialect = "{d}"', f"base_url = {value(base_url)}", f'api_key_env = "{KEY_ENV}"']
        lines.append("send_request_id = true")  # the fake provider tells requests apart by it
        if model:
            lines.append(f"model = {value(model)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def spawn_worker(config_path: Path, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """``python -m worker --config FILE`` as its own process, the API key in its environment, stderr (the
    JSON logs) to ``log_path``. The file says where Redis is, so REDIS_URL is not passed on."""
    env = {**os.environ, KEY_ENV: API_KEY, "PYTHONPATH": str(ROOT)}
    env.pop("REDIS_URL", None)
    with contextlib.ExitStack() as stack:
        err = stack.enter_context(log_path.open("wb")) if log_path is not None else subprocess.DEVNULL
        return subprocess.Popen(
            [sys.executable, "-m", "sluice.worker", "--config", str(config_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def raw_log_as_sse(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> bytes:
    """Re-frame a raw stream's SSE entries as a text/event-stream body (a plain oracle, independent of the
    audit's byte-exact re-framer), so a test can normalize offline exactly what the raw log holds."""
    out = bytearray()
    for _, f in entries:
        if f[b"kind"] != b"sse":
            continue
        if f[b"event"] != b"message":
            out += b"event: " + f[b"event"] + b"\n"
        for line in f[b"data"].split(b"\n"):
            out += b"data: " + line + b"\n"
        out += b"\n"
    return bytes(out)


def without_ts(ev: object) -> dict[str, object]:
    """A contract event as a dict without ``ts`` (the receive time differs between live and offline)."""
    d = msgspec.to_builtins(ev)
    d.pop("ts")
    return d  # type: ignore[no-any-return]
