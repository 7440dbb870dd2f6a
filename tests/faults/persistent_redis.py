"""A private redis-server that can be killed and started again with its data: an outage, not a data loss.

Rule: a fixed port and directory for its whole life, AOF with ``appendfsync always`` (what it acknowledged
survives a SIGKILL), no RDB snapshots. Only servers a test starts this way are killed; never the shared one.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from sluice.harness.embedded_redis import free_port, redis_server_binary

__all__ = ["PersistentRedis"]


class PersistentRedis:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sluice-persistent-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.binary = redis_server_binary()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (again) and return once it answers PING, its AOF loaded."""
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                pass
            assert time.monotonic() < deadline, "the private redis-server did not come back"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
