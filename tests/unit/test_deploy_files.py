"""The deployment files hold together: docker-compose.yml, the Dockerfile, and ops/deploy/*.

Docker cannot run here, so these tests check what `docker compose up` would trip over: every mounted file
exists, every service a service depends on is defined, every sluice command parses with the real CLI, the
worker reaches Redis as its ACL user with the password the ACL file expects, Redis has AOF on, the
collector's pipelines are complete; and the image's ENTRYPOINT + CMD run through the real `sluice` entry
point. tests/integration/test_deploy_acl.py loads redis.conf and users.acl into a real redis-server.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from sluice.cli.main import build_parser
from sluice.harness.fake import provider as fake_provider
from sluice.normalizer.adapters import DIALECTS
from sluice.worker.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "ops" / "deploy"
CONFIG_IN_IMAGE = "/etc/sluice/sluice.toml"
SLUICE_SERVICES = ("worker", "fake-provider", "cli")


def _interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set in the environment: the default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {k: _interpolate(str(v)) for k, v in service.get("environment", {}).items()}


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of the bind mounts (``./host:/container[:ro]``)."""
    out = {}
    for volume in service.get("volumes", []):
        host, container, *_ = volume.split(":")
        if host.startswith("."):
            out[container] = host
    return out


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instr, _, rest = line.partition(" ")
            pairs.append((instr.upper(), rest.strip()))
    return pairs


def _instr(name: str) -> list[str]:
    return [rest for instr, rest in _dockerfile() if instr == name]


def _exec_form(name: str) -> list[str]:
    (rest,) = _instr(name)[-1:]
    value = json.loads(rest)  # the exec form: a JSON array, so signals reach sluice itself
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def _acl_users() -> dict[str, list[str]]:
    users = {}
    for line in (DEPLOY / "users.acl").read_text().splitlines():
        if not line.strip():
            continue
        keyword, name, *rules = line.split()
        assert keyword == "user", f"users.acl: every line is a user (Redis ACL files have no comments): {line!r}"
        users[name] = rules
    return users


def _redis_conf() -> dict[str, str]:
    conf = {}
    for line in (DEPLOY / "redis.conf").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            conf[key.lower()] = value.strip()
    return conf


def _sluice_bin() -> str:
    candidate = Path(sys.executable).parent / "sluice"
    found = str(candidate) if candidate.exists() else shutil.which("sluice")
    assert found, "the sluice console script is not installed (pip install -e .)"
    return found


# -- docker-compose.yml --------------------------------------------------------------------------------


def test_compose_has_redis_workers_fake_provider_and_telemetry(services) -> None:
    assert {"redis", "worker", "fake-provider", "otel-collector", "jaeger"} <= set(services)
    assert services["worker"]["deploy"]["replicas"] >= 2
    assert "container_name" not in services["worker"]  # replicas need distinct names (and consumer names)


def test_every_dependency_mount_and_build_context_exists(services, compose) -> None:
    for name, service in services.items():
        depends = service.get("depends_on", [])
        for dep in depends if isinstance(depends, list) else depends.keys():
            assert dep in services, f"{name} depends on undefined service {dep}"
        for container, host in _mounts(service).items():
            assert (ROOT / host).is_file(), f"{name}: {host} (mounted at {container}) does not exist"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose.get("volumes", {}), f"{name}: named volume {source} is not declared"
        if build := service.get("build"):
            assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this machine"


def test_redis_runs_the_deploy_config_with_aof_and_the_acl_file(services) -> None:
    redis = services["redis"]
    mounts = _mounts(redis)
    conf_path = redis["command"][-1]
    assert redis["command"][0] == "redis-server" and mounts[conf_path] == "./ops/deploy/redis.conf"
    conf = _redis_conf()
    assert conf["appendonly"] == "yes"
    assert conf["appendfsync"] == "everysec"
    assert conf["maxmemory-policy"] == "noeviction"
    assert mounts[conf["aclfile"]] == "./ops/deploy/users.acl"
    assert any(v.split(":")[1] == "/data" for v in redis["volumes"] if not v.startswith("."))  # AOF survives


