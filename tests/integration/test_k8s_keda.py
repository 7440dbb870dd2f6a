"""The numbers KEDA's Redis scalers read, from a real Redis with the worker's own group, under a backlog
and as jobs are read and acked. The redis-streams scaler (pkg/scalers/redis_streams_scaler.go):

- the ``lagCount`` trigger: ``XINFO GROUPS <stream>``, the ``lag`` of the group (``XLEN`` while the
  group does not exist yet, 0 while the stream does not);
- the ``pendingEntriesCount`` trigger: ``XPENDING <stream> <group>``'s count;
- either is active when its number is above ``activationLagCount`` (0 here).

Lag counts the entries no consumer has read, pending those read and not acked: a read moves k from lag
to pending, an ack takes k off pending and leaves lag alone, and a running worker brings both to 0.

The redis scaler (pkg/scalers/redis_scaler.go, the admission triggers): ``EVAL`` of a fixed script that
asks ``TYPE listName`` and answers its length by that type (HLEN for a hash, LLEN for a list or no key
at all, ZCARD, SCARD). A limited route's jobs leave the job stream at intake, so a backlog of them shows
as lag 0 and pending 0 and only in the route store's waiting hash: every trigger the manifests ship
(base and sharded-4, parsed from the YAML) is evaluated so against the real worker holding such a
backlog, and the desired replica count follows docs/operations.md's formula.

Then the ``sluice-keda`` ACL user of ops/deploy/users.acl runs exactly those commands (and go-redis's
connection handshake) on a private redis-server, refused nothing, and is refused everything else.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import redis
import redis.asyncio as aioredis
import yaml
from redis.exceptions import NoPermissionError, ResponseError

from sluice.client import SluiceClient
from sluice.harness.embedded_redis import EmbeddedRedis
from sluice.harness.fake.provider import serve_fake_provider
from sluice.schemas.keys import Keys
from sluice.worker.config import Config, load_config
from sluice.worker.redis.connect import QUIET, ensure_group
from tests.integration.conftest import API_KEY, KEY_ENV, cleanup, make_config, running_worker
from tests.integration.test_deploy_acl import acl_redis

__all__ = ["acl_redis"]

GROUP = "sluice-workers"
KEDA_PASSWORD = "keda-dev-password"  # secrets.example.yaml's; users.acl holds its SHA-256
K8S = Path(__file__).resolve().parents[2] / "ops" / "deploy" / "k8s"
SHIPPED_PREFIX = "sluice"  # the key_prefix of the shipped worker config, in every trigger's key name
# What the redis scaler's script does, in this test's own words: the key's TYPE, then its length by that
# type; a key that does not exist (TYPE says none) is an empty list, any other type an error.
LIST_TYPES = ("redis", "redis-cluster")
LIST_LENGTH = """
local kind = redis.call('TYPE', KEYS[1])['ok']
local length_of = {hash = 'HLEN', list = 'LLEN', none = 'LLEN', zset = 'ZCARD', set = 'SCARD'}
if length_of[kind] == nil then
  return redis.error_reply('ERR unsupported key type: ' .. kind)
end
return redis.call(length_of[kind], KEYS[1])
"""


async def keda_list_length(r: aioredis.Redis, key: str) -> int:
    """The redis (and redis-cluster) scaler's metric: one EVAL, its key declared."""
    return int(await r.eval(LIST_LENGTH, 1, key))


async def keda_reads(r: aioredis.Redis, stream: str, group: str) -> tuple[int, int]:
    """(lag, pending) as the scaler computes them."""
    try:
        groups = await r.xinfo_groups(stream)
    except ResponseError as exc:
        if "no such key" not in str(exc):
            raise
        return 0, 0  # the scaler: no stream yet, lag 0 (XPENDING would answer NOGROUP: no metric)
    mine = [g for g in groups if g["name"].decode() == group]
    if not mine:
        return int(await r.xlen(stream)), 0  # the scaler's fallback before the group exists
    pending = await r.xpending(stream, group)
    return int(mine[0]["lag"]), int(pending["pending"])


def _job(i: int) -> dict[str, Any]:
    return {
        "route": "anthropic",
        "model": "synthetic;deltas=2",
        "request_id": f"keda-{i}",
        "request": {"messages": [{"role": "user", "content": "hi"}]},
    }


