"""The sharded-4 overlay on a real Redis Cluster: the worker with the overlay's environment
(``SLUICE_JOB_SHARDS=4``, ``SLUICE_REDIS_CLUSTER=1``) on the shipped config, and every trigger of the
overlay (``redis-cluster-streams`` per shard stream, ``redis-cluster`` for the admission trigger) read
through a cluster client, each command routed by its key's slot as KEDA's cluster scalers route it, under a
backlog waiting for admission (tests/integration/test_k8s_keda.py's scenario)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import connect
from tests.cluster.harness import Cluster
from tests.integration.test_k8s_keda import backlog_scenario


@pytest.mark.asyncio
async def test_the_overlay_triggers_read_the_backlog_on_a_cluster(cluster: Cluster, tmp_path: Path) -> None:
    prefix = f"ck{uuid.uuid4().hex[:10]}"
    rc = connect(cluster.seed_url, cluster=True)
    assert isinstance(rc, SluiceCluster)
    await rc.initialize()
    try:
        await backlog_scenario(rc, cluster.seed_url, prefix, tmp_path, overlay=True, cluster=True)
    finally:
        async for key in rc.scan_iter(match=f"{prefix}:*"):
            await rc.delete(key)
        await rc.aclose()
