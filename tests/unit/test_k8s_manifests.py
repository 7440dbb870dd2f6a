"""ops/deploy/k8s/: every core manifest validates against the Kubernetes schemas of a pinned version
(``kubernetes-validate``, strict: no unknown field); the KEDA resources, whose CRD is not in those
schemas, are checked field by field against KEDA's documented names (the metadata of the redis-streams
and redis scalers, pkg/scalers/redis_streams_scaler.go and redis_scaler.go, and of their cluster types);
and the manifests agree with each other and with the worker's configuration (ports, grace, group,
max_in_flight, the shard streams, one admission trigger per limited route, the cluster flag, the ACL user).
tests/integration/test_k8s_keda.py reads the scalers' numbers from a real Redis.
"""

from __future__ import annotations

import fnmatch
import math
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sluice.cli.main import build_parser
from sluice.schemas.keys import Keys
from sluice.worker.config import Config, load_config
from sluice.worker.redis.connect import env_flag

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "deploy" / "k8s"
BASE = K8S / "base"
SHARDED = K8S / "overlays" / "sharded-4"
KUBERNETES_VERSION = "1.33.0"  # the schemas the manifests are held to

# KEDA's documented names: ScaledObject spec and trigger fields, and the metadata of the Redis triggers.
SCALED_OBJECT_SPEC = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
TRIGGER_FIELDS = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
# The connection names both Redis scalers share (redisConnectionInfo: "address;addresses" accepts either
# name, and so on; a name read from the environment takes the suffix FromEnv).
REDIS_CONNECTION_METADATA = {
    "address",
    "addresses",
    "addressFromEnv",
    "addressesFromEnv",
    "host",
    "hosts",
    "hostFromEnv",
    "hostsFromEnv",
    "port",
    "ports",
    "portFromEnv",
    "portsFromEnv",
    "username",
    "usernameFromEnv",
    "password",
    "passwordFromEnv",
    "unsafeSsl",
}
REDIS_STREAMS_METADATA = REDIS_CONNECTION_METADATA | {
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "databaseIndex",
    "enableTLS",
}
# The redis scaler (Redis Lists): the length of listName by its type (HLEN for a hash).
REDIS_LIST_METADATA = REDIS_CONNECTION_METADATA | {
    "listName",
    "listLength",
    "activationListLength",
    "databaseIndex",
    "enableTLS",
}
# Trigger types: the single-node scalers and their cluster twins (pkg/scaling/scalers_builder.go), which
# take the same metadata and a cluster client seeded by address(es).
STREAM_TYPES = {"redis-streams": False, "redis-cluster-streams": True}
LIST_TYPES = {"redis": False, "redis-cluster": True}
TRIGGER_AUTH_PARAMS = {"username", "password", "tls", "ca", "cert", "key", "keyPassword"}
# What the scalers send: the streams scaler's commands, and the redis scaler's EVAL of a script that runs
# TYPE and then, for the route store's waiting HASH, HLEN (LLEN once the hash is gone: TYPE says none).
KEDA_COMMANDS = {"ping", "info", "xinfo|groups", "xpending", "xlen", "eval", "type", "hlen", "llen"}
# What the worker spends after shutdown_grace before it exits: the telemetry flush (consumer.py, 10 s)
# and leaving the group (2 s).
AFTER_GRACE = 12


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.parent == SHARDED:
            continue  # kustomize's own files; the overlay's patches are partial by design
        out.extend((path, d) for d in _docs(path))
    return out