def test_sluice_services_use_the_image_and_commands_the_cli_accepts(services) -> None:
    parser = build_parser()
    for name in SLUICE_SERVICES:
        service = services[name]
        assert service["image"] == services["worker"]["image"]
        command = service["command"]
        if command == ["--help"]:
            continue
        args = parser.parse_args(command)  # exits (fails the test) on anything the real CLI refuses
        assert args.command == command[0]
    assert services["worker"]["command"] == _exec_form("CMD")


def test_worker_reaches_redis_as_its_acl_user_with_the_expected_password(services) -> None:
    users = _acl_users()
    for service, user in (("worker", "sluice-worker"), ("cli", "sluice-producer")):
        url = urlsplit(_env(services[service])["REDIS_URL"])
        assert url.hostname == "redis" and url.port == 6379
        assert url.username == user
        digest = hashlib.sha256((url.password or "").encode()).hexdigest()
        assert f"#{digest}" in users[user], f"{service}: the compose password is not the one users.acl expects"
    health = services["redis"]["healthcheck"]["test"]
    password = _interpolate(health[health.index("--pass") + 1])
    reader = health[health.index("--user") + 1]
    assert f"#{hashlib.sha256(password.encode()).hexdigest()}" in users[reader]


def test_worker_config_is_mounted_loads_and_routes_to_the_fake_provider(services) -> None:
    worker, fake = services["worker"], services["fake-provider"]
    assert _mounts(worker)[CONFIG_IN_IMAGE] == "./ops/deploy/sluice.toml"
    config = load_config(DEPLOY / "sluice.toml", env={})
    assert set(config.routes) == set(DIALECTS)
    fake_args = build_parser().parse_args(fake["command"])
    assert fake_args.func is fake_provider.run_from_args
    for route in config.routes.values():
        url = urlsplit(route.base_url)
        assert (url.hostname, url.port) == ("fake-provider", fake_args.port)
        assert route.api_key_env in _env(worker)
        assert _env(worker)[route.api_key_env] == _env(fake)["SLUICE_FAKE_API_KEY"]
    grace = float(services["worker"]["stop_grace_period"].removesuffix("s"))
    assert grace > config.shutdown_grace  # docker must not SIGKILL a worker that is still closing streams


