"""One real Redis Cluster (3 masters, 3 replicas on loopback) shared by the session's cluster tests.

Tests may fail over, restart and migrate, so none may rely on which port is a master: ask the cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.harness import Cluster, start_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield c
    finally:
        c.stop()
