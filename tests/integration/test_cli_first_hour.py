"""A newcomer's first hour (issue 20), through the CLI as a user runs it: every unreadable input is one
line and exit 2, a queued request that no live worker serves is said so, values that cannot work are
refused at start, the worker checks its Redis URL before its banner, one exit table for the commands that
report a request, and ``bench`` says which SDK it misses."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from sluice.schemas.keys import Keys
from sluice.worker.config import Config
from sluice.worker.pipeline.consumer import Worker

# The harness fixtures are imported by name, so test arguments shadow them (F811) on purpose.
# ruff: noqa: F811
from tests.helpers import checkout_hint, run_cli
from tests.integration.conftest import API_KEY, KEY_ENV, make_config, write_config_file
from tests.integration.test_cli_harness import Service, fake, portal, service  # noqa: F401 - fixtures

SLUICE = str(Path(sys.executable).parent / "sluice")


# -- unreadable inputs: one line each, exit 2 ------------------------------------------------------------------

# (argv before the path, what the path is called in the message, the program name in the message)
_READERS = [
    (["worker", "--config"], "config file", "worker"),
    (["status", "r1", "--config"], "config file", "status"),
    (["audit", "r1", "--config"], "config file", "audit"),
    (["enqueue", "--route", "anthropic", "--prompt", "x", "--config"], "config file", "enqueue"),
    (["enqueue"], "job file", "enqueue"),
    (["relay", "--secrets-file"], "secrets file", "relay"),
    (["normalize", "--dialect", "anthropic"], "file", "normalize"),
    (["frames"], "file", "frames"),
]


@pytest.fixture
def odd_paths(tmp_path: Path) -> dict[str, str]:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # no writer: reading it would hang, so it must be refused without opening for a read
    return {"missing": str(tmp_path / "missing.toml"), "directory": str(tmp_path), "fifo": str(fifo)}


@pytest.mark.parametrize(("argv", "what", "prog"), _READERS)
def test_missing_directory_fifo_and_eio_each_have_their_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    odd_paths: dict[str, str],
    argv: list[str],
    what: str,
    prog: str,
) -> None:
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    expected = {
        "missing": f"no such {what}: {odd_paths['missing']}",
        "directory": f"{what} {odd_paths['directory']} is a directory, not a regular file",
        "fifo": f"{what} {odd_paths['fifo']} is a FIFO, not a regular file",
        # a regular file whose reads fail: EIO at offset 0
        "eio": f"cannot read {what} /proc/self/mem: Input/output error",
    }
    paths = {**odd_paths, "eio": "/proc/self/mem"}
    for case, message in expected.items():
        code, out, err = run_cli(capsys, *argv, paths[case])
        assert (code, out, err) == (2, "", f"sluice {prog}: {message}\n"), case


def _without_file_permission_override() -> list[str] | None:
    """The argv prefix that runs a command the way file permissions bind it: nothing for a normal user; for
    root, ``setpriv`` dropping the capabilities that let root read a mode-000 file (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH) from the bounding set; None when that cannot be done here."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_a_file_the_user_may_not_read_is_one_line_for_every_reader(tmp_path: Path) -> None:
    prefix = _without_file_permission_override()
    if prefix is None:
        pytest.skip("running as root without setpriv: nothing here honours a mode-000 file")
    locked = tmp_path / "locked"
    locked.write_text('redis_url = "redis://127.0.0.1:6379/0"\n')
    locked.chmod(0)
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_CONFIG"}
    for argv, what, prog in _READERS:
        proc = subprocess.run(
            [*prefix, SLUICE, *argv, str(locked)], capture_output=True, text=True, timeout=60, env=env, check=False
        )
        expected = f"sluice {prog}: cannot read {what} {locked}: Permission denied\n"
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", expected), argv


