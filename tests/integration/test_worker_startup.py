"""``sluice worker`` start-up through the real entry point: a banner of what it serves, one-line refusals,
and a Redis that is not there yet (retried with a log line per attempt until it answers, or --fail-fast)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.harness.embedded_redis import embedded_redis, free_port
from sluice.worker.main import main

ROOT = Path(__file__).resolve().parents[2]
ROUTES = """
[routes.keyed]
dialect = "anthropic"
base_url = "http://127.0.0.1:9"
model = "claude-x"
api_key_env = "SLUICE_STARTUP_TEST_KEY"

[routes.unkeyed]
dialect = "openai-chat"
base_url = "http://127.0.0.1:9"
api_key_env = "SLUICE_STARTUP_TEST_UNSET"
"""


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``main`` in-process points the ``sluice`` logger at this test's captured stderr: undone afterwards."""
    logger = logging.getLogger("sluice")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def _config(tmp_path: Path, redis_url: str, routes: str = ROUTES) -> Path:
    p = tmp_path / "sluice.toml"
    p.write_text(f'redis_url = "{redis_url}"\nkey_prefix = "sluicetest:startup"\n{routes}')
    return p


def _wait_for(path: Path, predicate: object, timeout: float = 30.0) -> list[dict[str, object]]:
    """The log's JSON records, once ``predicate(records)`` holds (polling a file another process writes)."""
    deadline = time.monotonic() + timeout
    while True:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
        if predicate(records):  # type: ignore[operator]
            return records
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.05)


@pytest.mark.server  # starts its own server
def test_waits_for_redis_with_a_line_per_attempt_then_starts(tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://:hunter2-pw@127.0.0.1:{port}/0"
    cfg = _config(tmp_path, url)
    log = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SLUICE_CONFIG")}
    env["SLUICE_STARTUP_TEST_KEY"] = "k"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.worker", "-c", str(cfg), "--log-format", "json", "--log-level", "debug"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        unreachable = lambda rs: sum("Redis unreachable" in str(r["msg"]) for r in rs) >= 2  # noqa: E731
        records = _wait_for(log, unreachable)
        with embedded_redis(port=port, extra_args=["--requirepass", "hunter2-pw"]):
            records = _wait_for(log, lambda rs: any(r["msg"] == "worker started" for r in rs))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "hunter2-pw" not in text and "Traceback" not in text
    attempts = [r for r in records if "Redis unreachable" in str(r["msg"])]
    assert all(f"redis://:***@127.0.0.1:{port}/0" in str(r["msg"]) for r in attempts)
    assert [r["attempt"] for r in attempts[:2]] == [1, 2]
    banner = records[0]
    assert banner["msg"] == "sluice worker starting" and banner["redis_url"] == f"redis://:***@127.0.0.1:{port}/0"
    assert banner["key_prefix"] == "sluicetest:startup" and banner["group"] == "sluice-workers"
    routes = {r["msg"]: r for r in records if str(r["msg"]).startswith("route ")}
    assert routes["route keyed"]["dialect"] == "anthropic" and routes["route keyed"]["model"] == "claude-x"
    assert routes["route unkeyed"]["dialect"] == "openai-chat"
    warnings = [r["msg"] for r in records if r["level"] == "warning" and "key variable" in str(r["msg"])]
    assert warnings == [
        "route unkeyed: the key variable SLUICE_STARTUP_TEST_UNSET is not set; its jobs will fail (authentication)"
    ]
    assert any(r["msg"] == "limits" and r["max_in_flight"] == 64 for r in records)


def test_fail_fast_is_one_line_and_exit_2(tmp_path: Path) -> None:
    port = free_port()
    cfg = _config(tmp_path, f"redis://user:hunter2-pw@127.0.0.1:{port}/0")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.worker", "--config", str(cfg), "--fail-fast"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("{")]  # the banner is JSON
    assert len(lines) == 1
    assert lines[0].startswith(f"sluice worker: Redis unreachable at redis://user:***@127.0.0.1:{port}/0 (")
    assert "hunter2-pw" not in proc.stderr


@pytest.mark.parametrize(
    ("argv", "env", "routes", "message"),
    [
        ([], {}, "", "has no routes: a worker without routes would fail every job it takes"),
        ([], {"SLUICE_CONCURRENCY": "abc"}, ROUTES, "SLUICE_CONCURRENCY must be a whole number of streams, not 'abc'"),
        (["--log-level", "loud"], {}, ROUTES, "unknown log level 'loud'"),
    ],
)
def test_refusals_are_one_line(tmp_path, capsys, monkeypatch, argv, env, routes, message) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = _config(tmp_path, "redis://127.0.0.1:1/0", routes)
    try:
        code = main(["--config", str(cfg), "--fail-fast", *argv])
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if not line.startswith(("{", "usage:", " "))]) == 1


def test_log_level_is_case_blind_and_redis_url_flag_wins(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    port = free_port()
    cfg = _config(tmp_path, "redis://from-the-file:6379/0")
    url = f"redis://127.0.0.1:{port}/0"
    code = main(["--config", str(cfg), "--fail-fast", "--log-level", "debug", "--redis-url", url])
    err = capsys.readouterr().err
    assert code == 2 and f"Redis unreachable at {url}" in err