def _one(kind: str, name: str | None = None, root: Path = BASE) -> dict[str, Any]:
    found = [
        d
        for p in sorted(root.glob("*.yaml"))
        for d in _docs(p)
        if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _toml() -> str:
    return str(_one("ConfigMap", "sluice-worker-config")["data"]["sluice.toml"])


def _worker_config() -> Config:
    """The ConfigMap's TOML as the worker loads it, the admin endpoint's keys included."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sluice.toml"
        path.write_text(_toml())
        return load_config(path, env={})


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


# -- schemas -------------------------------------------------------------------------------------------


def test_every_core_manifest_validates_against_the_kubernetes_schemas() -> None:
    checked = set()
    for _path, doc in _manifests():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises on any error
        checked.add(doc["kind"])
    assert checked == {"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "Secret"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (its built-in kustomize)")
@pytest.mark.parametrize("root", [K8S, SHARDED], ids=["base", "sharded-4"])
def test_the_kustomizations_build_and_what_they_build_validates(root: Path) -> None:
    built = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(built) if d]
    kinds = sorted(d["kind"] for d in docs)
    core = ["ConfigMap", "Deployment", "Deployment", "PodDisruptionBudget", "PodDisruptionBudget", "Service"]
    assert kinds == sorted([*core, "ScaledObject", "TriggerAuthentication"])
    for doc in docs:
        if not doc["apiVersion"].startswith("keda.sh/"):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        else:
            _check_keda(doc)


def test_kustomizations_name_files_that_exist() -> None:
    for kustomization in K8S.rglob("kustomization.yaml"):
        (doc,) = _docs(kustomization)
        for entry in doc.get("resources", []):
            assert (kustomization.parent / entry).exists(), (kustomization, entry)
        for patch in doc.get("patches", []):
            assert (kustomization.parent / patch["path"]).is_file(), (kustomization, patch)
    listed = {p for p in _docs(BASE / "kustomization.yaml")[0]["resources"]}
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}


# -- the worker ----------------------------------------------------------------------------------------


def test_the_worker_probes_the_admin_port_the_config_opens() -> None:
    worker = _one("Deployment", "sluice-worker")
    container = _container(worker)
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("admin", 9102)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    annotations = worker["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == ("9102", "/metrics")
    config = _worker_config()
    assert (config.admin_port, config.admin_host) == (9102, "0.0.0.0")  # loopback would be unreachable


def test_the_worker_drains_within_its_grace_and_has_no_prestop_delay() -> None:
    worker = _one("Deployment", "sluice-worker")
    spec = worker["spec"]["template"]["spec"]
    config = _config()
    assert spec["terminationGracePeriodSeconds"] > config.shutdown_grace + AFTER_GRACE
    # SIGTERM is the worker's intake stop; a preStop hook runs before it and would only delay it.
    assert "lifecycle" not in _container(worker)
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_the_worker_takes_config_from_the_configmap_and_credentials_only_from_secrets() -> None:
    worker = _one("Deployment", "sluice-worker")
    container = _container(worker)
    assert container["args"] == ["worker", "--config", "/etc/sluice/sluice.toml"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "worker"
    (mount,) = container["volumeMounts"]
    (volume,) = worker["spec"]["template"]["spec"]["volumes"]
    assert (mount["mountPath"], volume["configMap"]["name"]) == ("/etc/sluice", "sluice-worker-config")
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "sluice-worker-redis", "key": "url"}
    # Nothing literal but the GenAI naming switch: every other variable is a Secret's.
    assert env.pop("OTEL_SEMCONV_STABILITY_OPT_IN") == {
        "name": "OTEL_SEMCONV_STABILITY_OPT_IN",
        "value": "gen_ai_latest_experimental",
    }
    assert all("value" not in e for e in env.values())
    (keys,) = container["envFrom"]
    config = _config()
    secrets = {d["metadata"]["name"]: d for d in _docs(K8S / "secrets.example.yaml")}
    provider_keys = set(secrets[keys["secretRef"]["name"]]["stringData"])
    assert {r.api_key_env for r in config.routes.values()} <= provider_keys
    toml = _toml()
    assert "redis_url" not in toml and "password" not in toml.lower() and "api_key =" not in toml


def test_the_pdbs_select_their_deployments() -> None:
    for name in ("sluice-worker", "sluice-relay"):
        pdb = _one("PodDisruptionBudget", name)
        pods = _one("Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pods.items()


# -- the relay -----------------------------------------------------------------------------------------


def test_the_relay_is_its_own_deployment_behind_a_service() -> None:
    relay = _one("Deployment", "sluice-relay")
    container = _container(relay)
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.host, args.port) == ("relay", "0.0.0.0", 8090)
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env == {
        "REDIS_URL": {"name": "sluice-relay", "key": "redis-url"},
        "SLUICE_RELAY_SECRETS": {"name": "sluice-relay", "key": "secrets"},
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    # The endpoints drop the pod during the sleep; the relay then closes its streams within the grace.
    sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < sleep < relay["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    service = _one("Service", "sluice-relay")
    assert service["spec"]["selector"].items() <= relay["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http" and container["ports"][0]["containerPort"] == 8090


# -- KEDA ----------------------------------------------------------------------------------------------


def _check_keda(doc: dict[str, Any]) -> None:
    """A KEDA resource uses only the names KEDA documents, with string metadata values."""
    assert doc["apiVersion"] == "keda.sh/v1alpha1"
    if doc["kind"] == "TriggerAuthentication":
        for ref in doc["spec"]["secretTargetRef"]:
            assert set(ref) == {"parameter", "name", "key"} and ref["parameter"] in TRIGGER_AUTH_PARAMS
        return
    assert doc["kind"] == "ScaledObject"
    spec = doc["spec"]
    assert set(spec) <= SCALED_OBJECT_SPEC
    clusters = set()
    for trigger in spec["triggers"]:
        assert set(trigger) <= TRIGGER_FIELDS and trigger["type"] in STREAM_TYPES | LIST_TYPES, trigger
        meta = trigger["metadata"]
        assert all(isinstance(v, str) for v in meta.values()), "KEDA metadata values are strings"
        cluster = {**STREAM_TYPES, **LIST_TYPES}[trigger["type"]]
        clusters.add(cluster)
        # One way to name the server: a cluster client is seeded by addresses, a single node by address.
        assert {"address", "addresses"} & set(meta) == ({"addresses"} if cluster else {"address"}), trigger["name"]
        if trigger["type"] in STREAM_TYPES:
            assert set(meta) <= REDIS_STREAMS_METADATA, set(meta) - REDIS_STREAMS_METADATA
            # The scaler reads XINFO GROUPS lag when lagCount is set (and not 0), else XPENDING's count.
            assert ("lagCount" in meta) != ("pendingEntriesCount" in meta), trigger["name"]
            assert int(meta.get("lagCount", "1")) > 0 and int(meta["activationLagCount"]) >= 0
        else:
            assert set(meta) <= REDIS_LIST_METADATA, set(meta) - REDIS_LIST_METADATA
            assert int(meta["listLength"]) > 0 and int(meta["activationListLength"]) >= 0
    assert len(clusters) == 1, "every trigger talks to the same kind of Redis"


def _triggers(scaled: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """stream -> its triggers' metadata (the job-stream triggers)."""
    out: dict[str, list[dict[str, str]]] = {}
    for t in scaled["spec"]["triggers"]:
        if t["type"] in STREAM_TYPES:
            out.setdefault(t["metadata"]["stream"], []).append(t["metadata"])
    return out


def _route_triggers(scaled: dict[str, Any]) -> dict[str, dict[str, str]]:
    """listName -> its trigger's metadata (the admission triggers)."""
    out: dict[str, dict[str, str]] = {}
    for t in scaled["spec"]["triggers"]:
        if t["type"] in LIST_TYPES:
            assert t["metadata"]["listName"] not in out, t["name"]
            out[t["metadata"]["listName"]] = t["metadata"]
    return out


def _check_route_triggers(scaled: dict[str, Any], config: Config) -> None:
    """One admission trigger per limited route of the shipped config, on that route's waiting hash."""
    limited = [name for name, route in config.routes.items() if route.limited]
    assert limited, "the shipped config has a limited route (else there is nothing to show)"
    routes = _route_triggers(scaled)
    assert list(routes) == [Keys(config.key_prefix).route(name).waiting for name in limited]
    for meta in routes.values():
        # One replica per max_in_flight waiting jobs: enough slots to start them all at once.
        assert int(meta["listLength"]) == config.max_in_flight
        assert meta["activationListLength"] == "0"


def test_the_scaled_object_watches_the_workers_group_with_keda_names() -> None:
    scaled = _one("ScaledObject", "sluice-worker")
    auth = _one("TriggerAuthentication", "sluice-keda-redis")
    _check_keda(scaled)
    _check_keda(auth)
    config = _config()
    assert scaled["spec"]["scaleTargetRef"] == {"name": "sluice-worker"}
    assert {t["authenticationRef"]["name"] for t in scaled["spec"]["triggers"]} == {"sluice-keda-redis"}
    assert {t["type"] for t in scaled["spec"]["triggers"]} == {"redis-streams", "redis"}
    streams = _triggers(scaled)
    assert list(streams) == [Keys(config.key_prefix).shard(0).jobs]
    (lag, pending) = streams[Keys(config.key_prefix).shard(0).jobs]
    assert lag["consumerGroup"] == pending["consumerGroup"] == config.group
    assert int(pending["pendingEntriesCount"]) == config.max_in_flight
    assert lag["activationLagCount"] == pending["activationLagCount"] == "0"
    _check_route_triggers(scaled, config)
    assert {t["metadata"]["address"] for t in scaled["spec"]["triggers"]} == {"redis:6379"}
    secrets = {d["metadata"]["name"]: d for d in _docs(K8S / "secrets.example.yaml")}
    keda = secrets["sluice-keda-redis"]["stringData"]
    assert {r["key"] for r in auth["spec"]["secretTargetRef"]} == set(keda) == {"username", "password"}
    assert keda["username"] == "sluice-keda"


def test_the_sharded_overlay_uses_the_cluster_scalers_and_the_cluster_flag() -> None:
    config = _config()
    (patch,) = [d for d in _docs(SHARDED / "keda-triggers.yaml")]
    _check_keda({**patch, "spec": {**patch["spec"]}})
    assert {t["type"] for t in patch["spec"]["triggers"]} == {"redis-cluster-streams", "redis-cluster"}
    assert len({t["metadata"]["addresses"] for t in patch["spec"]["triggers"]}) == 1
    # The patch replaces the base's list: the admission triggers must be in it too.
    _check_route_triggers(patch, config)
    streams = _triggers(patch)
    shards = Keys(config.key_prefix, job_shards=4).shards
    assert list(streams) == [s.jobs for s in shards]
    for metas in streams.values():
        assert [("lagCount" in m, "pendingEntriesCount" in m) for m in metas] == [(True, False), (False, True)]
        assert int(metas[1]["pendingEntriesCount"]) == config.max_in_flight
        assert {m["consumerGroup"] for m in metas} == {config.group}
    env = {e["name"]: e["value"] for e in _container(_docs(SHARDED / "worker-shards.yaml")[0])["env"]}
    assert env.keys() == {"SLUICE_JOB_SHARDS", "SLUICE_REDIS_CLUSTER"}
    assert int(env["SLUICE_JOB_SHARDS"]) == 4 and env_flag("SLUICE_REDIS_CLUSTER", env["SLUICE_REDIS_CLUSTER"])
    # As the worker loads it: the ConfigMap's file with the overlay's environment.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sluice.toml"
        path.write_text(_toml())
        sharded = load_config(path, env=env)
    assert (sharded.job_shards, sharded.redis_cluster) == (4, True)
    (relay_env,) = _container(_docs(SHARDED / "relay-cluster.yaml")[0])["env"]
    assert relay_env["name"] == "SLUICE_REDIS_CLUSTER" and env_flag(relay_env["name"], relay_env["value"])


def test_replicas_follow_the_documented_formula() -> None:
    """The HPA's AverageValue target: desired replicas = ceil(metric / target) per trigger, the largest,
    bounded by min/max (the numbers docs/operations.md's Scale section gives)."""
    scaled = _one("ScaledObject", "sluice-worker")
    (lag, pending) = _triggers(scaled)["sluice:jobs"]
    (admission,) = _route_triggers(scaled).values()
    lo, hi = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]

    def replicas(waiting: int, in_flight: int, admitting: int = 0) -> int:
        want = max(
            math.ceil(waiting / int(lag["lagCount"])),
            math.ceil(in_flight / int(pending["pendingEntriesCount"])),
            math.ceil(admitting / int(admission["listLength"])),
        )
        return min(hi, max(lo, want))

    assert [replicas(0, 0), replicas(0, 64), replicas(0, 65), replicas(16, 128), replicas(17, 0)] == [1, 1, 2, 2, 2]
    assert [replicas(0, 0, 168), replicas(17, 64, 64), replicas(0, 0, 129)] == [3, 2, 3]
    assert replicas(10_000, 0) == hi == replicas(0, 0, 10_000)


def test_the_keda_acl_user_reads_the_job_streams_and_the_waiting_hashes_only() -> None:
    line = next(
        x for x in (ROOT / "ops/deploy/users.acl").read_text().splitlines() if x.startswith("user sluice-keda ")
    )
    rules = line.split()[2:]
    assert "on" in rules and "-@all" in rules and not any(r.startswith(("+@", ">")) for r in rules)
    assert {r[1:] for r in rules if r.startswith("+")} == KEDA_COMMANDS
    # EVAL's keys are declared read-write (Redis cannot tell what a script does), so the waiting hashes
    # take a plain ~ pattern; what runs on them is read-only because every granted command is.
    assert [r for r in rules if "~" in r] == ["%R~sluice:jobs", "%R~sluice:{shard-*}:jobs", "~sluice:{cap:*}:waiting"]
    config = _config()
    for name, route in config.routes.items():
        if route.limited:
            assert fnmatch.fnmatchcase(Keys(config.key_prefix).route(name).waiting, "sluice:{cap:*}:waiting")


def _config() -> Config:
    return _worker_config()
