"""The test command's two passes (``requirements/dev.py run_tests``): the whole suite on Redis, then the
integration tests again with every server an embedded Valkey. ``py`` is a real script that records each
pytest invocation it is run as (its arguments and the environment that picks the servers)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
_KEYS = ("REDIS_URL", "REDIS_SERVER_BIN", "SLUICE_TEST_REDIS", "SLUICE_REDIS_ENGINE")


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sluice_dev_passes", ROOT / "requirements" / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recorder(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "calls.jsonl"
    script = tmp_path / "py"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        f"    f.write(json.dumps([sys.argv[1:], {{k: os.environ.get(k) for k in {_KEYS!r}}}]) + '\\n')\n"
    )
    script.chmod(0o755)
    return script, log


def _calls(log: Path) -> list[tuple[list[str], dict[str, str | None]]]:
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]


def test_a_full_run_on_redis_runs_the_integration_tests_again_on_an_embedded_valkey(recorder, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dev = _dev()
    monkeypatch.setattr(dev.shutil, "which", lambda name: "/usr/bin/redis-server" if name == "redis-server" else None)
    py, log = recorder
    env = {"PATH": "/usr/bin", "REDIS_URL": "redis://127.0.0.1:6379/0", "REDIS_SERVER_BIN": "/x/redis-server"}
    assert dev.run_tests(py, [], env) == 0
    assert _calls(log) == [
        (
            ["-m", "pytest", "-q"],
            {
                "REDIS_URL": "redis://127.0.0.1:6379/0",
                "REDIS_SERVER_BIN": "/x/redis-server",
                "SLUICE_TEST_REDIS": None,
                "SLUICE_REDIS_ENGINE": "redis",
            },
        ),
        (
            ["-m", "pytest", "-q", "tests/integration"],
            {
                "REDIS_URL": None,
                "REDIS_SERVER_BIN": None,
                "SLUICE_TEST_REDIS": "embedded",
                "SLUICE_REDIS_ENGINE": "valkey",
            },
        ),
    ]


@pytest.mark.parametrize("case", ["args", "opt-out", "no-redis"])
def test_one_pass_only(recorder, monkeypatch, case: str) -> None:  # type: ignore[no-untyped-def]
    dev = _dev()
    py, log = recorder
    env = {"PATH": "/usr/bin", "REDIS_URL": "redis://127.0.0.1:6379/0"}
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
    assert argv == ["-m", "pytest", "-q", *args]