# -- values that cannot work, the Redis URL before the banner ----------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "table", "message"),
    [
        ("p", "[timeouts]\nfirst_byte = -1\n", "timeouts.first_byte must be above 0, not -1"),
        ("p", "[retry]\nmax_attempts = 0\n", "retry.max_attempts must be at least 1, not 0"),
        ("", "", "key_prefix must not be empty"),
    ],
)
def test_the_worker_refuses_values_that_cannot_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, prefix: str, table: str, message: str
) -> None:
    path = write_config_file(tmp_path / "sluice.toml", "redis://127.0.0.1:1/0", prefix, "http://127.0.0.1:1")
    path.write_text(path.read_text() + table)
    for argv in (["worker", "-c", str(path)], ["status", "r1", "-c", str(path)]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "" and err.startswith(f"sluice {argv[0]}: {message}"), err
        assert err.count("\n") == 1


def test_the_worker_checks_its_redis_url_before_logging_anything(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    path = write_config_file(tmp_path / "sluice.toml", "redis://127.0.0.1:1/0", "p", "http://127.0.0.1:1")
    for url, shown in [("http://op:s3cret@h:6379/0", "http://op:***@h:6379/0"), ("redis://h:port/0", None)]:
        code, out, err = run_cli(capsys, "worker", "-c", str(path), "--redis-url", url, "--log-format", "json")
        assert code == 2 and out == "" and err.count("\n") == 1, err  # no banner before the refusal
        assert err.startswith(f"sluice worker: bad Redis URL {shown or '(unparsable URL)'}: ")
        assert "s3cret" not in err


# -- one exit table for the commands that report a request ---------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "code", "state"),
    [
        ("synthetic;deltas=2", 0, "completed"),
        ("synthetic;status=400", 3, "failed"),
        ("synthetic;deltas=3;drop_terminal=1", 4, "interrupted"),
    ],
)
def test_tail_status_and_enqueue_follow_share_the_exit_table(
    service: Service, model: str, code: int, state: str
) -> None:
    got, out, _ = service.cli("enqueue", "--route", "anthropic", "--prompt", "hi", "--model", model, "--follow")
    rid = out.splitlines()[0]
    assert service.status(rid)["state"] == state
    assert got == code
    for argv in (["tail", rid], ["tail", rid, "--json"], ["tail", rid, "--raw"], ["status", rid]):
        assert service.cli(*argv)[0] == code, argv


def test_a_request_not_finished_exits_5(service: Service) -> None:
    rid = "waiting-1"  # a status record no job backs: it stays queued whatever the worker does
    service.r.hset(service.keys.request(rid).status, mapping={"state": "queued", "request_id": rid, "route": "x"})
    code, out, _ = service.cli("status", rid)
    assert code == 5 and '"state": "queued"' in out
    code, out, err = service.cli("cancel", rid, "--wait", "--timeout", "0.2")
    assert code == 5 and err == f"sluice cancel: request {rid} has no terminal status after 0.2s\n"


# -- enqueue --follow with no worker to serve it --------------------------------------------------------------------


@contextlib.contextmanager
def _worker(portal: Any, config: Config) -> Iterator[Worker]:
    worker = portal.call(Worker, config)
    ready = threading.Event()
    running = portal.start_task_soon(functools.partial(worker.run, ready=ready.set))
    assert ready.wait(10), "the worker did not start"
    try:
        yield worker
    finally:
        portal.call(worker.stop)
        running.result(timeout=30)


@pytest.fixture
def r(redis_url: str, key_prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    for key in client.scan_iter(match=f"{key_prefix}:*", count=1000):
        client.delete(key)
    client.close()


def _follow(redis_url: str, prefix: str, *argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "REDIS_URL": redis_url, "SLUICE_KEY_PREFIX": prefix}
    env.pop("SLUICE_CONFIG", None)
    return subprocess.Popen(
        [SLUICE, "enqueue", "--route", "anthropic", "--prompt", "hi", "--follow", "--plain", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_follow_says_when_no_live_worker_serves_the_route_then_runs_once_one_starts(
    portal: Any, fake: Any, redis_url: str, key_prefix: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _follow(redis_url, key_prefix, "--warn-after", "0.2", "--request-id", "lonely-1")
    try:
        assert proc.stderr is not None and proc.stdout is not None
        assert proc.stdout.readline() == "lonely-1\n"
        queued = proc.stderr.readline()
        assert queued == "sluice enqueue: request lonely-1 is queued: waiting for a worker to pick it up\n"
        warning = proc.stderr.readline()  # blocks until the command has looked at the workers' registry
        assert warning == (
            f"sluice enqueue: no live worker of key prefix {key_prefix!r} at {redis_url} serves route 'anthropic' "
            "(none is registered): the request waits until one starts; check --key-prefix / --redis-url against "
            "the workers' configuration\n"
        )
        monkeypatch.setenv(KEY_ENV, API_KEY)
        with _worker(portal, make_config(redis_url, key_prefix, fake.base_url)):
            out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and err == ""
    assert out.splitlines()[-1].startswith("[completed: ")


def test_follow_names_busy_live_workers_and_workers_of_other_routes(
    portal: Any, fake: Any, redis_url: str, key_prefix: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    config = make_config(redis_url, key_prefix, fake.base_url, max_in_flight=1)
    gemini_only = msgspec.structs.replace(config, routes={"gemini": config.routes["gemini"]})
    # a blocker that would stream for a minute holds the one slot until the test cancels it
    job = b'{"route": "%s", "model": "synthetic;deltas=1200;pace_ms=50", "request_id": "%s", "request": {"messages": [{"role": "user", "content": "x"}]}}'  # noqa: E501
    keys = Keys(key_prefix)
    env = {**os.environ, "REDIS_URL": redis_url, "SLUICE_KEY_PREFIX": key_prefix}
    for cfg, route, expect, code in (
        (config, "anthropic", "serve route 'anthropic' (w-test); all busy", 0),
        (gemini_only, "gemini", "serves route 'anthropic' (they serve gemini)", 3),  # then fails it: unknown route
    ):
        blocker = f"blocker-{route}"
        with _worker(portal, cfg):
            r.xadd(keys.jobs, {"job": job % (route.encode(), blocker.encode())})
            while r.hget(keys.request(blocker).status, "state") != b"running":  # the one slot is taken
                time.sleep(0.02)
            proc = _follow(redis_url, key_prefix, "--warn-after", "0.1")
            try:
                assert proc.stderr is not None
                queued = proc.stderr.readline()
                warning = proc.stderr.readline()  # blocks until the command has looked at the registry
                cancelled = subprocess.run([SLUICE, "cancel", blocker], env=env, capture_output=True, timeout=60)
                assert cancelled.returncode == 0, cancelled.stderr
                out, err = proc.communicate(timeout=60)  # the slot is free: the worker takes the followed job
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert queued.endswith("is queued: waiting for a worker to pick it up\n") and err == ""
        prefix = f"sluice enqueue: no live worker of key prefix {key_prefix!r}" if code else "sluice enqueue: request "
        assert warning.startswith(prefix) and expect in warning, warning
        assert proc.returncode == code, (out, err)


# -- bench without the SDKs ------------------------------------------------------------------------------------------


def test_bench_says_which_sdk_it_misses(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "anthropic", None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, "openai", None)
    argv = [
        "bench",
        "normalizer",
        "--dialects",
        "anthropic,openai-chat,openai-responses,gemini",
        "--size-mb",
        "0.02",
        "--repeat",
        "1",
    ]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0
    hint = f"SDK is not installed, so its comparison is skipped (install the bench extra: {checkout_hint('bench')}"
    assert err.splitlines() == [
        f"sluice bench: the {name} {hint}; or pass --no-sdk)" for name in ("anthropic", "openai")
    ]
    code, _, err = run_cli(capsys, *argv, "--no-sdk")
    assert code == 0 and err == ""


# -- the relay's logs --------------------------------------------------------------------------------------------


def test_relay_log_format_text_has_no_json_and_stdout_stays_empty(redis_url: str, key_prefix: str) -> None:
    env = {**os.environ, "SLUICE_RELAY_SECRETS": "r" * 32}
    argv = [SLUICE, "relay", "--port", "0", "--redis-url", redis_url, "--key-prefix", key_prefix]
    argv += ["--log-format", "text"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # blocks until the relay listens
        m = re.fullmatch(r"\d\d:\d\d:\d\d info    listening on (http://127\.0\.0\.1:\d+)  url=\1\n", first)
        assert m, first
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out == ""
    assert not [line for line in err.splitlines() if line.startswith("{")]  # text only, as asked
    assert "r" * 32 not in first + err