def test_telemetry_goes_worker_to_collector_to_jaeger(services) -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from sluice.worker.observability.telemetry import Telemetry

    # The worker's own configuration turns the exporter on (not only the environment compose sets) ...
    config = load_config(DEPLOY / "sluice.toml", env={})
    assert config.telemetry.exporter == "otlp" and config.telemetry.otlp_endpoint
    endpoint = urlsplit(config.telemetry.otlp_endpoint)
    assert endpoint.hostname == "otel-collector" and endpoint.hostname in services
    # ... and what it builds from it exports there over OTLP/HTTP.
    telemetry = Telemetry.from_config(config.telemetry, instance_id="w-1")
    try:
        spans = telemetry.tracer_provider._active_span_processor._span_processors[0].span_exporter  # type: ignore[attr-defined]
        metrics = telemetry.meter_provider._metric_readers[0]._exporter  # type: ignore[attr-defined]
        assert isinstance(spans, OTLPSpanExporter) and isinstance(metrics, OTLPMetricExporter)
        assert spans._endpoint == f"{config.telemetry.otlp_endpoint}/v1/traces"
        assert metrics._endpoint == f"{config.telemetry.otlp_endpoint}/v1/metrics"
    finally:
        telemetry.shutdown()
    collector = services["otel-collector"]
    config_path = collector["command"][0].removeprefix("--config=")
    otel = yaml.safe_load((ROOT / _mounts(collector)[config_path]).read_text())
    http = otel["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert http.endswith(f":{endpoint.port}")
    for kind, pipeline in otel["service"]["pipelines"].items():
        assert kind in ("traces", "metrics", "logs")
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                assert component in otel[section], f"{kind} pipeline: {section} {component} is not defined"
    jaeger = urlsplit("//" + otel["exporters"]["otlp/jaeger"]["endpoint"])
    assert jaeger.hostname in services and "otlp/jaeger" in otel["service"]["pipelines"]["traces"]["exporters"]


# -- Dockerfile ----------------------------------------------------------------------------------------


def test_dockerfile_builds_from_python_311_slim_and_installs_the_lock_then_the_project() -> None:
    assert _instr("FROM") == ["python:3.11-slim"]
    runs = _instr("RUN")
    lock = next(i for i, run in enumerate(runs) if "--require-hashes -r requirements/image.txt" in run)
    project = next(i for i, run in enumerate(runs) if re.search(r"\bpip install --no-deps [^&]*\.(\s|$)", run))
    assert lock < project  # the project adds no unlocked dependency
    assert _exec_form("ENTRYPOINT") == ["sluice"]
    assert _exec_form("CMD") == ["worker", "--config", CONFIG_IN_IMAGE]
    assert _instr("USER") and _instr("USER")[-1] != "root"


def test_dockerfile_copies_every_package_and_nothing_dockerignore_drops() -> None:
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    sources = []
    for rest in _instr("COPY"):
        *srcs, _dest = rest.split()
        sources += srcs
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
        assert not any(fnmatch(src, pat) or src.startswith(pat.rstrip("/") + "/") for pat in ignored), src
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders <= set(sources), "every folder `pip install .` maps into the package is copied"
    assert pyproject["project"]["readme"] in sources  # setuptools reads it during the build


def test_image_entrypoint_and_default_command_run_through_the_real_entry_point() -> None:
    command = [_sluice_bin(), *_exec_form("ENTRYPOINT")[1:], *_exec_form("CMD"), "--help"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "--config" in done.stdout and "worker" in done.stdout


def test_entrypoint_runs_each_compose_command_with_help(services) -> None:
    for name in SLUICE_SERVICES:
        command = [c for c in services[name]["command"] if c != "--help"]
        done = subprocess.run(
            [_sluice_bin(), *command, "--help"], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, (name, done.stderr)
        assert done.stdout.startswith("usage: sluice")


# -- users.acl -----------------------------------------------------------------------------------------

WORKER_NEEDS = {
    "xreadgroup",
    "xack",
    "xclaim",
    "xautoclaim",
    "xpending",
    "xgroup|create",
    "xadd",
    "xtrim",
    "xinfo|groups",
    "xrange",
    "xrevrange",
    "xread",
    "hset",
    "hsetnx",
    "hget",
    "hmget",
    "hgetall",
    "hincrby",
    "expire",
    "exists",
    "evalsha",
    "eval",
    "script|load",
}
READER_MAY = {
    "ping",
    "xread",
    "xreadgroup",
    "xack",
    "xgroup|create",
    "xrange",
    "xrevrange",
    "xinfo|stream",
    "hget",
    "hgetall",
}


def _commands(rules: list[str]) -> set[str]:
    return {r[1:] for r in rules if r.startswith("+")}


def _key_patterns(rules: list[str]) -> list[str]:
    return [r.split("~", 1)[1] for r in rules if "~" in r and r.split("~", 1)[0] in ("", "%R", "%W", "%RW")]


def test_acl_file_defines_least_privilege_roles() -> None:
    users = _acl_users()
    assert "off" in users["default"] and "-@all" in users["default"]
    for name in ("sluice-worker", "sluice-producer", "sluice-reader", "sluice-consumer"):
        rules = users[name]
        assert "on" in rules and "-@all" in rules and not any(r.startswith("+@") for r in rules), name
        assert all(p.startswith("sluice:") for p in _key_patterns(rules)), f"{name}: keys outside the prefix"
        assert not any(r.startswith(">") for r in rules), f"{name}: store password hashes (#...), not plain text"
    assert _commands(users["sluice-worker"]) >= WORKER_NEEDS
    assert _key_patterns(users["sluice-worker"]) == ["sluice:*"]
    assert _commands(users["sluice-reader"]) <= READER_MAY
    # Producers may enqueue and cancel, but the logs are read-only for them: no forged events.
    producer = users["sluice-producer"]
    assert {"%R~sluice:{req:*}:events", "%R~sluice:{req:*}:raw"} <= set(producer)
    assert "~sluice:jobs" in producer and "~sluice:{req:*}:events" not in producer
    # The terminal-feed consumer keeps groups on the streams it reads, and writes nothing else.
    consumer = users["sluice-consumer"]
    assert _commands(consumer) <= READER_MAY | {"xautoclaim", "xclaim", "xpending", "xinfo|groups", "multi", "exec"}
    assert {"~sluice:terminal", "~sluice:{shard-*}:terminal"} <= set(consumer)
