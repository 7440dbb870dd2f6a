"""On a fresh machine (Python only: no browser, no Node.js) the tests that need them skip cleanly.

Run as a user would: the tests in a pytest of its own, every warning an error, Chromium (or node and npm)
out of reach. Each browser test must be reported skipped with the Chromium reason before any fixture was
set up (``--setup-show`` prints none), so no socket, worker or relay was started; each Node test skipped
with the Node reason, and nothing fails or warns.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BROWSER_TESTS = ROOT / "tests" / "browser"


def _without_chromium_on_path() -> str:
    return os.pathsep.join(
        d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "chromium").exists()
    )


def _run(env: dict[str, str], *tests: str, flags: tuple[str, ...] = ("--setup-show",)) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *(tests or (str(BROWSER_TESTS),)),
            "-p",
            "no:cacheprovider",
            "-W",
            "error",
            "-W",
            "error::ResourceWarning",
            *flags,
            "-rs",
            "-q",
        ],
        cwd=ROOT,
        env={**env, "PYTHONDEVMODE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def _collected() -> int:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(BROWSER_TESTS), "-p", "no:cacheprovider", "--collect-only", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return len([line for line in done.stdout.splitlines() if "::" in line])


def _check_skipped(out: str, reason: str) -> None:
    total = _collected()
    assert total >= 6, out
    summary = re.search(r"(\d+) skipped", out)
    assert summary is not None and int(summary[1]) == total, out
    assert not re.search(r"\d+ (passed|failed|errors?|warnings?)\b", out), out
    assert "SETUP" not in out, out  # not one fixture: nothing was started
    assert "ResourceWarning" not in out, out
    # -rs folds a file's skips into one line: "SKIPPED [n] file: reason"; every one says why
    lines = re.findall(r"^SKIPPED \[(\d+)\] (\S+): (.*)$", out, re.M)
    assert sum(int(n) for n, _, _ in lines) == total, out
    assert all(reason in why for _, _, why in lines), out


def test_an_explicit_chromium_that_is_missing_skips_every_browser_test(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": _without_chromium_on_path(), "SLUICE_CHROMIUM": str(tmp_path / "chromium")}
    _check_skipped(_run(env), f"SLUICE_CHROMIUM={str(tmp_path / 'chromium')!r} is not an executable file")


@pytest.mark.skipif(Path("/usr/bin/chromium").exists(), reason="Debian's Chromium is installed here")
def test_a_machine_without_chromium_skips_every_browser_test() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_CHROMIUM"}
    env["PATH"] = _without_chromium_on_path()
    _check_skipped(_run(env), "no Chromium at /usr/bin/chromium or on PATH")


NODE_TESTS = (
    "tests/integration/test_relay_aisdk.py",
    "tests/unit/test_contract_schema_ajv.py",
    "tests/integration/test_consumer_guide.py",
)


def test_without_node_the_node_tests_skip(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # a PATH with a redis-server (an embedded Redis may be needed) and no node
    bin_dir.mkdir()
    if server := shutil.which("redis-server"):
        (bin_dir / "redis-server").symlink_to(server)
    out = _run({**os.environ, "PATH": str(bin_dir)}, *NODE_TESTS, "-k", "not redis_cli", flags=())
    assert not re.search(r"\d+ (failed|errors?|warnings?)\b", out), out
    lines = re.findall(r"^SKIPPED \[(\d+)\] (\S+): (.*)$", out, re.M)
    assert sum(int(n) for n, _, _ in lines) >= 8, out
    assert all("node and npm are needed" in why for _, _, why in lines), out