@pytest.mark.asyncio
async def test_lag_and_pending_move_as_documented(redis_url, key_prefix, redis_client, fake, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    stream = Keys(key_prefix).shard(0).jobs
    client = SluiceClient(redis_url, key_prefix=key_prefix)
    try:
        assert await keda_reads(redis_client, stream, GROUP) == (0, 0)  # nothing enqueued, no stream
        for i in range(10):
            await client.enqueue(_job(i))
        assert await keda_reads(redis_client, stream, GROUP) == (10, 0)  # no group yet: XLEN
        await ensure_group(redis_client, stream, GROUP)  # what a worker does first (from id 0)
        seen = [await keda_reads(redis_client, stream, GROUP)]
        # Read as the worker reads (XREADGROUP ... >), then ack as it does when a job is finished.
        got = await redis_client.xreadgroup(GROUP, "w1", {stream: ">"}, count=3)
        ids = [entry_id for _, entries in got for entry_id, _ in entries]
        seen.append(await keda_reads(redis_client, stream, GROUP))
        await redis_client.xreadgroup(GROUP, "w2", {stream: ">"}, count=4)
        seen.append(await keda_reads(redis_client, stream, GROUP))
        await redis_client.xack(stream, GROUP, *ids[:2])
        seen.append(await keda_reads(redis_client, stream, GROUP))
        await client.enqueue(_job(10))
        seen.append(await keda_reads(redis_client, stream, GROUP))
        assert seen == [(10, 0), (7, 3), (3, 7), (3, 5), (4, 5)]
        # A worker of the group takes the rest; the entries read by w1 and w2 (consumers that went
        # away) stay pending until the worker's reclaim takes them over after their idle time.
        await redis_client.xack(stream, GROUP, *ids[2:])
        leftover = await redis_client.xpending_range(stream, GROUP, "-", "+", 10)
        await redis_client.xack(stream, GROUP, *[p["message_id"] for p in leftover])
        assert await keda_reads(redis_client, stream, GROUP) == (4, 0)
        config = make_config(redis_url, key_prefix, fake.base_url)
        async with running_worker(config):
            with anyio.fail_after(30):
                while await keda_reads(redis_client, stream, GROUP) != (0, 0):  # noqa: ASYNC110 - Redis state
                    await anyio.sleep(0.05)
        states = [await client.status(f"keda-{i}") for i in range(7, 11)]
        assert [s.state for s in states] == ["completed"] * 4
    finally:
        await client.aclose()
        await cleanup(redis_client, key_prefix)


def test_the_keda_user_runs_what_the_scaler_sends_and_nothing_else(acl_redis: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(f"redis://sluice-admin:admin-dev-password@127.0.0.1:{acl_redis.port}/0")
    # KEDA's go-redis sends no CLIENT SETINFO (nor does sluice): neither does this stand-in.
    keda = redis.Redis.from_url(f"redis://sluice-keda:{KEDA_PASSWORD}@127.0.0.1:{acl_redis.port}/0", **QUIET)
    try:
        admin.flushall()
        admin.acl_log_reset()
        sharded = Keys("sluice", job_shards=4).shard(2).jobs
        for stream in ("sluice:jobs", sharded):
            admin.xadd(stream, {"job": json.dumps(_job(0))})
            admin.xgroup_create(stream, GROUP, id="0")
        store = Keys("sluice").route("claude")
        admin.hset(store.waiting, mapping={"r1": "{}", "r2": "{}"})
        admin.hset(store.state, "limits", "{}")
        # go-redis (KEDA's client) opens with HELLO 3 AUTH, then PING; the lag trigger checks INFO's
        # redis_version, then XINFO GROUPS (XLEN when the group is missing); the pending one XPENDING.
        assert keda.execute_command("HELLO", "3", "AUTH", "sluice-keda", KEDA_PASSWORD)
        assert keda.ping() is True
        assert int(str(keda.info("server")["redis_version"]).split(".")[0]) >= 7
        for stream in ("sluice:jobs", sharded):
            (group,) = keda.xinfo_groups(stream)
            assert (group["lag"], keda.xpending(stream, GROUP)["pending"], keda.xlen(stream)) == (1, 0, 1)
        # The admission trigger: EVAL, and inside it TYPE then HLEN (a backlog) or LLEN (none: no key).
        assert keda.eval(LIST_LENGTH, 1, store.waiting) == 2
        assert keda.eval(LIST_LENGTH, 1, Keys("sluice").route("other").waiting) == 0
        assert admin.acl_log() == []  # not one command refused
        refused = [
            lambda: keda.xreadgroup(GROUP, "k", {"sluice:jobs": ">"}),
            lambda: keda.xadd("sluice:jobs", {"job": "{}"}),
            lambda: keda.xrange("sluice:jobs"),
            lambda: keda.xinfo_groups("sluice:terminal"),
            lambda: keda.xpending("sluice:{req:x}:events", GROUP),
            lambda: keda.xack("sluice:jobs", GROUP, "0-1"),
            lambda: keda.keys("*"),
            # The route store: the waiting hash is counted, never read or written; its other keys not seen.
            lambda: keda.hgetall(store.waiting),
            lambda: keda.hset(store.waiting, "r3", "{}"),
            lambda: keda.delete(store.waiting),
            lambda: keda.eval(LIST_LENGTH, 1, store.state),
            lambda: keda.eval("return redis.call('HLEN', KEYS[1])", 1, store.state),
            lambda: keda.evalsha("0" * 40, 1, store.waiting),
        ]
        for call in refused:
            with pytest.raises(NoPermissionError):
                call()
        # A script may call only what the user may: a write inside EVAL on the waiting hash is refused.
        for script in ("return redis.call('HSET', KEYS[1], 'r3', '{}')", "return redis.call('DEL', KEYS[1])"):
            with pytest.raises(ResponseError, match=r"no permissions|can't run this command|NOPERM"):
                keda.eval(script, 1, store.waiting)
        assert admin.hlen(store.waiting) == 2
    finally:
        keda.close()
        admin.close()


# -- every shipped trigger against the real worker ---------------------------------------------------------


def _shipped_config(
    tmp: Path, redis_url: str, prefix: str, base_url: str, env: dict[str, str], *, cluster: bool
) -> Config:
    """worker-config.yaml's file as the worker loads it (with ``env``, the overlay's environment), pointed at
    this test's Redis (a cluster or not), key prefix and fake provider. The limited route's cap is 2 here,
    so a backlog forms with a few jobs; its admin endpoint is off (a fixed port)."""
    (configmap,) = [d for d in yaml.safe_load_all((K8S / "base" / "worker-config.yaml").read_text()) if d]
    path = tmp / "sluice.toml"
    path.write_text(configmap["data"]["sluice.toml"])
    shipped = load_config(path, env=env)
    assert shipped.key_prefix == SHIPPED_PREFIX
    assert shipped.redis_cluster == ("SLUICE_REDIS_CLUSTER" in env)  # the overlay's flag, as the worker reads it
    routes = {
        name: msgspec.structs.replace(
            route,
            base_url=base_url,
            api_key_env=KEY_ENV,
            send_request_id=True,  # the fake provider's hold gates tell requests apart by it
            max_concurrency=2 if route.limited else None,
        )
        for name, route in shipped.routes.items()
    }
    return msgspec.structs.replace(
        shipped,
        redis_url=redis_url,
        key_prefix=prefix,
        redis_cluster=cluster,
        routes=routes,
        admin_port=None,
        shutdown_grace=5.0,
        consumer="w-keda",
    )


def _scaled_object(overlay: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The base ScaledObject and the triggers in force (the overlay's patch replaces the list)."""
    (base,) = [d for d in yaml.safe_load_all((K8S / "base" / "keda-scaledobject.yaml").read_text()) if d]
    if not overlay:
        return base, base["spec"]["triggers"]
    path = K8S / "overlays" / "sharded-4" / "keda-triggers.yaml"
    (patch,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return base, patch["spec"]["triggers"]


def _here(name: str, prefix: str) -> str:
    """A shipped key name under this test's prefix."""
    assert name.startswith(f"{SHIPPED_PREFIX}:"), name
    return prefix + name[len(SHIPPED_PREFIX) :]


async def _metrics(r: aioredis.Redis, triggers: list[dict[str, Any]], prefix: str) -> dict[str, tuple[int, int]]:
    """trigger name -> (metric, target), each computed as its scaler computes it."""
    out: dict[str, tuple[int, int]] = {}
    for t in triggers:
        meta = t["metadata"]
        if t["type"] in ("redis-streams", "redis-cluster-streams"):
            lag, pending = await keda_reads(r, _here(meta["stream"], prefix), meta["consumerGroup"])
            if "lagCount" in meta:
                out[t["name"]] = (lag, int(meta["lagCount"]))
            else:
                out[t["name"]] = (pending, int(meta["pendingEntriesCount"]))
        else:
            assert t["type"] in LIST_TYPES, t["type"]
            out[t["name"]] = (await keda_list_length(r, _here(meta["listName"], prefix)), int(meta["listLength"]))
    return out


def desired_replicas(scaled: dict[str, Any], metrics: dict[str, tuple[int, int]]) -> int:
    """docs/operations.md: ceil(metric / target) per trigger, the HPA takes the largest, bounded by min/max."""
    want = max(math.ceil(metric / target) for metric, target in metrics.values())
    return min(scaled["spec"]["maxReplicaCount"], max(scaled["spec"]["minReplicaCount"], want))


def _route_job(route: str, model: str) -> dict[str, Any]:
    return {"route": route, "model": model, "request": {"messages": [{"role": "user", "content": "hi"}]}}


async def backlog_scenario(r: Any, redis_url: str, prefix: str, tmp: Path, *, overlay: bool, cluster: bool) -> None:
    """The shipped worker config (the overlay's environment with ``overlay``) on the Redis ``redis_url``
    names (a cluster's seed node with ``cluster``), 2 jobs held at the fake provider on the limited route
    (cap 2) and 130 more waiting for admission; every shipped trigger read through ``r`` as its scaler
    reads it, the desired replicas by the documented formula, then again once drained."""
    env = {"SLUICE_JOB_SHARDS": "4", "SLUICE_REDIS_CLUSTER": "1"} if overlay else {}
    scaled, triggers = _scaled_object(overlay)
    waiting = 130  # ceil(130 / 64) = 3 replicas
    async with serve_fake_provider(api_key=API_KEY) as fake:
        config = _shipped_config(tmp, redis_url, prefix, fake.base_url, env, cluster=cluster)
        (route,) = [name for name, rt in config.routes.items() if rt.limited]
        keys = Keys(prefix, job_shards=config.job_shards, cluster=cluster)
        # Every trigger names a key of this layout: the shard streams and the route's waiting hash.
        names = {_here(t["metadata"].get("stream") or t["metadata"]["listName"], prefix) for t in triggers}
        assert names == {s.jobs for s in keys.shards} | {keys.route(route).waiting}
        async with (
            running_worker(config),
            SluiceClient(redis_url, key_prefix=prefix, job_shards=config.job_shards, cluster=cluster) as client,
        ):
            held = [await client.enqueue(_route_job(route, f"synthetic;deltas=2;hold=g;seed={i}")) for i in range(2)]
            with anyio.fail_after(30):
                await fake.stats.wait_until(lambda s: s.limiter.in_flight == 2)
            rest = [await client.enqueue(_route_job(route, f"synthetic;deltas=1;seed={i}")) for i in range(waiting)]
            # What KEDA sees once intake has settled: the job streams empty of work (every limited job acked
            # at intake), the backlog only in the route's waiting hash.
            admission = {t["name"] for t in triggers if t["type"] in LIST_TYPES}
            expected = {t["name"]: waiting if t["name"] in admission else 0 for t in triggers}
            seen: dict[str, tuple[int, int]] = {}
            with anyio.fail_after(30):
                while {k: v[0] for k, v in seen.items()} != expected:
                    seen = await _metrics(r, triggers, prefix)
                    await anyio.sleep(0.05)
            assert desired_replicas(scaled, seen) == math.ceil(waiting / config.max_in_flight) == 3
            # The job-stream triggers alone would leave the fleet at its minimum.
            streams_only = {k: v for k, v in seen.items() if k not in admission}
            assert desired_replicas(scaled, streams_only) == scaled["spec"]["minReplicaCount"] == 1
            fake.release("g")
            results = [await client.result(rid, timeout=60) for rid in [*held, *rest]]
            assert [res.status for res in results] == ["completed"] * (waiting + 2)
            # Drained: the hash is gone (TYPE none, so the script answers LLEN: 0), the streams idle.
            seen = await _metrics(r, triggers, prefix)
            assert {k: v[0] for k, v in seen.items()} == {t["name"]: 0 for t in triggers}
            assert await r.exists(keys.route(route).waiting) == 0
            assert desired_replicas(scaled, seen) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("overlay", [False, True], ids=["base", "sharded-4"])
async def test_every_shipped_trigger_sees_a_backlog_waiting_for_admission(
    redis_url, key_prefix, redis_client, monkeypatch, tmp_path, overlay: bool
) -> None:
    """On one redis-server (the sharded-4 overlay's shard streams and trigger types too: a cluster scaler
    sends the same commands, routed by slot; tests/cluster/test_cluster_keda.py runs it on a cluster)."""
    monkeypatch.setenv(KEY_ENV, API_KEY)
    try:
        await backlog_scenario(redis_client, redis_url, key_prefix, tmp_path, overlay=overlay, cluster=False)
    finally:
        await cleanup(redis_client, key_prefix)
