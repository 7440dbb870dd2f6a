"""The test command's two passes (``requirements/dev.py run_tests``): the whole suite on Redis, then every
test that touches a server again with every server an embedded Valkey, and the check that the second pass
ran exactly the first pass's server set. ``py`` is a real script that records each pytest invocation it is
run as (its arguments and the environment that picks the servers) and writes, as tests/passes.py does, what
it "ran" where ``SLUICE_TEST_RAN`` says."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
_KEYS = ("REDIS_URL", "REDIS_SERVER_BIN", "SLUICE_TEST_REDIS", "SLUICE_REDIS_ENGINE")
# What each pass reports it ran: {test id: touches a server}.
_REDIS_PASS = {"tests/integration/test_a.py::test_x": True, "tests/unit/test_b.py::test_y": False}
_VALKEY_PASS = {"tests/integration/test_a.py::test_x": True}


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sluice_dev_passes", ROOT / "requirements" / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorder(tmp_path: Path, valkey_pass: dict[str, bool]) -> tuple[Path, Path]:
    log = tmp_path / "calls.jsonl"
    script = tmp_path / "py"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        f"    f.write(json.dumps([sys.argv[1:], {{k: os.environ.get(k) for k in {_KEYS!r}}}]) + '\\n')\n"
        f"ran = {valkey_pass!r} if 'server' in sys.argv[1:] else {_REDIS_PASS!r}\n"
        "if path := os.environ.get('SLUICE_TEST_RAN'):\n"
        "    with open(path, 'w') as f:\n"
        "        for t, s in ran.items():\n"
        "            f.write(json.dumps({'test': t, 'server': s, 'outcome': 'passed'}) + '\\n')\n"
    )
    script.chmod(0o755)
    return script, log


def _calls(log: Path) -> list[tuple[list[str], dict[str, str | None]]]:
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]


_PYTEST = ["-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup", "--durations=25"]


def test_a_full_run_on_redis_runs_every_server_test_again_on_an_embedded_valkey(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    dev = _dev()
    monkeypatch.setattr(dev.shutil, "which", lambda name: "/usr/bin/redis-server" if name == "redis-server" else None)
    py, log = _recorder(tmp_path, _VALKEY_PASS)
    env = {
        "PATH": "/usr/bin",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "REDIS_SERVER_BIN": "/x/redis-server",
        "SLUICE_TEST_WORKERS": "3",
    }
    assert dev.run_tests(py, [], env) == 0
    assert _calls(log) == [
        (
            _PYTEST,
            {
                "REDIS_URL": "redis://127.0.0.1:6379/0",
                "REDIS_SERVER_BIN": "/x/redis-server",
                "SLUICE_TEST_REDIS": None,
                "SLUICE_REDIS_ENGINE": "redis",
            },
        ),
        (
            [*_PYTEST, "-m", "server"],
            {
                "REDIS_URL": None,
                "REDIS_SERVER_BIN": None,
                "SLUICE_TEST_REDIS": "embedded",
                "SLUICE_REDIS_ENGINE": "valkey",
            },
        ),
    ]
    assert capsys.readouterr().err.splitlines()[-1] == (
        "dev.py: the Redis pass ran 2 tests, 1 of them touch a server; the Valkey pass ran 1, exactly those"
    )


@pytest.mark.parametrize(
    ("valkey_pass", "says"),
    [
        ({}, ["dev.py: 1 tests left out by the Valkey pass:", "  tests/integration/test_a.py::test_x"]),
        (
            {**_VALKEY_PASS, "tests/unit/test_b.py::test_y": False},
            ["dev.py: 1 tests not expected by the Valkey pass:", "  tests/unit/test_b.py::test_y"],
        ),
    ],
    ids=["one-left-out", "one-extra"],
)
def test_a_valkey_pass_that_ran_another_set_fails_and_names_the_difference(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch, capsys, valkey_pass, says
) -> None:
    dev = _dev()
    monkeypatch.setattr(dev.shutil, "which", lambda name: "/usr/bin/redis-server" if name == "redis-server" else None)
    py, _ = _recorder(tmp_path, valkey_pass)
    assert dev.run_tests(py, [], {"PATH": "/usr/bin", "REDIS_URL": "redis://127.0.0.1:6379/0"}) == 1
    assert capsys.readouterr().err.splitlines()[-2:] == says


@pytest.mark.parametrize("case", ["args", "opt-out", "no-redis"])
def test_one_pass_only(tmp_path, monkeypatch, case: str) -> None:  # type: ignore[no-untyped-def]
    dev = _dev()
    py, log = _recorder(tmp_path, _VALKEY_PASS)
    env = {"PATH": "/usr/bin", "REDIS_URL": "redis://127.0.0.1:6379/0", "SLUICE_TEST_WORKERS": "3"}
    args: list[str] = []
    if case == "args":
        args = ["tests/unit"]
    elif case == "opt-out":
        env["SLUICE_VALKEY_PASS"] = "0"
    else:
        del env["REDIS_URL"]
        monkeypatch.setattr(dev.shutil, "which", lambda name: None)
        monkeypatch.setattr(dev, "_answers", lambda port: False)
    assert dev.run_tests(py, args, env) == 0
    ((argv, _),) = _calls(log)
    assert argv == [*_PYTEST, *args]


def test_the_worker_count_is_two_per_cpu_unless_set(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dev = _dev()
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 2)
    assert dev.worker_count({}) == "4"
    assert dev.worker_count({"SLUICE_TEST_WORKERS": "1"}) == "1"
