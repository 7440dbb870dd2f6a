"""ops/deploy/k8s/: every core manifest validates against the Kubernetes schemas of a pinned version
(``kubernetes-validate``, strict: no unknown field); the KEDA resources, whose CRD is not in those
schemas, are checked field by field against KEDA's documented names (the redis-streams scaler's
metadata, pkg/scalers/redis_streams_scaler.go); and the manifests agree with each other and with the
worker's configuration (ports, grace, group, max_in_flight, the shard streams, the ACL user).
tests/integration/test_k8s_keda.py reads the scaler's numbers from a real Redis.
"""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "deploy" / "k8s"
BASE = K8S / "base"
SHARDED = K8S / "overlays" / "sharded-4"
KUBERNETES_VERSION = "1.33.0"  # the schemas the manifests are held to

# KEDA's documented names: ScaledObject spec and trigger fields, and the redis-streams trigger metadata.
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
REDIS_STREAMS_METADATA = {
    "address",
    "addressFromEnv",
    "host",
    "hostFromEnv",
    "port",
    "portFromEnv",
    "username",
    "usernameFromEnv",
    "password",
    "passwordFromEnv",
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "databaseIndex",
    "enableTLS",
    "unsafeSsl",
}
TRIGGER_AUTH_PARAMS = {"username", "password", "tls", "ca", "cert", "key", "keyPassword"}
KEDA_COMMANDS = {"ping", "info", "xinfo|groups", "xpending", "xlen"}
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
    for trigger in spec["triggers"]:
        assert set(trigger) <= TRIGGER_FIELDS and trigger["type"] == "redis-streams"
        meta = trigger["metadata"]
        assert set(meta) <= REDIS_STREAMS_METADATA, set(meta) - REDIS_STREAMS_METADATA
        assert all(isinstance(v, str) for v in meta.values()), "KEDA metadata values are strings"
        # The scaler reads XINFO GROUPS lag when lagCount is set (and not 0), else XPENDING's count.
        assert ("lagCount" in meta) != ("pendingEntriesCount" in meta), trigger["name"]
        assert int(meta.get("lagCount", "1")) > 0 and int(meta["activationLagCount"]) >= 0


def _triggers(scaled: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """stream -> its triggers' metadata."""
    out: dict[str, list[dict[str, str]]] = {}
    for t in scaled["spec"]["triggers"]:
        out.setdefault(t["metadata"]["stream"], []).append(t["metadata"])
    return out


def test_the_scaled_object_watches_the_workers_group_with_keda_names() -> None:
    scaled = _one("ScaledObject", "sluice-worker")
    auth = _one("TriggerAuthentication", "sluice-keda-redis")
    _check_keda(scaled)
    _check_keda(auth)
    config = _config()
    assert scaled["spec"]["scaleTargetRef"] == {"name": "sluice-worker"}
    assert {t["authenticationRef"]["name"] for t in scaled["spec"]["triggers"]} == {"sluice-keda-redis"}
    streams = _triggers(scaled)
    assert list(streams) == [Keys(config.key_prefix).shard(0).jobs]
    (lag, pending) = streams[Keys(config.key_prefix).shard(0).jobs]
    assert lag["consumerGroup"] == pending["consumerGroup"] == config.group
    assert int(pending["pendingEntriesCount"]) == config.max_in_flight
    assert lag["activationLagCount"] == pending["activationLagCount"] == "0"
    secrets = {d["metadata"]["name"]: d for d in _docs(K8S / "secrets.example.yaml")}
    keda = secrets["sluice-keda-redis"]["stringData"]
    assert {r["key"] for r in auth["spec"]["secretTargetRef"]} == set(keda) == {"username", "password"}
    assert keda["username"] == "sluice-keda"


def test_the_sharded_overlay_has_a_pair_of_triggers_per_shard_stream() -> None:
    config = _config()
    (patch,) = [d for d in _docs(SHARDED / "keda-triggers.yaml")]
    _check_keda({**patch, "spec": {**patch["spec"]}})
    streams = _triggers(patch)
    shards = Keys(config.key_prefix, job_shards=4).shards
    assert list(streams) == [s.jobs for s in shards]
    for metas in streams.values():
        assert [("lagCount" in m, "pendingEntriesCount" in m) for m in metas] == [(True, False), (False, True)]
        assert int(metas[1]["pendingEntriesCount"]) == config.max_in_flight
        assert {m["consumerGroup"] for m in metas} == {config.group}
    (env,) = _container(_docs(SHARDED / "worker-shards.yaml")[0])["env"]
    assert env == {"name": "SLUICE_JOB_SHARDS", "value": "4"}


def test_replicas_follow_the_documented_formula() -> None:
    """The HPA's AverageValue target: desired replicas = ceil(metric / target), the larger of the two
    triggers, bounded by min/max (the numbers docs/notes/platform.md gives)."""
    scaled = _one("ScaledObject", "sluice-worker")
    (lag, pending) = _triggers(scaled)["sluice:jobs"]
    lo, hi = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]

    def replicas(waiting: int, in_flight: int) -> int:
        want = max(
            math.ceil(waiting / int(lag["lagCount"])), math.ceil(in_flight / int(pending["pendingEntriesCount"]))
        )
        return min(hi, max(lo, want))

    assert [replicas(0, 0), replicas(0, 64), replicas(0, 65), replicas(16, 128), replicas(17, 0)] == [1, 1, 2, 2, 2]
    assert replicas(10_000, 0) == hi


def test_the_keda_acl_user_reads_the_job_streams_only() -> None:
    line = next(
        x for x in (ROOT / "ops/deploy/users.acl").read_text().splitlines() if x.startswith("user sluice-keda ")
    )
    rules = line.split()[2:]
    assert "on" in rules and "-@all" in rules and not any(r.startswith(("+@", ">")) for r in rules)
    assert {r[1:] for r in rules if r.startswith("+")} == KEDA_COMMANDS
    assert [r for r in rules if "~" in r] == ["%R~sluice:jobs", "%R~sluice:{shard-*}:jobs"]


def _config() -> Config:
    return _worker_config()
