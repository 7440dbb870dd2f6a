"""The `server` marker cannot be forgotten (tests/passes.py): in a pytest of its own, with real servers, a test
that starts one without the marker fails, so does one whose shared fixture starts one without being listed,
and the session says what it ran. The inner session gets its own recording wrapper: its servers are not this
session's to account for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_INNER = """
import pytest

from sluice.harness.embedded_redis import embedded_redis


@pytest.fixture(scope="module")
def shared_server():
    with embedded_redis() as server:
        yield server


def test_starts_one_unmarked():
    with embedded_redis():
        pass


@pytest.mark.server
def test_starts_one_marked():
    with embedded_redis():
        pass


@pytest.mark.server
def test_through_an_unlisted_shared_fixture(shared_server):
    pass


def test_starts_none():
    pass
"""


def test_a_server_started_without_the_marker_fails_the_test_that_started_it(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(_INNER)
    outer = ("REDIS_SERVER_BIN", "SLUICE_TEST_SERVER_STARTS", "SLUICE_TEST_FIXTURE", "PYTEST_CURRENT_TEST")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    config = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), *config, "-p", "tests.passes", "-p", "no:cacheprovider", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "ERROR at teardown of test_starts_one_unmarked" in out, out
    assert "this test starts a server itself but is not marked: add @pytest.mark.server" in out, out
    assert "ERROR at teardown of test_through_an_unlisted_shared_fixture" in out, out
    assert "the module-scoped fixture 'shared_server' starts a server: list it in SERVER_FIXTURES" in out, out
    assert "tests that touch a server: 2 (1 failed, 1 passed)" in out, out
    assert "tests that do not: 2 (1 failed, 1 passed)" in out, out
    assert out.splitlines()[-1].startswith("4 passed, 2 errors"), out  # a teardown error counts beside its pass
