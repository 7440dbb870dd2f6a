"""Fixtures for the CLI tests (no tests here): the real fake provider and a real worker run on an event
loop in a background thread (an anyio blocking portal), so the tests themselves stay synchronous and call
the CLI's real entry point, ``sluice.cli.main.main``, in-process (it runs its own event loop), with capsys.

The CLI finds Redis and the key prefix through ``REDIS_URL`` / ``SLUICE_KEY_PREFIX``, as an operator's
shell would set them.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import redis

from sluice.cli.main import main
from sluice.harness.fake.provider import serve_fake_provider
from sluice.schemas.events import Event, decode_event
from sluice.schemas.keys import Keys
from sluice.worker.pipeline.consumer import Worker
from tests.integration.conftest import API_KEY, make_config

TERMINAL = ("completed", "failed", "interrupted")


@dataclass
class Service:
    portal: Any
    redis_url: str
    prefix: str
    base_url: str
    r: redis.Redis
    capsys: pytest.CaptureFixture[str]

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)

    def cli(self, *argv: str) -> tuple[int, str, str]:
        """Run ``sluice ARGV`` in-process; returns (exit status, stdout, stderr)."""
        self.capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: --help, usage errors
            code = int(exc.code or 0)
        out, err = self.capsys.readouterr()
        return code, out, err

    def status(self, rid: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.keys.request(rid).status).items()}

    def wait_state(self, rid: str, states: tuple[str, ...] = TERMINAL, timeout: float = 30.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status(rid)
            # A terminal state is stored just before the terminal-stream entry: wait for that too, since
            # commands like `audit --since` read the terminal stream.
            if st.get("state") in states and (st.get("state") not in TERMINAL or st.get("published") == "1"):
                return st
            time.sleep(0.02)
        raise AssertionError(f"{rid} did not reach {states}: {self.status(rid)}")

    def events(self, rid: str) -> list[tuple[str, Event]]:
        return [(i.decode(), decode_event(f[b"event"])) for i, f in self.r.xrange(self.keys.request(rid).events)]

    def enqueue(self, route: str, model: str, rid: str, **extra: Any) -> str:
        job = {
            "route": route,
            "model": model,
            "request_id": rid,
            "request": {"messages": [{"role": "user", "content": "Привет"}]},
            **extra,
        }
        self.r.xadd(self.keys.jobs, {"job": msgspec.json.encode(job)})
        return rid


@pytest.fixture(scope="module")
def portal() -> Iterator[Any]:
    from anyio.from_thread import start_blocking_portal

    with start_blocking_portal() as p:
        yield p


@pytest.fixture(scope="module")
def fake(portal: Any) -> Iterator[Any]:
    with portal.wrap_async_context_manager(serve_fake_provider(api_key=API_KEY)) as server:
        yield server


@pytest.fixture
def service(
    request: pytest.FixtureRequest,
    portal: Any,
    fake: Any,
    redis_url: str,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> Iterator[Service]:
    """The worker on ``make_config``'s settings; a test overrides some with ``indirect`` parametrization
    (``@pytest.mark.parametrize("service", [{"prices": ...}], indirect=True)``)."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("SLUICE_KEY_PREFIX", key_prefix)
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    config = make_config(redis_url, key_prefix, fake.base_url, **getattr(request, "param", {}))
    worker = portal.call(Worker, config)  # built on the loop that runs it
    ready = threading.Event()
    running = portal.start_task_soon(functools.partial(worker.run, ready=ready.set))
    assert ready.wait(10), "the worker did not start"
    r = redis.Redis.from_url(redis_url)
    try:
        yield Service(portal, redis_url, key_prefix, fake.base_url, r, capsys)
    finally:
        portal.call(worker.stop)
        running.result(timeout=30)
        for key in r.scan_iter(match=f"{key_prefix}:*", count=1000):
            r.delete(key)
        r.close()
