"""One real Redis Cluster (3 masters, 3 replicas on loopback) shared by the session's cluster tests.

Tests may fail over, restart and migrate, so none may rely on which port is a master: ask the cluster. Under
xdist every test here runs on one worker (the ``cluster`` group), so the session starts one cluster, not one
per worker."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.cluster.harness import Cluster, start_cluster

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before xdist's loadgroup reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.xdist_group("cluster"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def _api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.conftest import API_KEY, KEY_ENV

    monkeypatch.setenv(KEY_ENV, API_KEY)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[object]:
    from sluice.harness.fake.provider import serve_fake_provider
    from tests.integration.conftest import API_KEY

    async with serve_fake_provider(api_key=API_KEY) as server:
        yield server
